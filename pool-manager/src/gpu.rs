//! The GPU inventory of one machine: which GPU ids are free.

use std::collections::BTreeSet;

/// Free and total GPUs. Replicas take whole GPUs; two replicas never share one.
#[derive(Debug, Clone, Default)]
pub struct GpuInventory {
    all: BTreeSet<u32>,
    free: BTreeSet<u32>,
}

impl GpuInventory {
    /// An inventory of these GPU ids, all free.
    pub fn new(ids: impl IntoIterator<Item = u32>) -> Self {
        let all: BTreeSet<u32> = ids.into_iter().collect();
        GpuInventory {
            free: all.clone(),
            all,
        }
    }

    /// Takes `n` free GPUs (lowest ids first), or none if fewer are free.
    pub fn allocate(&mut self, n: u32) -> Option<Vec<u32>> {
        if (self.free.len() as u64) < u64::from(n) {
            return None;
        }
        let ids: Vec<u32> = self.free.iter().take(n as usize).copied().collect();
        for id in &ids {
            self.free.remove(id);
        }
        Some(ids)
    }

    /// Gives GPUs back. Ids this inventory does not own are ignored.
    pub fn release(&mut self, ids: &[u32]) {
        for id in ids {
            if self.all.contains(id) {
                self.free.insert(*id);
            }
        }
    }

    /// How many GPUs are free.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// How many GPUs there are.
    pub fn total(&self) -> usize {
        self.all.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_hands_out_a_gpu_twice() {
        let mut inv = GpuInventory::new([0, 1, 2]);
        let a = inv.allocate(2).expect("two free");
        assert_eq!(a, vec![0, 1]);
        assert_eq!(inv.allocate(2), None, "only one left");
        let b = inv.allocate(1).expect("one free");
        assert_eq!(b, vec![2]);
        assert_eq!(inv.free(), 0);
        inv.release(&a);
        assert_eq!(inv.allocate(2), Some(vec![0, 1]));
    }

    #[test]
    fn zero_gpus_always_fit_and_foreign_ids_are_ignored() {
        let mut inv = GpuInventory::new([]);
        assert_eq!(inv.allocate(0), Some(vec![]));
        inv.release(&[7]);
        assert_eq!(inv.free(), 0);
        assert_eq!(inv.total(), 0);
    }
}
