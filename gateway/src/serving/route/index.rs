//! Which replicas recently served which prompt chunks: a bounded map from a
//! chained chunk hash ([`super::key`]) to the few replicas that were sent
//! it last.
//!
//! It is what the gateway believes the engines' prefix caches hold, so it
//! forgets in the same spirit: least recently used first. Two generations
//! stand in for a list: entries go into the current map; when it holds
//! half the bound, it becomes the previous one and the old previous one is
//! emptied and filled anew; an entry used again moves to the current map.
//! Memory is bounded by the two maps' tables (a map of a power of two of
//! [`BUCKET_BYTES`] buckets never grows past 7/8 full), and every operation
//! is a few hash-map probes per chunk, with no list to keep in order.

use std::collections::HashMap;
use std::hash::Hasher;

/// A replica as the index knows it: the hash of its id, which every
/// gateway computes alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReplicaKey(pub u64);

impl ReplicaKey {
    /// The key of the replica named `id`.
    pub fn of(id: &str) -> ReplicaKey {
        ReplicaKey(rapidhash::v3::rapidhash_v3(id.as_bytes()))
    }
}

/// Replicas kept per chunk: the last four sent it. A prefix hot enough to
/// be on more replicas than that is matched on the four used last.
const HOLDERS: usize = 4;

/// The replicas that were sent a chunk, most recent first.
#[derive(Debug, Clone, Copy, Default)]
struct Holders {
    replicas: [u64; HOLDERS],
    len: u8,
}

impl Holders {
    fn contains(&self, r: ReplicaKey) -> bool {
        self.replicas[..self.len as usize].contains(&r.0)
    }

    /// Puts `r` first, dropping the least recent when full.
    fn touch(&mut self, r: ReplicaKey) {
        let n = self.len as usize;
        let at = self.replicas[..n].iter().position(|x| *x == r.0);
        let end = match at {
            Some(i) => i,
            None if n < HOLDERS => {
                self.len += 1;
                n
            }
            None => HOLDERS - 1,
        };
        self.replicas.copy_within(0..end, 1);
        self.replicas[0] = r.0;
    }

    fn remove(&mut self, r: ReplicaKey) {
        let n = self.len as usize;
        if let Some(i) = self.replicas[..n].iter().position(|x| *x == r.0) {
            self.replicas.copy_within(i + 1..n, i);
            self.len -= 1;
        }
    }
}

/// The map's own hasher: chunk hashes are hashes already, but unkeyed and
/// the same in every gateway, so a client could pick texts whose hashes
/// share the bits that choose a bucket. Each is mixed with a key drawn once
/// per process (a folded 128-bit multiply: every output bit depends on
/// every input bit) before the map sees it.
#[derive(Clone, Copy)]
pub struct Keyed(u64);

impl Default for Keyed {
    fn default() -> Self {
        static KEY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        Keyed(*KEY.get_or_init(|| {
            let mut b = [0u8; 8];
            // Without randomness, a key from the clock and the process id
            // still differs between runs.
            if getrandom::fill(&mut b).is_err() {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64);
                b = (t ^ u64::from(std::process::id())).to_le_bytes();
            }
            u64::from_le_bytes(b) | 1
        }))
    }
}

impl std::hash::BuildHasher for Keyed {
    type Hasher = Mixed;
    fn build_hasher(&self) -> Mixed {
        Mixed {
            key: self.0,
            value: 0,
        }
    }
}

/// A [`Keyed`] hash of one `u64`.
pub struct Mixed {
    key: u64,
    value: u64,
}

impl Hasher for Mixed {
    fn finish(&self) -> u64 {
        let m =
            u128::from(self.value ^ self.key) * u128::from(0x9E37_79B9_7F4A_7C15_u64 ^ self.key);
        (m as u64) ^ ((m >> 64) as u64)
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed; anything else is folded in.
        for b in bytes {
            self.value = self.value.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.value = n;
    }
}

type Map = HashMap<u64, Holders, Keyed>;

/// The bytes one bucket of a map costs: key and value, and its control
/// byte. A map of `n` entries has the next power of two above `n × 8 / 7`
/// buckets.
pub const BUCKET_BYTES: usize = std::mem::size_of::<(u64, Holders)>() + 1;

/// The prefix index of one app's revision.
pub struct PrefixIndex {
    current: Map,
    previous: Map,
    /// Entries the current map takes before it becomes the previous one.
    half: usize,
}

impl PrefixIndex {
    /// An empty index of at most `bytes` of tables (each map's buckets,
    /// rounded to the power of two the map allocates; at least a few
    /// entries). The maps are allocated as they fill and kept when they
    /// turn over.
    pub fn new(bytes: u64) -> PrefixIndex {
        PrefixIndex {
            current: Map::default(),
            previous: Map::default(),
            half: Self::half_of(bytes),
        }
    }

    /// Entries one map may hold so that both maps' tables fit in `bytes`:
    /// the largest power of two of buckets that fits in half of it, 7/8
    /// full.
    fn half_of(bytes: u64) -> usize {
        let per_map = usize::try_from(bytes / 2).unwrap_or(usize::MAX) / BUCKET_BYTES;
        let buckets = if per_map == 0 {
            0
        } else {
            1usize << (usize::BITS - 1 - per_map.leading_zeros())
        };
        (buckets / 8 * 7).max(4)
    }

