//! The rules for names: DNS labels and Kubernetes names, model names and
//! aliases, environment variables, API key digests and revision ids.

/// Whether `name` can be an environment variable's name (POSIX: letters,
/// digits and `_`, not starting with a digit).
pub(super) fn is_env_name(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Why `name` is not a Kubernetes object name (an RFC 1123 subdomain), if
/// it is not.
pub(super) fn check_dns_subdomain(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                && l.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                && l.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a Kubernetes name (lowercase letters, digits, '-' and '.')"
        ))
    }
}

/// Why `text` is not a SHA-256 digest in hex, if it is not.
pub(super) fn check_sha256_hex(text: &str) -> std::result::Result<(), String> {
    if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err("must be 64 hex digits, the SHA-256 of the key (printf %s KEY | sha256sum)".into())
    }
}

/// Whether `name` is the id of a revision of `app` (`<app>-` and at least
/// five digits, as revisions are numbered).
pub(super) fn is_revision_of(name: &str, app: &str) -> bool {
    name.strip_prefix(app)
        .and_then(|r| r.strip_prefix('-'))
        .is_some_and(|d| d.len() >= 5 && d.bytes().all(|b| b.is_ascii_digit()))
}

/// App names end up in URLs, file names, metric labels and (on Kubernetes)
/// object names, so they follow RFC 1123 labels.
pub fn check_dns_label(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.as_bytes()[0].is_ascii_lowercase()
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a valid name: use 1-63 lowercase letters, digits and '-', \
             starting with a letter"
        ))
    }
}

/// The most bytes of an alias (an OpenAI `model` name): Hugging Face
/// repository ids are at most 96 characters; 128 leaves room for a tag.
pub const MAX_MODEL_NAME_LEN: usize = 128;

/// Checks an alias: the characters model names use (ASCII letters and
/// digits, `-`, `_`, `.`, `/`, `:`, `@`), at most [`MAX_MODEL_NAME_LEN`]
/// bytes, starting with a letter or digit, with no `..` segment. Control
/// characters, zero-width and look-alike letters, and paths (`../x`) are
/// refused: an alias is echoed in errors and logs and names a route.
pub fn check_model_name(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_MODEL_NAME_LEN
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:@".contains(&b))
        && !name
            .split('/')
            .any(|seg| seg == ".." || seg == "." || seg.is_empty());
    if ok {
        Ok(())
    } else {
        let shown: String = name.chars().take(64).collect();
        Err(format!(
            "{shown:?} is not a valid model name: use 1-{MAX_MODEL_NAME_LEN} ASCII letters, \
             digits and '-', '_', '.', '/', ':', '@', starting with a letter or digit, with \
             no empty, '.' or '..' segment"
        ))
    }
}
