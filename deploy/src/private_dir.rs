//! Folders a gateway may trust: its own, and reached only through folders
//! no other user can change.
//!
//! `serve` runs the commands its `state.db` holds, signals the process
//! groups its `run/` records name, and serves the files its cache keeps. A
//! state folder another user made, can write, or can swap (through a
//! folder of theirs on the way, or a link they own) would let that user
//! plant all of it. So before a gateway uses a folder it walks the path,
//! as OpenSSH's `StrictModes` and sudo do for their files:
//!
//! - the folder itself is this user's, a folder, and nobody else may write
//!   to it;
//! - every folder on the way (the path as given, and where its links lead)
//!   belongs to root or to this user, and nobody else may write to it
//!   unless its sticky bit is set (`/tmp`), where others cannot rename or
//!   remove what is not theirs;
//! - every link on the way belongs to root or to this user.

use std::fmt;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Component, Path, PathBuf};

/// Why a folder cannot be trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Untrusted {
    /// It, or a folder or link on the way to it, belongs to another user.
    Owner {
        /// The path that does.
        path: PathBuf,
        /// Its owner's uid.
        uid: u32,
    },
    /// Another user may write to it, or to a folder on the way without a
    /// sticky bit.
    Writable {
        /// The path others may write to.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// It is not a folder.
    NotAFolder {
        /// The path.
        path: PathBuf,
    },
    /// It could not be read.
    Unreadable {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Links lead to links more than [`MAX_LINKS`] times.
    TooManyLinks {
        /// The path as given.
        path: PathBuf,
    },
}

impl fmt::Display for Untrusted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Untrusted::Owner { path, uid } => write!(
                f,
                "{} belongs to another user (uid {uid}), who could plant or swap what is in it",
                path.display()
            ),
            Untrusted::Writable { path, mode } => write!(
                f,
                "{} may be written by other users (mode {:o}), who could plant or swap what is in it: \
                 chmod go-w it",
                path.display(),
                mode & 0o7777
            ),
            Untrusted::NotAFolder { path } => write!(f, "{} is not a folder", path.display()),
            Untrusted::Unreadable { path, reason } => {
                write!(f, "cannot check {}: {reason}", path.display())
            }
            Untrusted::TooManyLinks { path } => {
                write!(f, "{}: too many symbolic links on the way", path.display())
            }
        }
    }
}

impl std::error::Error for Untrusted {}

/// Links followed on one path before giving up (Linux's own limit).
pub const MAX_LINKS: usize = 40;

/// Checks that `dir` exists and may be trusted by this process's user (see
/// the module's documentation).
pub fn check(dir: &Path) -> Result<(), Untrusted> {
    check_as(dir, nix::unistd::geteuid().as_raw())
}

/// Makes `dir` (owner-only, with its missing parents) unless it exists,
/// then [`check`]s it. A folder made here is this user's; one that existed
/// is checked as it is, never changed.
pub fn ensure(dir: &Path) -> Result<(), Untrusted> {
    use std::os::unix::fs::DirBuilderExt as _;
    if let Err(e) = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        return Err(Untrusted::Unreadable {
            path: dir.to_path_buf(),
            reason: format!("cannot create it: {e}"),
        });
    }
    check(dir)
}

/// Checks that a folder could be made in `dir` that others cannot swap:
/// `dir` and the way to it belong to root or this user, and others may not
/// write to them unless sticky.
pub fn check_on_the_way_to(dir: &Path) -> Result<(), Untrusted> {
    let uid = nix::unistd::geteuid().as_raw();
    let absolute = absolute(dir)?;
    let mut links = 0;
    walk(&absolute, uid, &mut links, dir).map(|_| ())
}

fn absolute(dir: &Path) -> Result<PathBuf, Untrusted> {
    if dir.is_absolute() {
        return Ok(dir.to_path_buf());
    }
    std::env::current_dir()
        .map(|c| c.join(dir))
        .map_err(|e| Untrusted::Unreadable {
            path: dir.to_path_buf(),
            reason: format!("no current folder: {e}"),
        })
}

/// [`check`] for the user `uid`.
pub fn check_as(dir: &Path, uid: u32) -> Result<(), Untrusted> {
    let absolute = absolute(dir)?;
    let mut links = 0;
    let last = walk(&absolute, uid, &mut links, dir)?;
    let meta = std::fs::metadata(&last).map_err(|e| unreadable(&last, e))?;
    if !meta.is_dir() {
        return Err(Untrusted::NotAFolder { path: last });
    }
    if meta.uid() != uid {
        return Err(Untrusted::Owner {
            path: last,
            uid: meta.uid(),
        });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(Untrusted::Writable {
            path: last,
            mode: meta.mode(),
        });
    }
    Ok(())
}

