//! Part buffers used again within one download.
//!
//! A download copies each ranged GET's body into a buffer of the part's
//! size. A fresh buffer of megabytes is fresh pages: the kernel faults in
//! and zeroes each one as the copy first touches it, which costs as much
//! CPU as the copy itself. So the buffers of parts that every reader has
//! let go of are kept and filled again by the parts behind them. The free
//! list never holds more buffers than were alive at once, so it adds no
//! memory beyond the download's peak, and it goes with the download. The
//! same holds for a reader that reads chunks from a cache file.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

/// The free buffers of one download. Its parts' bytes give their buffers
/// back to it; once it is dropped (the download is over) they are freed
/// instead, so a part a reader still holds keeps no idle buffers alive.
#[derive(Debug)]
pub struct Recycler(Arc<FreeList>);

#[derive(Debug)]
struct FreeList(Mutex<Free>);

#[derive(Debug)]
struct Free {
    buffers: Vec<Vec<u8>>,
    /// Buffers kept at most; the rest are freed. Zero once closed.
    keep: usize,
}

impl Recycler {
    /// A free list of at most `keep` buffers.
    pub fn new(keep: usize) -> Recycler {
        Recycler(Arc::new(FreeList(Mutex::new(Free {
            buffers: Vec::new(),
            keep,
        }))))
    }

    /// A buffer with room for `len` bytes: a kept one when one is large
    /// enough, else a new, empty one. A kept one holds what it held before
    /// (its length is that of its last use), so a reader that fills the
    /// same length again need not zero it first; one that appends clears
    /// it.
    pub fn take(&self, len: usize) -> Vec<u8> {
        let kept = {
            let mut free = self.0.0.lock();
            let at = free.buffers.iter().rposition(|b| b.capacity() >= len);
            at.map(|i| free.buffers.swap_remove(i))
        };
        kept.unwrap_or_else(|| Vec::with_capacity(len))
    }

    /// `buf` as shared bytes that give the buffer back here when the last
    /// reference to them is dropped.
    pub fn seal(&self, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Lent {
            buf,
            home: self.0.clone(),
        })
    }

    /// Buffers on the free list now.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.0.0.lock().buffers.len()
    }
}

impl Drop for Recycler {
    fn drop(&mut self) {
        let idle = {
            let mut free = self.0.0.lock();
            free.keep = 0;
            std::mem::take(&mut free.buffers)
        };
        drop(idle);
    }
}

impl FreeList {
    fn give(&self, buf: Vec<u8>) {
        let mut free = self.0.lock();
        if free.buffers.len() < free.keep {
            free.buffers.push(buf);
        }
    }
}

/// A buffer lent out as [`Bytes`].
struct Lent {
    buf: Vec<u8>,
    home: Arc<FreeList>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.home.give(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_comes_back_when_its_last_reference_goes() {
        let r = Recycler::new(4);
        let mut buf = r.take(1024);
        buf.extend_from_slice(&[7u8; 1024]);
        let ptr = buf.as_ptr();
        let bytes = r.seal(buf);
        let slice = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(r.kept(), 0, "a slice still holds it");
        assert_eq!(&slice[..], &[7u8; 10]);
        drop(slice);
        assert_eq!(r.kept(), 1);
        let again = r.take(1000);
        assert_eq!(again.as_ptr(), ptr, "the same memory is filled again");
        assert_eq!(again.len(), 1024, "as it was: filled again, not zeroed");
    }

    #[test]
    fn once_the_download_is_over_buffers_are_freed_not_kept() {
        let r = Recycler::new(4);
        let part = r.seal(r.take(64));
        drop(r.seal(r.take(64)));
        let inner = r.0.clone();
        drop(r);
        assert!(
            inner.0.lock().buffers.is_empty(),
            "the idle ones go with it"
        );
        drop(part);
        assert!(inner.0.lock().buffers.is_empty(), "a late one is not kept");
    }

    #[test]
    fn a_buffer_too_small_is_not_used_and_the_list_is_bounded() {
        let r = Recycler::new(2);
        let small = r.seal(Vec::with_capacity(10));
        drop(small);
        assert!(r.take(100).capacity() >= 100);
        assert_eq!(r.kept(), 1, "the small one stays for a small part");
        let held: Vec<Bytes> = (0..5).map(|_| r.seal(r.take(100))).collect();
        drop(held);
        assert_eq!(r.kept(), 2, "no more than `keep` are kept");
    }
}
