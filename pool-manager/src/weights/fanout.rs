//! One download of an object, fed to every reader from memory as it
//! arrives, with the cache file written beside them.
//!
//! The store is usually faster than the disk that caches it: a cold read
//! that waited for the cache file ran at the disk's write speed. Here the
//! download keeps its newest bytes in a window bounded by bytes, and each
//! reader takes them from there; the cache writer is one more reader, off
//! everyone's critical path. A reader that falls behind the window reads
//! what the cache file already holds and then waits for the writer (it is
//! the slowest there is anyway); the writer, when it falls behind, reads
//! the rest from the store on its own, at the disk's pace. Without a cache
//! file (the disk refused it), readers are served from the window alone,
//! and one that falls behind it fails rather than read the store again:
//! the memory and the store reads a download costs stay bounded.
//!
//! The download runs no faster than its leading reader needs: it waits
//! while that reader is a whole window behind, and stops when nobody
//! reads it from the window any more.
//!
//! [`State`] is the policy, pure; [`Fanout`] wraps it with a lock and a
//! wake-up for the async readers and the download.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::watch;

/// A reader's identity within one download.
pub type ReaderId = u64;

/// What a reader at some offset gets next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Bytes at its offset, from memory.
    Memory(Bytes),
    /// Bytes at its offset are in `path` up to offset `until`.
    File {
        /// The cache file (its temporary name while it is written, the
        /// entry once committed).
        path: PathBuf,
        /// How far the file holds the object's bytes.
        until: u64,
    },
    /// Not there yet: wait for a change.
    Wait,
    /// Neither in memory nor on file, and nothing will bring them here:
    /// read them from the store (only the cache writer is told this).
    Store,
    /// The object is read whole.
    End,
    /// The download failed, with the reason.
    Failed(String),
}

/// How the download went.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Feed {
    /// Still arriving.
    Running,
    /// Stopped early: nobody read from the window any more.
    Stopped,
    /// Every byte arrived.
    Done,
    /// Failed, with the reason.
    Failed(String),
}

/// How the cache file is going.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Fill {
    /// Being written: `written` bytes from the start so far.
    Writing { tmp: PathBuf, written: u64 },
    /// Committed: the cache entry.
    Committed(PathBuf),
    /// Given up (a disk error, a digest mismatch): no file to read.
    Gone,
}

/// The policy of one download: its window, its readers' offsets, and how
/// far the cache file has got.
#[derive(Debug)]
pub struct State {
    size: u64,
    cap: u64,
    window: VecDeque<Bytes>,
    window_start: u64,
    window_bytes: u64,
    received: u64,
    feed: Feed,
    fill: Fill,
    readers: BTreeMap<ReaderId, u64>,
    next_id: ReaderId,
}

impl State {
    /// A download of `size` bytes holding at most about `cap` of them in
    /// memory, its cache file being written at `tmp` (`None`: it has
    /// none).
    pub fn new(size: u64, cap: u64, tmp: Option<PathBuf>) -> State {
        State {
            size,
            cap: cap.max(1),
            window: VecDeque::new(),
            window_start: 0,
            window_bytes: 0,
            received: 0,
            feed: Feed::Running,
            fill: match tmp {
                Some(tmp) => Fill::Writing { tmp, written: 0 },
                None => Fill::Gone,
            },
            readers: BTreeMap::new(),
            next_id: 0,
        }
    }

    /// Adds a reader that reads from the window at `offset`.
    pub fn join(&mut self, offset: u64) -> ReaderId {
        let id = self.next_id;
        self.next_id += 1;
        self.readers.insert(id, offset);
        id
    }

    /// Removes a reader.
    pub fn leave(&mut self, id: ReaderId) {
        self.readers.remove(&id);
    }

    /// Moves a reader to `offset`.
    pub fn advance(&mut self, id: ReaderId, offset: u64) {
        if let Some(o) = self.readers.get_mut(&id) {
            *o = offset;
        }
    }

    /// Bytes arrived so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Readers that read from the window.
    pub fn readers(&self) -> usize {
        self.readers.len()
    }

    /// Whether the download may take another part now: it runs at most a
    /// window ahead of its leading reader. `None`: it should stop, as
    /// nobody reads from the window.
    pub fn may_push(&self) -> Option<bool> {
        let lead = self.readers.values().max()?;
        Some(self.received.saturating_sub(*lead) < self.cap)
    }

    /// Takes the next part of the object, dropping the oldest parts past
    /// the window's cap.
    pub fn push(&mut self, part: Bytes) {
        self.received += part.len() as u64;
        self.window_bytes += part.len() as u64;
        self.window.push_back(part);
        while self.window_bytes > self.cap && self.window.len() > 1 {
            let old = self.window.pop_front().expect("more than one");
            self.window_start += old.len() as u64;
            self.window_bytes -= old.len() as u64;
        }
        if self.received >= self.size {
            self.feed = Feed::Done;
        }
    }

