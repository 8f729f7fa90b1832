//! A checkpoint on this machine's file system, read where it was checked.
//!
//! object_store's local store opens every path by name, following
//! symlinks, each time it is asked: a checkpoint folder swapped for a
//! symlink after it was checked (`mv ck/v6 ck/v6.real && ln -s /etc
//! ck/v6`), or a symlink planted in it after it was listed, would be
//! followed. A [`LocalTree`] instead opens the checkpoint's root once,
//! checks the real path of what it opened against the allowed prefix, and
//! reaches every file from that descriptor:
//!
//! - with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` where the
//!   kernel has it (Linux 5.6): a symlink is followed only while it stays
//!   inside the root;
//! - otherwise one `openat(O_NOFOLLOW)` per path component: no symlink is
//!   followed at all.
//!
//! The device, inode and status-change time of each file are recorded the
//! first time it is seen (listed or read); a file found later with
//! another identity or type is refused. The root stays open as long as the checkpoint is
//! registered, so what is read is the folder that was checked, whatever
//! its name now points at.
//!
//! The tree is read-only: writes are refused as not supported.

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat, openat2};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat};
use object_store::path::Path;
use object_store::{
    Attributes, CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload,
    ObjectMeta, ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use parking_lot::Mutex;

const STORE: &str = "LocalTree";

/// Entries listed at most: a checkpoint is a few hundred files, and a
/// root that holds millions is a mistake to report, not to walk.
const MAX_ENTRIES: usize = 100_000;
/// Folders deep at most.
const MAX_DEPTH: usize = 32;

/// Whether `openat2` answered ENOSYS or EPERM (an old kernel, or a seccomp
/// profile that blocks it) once: then every walk is component by component.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

/// A checkpoint folder (or single file) on this machine, held open.
pub struct LocalTree {
    /// The URI, for messages.
    uri: String,
    /// The root as a path of the store (the file system path without its
    /// leading `/`), as the checkpoint's locations are written.
    prefix: String,
    /// The root's path as written.
    path: PathBuf,
    /// The real path the root must stay under, when an allow-list applies.
    limit: Option<PathBuf>,
    /// The root, opened on first use when it did not exist yet.
    root: Mutex<Option<Arc<Root>>>,
    /// The identity of each file seen, by path relative to the root.
    seen: Mutex<HashMap<String, Identity>>,
}

/// A file's device, inode and status-change time: an inode number can be
/// reused at once by a file made after another was removed, and the
/// change time tells them apart.
type Identity = (u64, u64, i64, i64);

/// What the root is.
enum Root {
    Dir(OwnedFd),
    File(OwnedFd),
}

/// A file opened beneath the root, with its status.
struct Opened {
    fd: OwnedFd,
    stat: FileStat,
}

// === impl LocalTree ===

impl LocalTree {
    /// The tree at `path` (absolute), which must stay under `limit` (a
    /// path whose symlinks are resolved when it is compared) when given.
    /// The root is opened now when it exists, else on first use.
    pub fn new(uri: &str, path: PathBuf, limit: Option<PathBuf>) -> LocalTree {
        let prefix = path
            .to_string_lossy()
            .trim_start_matches('/')
            .trim_end_matches('/')
            .to_string();
        let tree = LocalTree {
            uri: uri.to_string(),
            prefix,
            path,
            limit,
            root: Mutex::new(None),
            seen: Mutex::new(HashMap::new()),
        };
        // A root that does not exist yet is reported on first read.
        let _ = tree.root();
        tree
    }

    /// The root, opened (and checked) now if it was not yet.
    fn root(&self) -> object_store::Result<Arc<Root>> {
        let mut held = self.root.lock();
        if let Some(r) = &*held {
            return Ok(r.clone());
        }
        let flags = OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
        let fd = nix::fcntl::open(&self.path, flags, Mode::empty())
            .map_err(|e| self.errno(e, &self.path.to_string_lossy()))?;
        let stat = fstat(&fd).map_err(|e| self.errno(e, ""))?;
        let real = std::fs::read_link(format!("/proc/self/fd/{}", raw(&fd))).map_err(|e| {
            self.generic(format!("cannot tell where the checkpoint's root is: {e}"))
        })?;
        if let Some(limit) = &self.limit {
            let real_limit = std::fs::canonicalize(limit).unwrap_or_else(|_| limit.clone());
            if !real.starts_with(&real_limit) {
                return Err(object_store::Error::PermissionDenied {
                    path: self.uri.clone(),
                    source: format!(
                        "the checkpoint's root is {}, outside the allowed prefix {}",
                        real.display(),
                        real_limit.display()
                    )
                    .into(),
                });
            }
        }
        let root = Arc::new(match kind(&stat) {
            Kind::Dir => Root::Dir(fd),
            Kind::File => Root::File(fd),
            Kind::Other => {
                return Err(self.generic(format!(
                    "{} is neither a folder nor a regular file",
                    self.path.display()
                )));
            }
        });
        *held = Some(root.clone());
        Ok(root)
    }

    /// The path of `location` relative to the root ("" for the root), or
    /// not found when it lies outside.
    fn relative<'a>(&self, location: &'a Path) -> object_store::Result<&'a str> {
        let loc = location.as_ref();
        if loc == self.prefix {
            return Ok("");
        }
        loc.strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix('/'))
            .ok_or_else(|| not_found(loc, "outside the checkpoint"))
    }

    /// The location of `relative` in the store.
    fn location(&self, relative: &str) -> Path {
        if relative.is_empty() {
            Path::from(self.prefix.as_str())
        } else {
            Path::from(format!("{}/{relative}", self.prefix))
        }
    }

    /// Opens the regular file at `relative`, beneath the root, and checks
    /// it is the file first seen there.
    fn open_file(&self, relative: &str) -> object_store::Result<Opened> {
        let root = self.root()?;
        let fd = match (&*root, relative) {
            (Root::File(fd), "") => fd.try_clone().map_err(|e| self.generic(e.to_string()))?,
            (Root::File(_), _) => return Err(not_found(relative, "the checkpoint is one file")),
            (Root::Dir(_), "") => return Err(not_found(&self.prefix, "a folder, not a file")),
            (Root::Dir(dir), rel) => beneath(dir, rel).map_err(|e| self.errno(e, rel))?,
        };
        let stat = fstat(&fd).map_err(|e| self.errno(e, relative))?;
        if kind(&stat) != Kind::File {
            return Err(not_found(relative, "not a regular file"));
        }
        self.same_as_seen(relative, &stat)?;
        Ok(Opened { fd, stat })
    }

    /// Records the identity of `relative` the first time, and refuses a
    /// file that is not the one recorded.
    fn same_as_seen(&self, relative: &str, stat: &FileStat) -> object_store::Result<()> {
        let id = (stat.st_dev, stat.st_ino, stat.st_ctime, stat.st_ctime_nsec);
        let mut seen = self.seen.lock();
        match seen.get(relative) {
            Some(was) if *was != id => Err(object_store::Error::PermissionDenied {
                path: self.location(relative).to_string(),
                source: "the file was replaced since the checkpoint was listed".into(),
            }),
            Some(_) => Ok(()),
            None => {
                seen.insert(relative.to_string(), id);
                Ok(())
            }
        }
    }

    /// Every regular file under the root, walked from the held descriptor.
    fn walk(&self) -> object_store::Result<Vec<ObjectMeta>> {
        let root = self.root()?;
        let dir = match &*root {
            Root::File(fd) => {
                let stat = fstat(fd).map_err(|e| self.errno(e, ""))?;
                self.same_as_seen("", &stat)?;
                return Ok(vec![meta(self.location(""), &stat)]);
            }
            Root::Dir(dir) => dir,
        };
        let mut out = Vec::new();
        // Folders to read: (relative path, descriptor, depth).
        let mut stack: Vec<(String, OwnedFd, usize)> = vec![(
            String::new(),
            dir.try_clone().map_err(|e| self.generic(e.to_string()))?,
            0,
        )];
        let mut entries = 0usize;
        while let Some((rel_dir, fd, depth)) = stack.pop() {
            let names = read_names(fd).map_err(|e| self.errno(e, &rel_dir))?;
            for name in names {
                entries += 1;
                if entries > MAX_ENTRIES {
                    return Err(self.generic(format!(
                        "more than {MAX_ENTRIES} entries under the checkpoint"
                    )));
                }
                let rel = if rel_dir.is_empty() {
                    name
                } else {
                    format!("{rel_dir}/{name}")
                };
                // Opened from the root, so a symlink is followed only
                // while it stays inside (or not at all without openat2).
                let fd = match beneath(dir, &rel) {
                    Ok(fd) => fd,
                    Err(e) => {
                        tracing::warn!(uri = %self.uri, file = %rel, error = %e, "skipping a checkpoint entry that cannot be opened inside the checkpoint");
                        continue;
                    }
                };
                let Ok(stat) = fstat(&fd) else { continue };
                match kind(&stat) {
                    Kind::File => {
                        self.same_as_seen(&rel, &stat)?;
                        out.push(meta(self.location(&rel), &stat));
                    }
                    Kind::Dir if depth + 1 < MAX_DEPTH && !is_link(dir, &rel) => {
                        stack.push((rel, fd, depth + 1));
                    }
                    _ => {}
                }
            }
        }
        Ok(out)
    }

    /// Where `location` can be read by name on this machine, when the
    /// name still leads to the file that was seen there (for a worker on
    /// the same machine that reads files itself).
    pub fn verified_path(&self, location: &Path) -> Option<PathBuf> {
        let rel = self.relative(location).ok()?;
        let path = PathBuf::from(format!("/{}", location.as_ref()));
        let id = *self.seen.lock().get(rel)?;
        let m = std::fs::metadata(&path).ok()?;
        use std::os::unix::fs::MetadataExt as _;
        (m.is_file() && (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()) == id).then_some(path)
    }

    fn errno(&self, e: Errno, what: &str) -> object_store::Error {
        match e {
            Errno::ENOENT | Errno::ENOTDIR => {
                not_found(&format!("{}/{what}", self.prefix), "no such file or folder")
            }
            Errno::EXDEV | Errno::ELOOP => object_store::Error::PermissionDenied {
                path: format!("{}/{what}", self.prefix),
                source: "a symlink leads out of the checkpoint".into(),
            },
            Errno::EACCES | Errno::EPERM => object_store::Error::PermissionDenied {
                path: format!("{}/{what}", self.prefix),
                source: Box::new(std::io::Error::from(e)),
            },
            other => self.generic(format!("{what}: {other}")),
        }
    }

    fn generic(&self, text: String) -> object_store::Error {
        object_store::Error::Generic {
            store: STORE,
            source: format!("{}: {text}", self.uri).into(),
        }
    }

    fn read_only(&self) -> object_store::Error {
        object_store::Error::NotSupported {
            source: "a checkpoint on this machine is read-only to warmgate".into(),
        }
    }

    /// Runs `f` on tokio's blocking pool when inside a runtime.
    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&LocalTree) -> object_store::Result<T> + Send + 'static,
    ) -> object_store::Result<T> {
        let me = self.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(h) => h
                .spawn_blocking(move || f(&me))
                .await
                .map_err(|e| self.generic(format!("a file task failed: {e}")))?,
            Err(_) => f(self),
        }
    }
}

