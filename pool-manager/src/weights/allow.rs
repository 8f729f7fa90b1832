//! Which checkpoint URIs the gateway may open: an allow-list of prefixes.
//!
//! A URI is compared after it is resolved and parsed the way
//! [`Source::open`](super::Source::open) parses it, so what is checked is
//! what is opened: `.` and `..` segments (percent-encoded ones too) are
//! gone, the scheme and the authority (bucket, host and port) must be the
//! same, and the prefix must end on a segment boundary (`s3://bucket` does
//! not cover `s3://bucket-other`, `file:///ok` does not cover
//! `file:///okay`). Segments that percent-encode a separator or a dot are
//! refused outright, as are queries and fragments. A `file://` URI must
//! also stay under the prefix once its symlinks are resolved.

use std::path::{Path, PathBuf};

use url::Url;

use super::source::resolve;
use crate::{Error, Result};

/// Checkpoint URI prefixes the gateway may open.
#[derive(Debug, Clone, Default)]
pub struct AllowList {
    prefixes: Vec<Prefix>,
}

/// One allowed prefix, parsed.
#[derive(Debug, Clone)]
struct Prefix {
    /// As written, for messages.
    text: String,
    url: Url,
    segments: Vec<String>,
}

// === impl AllowList ===

impl AllowList {
    /// Parses `prefixes`; a relative `file://` prefix resolves against `base`.
    pub fn new<S: AsRef<str>>(prefixes: &[S], base: &Path) -> Result<AllowList> {
        let mut out = Vec::new();
        for p in prefixes {
            let text = p.as_ref().to_string();
            let url = resolve(&text, base)?;
            let segments = segments(&url, &text)?;
            out.push(Prefix {
                text,
                url,
                segments,
            });
        }
        Ok(AllowList { prefixes: out })
    }

    /// The prefixes as written.
    pub fn prefixes(&self) -> Vec<&str> {
        self.prefixes.iter().map(|p| p.text.as_str()).collect()
    }

    /// Ok when `uri` (a relative `file://` one resolved against `base`)
    /// lies under one of the prefixes; checked before anything is opened.
    /// For a `file://` URI, the path of the prefix it lies under, which
    /// the opened root must stay under too
    /// ([`Source::open_within`](super::Source::open_within)).
    pub fn check(&self, uri: &str, base: &Path) -> Result<Option<PathBuf>> {
        let url = resolve(uri, base)?;
        let segs = segments(&url, uri)?;
        let refused = || Error::Weights {
            uri: uri.to_string(),
            reason: format!(
                "outside the allowed checkpoint prefixes ([weights] allowed_prefixes: {})",
                if self.prefixes.is_empty() {
                    "none".to_string()
                } else {
                    self.prefixes().join(", ")
                }
            ),
        };
        let under = |p: &Prefix| {
            p.url.scheme() == url.scheme()
                && authority(&p.url) == authority(&url)
                && segs.len() >= p.segments.len()
                && p.segments.iter().zip(&segs).all(|(a, b)| a == b)
        };
        let prefix = self
            .prefixes
            .iter()
            .find(|p| under(p))
            .ok_or_else(refused)?;
        if url.scheme() == "file" {
            // Symlinks must not lead out of the prefix.
            let (Ok(path), Ok(root)) = (url.to_file_path(), prefix.url.to_file_path()) else {
                return Err(refused());
            };
            if let (Ok(real), Ok(real_root)) = (canonical(&path), canonical(&root))
                && !real.starts_with(&real_root)
            {
                return Err(Error::Weights {
                    uri: uri.to_string(),
                    reason: format!(
                        "resolves to {} through a symlink, outside the allowed prefix {}",
                        real.display(),
                        prefix.text
                    ),
                });
            }
            return Ok(Some(root));
        }
        Ok(None)
    }
}

/// The parts of a URL before its path: user, host and port.
fn authority(url: &Url) -> &str {
    &url[url::Position::BeforeUsername..url::Position::AfterPort]
}

/// The path's non-empty segments, refusing queries, fragments and
/// percent-encoded separators or dots (a segment the store might decode
/// into a different path than the one checked).
fn segments(url: &Url, uri: &str) -> Result<Vec<String>> {
    let bad = |reason: &str| Error::Weights {
        uri: uri.to_string(),
        reason: reason.to_string(),
    };
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("a checkpoint URI has no query or fragment"));
    }
    let segs: Vec<String> = url
        .path_segments()
        .map(|s| s.filter(|s| !s.is_empty()).map(str::to_string).collect())
        .unwrap_or_default();
    for s in &segs {
        let lower = s.to_ascii_lowercase();
        if s == "."
            || s == ".."
            || ["%2f", "%5c", "%2e", "%00"]
                .iter()
                .any(|e| lower.contains(e))
        {
            return Err(bad(
                "a checkpoint URI may not encode '/', '\\', '.' or NUL in a path segment",
            ));
        }
    }
    Ok(segs)
}

fn canonical(path: &Path) -> std::io::Result<PathBuf> {
    std::fs::canonicalize(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allows(prefixes: &[&str], uri: &str) -> bool {
        let base = Path::new("/srv/app");
        AllowList::new(prefixes, base)
            .expect("valid prefixes")
            .check(uri, base)
            .is_ok()
    }

    #[test]
    fn prefixes_match_on_segment_boundaries_after_normalisation() {
        let ok = ["file:///ok", "s3://bucket/ckpt", "http://store:9000/b/x"];
        assert!(allows(&ok, "file:///ok/model"));
        assert!(allows(&ok, "file:///ok"));
        assert!(allows(&ok, "s3://bucket/ckpt/v2"));
        assert!(allows(&ok, "http://store:9000/b/x/y"));
        for bad in [
            "file:///etc/passwd",
            "file:///ok/../etc/passwd",
            "file:///ok/%2e%2e/etc/passwd",
            "file:///ok/%2E%2E/etc",
            "file:///ok/a%2f..%2f..%2fetc",
            "file:///okay/x",
            "s3://bucket-other/ckpt/v2",
            "s3://bucket/ckpt-other",
            "s3://bucket/ckpt/../secret",
            "s3://bucket/ckpt/%2e%2e/secret",
            "gs://bucket/ckpt/v2",
            "http://store:9001/b/x/y",
            "http://127.0.0.1:8080/internal/admin",
            "https://store:9000/b/x/y",
            "http://user@store:9000/b/x/y",
            "s3://bucket/ckpt/v2?versionId=1",
        ] {
            assert!(!allows(&ok, bad), "{bad} was allowed");
        }
        assert!(!allows(&[], "file:///ok/model"));
    }

    #[test]
    fn relative_file_uris_resolve_against_the_base() {
        assert!(allows(&["file://./checkpoints"], "file://./checkpoints/v2"));
        assert!(allows(
            &["file://./checkpoints"],
            "file:///srv/app/checkpoints/v2"
        ));
        assert!(!allows(&["file://./checkpoints"], "file://./other"));
        assert!(!allows(
            &["file://./checkpoints"],
            "file://./checkpoints/../../etc"
        ));
    }

    #[test]
    fn a_symlink_out_of_the_prefix_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ok = dir.path().join("ok");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&ok).expect("mkdir");
        std::fs::create_dir_all(&outside).expect("mkdir");
        std::os::unix::fs::symlink(&outside, ok.join("evil")).expect("symlink");
        std::fs::create_dir_all(ok.join("good")).expect("mkdir");
        let prefix = format!("file://{}", ok.display());
        assert!(allows(&[&prefix], &format!("{prefix}/good")));
        assert!(!allows(&[&prefix], &format!("{prefix}/evil")));
    }
}