    /// Changes the bound; a smaller one takes effect as the maps turn over.
    pub fn set_bound(&mut self, bytes: u64) {
        let half = Self::half_of(bytes);
        if half != self.half {
            self.half = half;
            // Tables sized for the old bound are given back.
            self.current.shrink_to(half);
            self.previous.shrink_to(half);
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes its tables hold (see [`BUCKET_BYTES`]).
    pub fn bytes(&self) -> usize {
        let buckets = |m: &Map| {
            let c = m.capacity();
            if c == 0 {
                0
            } else {
                (c * 8 / 7).next_power_of_two()
            }
        };
        (buckets(&self.current) + buckets(&self.previous)) * BUCKET_BYTES
    }

    fn get(&self, chunk: u64) -> Option<&Holders> {
        self.current
            .get(&chunk)
            .or_else(|| self.previous.get(&chunk))
    }

    /// For each of `replicas`, how many of `chunks`, from the first, it was
    /// sent (its longest matching prefix), written into `out`.
    pub fn matches(&self, chunks: &[u64], replicas: &[ReplicaKey], out: &mut [u32]) {
        out.fill(0);
        for (i, chunk) in chunks.iter().enumerate() {
            let Some(holders) = self.get(*chunk) else {
                return;
            };
            let mut any = false;
            for (c, r) in replicas.iter().enumerate() {
                if out[c] as usize == i && holders.contains(*r) {
                    out[c] += 1;
                    any = true;
                }
            }
            if !any {
                return;
            }
        }
    }

    /// Notes that `replica` was sent `chunks`.
    pub fn record(&mut self, chunks: &[u64], replica: ReplicaKey) {
        for chunk in chunks {
            let mut holders = self
                .current
                .get(chunk)
                .copied()
                .or_else(|| self.previous.remove(chunk))
                .unwrap_or_default();
            holders.touch(replica);
            if self.current.len() >= self.half && !self.current.contains_key(chunk) {
                // The current map becomes the previous one; the old
                // previous one's table is emptied and filled anew.
                std::mem::swap(&mut self.current, &mut self.previous);
                self.current.clear();
            }
            self.current.insert(*chunk, holders);
        }
    }

    /// Forgets `replica` (it left): its entries go, and chunks no other
    /// replica holds go with them.
    pub fn forget(&mut self, replica: ReplicaKey) {
        for map in [&mut self.current, &mut self.previous] {
            map.retain(|_, h| {
                h.remove(replica);
                h.len > 0
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: ReplicaKey = ReplicaKey(1);
    const B: ReplicaKey = ReplicaKey(2);
    const C: ReplicaKey = ReplicaKey(3);

    fn matches(ix: &PrefixIndex, chunks: &[u64], replicas: &[ReplicaKey]) -> Vec<u32> {
        let mut out = vec![0; replicas.len()];
        ix.matches(chunks, replicas, &mut out);
        out
    }

    #[test]
    fn the_longest_leading_run_counts_and_a_gap_ends_it() {
        let mut ix = PrefixIndex::new(1 << 20);
        ix.record(&[10, 11, 12, 13], A);
        ix.record(&[10, 11, 20], B);
        assert_eq!(
            matches(&ix, &[10, 11, 12, 13, 14], &[A, B, C]),
            vec![4, 2, 0]
        );
        assert_eq!(matches(&ix, &[10, 11, 20, 21], &[A, B, C]), vec![2, 3, 0]);
        // A chunk in the middle is no prefix.
        assert_eq!(matches(&ix, &[99, 11, 12], &[A, B, C]), vec![0, 0, 0]);
    }

    #[test]
    fn a_chunk_keeps_its_last_four_replicas() {
        let mut h = Holders::default();
        for r in 1..=6 {
            h.touch(ReplicaKey(r));
        }
        assert_eq!(&h.replicas[..h.len as usize], &[6, 5, 4, 3]);
        h.touch(ReplicaKey(4));
        assert_eq!(&h.replicas[..h.len as usize], &[4, 6, 5, 3]);
        h.remove(ReplicaKey(6));
        assert_eq!(&h.replicas[..h.len as usize], &[4, 5, 3]);
    }

    #[test]
    fn the_index_stays_within_its_bound_and_keeps_what_is_used() {
        let bytes = 64 * 1024;
        let mut ix = PrefixIndex::new(bytes);
        let hot: Vec<u64> = (1..=16).collect();
        for i in 0..10_000u64 {
            ix.record(&[1_000_000 + i], B);
            if i % 100 == 0 {
                ix.record(&hot, A);
            }
            assert!(ix.bytes() as u64 <= bytes, "{} bytes", ix.bytes());
        }
        // The hot prefix, used all along, survives the churn.
        assert_eq!(matches(&ix, &hot, &[A]), vec![16]);
        // An entry never used again is gone.
        assert_eq!(matches(&ix, &[1_000_000], &[B]), vec![0]);
    }

    #[test]
    fn a_replica_that_leaves_takes_its_entries() {
        let mut ix = PrefixIndex::new(1 << 20);
        ix.record(&[1, 2, 3], A);
        ix.record(&[1, 2], B);
        ix.forget(A);
        assert_eq!(matches(&ix, &[1, 2, 3], &[A, B]), vec![0, 2]);
        assert_eq!(ix.len(), 2);
        ix.forget(B);
        assert!(ix.is_empty());
    }
}