    /// The download ended before the object's end: `Err` when it failed,
    /// `Ok` when it stopped for want of readers.
    pub fn end(&mut self, outcome: Result<(), String>) {
        if self.feed == Feed::Running {
            self.feed = match outcome {
                Ok(()) => Feed::Stopped,
                Err(e) => Feed::Failed(e),
            };
        }
    }

    /// The cache file holds the first `written` bytes.
    pub fn written(&mut self, written: u64) {
        if let Fill::Writing { written: w, .. } = &mut self.fill {
            *w = (*w).max(written);
        }
    }

    /// The cache file is committed at `path`, or (`None`) given up.
    pub fn filled(&mut self, path: Option<PathBuf>) {
        self.fill = match path {
            Some(p) => Fill::Committed(p),
            None => Fill::Gone,
        };
    }

    /// Whether anything is still going on: bytes arriving or the file
    /// being written.
    pub fn live(&self) -> bool {
        self.feed == Feed::Running || matches!(self.fill, Fill::Writing { .. })
    }

    /// Whether new readers should start a download of their own instead
    /// of joining this one: its file is committed (they read the cache),
    /// or it failed, or it has neither a file nor bytes arriving.
    pub fn retired(&self) -> bool {
        matches!(self.fill, Fill::Committed(_))
            || matches!(self.feed, Feed::Failed(_))
            || (self.fill == Fill::Gone && self.feed != Feed::Running)
    }

    /// What a reader at `offset` gets next, at most `max` bytes of it;
    /// `use_file`: whether it may read the cache file (the writer may not).
    pub fn next(&self, offset: u64, max: usize, use_file: bool) -> Next {
        if offset >= self.size {
            return Next::End;
        }
        if offset >= self.window_start && offset < self.received {
            let mut start = self.window_start;
            for part in &self.window {
                let end = start + part.len() as u64;
                if offset < end {
                    let from = (offset - start) as usize;
                    let to = part.len().min(from + max.max(1));
                    return Next::Memory(part.slice(from..to));
                }
                start = end;
            }
        }
        if use_file {
            match &self.fill {
                Fill::Committed(path) => {
                    return Next::File {
                        path: path.clone(),
                        until: self.size,
                    };
                }
                Fill::Writing { tmp, written } if offset < *written => {
                    return Next::File {
                        path: tmp.clone(),
                        until: *written,
                    };
                }
                Fill::Writing { .. } => {
                    // Behind the window or past a stopped download: the
                    // writer will get here.
                    if offset < self.window_start || self.feed != Feed::Running {
                        return match &self.feed {
                            Feed::Failed(e) if offset >= self.received => Next::Failed(e.clone()),
                            _ => Next::Wait,
                        };
                    }
                }
                Fill::Gone => {
                    if offset < self.window_start || self.feed != Feed::Running {
                        return match &self.feed {
                            Feed::Failed(e) if offset >= self.received => Next::Failed(e.clone()),
                            _ => Next::Failed(
                                "these bytes have left the download's memory, and the cache \
                                 file that would hold them could not be written"
                                    .into(),
                            ),
                        };
                    }
                }
            }
        } else if offset < self.window_start {
            return Next::Store;
        }
        match &self.feed {
            Feed::Running => Next::Wait,
            Feed::Failed(e) => Next::Failed(e.clone()),
            // Only the writer gets here: readers of the file wait for it.
            Feed::Stopped | Feed::Done => Next::Store,
        }
    }
}

/// A [`State`] shared by the download's task and its readers, with a
/// wake-up on every change.
pub struct Fanout {
    state: Mutex<State>,
    /// Bytes arrived, the file grew, the download or the file ended: what
    /// readers wait for.
    arrived: watch::Sender<()>,
    /// A reader joined, moved or left: what the download waits for.
    moved: watch::Sender<()>,
}

impl Fanout {
    /// See [`State::new`].
    pub fn new(size: u64, cap: u64, tmp: Option<PathBuf>) -> Arc<Fanout> {
        Fanout::with(State::new(size, cap, tmp))
    }

    fn with(state: State) -> Arc<Fanout> {
        Arc::new(Fanout {
            state: Mutex::new(state),
            arrived: watch::channel(()).0,
            moved: watch::channel(()).0,
        })
    }

    /// A finished download: the object whole in the cache entry at
    /// `path`, for a reader of a cache hit.
    pub fn committed(size: u64, path: PathBuf) -> Arc<Fanout> {
        let mut state = State::new(size, 1, None);
        state.feed = Feed::Done;
        state.received = size;
        state.window_start = size;
        state.filled(Some(path));
        Fanout::with(state)
    }