impl fmt::Debug for LocalTree {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalTree").field("uri", &self.uri).finish()
    }
}

impl fmt::Display for LocalTree {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalTree({})", self.path.display())
    }
}

/// The store over a shared tree: object_store's trait takes `&self`, and
/// blocking work needs an owned handle.
#[derive(Debug, Clone)]
pub struct TreeStore(pub Arc<LocalTree>);

impl fmt::Display for TreeStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[async_trait]
impl ObjectStore for TreeStore {
    async fn put_opts(
        &self,
        _: &Path,
        _: PutPayload,
        _: PutOptions,
    ) -> object_store::Result<PutResult> {
        Err(self.0.read_only())
    }

    async fn put_multipart_opts(
        &self,
        _: &Path,
        _: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        Err(self.0.read_only())
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let location = location.clone();
        self.0
            .blocking(move |tree| {
                let rel = tree.relative(&location)?;
                let opened = tree.open_file(rel)?;
                let meta = meta(location.clone(), &opened.stat);
                options.check_preconditions(&meta)?;
                let range = match &options.range {
                    Some(r) => r
                        .as_range(meta.size)
                        .map_err(|e| tree.generic(e.to_string()))?,
                    None => 0..meta.size,
                };
                let payload = if options.head {
                    GetResultPayload::Stream(futures_util::stream::empty().boxed())
                } else {
                    let path = PathBuf::from(format!("/{}", location.as_ref()));
                    GetResultPayload::File(std::fs::File::from(opened.fd), path)
                };
                Ok(GetResult {
                    payload,
                    meta,
                    range,
                    attributes: Attributes::default(),
                    extensions: Default::default(),
                })
            })
            .await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        let tree = self.0.clone();
        locations.map(move |_| Err(tree.read_only())).boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let tree = self.0.clone();
        let prefix = prefix.map(|p| p.as_ref().to_string());
        futures_util::stream::once(async move {
            let all = tree.blocking(|t| t.walk()).await?;
            let under = |m: &ObjectMeta| match &prefix {
                None => true,
                Some(p) => {
                    let loc = m.location.as_ref();
                    loc == p
                        || loc
                            .strip_prefix(p.as_str())
                            .is_some_and(|r| r.starts_with('/'))
                }
            };
            Ok::<_, object_store::Error>(futures_util::stream::iter(
                all.into_iter().filter(under).map(Ok).collect::<Vec<_>>(),
            ))
        })
        .map(|r| match r {
            Ok(s) => s.boxed(),
            Err(e) => futures_util::stream::once(async move { Err(e) }).boxed(),
        })
        .flatten()
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        let prefix = prefix.cloned();
        let base = prefix
            .as_ref()
            .map(|p| p.as_ref().to_string())
            .unwrap_or_default();
        let all = self.0.blocking(|t| t.walk()).await?;
        let mut objects = Vec::new();
        let mut folders = std::collections::BTreeSet::new();
        for m in all {
            let loc = m.location.as_ref().to_string();
            let Some(rest) = (if base.is_empty() {
                Some(loc.as_str())
            } else {
                loc.strip_prefix(base.as_str())
                    .and_then(|r| r.strip_prefix('/'))
            }) else {
                continue;
            };
            match rest.split_once('/') {
                Some((dir, _)) if base.is_empty() => {
                    folders.insert(dir.to_string());
                }
                Some((dir, _)) => {
                    folders.insert(format!("{base}/{dir}"));
                }
                None => objects.push(m),
            }
        }
        Ok(ListResult {
            common_prefixes: folders.into_iter().map(Path::from).collect(),
            objects,
            extensions: Default::default(),
        })
    }