/// Walks `path` (absolute) from `/`, checking each folder and link on the
/// way and following links; the real path of what it names.
fn walk(path: &Path, uid: u32, links: &mut usize, given: &Path) -> Result<PathBuf, Untrusted> {
    let mut at = PathBuf::from("/");
    check_on_the_way(&at, uid)?;
    for part in path.components() {
        match part {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => continue,
            Component::ParentDir => {
                at.pop();
                continue;
            }
            Component::Normal(name) => at.push(name),
        }
        let meta = std::fs::symlink_metadata(&at).map_err(|e| unreadable(&at, e))?;
        if meta.file_type().is_symlink() {
            if meta.uid() != 0 && meta.uid() != uid {
                return Err(Untrusted::Owner {
                    path: at,
                    uid: meta.uid(),
                });
            }
            *links += 1;
            if *links > MAX_LINKS {
                return Err(Untrusted::TooManyLinks {
                    path: given.to_path_buf(),
                });
            }
            let target = std::fs::read_link(&at).map_err(|e| unreadable(&at, e))?;
            at.pop();
            let next = at.join(target);
            at = walk(&next, uid, links, given)?;
            continue;
        }
        check_on_the_way(&at, uid)?;
    }
    Ok(at)
}

/// A folder on the way: root's or ours, and not writable by others unless
/// sticky. (The last folder is held to more in [`check_as`].)
fn check_on_the_way(at: &Path, uid: u32) -> Result<(), Untrusted> {
    let meta = std::fs::symlink_metadata(at).map_err(|e| unreadable(at, e))?;
    if !meta.is_dir() {
        return Err(Untrusted::NotAFolder {
            path: at.to_path_buf(),
        });
    }
    if meta.uid() != 0 && meta.uid() != uid {
        return Err(Untrusted::Owner {
            path: at.to_path_buf(),
            uid: meta.uid(),
        });
    }
    let sticky = meta.mode() & 0o1000 != 0;
    if meta.mode() & 0o022 != 0 && !sticky {
        return Err(Untrusted::Writable {
            path: at.to_path_buf(),
            mode: meta.mode(),
        });
    }
    Ok(())
}

fn unreadable(path: &Path, e: std::io::Error) -> Untrusted {
    Untrusted::Unreadable {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn me() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    /// A folder of ours under the temporary folder, itself checked: the
    /// tests' own temporary root may not be trustworthy (a shared /tmp
    /// is, with its sticky bit).
    fn base() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("dir");
        chmod(dir.path(), 0o700);
        dir
    }

    #[test]
    fn a_private_folder_of_ours_is_trusted_and_made_when_missing() {
        let dir = base();
        let state = dir.path().join("a/b/state");
        ensure(&state).expect("made and trusted");
        let meta = std::fs::metadata(&state).expect("made");
        assert_eq!(meta.mode() & 0o777, 0o700);
        assert_eq!(check(&state), Ok(()));
    }

    #[test]
    fn a_folder_others_may_write_is_refused_and_left_as_it_is() {
        let dir = base();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).expect("mkdir");
        chmod(&state, 0o777);
        let e = ensure(&state).expect_err("writable by all");
        assert!(
            matches!(&e, Untrusted::Writable { path, .. } if path == &state),
            "{e}"
        );
        assert!(e.to_string().contains("chmod go-w"), "{e}");
        let meta = std::fs::metadata(&state).expect("still there");
        assert_eq!(meta.mode() & 0o777, 0o777, "not changed");
    }

    #[test]
    fn a_folder_inside_one_others_may_write_without_a_sticky_bit_is_refused() {
        let dir = base();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        chmod(&open, 0o777);
        let state = open.join("state");
        std::fs::create_dir(&state).expect("mkdir");
        chmod(&state, 0o700);
        let e = check(&state).expect_err("the parent may be rewritten");
        assert!(
            matches!(&e, Untrusted::Writable { path, .. } if path == &open),
            "{e}"
        );
        // With the sticky bit (as /tmp), others cannot swap our folder.
        chmod(&open, 0o1777);
        assert_eq!(check(&state), Ok(()));
    }

    #[test]
    fn another_user_s_folder_or_link_on_the_way_is_refused() {
        let dir = base();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).expect("mkdir");
        chmod(&state, 0o700);
        // Checked as a user who owns none of it.
        let other = me().wrapping_add(4242);
        let e = check_as(&state, other).expect_err("ours, not theirs");
        assert!(
            matches!(e, Untrusted::Owner { uid, .. } if uid == me()),
            "{e}"
        );
        // A link of ours to our folder is fine; the real folder is checked.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&state, &link).expect("link");
        assert_eq!(check(&link), Ok(()));
        // A link that leads into a folder others may write is not.
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        chmod(&open, 0o777);
        std::fs::create_dir(open.join("s")).expect("mkdir");
        chmod(&open.join("s"), 0o700);
        let sneaky = dir.path().join("sneaky");
        std::os::unix::fs::symlink(open.join("s"), &sneaky).expect("link");
        let e = check(&sneaky).expect_err("leads through an open folder");
        assert!(
            matches!(&e, Untrusted::Writable { path, .. } if path == &open),
            "{e}"
        );
    }

    #[test]
    fn a_file_in_place_of_the_folder_and_a_link_loop_are_refused() {
        let dir = base();
        let file = dir.path().join("file");
        std::fs::write(&file, "x").expect("write");
        assert!(matches!(check(&file), Err(Untrusted::NotAFolder { .. })));
        let a = dir.path().join("a");
        std::os::unix::fs::symlink(dir.path().join("b"), &a).expect("link");
        std::os::unix::fs::symlink(&a, dir.path().join("b")).expect("link");
        assert!(matches!(check(&a), Err(Untrusted::TooManyLinks { .. })));
    }
}