    /// Changes what readers read (bytes, the file, how the download
    /// ended) and wakes the readers.
    pub fn update<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let r = f(&mut self.state.lock());
        self.arrived.send_replace(());
        r
    }

    /// Changes the readers' positions and wakes the download.
    fn reposition<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let r = f(&mut self.state.lock());
        self.moved.send_replace(());
        r
    }

    /// Reads the state.
    pub fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&self.state.lock())
    }

    /// Waits until the download may take another part: `false` when it
    /// should stop instead.
    pub async fn room(&self) -> bool {
        let mut rx = self.moved.subscribe();
        loop {
            rx.borrow_and_update();
            match self.read(State::may_push) {
                None => return false,
                Some(true) => return true,
                Some(false) => {
                    if rx.changed().await.is_err() {
                        return false;
                    }
                }
            }
        }
    }

    /// A reader from `offset`; see [`State::next`] for `use_file`.
    pub fn reader(self: &Arc<Self>, offset: u64, use_file: bool) -> Reader {
        let id = self.reposition(|s| s.join(offset));
        Reader {
            fanout: self.clone(),
            rx: self.arrived.subscribe(),
            id: Some(id),
            offset,
            use_file,
        }
    }
}

/// One reader of a [`Fanout`]; it leaves the window when dropped.
pub struct Reader {
    fanout: Arc<Fanout>,
    rx: watch::Receiver<()>,
    id: Option<ReaderId>,
    offset: u64,
    use_file: bool,
}

impl Reader {
    /// Its offset.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// What comes next at its offset, at most `max` bytes, waiting while
    /// it is [`Next::Wait`].
    pub async fn next(&mut self, max: usize) -> Next {
        loop {
            self.rx.borrow_and_update();
            let next = self
                .fanout
                .read(|s| s.next(self.offset, max, self.use_file));
            if next != Next::Wait {
                return next;
            }
            if self.rx.changed().await.is_err() {
                return Next::Failed("the download stopped".into());
            }
        }
    }

    /// Moves on by `n` bytes it has taken.
    pub fn consumed(&mut self, n: u64) {
        self.offset += n;
        if let Some(id) = self.id {
            let offset = self.offset;
            self.fanout.reposition(|s| s.advance(id, offset));
        }
    }