    async fn copy_opts(&self, _: &Path, _: &Path, _: CopyOptions) -> object_store::Result<()> {
        Err(self.0.read_only())
    }
}

// === helpers ===

#[derive(Debug, PartialEq, Eq)]
enum Kind {
    Dir,
    File,
    Other,
}

fn kind(stat: &FileStat) -> Kind {
    let fmt = SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT;
    if fmt == SFlag::S_IFDIR {
        Kind::Dir
    } else if fmt == SFlag::S_IFREG {
        Kind::File
    } else {
        Kind::Other
    }
}

fn raw(fd: &OwnedFd) -> i32 {
    use std::os::fd::AsRawFd as _;
    fd.as_raw_fd()
}

fn meta(location: Path, stat: &FileStat) -> ObjectMeta {
    let secs = stat.st_mtime;
    let nanos = stat.st_mtime_nsec as u32;
    let last_modified: DateTime<Utc> = DateTime::from_timestamp(secs, nanos).unwrap_or_default();
    let micros = (secs as i128 * 1_000_000 + (nanos / 1000) as i128).max(0);
    ObjectMeta {
        location,
        last_modified,
        size: stat.st_size as u64,
        e_tag: Some(format!(
            "\"{:x}-{micros:x}-{:x}\"",
            stat.st_ino, stat.st_size
        )),
        version: None,
    }
}

