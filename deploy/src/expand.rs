//! `$VAR` and `${VAR}` in a worker's command, expanded without a shell,
//! so a stock server takes its port as it expects (`--port $PORT`).
//!
//! `$$` is a literal `$`; a `$` not followed by a name or `{` stays as it
//! is. A variable the worker's environment does not have is an error that
//! names it, not an empty string: `--port ` with nothing after it would
//! fail far from the cause.

/// Why a word could not be expanded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpandError {
    /// `${` without its `}`.
    #[error("{word:?}: `${{` is not closed by `}}`")]
    Unclosed {
        /// The word.
        word: String,
    },
    /// `${}` or a name that is not `[A-Za-z_][A-Za-z0-9_]*`.
    #[error("{word:?}: {name:?} is not a variable name")]
    BadName {
        /// The word.
        word: String,
        /// What stood between the braces.
        name: String,
    },
    /// A variable the environment does not have.
    #[error("{word:?}: ${name} is not set in the worker's environment")]
    Unset {
        /// The word.
        word: String,
        /// The variable.
        name: String,
    },
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_name(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `word` with every variable replaced by `lookup`'s value.
pub fn expand<'a>(
    word: &str,
    lookup: impl Fn(&str) -> Option<&'a str>,
) -> Result<String, ExpandError> {
    let mut out = String::with_capacity(word.len());
    let mut rest = word;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (name, next) = if let Some(braced) = after.strip_prefix('{') {
            let end = braced.find('}').ok_or_else(|| ExpandError::Unclosed {
                word: word.to_string(),
            })?;
            let name = &braced[..end];
            if name.is_empty() || !name.starts_with(is_name_start) || !name.chars().all(is_name) {
                return Err(ExpandError::BadName {
                    word: word.to_string(),
                    name: name.to_string(),
                });
            }
            (name, &braced[end + 1..])
        } else if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
            continue;
        } else if after.starts_with(is_name_start) {
            let end = after.find(|c: char| !is_name(c)).unwrap_or(after.len());
            (&after[..end], &after[end..])
        } else {
            out.push('$');
            rest = after;
            continue;
        };
        let value = lookup(name).ok_or_else(|| ExpandError::Unset {
            word: word.to_string(),
            name: name.to_string(),
        })?;
        out.push_str(value);
        rest = next;
    }
    out.push_str(rest);
    Ok(out)
}

/// Checks a word's syntax without an environment (at config load): only
/// unclosed braces and bad names fail here.
pub fn check(word: &str) -> Result<(), ExpandError> {
    match expand(word, |_| Some("")) {
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<&'static str> {
        match name {
            "PORT" => Some("8123"),
            "MODEL" => Some("Qwen/Qwen2.5-0.5B"),
            "EMPTY" => Some(""),
            _ => None,
        }
    }

    #[test]
    fn variables_are_replaced_without_a_shell() {
        let cases = [
            ("--port", "--port"),
            ("$PORT", "8123"),
            ("${PORT}", "8123"),
            ("--port=$PORT", "--port=8123"),
            ("0.0.0.0:${PORT}x", "0.0.0.0:8123x"),
            ("$PORT-$MODEL", "8123-Qwen/Qwen2.5-0.5B"),
            ("$$PORT", "$PORT"),
            ("costs $5", "costs $5"),
            ("ends with $", "ends with $"),
            ("a $ b", "a $ b"),
            ("$EMPTY", ""),
            ("`rm -rf /` $(id) ; $PORT", "`rm -rf /` $(id) ; 8123"),
        ];
        for (word, want) in cases {
            assert_eq!(expand(word, env).as_deref(), Ok(want), "{word}");
        }
    }

    #[test]
    fn unset_and_malformed_variables_are_named() {
        assert_eq!(
            expand("--port $PROT", env),
            Err(ExpandError::Unset {
                word: "--port $PROT".into(),
                name: "PROT".into()
            })
        );
        assert!(matches!(
            expand("${PORT", env),
            Err(ExpandError::Unclosed { .. })
        ));
        assert!(matches!(
            expand("${}", env),
            Err(ExpandError::BadName { .. })
        ));
        assert!(matches!(
            expand("${1X}", env),
            Err(ExpandError::BadName { .. })
        ));
        assert!(matches!(
            expand("${A B}", env),
            Err(ExpandError::BadName { .. })
        ));
        assert!(check("--port ${PORT}").is_ok());
        assert!(check("--port ${PORT").is_err());
        let msg = expand("--port $PROT", env).unwrap_err().to_string();
        assert!(msg.contains("$PROT") && msg.contains("not set"), "{msg}");
    }

    #[test]
    fn arbitrary_words_never_panic() {
        for word in [
            "$",
            "${",
            "}",
            "$}",
            "${}}",
            "$$$",
            "${${PORT}}",
            "é$PORTé",
            "$é",
        ] {
            let _ = expand(word, env);
        }
    }
}