    /// Stops reading from the window (it reads elsewhere from now on), so
    /// the download no longer runs for it.
    pub fn leave(&mut self) {
        if let Some(id) = self.id.take() {
            self.fanout.reposition(|s| s.leave(id));
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_hit_is_read_from_its_entry() {
        let f = Fanout::committed(10, PathBuf::from("/cache/x"));
        let next = f.read(|s| s.next(3, 100, true));
        assert_eq!(
            next,
            Next::File {
                path: PathBuf::from("/cache/x"),
                until: 10
            }
        );
        assert_eq!(f.read(|s| s.next(10, 100, true)), Next::End);
    }

    fn part(n: usize, b: u8) -> Bytes {
        Bytes::from(vec![b; n])
    }

    fn tmp() -> PathBuf {
        PathBuf::from("/cache/x.tmp")
    }

    #[test]
    fn readers_take_parts_from_memory_as_they_arrive() {
        let mut s = State::new(30, 100, Some(tmp()));
        let r = s.join(0);
        assert_eq!(s.next(0, 100, true), Next::Wait);
        s.push(part(10, 1));
        assert_eq!(s.next(0, 100, true), Next::Memory(part(10, 1)));
        assert_eq!(s.next(4, 3, true), Next::Memory(part(3, 1)));
        s.advance(r, 10);
        s.push(part(20, 2));
        assert_eq!(s.next(10, 100, true), Next::Memory(part(20, 2)));
        assert_eq!(s.next(30, 100, true), Next::End);
    }

    #[test]
    fn the_download_runs_at_most_a_window_ahead_of_its_lead_and_stops_without_readers() {
        let mut s = State::new(100, 20, Some(tmp()));
        assert_eq!(s.may_push(), None);
        let slow = s.join(0);
        let fast = s.join(0);
        s.push(part(10, 1));
        assert_eq!(s.may_push(), Some(true));
        s.push(part(10, 2));
        assert_eq!(
            s.may_push(),
            Some(false),
            "the lead is a whole window behind"
        );
        s.advance(fast, 20);
        assert_eq!(s.may_push(), Some(true), "the slow reader does not hold it");
        s.push(part(10, 3));
        // The oldest part left the window: the slow reader reads the file
        // once the writer has written it, and waits until then.
        assert_eq!(s.next(0, 100, true), Next::Wait);
        s.written(10);
        assert_eq!(
            s.next(0, 100, true),
            Next::File {
                path: tmp(),
                until: 10
            }
        );
        s.leave(slow);
        s.leave(fast);
        assert_eq!(s.may_push(), None);
    }

    #[test]
    fn a_writer_behind_the_window_reads_the_store_and_never_the_file() {
        let mut s = State::new(100, 10, Some(tmp()));
        let _lead = s.join(0);
        s.push(part(10, 1));
        s.push(part(10, 2));
        s.written(10);
        assert_eq!(s.next(0, 100, false), Next::Store);
        assert_eq!(s.next(10, 100, false), Next::Memory(part(10, 2)));
    }

    #[test]
    fn a_reader_past_a_stopped_download_waits_for_the_file_then_reads_it() {
        let mut s = State::new(100, 10, Some(tmp()));
        let r = s.join(0);
        s.push(part(10, 1));
        s.leave(r);
        s.end(Ok(()));
        assert_eq!(
            s.next(50, 100, true),
            Next::Wait,
            "the writer will get there"
        );
        s.filled(Some(PathBuf::from("/cache/x")));
        assert_eq!(
            s.next(50, 100, true),
            Next::File {
                path: PathBuf::from("/cache/x"),
                until: 100
            }
        );
        assert!(!s.live());
    }

    #[test]
    fn without_a_file_readers_are_served_from_the_window_and_one_behind_it_fails() {
        let mut s = State::new(100, 10, Some(tmp()));
        let _r = s.join(0);
        s.push(part(10, 1));
        s.push(part(10, 2));
        s.filled(None);
        assert!(matches!(s.next(0, 100, true), Next::Failed(_)));
        assert_eq!(s.next(10, 100, true), Next::Memory(part(10, 2)));
        assert_eq!(s.next(20, 100, true), Next::Wait);
        assert!(!s.retired(), "bytes still arrive for the window's readers");
        // A download that never had a file serves the same way.
        let mut s = State::new(100, 10, None);
        let r = s.join(0);
        s.push(part(10, 1));
        assert_eq!(s.next(0, 100, true), Next::Memory(part(10, 1)));
        s.leave(r);
        s.end(Ok(()));
        assert!(s.retired(), "nothing arrives and nothing is on file");
        assert!(matches!(s.next(10, 100, true), Next::Failed(_)));
    }

    #[test]
    fn a_download_is_retired_once_committed_or_failed() {
        let mut s = State::new(10, 100, Some(tmp()));
        assert!(!s.retired());
        s.push(part(10, 1));
        assert!(!s.retired(), "the file is not written yet");
        s.filled(Some(PathBuf::from("/cache/x")));
        assert!(s.retired());
        let mut s = State::new(100, 100, Some(tmp()));
        s.end(Err("500".into()));
        assert!(s.retired(), "new readers start again at once");
    }

    #[test]
    fn a_failed_download_fails_readers_past_what_arrived_only() {
        let mut s = State::new(100, 100, Some(tmp()));
        let _r = s.join(0);
        s.push(part(10, 1));
        s.end(Err("store said 500".into()));
        assert_eq!(s.next(0, 100, true), Next::Memory(part(10, 1)));
        assert_eq!(s.next(10, 100, true), Next::Failed("store said 500".into()));
        assert_eq!(
            s.next(10, 100, false),
            Next::Failed("store said 500".into())
        );
        // Failing after the end changes nothing.
        let mut s = State::new(10, 100, Some(tmp()));
        s.push(part(10, 1));
        s.end(Err("late".into()));
        assert_eq!(s.next(0, 100, true), Next::Memory(part(10, 1)));
    }

    #[test]
    fn memory_stays_within_the_cap_plus_one_part() {
        let mut s = State::new(1000, 25, Some(tmp()));
        let r = s.join(0);
        for i in 0..100 {
            s.push(part(10, i as u8));
            s.advance(r, s.received);
            assert!(s.window_bytes <= 25 + 10, "{}", s.window_bytes);
        }
        assert_eq!(s.next(990, 100, true), Next::Memory(part(10, 99)));
    }

    #[tokio::test]
    async fn a_waiting_reader_wakes_on_a_part_and_the_download_on_a_read() {
        let f = Fanout::new(20, 10, Some(tmp()));
        let mut r = f.reader(0, true);
        let f2 = f.clone();
        let feeder = tokio::spawn(async move {
            assert!(f2.room().await);
            f2.update(|s| s.push(part(10, 1)));
            // Full until the reader takes it.
            assert!(f2.room().await);
            f2.update(|s| s.push(part(10, 2)));
        });
        assert_eq!(r.next(100).await, Next::Memory(part(10, 1)));
        r.consumed(10);
        assert_eq!(r.next(100).await, Next::Memory(part(10, 2)));
        r.consumed(10);
        assert_eq!(r.next(100).await, Next::End);
        feeder.await.unwrap();
        drop(r);
        assert_eq!(f.read(State::readers), 0);
        assert!(!f.room().await, "nobody reads: stop");
    }
}