fn not_found(path: &str, why: &str) -> object_store::Error {
    object_store::Error::NotFound {
        path: path.to_string(),
        source: why.to_string().into(),
    }
}

/// Opens `rel` (components separated by `/`) beneath `dir`, for reading,
/// never leaving it.
fn beneath(dir: &OwnedFd, rel: &str) -> Result<OwnedFd, Errno> {
    if rel
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(Errno::ENOENT);
    }
    let flags = OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
    if !NO_OPENAT2.load(Ordering::Relaxed) {
        let how = OpenHow::new()
            .flags(flags)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        match openat2(dir.as_fd(), rel, how) {
            Err(Errno::ENOSYS | Errno::EPERM) => NO_OPENAT2.store(true, Ordering::Relaxed),
            other => return other,
        }
    }
    // One component at a time, following no symlink.
    let mut parts = rel.split('/').peekable();
    let mut cur: Option<OwnedFd> = None;
    while let Some(part) = parts.next() {
        let at = cur.as_ref().unwrap_or(dir);
        let extra = if parts.peek().is_some() {
            OFlag::O_DIRECTORY
        } else {
            OFlag::empty()
        };
        cur = Some(openat(
            at.as_fd(),
            part,
            flags | OFlag::O_NOFOLLOW | extra,
            Mode::empty(),
        )?);
    }
    cur.ok_or(Errno::ENOENT)
}

/// Whether `rel` beneath `dir` is itself a symlink (a folder reached
/// through one is not walked into, so a loop cannot be).
fn is_link(dir: &OwnedFd, rel: &str) -> bool {
    nix::sys::stat::fstatat(dir.as_fd(), rel, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        .map(|s| SFlag::from_bits_truncate(s.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK)
        .unwrap_or(true)
}

/// The names in the folder `fd`, without `.` and `..`.
fn read_names(fd: OwnedFd) -> Result<Vec<String>, Errno> {
    let mut dir = nix::dir::Dir::from_fd(fd)?;
    let mut names = Vec::new();
    for entry in dir.iter() {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != "." && name != ".." {
            names.push(name);
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt as _;
    use std::path::Path as FsPath;

    fn tree(root: &FsPath, limit: Option<&FsPath>) -> TreeStore {
        TreeStore(Arc::new(LocalTree::new(
            "file:///test",
            root.to_path_buf(),
            limit.map(FsPath::to_path_buf),
        )))
    }

    fn loc(p: &FsPath) -> Path {
        Path::from(p.to_string_lossy().trim_start_matches('/'))
    }

    async fn names(store: &TreeStore, root: &FsPath) -> Vec<String> {
        let mut v: Vec<String> = store
            .list(Some(&loc(root)))
            .map(|m| m.expect("listed").location.to_string())
            .collect()
            .await;
        v.sort();
        let base = format!("{}/", loc(root));
        v.into_iter()
            .map(|s| s.trim_start_matches(&base).to_string())
            .collect()
    }

    #[tokio::test]
    async fn a_root_swapped_for_a_symlink_after_it_was_opened_serves_the_old_folder() {
        let d = tempfile::tempdir().expect("tmp");
        let ck = d.path().join("ck/v6");
        let outside = d.path().join("secret");
        std::fs::create_dir_all(&ck).expect("mkdir");
        std::fs::create_dir_all(&outside).expect("mkdir");
        std::fs::write(ck.join("model.safetensors"), b"weights").expect("write");
        std::fs::write(outside.join("shadow"), b"root:x").expect("write");
        let store = tree(&ck, Some(&d.path().join("ck")));
        std::fs::rename(&ck, d.path().join("ck/v6.real")).expect("mv");
        std::os::unix::fs::symlink(&outside, &ck).expect("ln");
        assert_eq!(names(&store, &ck).await, vec!["model.safetensors"]);
        let got = store
            .get(&loc(&ck.join("model.safetensors")))
            .await
            .expect("get");
        assert_eq!(&got.bytes().await.expect("bytes")[..], b"weights");
        assert!(store.get(&loc(&ck.join("shadow"))).await.is_err());
    }

    #[tokio::test]
    async fn a_root_that_is_a_symlink_out_of_the_limit_when_first_opened_is_refused() {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(d.path().join("ck")).expect("mkdir");
        std::fs::create_dir_all(d.path().join("secret")).expect("mkdir");
        std::fs::write(d.path().join("secret/shadow"), b"root:x").expect("write");
        let ck = d.path().join("ck/v7");
        // Missing at registration; a symlink to outside by the first read.
        let store = tree(&ck, Some(&d.path().join("ck")));
        std::os::unix::fs::symlink(d.path().join("secret"), &ck).expect("ln");
        let err = store
            .list(Some(&loc(&ck)))
            .next()
            .await
            .expect("one")
            .expect_err("refused");
        assert!(
            err.to_string().contains("outside the allowed prefix"),
            "{err}"
        );
        assert!(store.get(&loc(&ck.join("shadow"))).await.is_err());
    }

    #[tokio::test]
    async fn a_symlink_planted_after_listing_or_leading_out_is_not_followed() {
        let d = tempfile::tempdir().expect("tmp");
        let ck = d.path().join("ck");
        std::fs::create_dir_all(ck.join("sub")).expect("mkdir");
        std::fs::write(ck.join("a.bin"), b"aaaa").expect("write");
        std::fs::write(ck.join("sub/b.bin"), b"bb").expect("write");
        std::fs::write(d.path().join("secret"), b"root:x").expect("write");
        // A symlink inside that stays inside is followed; one that leads
        // out is skipped.
        std::os::unix::fs::symlink("a.bin", ck.join("alias.bin")).expect("ln");
        std::os::unix::fs::symlink(d.path().join("secret"), ck.join("evil")).expect("ln");
        let store = tree(&ck, None);
        let listed = names(&store, &ck).await;
        assert!(listed.contains(&"a.bin".to_string()) && listed.contains(&"sub/b.bin".to_string()));
        assert!(!listed.contains(&"evil".to_string()), "{listed:?}");
        assert!(store.get(&loc(&ck.join("evil"))).await.is_err());
        // Replaced after listing by a symlink out, and by another file.
        std::fs::remove_file(ck.join("sub/b.bin")).expect("rm");
        std::os::unix::fs::symlink(d.path().join("secret"), ck.join("sub/b.bin")).expect("ln");
        assert!(store.get(&loc(&ck.join("sub/b.bin"))).await.is_err());
        std::fs::remove_file(ck.join("a.bin")).expect("rm");
        std::fs::write(ck.join("a.bin"), b"other").expect("write");
        let err = store
            .get(&loc(&ck.join("a.bin")))
            .await
            .expect_err("replaced");
        assert!(err.to_string().contains("replaced"), "{err}");
    }

    #[tokio::test]
    async fn a_single_file_checkpoint_reads_by_range() {
        let d = tempfile::tempdir().expect("tmp");
        let f = d.path().join("model.safetensors");
        std::fs::write(&f, b"0123456789").expect("write");
        let store = tree(&f, None);
        let listed: Vec<_> = store.list(Some(&loc(&f))).collect().await;
        assert_eq!(listed.len(), 1);
        let b = store.get_range(&loc(&f), 2..5).await.expect("range");
        assert_eq!(&b[..], b"234");
        assert!(
            store
                .put(&loc(&f), PutPayload::from_static(b"x"))
                .await
                .is_err()
        );
    }

    #[test]
    fn a_path_with_dot_dot_is_not_opened() {
        let d = tempfile::tempdir().expect("tmp");
        let fd = nix::fcntl::open(
            d.path(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY,
            Mode::empty(),
        )
        .expect("open");
        assert!(beneath(&fd, "../etc/passwd").is_err());
        assert!(beneath(&fd, "a//b").is_err());
    }
}
