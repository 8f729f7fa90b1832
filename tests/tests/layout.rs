//! The gateway crate's modules form layers: no module reaches, through
//! `crate::` paths, a module that reaches back to it. Read from the
//! sources (tests excluded), so a cycle fails here before review.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every top-level module of the gateway crate and the modules its code
/// (before `#[cfg(test)]`) names as `crate::<module>`.
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../gateway/src");
    let mut files = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read gateway/src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(&src).expect("under src");
        let first = rel.components().next().expect("a component");
        let module = first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("read a module");
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let deps = graph.entry(module.clone()).or_default();
        for (i, _) in code.match_indices("crate::") {
            let name: String = code[i + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if !name.is_empty() && name != module {
                deps.insert(name);
            }
        }
    }
    graph
}

/// The modules on a cycle through `start`, if any.
fn cycle_through(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        start: &str,
        at: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in graph.get(at).into_iter().flatten() {
            if next == start {
                return true;
            }
            if graph.contains_key(next) && seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(graph, start, next, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start.to_string()];
    let mut seen = BTreeSet::new();
    walk(graph, start, start, &mut path, &mut seen).then_some(path)
}

#[test]
fn the_gateway_modules_have_no_import_cycle() {
    let graph = module_graph();
    assert!(
        graph.contains_key("server") && graph.contains_key("http"),
        "{graph:?}"
    );
    for module in graph.keys() {
        if let Some(cycle) = cycle_through(&graph, module) {
            panic!("import cycle: {} -> {module}", cycle.join(" -> "));
        }
    }
}

/// Source with comments, strings and character literals blanked (newlines
/// kept), so braces can be counted.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    out.extend(b"  ");
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    out.extend(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if let Some((start, hashes)) = raw_string_start(b, i) {
            let mut close = vec![b'"'];
            close.extend(std::iter::repeat_n(b'#', hashes));
            let open = start + hashes + 1;
            out.extend(std::iter::repeat_n(b' ', open));
            i += open;
            while i < b.len() && !b[i..].starts_with(&close) {
                blank(&mut out, b[i]);
                i += 1;
            }
            out.extend(std::iter::repeat_n(b' ', close.len()));
            i += close.len();
        } else if b[i] == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    out.push(b' ');
                    i += 1;
                }
                if i < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if b[i] == b'\'' && (rest.get(2) == Some(&b'\'') || rest.get(1) == Some(&b'\\')) {
            // A character literal ('{', '\n', '\''); a lifetime has no
            // closing quote two bytes on.
            let len = if rest.get(1) == Some(&b'\\') {
                rest[2..]
                    .iter()
                    .position(|c| *c == b'\'')
                    .map_or(2, |p| p + 3)
            } else {
                3
            };
            out.extend(std::iter::repeat_n(b' ', len));
            i += len;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// At a raw string literal (`r"`, `r#"`, `br##"`): the length of its
/// `b`/`r` prefix and its number of `#`.
fn raw_string_start(b: &[u8], i: usize) -> Option<(usize, usize)> {
    let rest = &b[i..];
    let after_word = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
    let start = rest
        .iter()
        .take_while(|c| **c == b'b' || **c == b'r')
        .count();
    if after_word || !rest[..start].contains(&b'r') || start > 2 {
        return None;
    }
    let hashes = rest[start..].iter().take_while(|c| **c == b'#').count();
    (rest.get(start + hashes) == Some(&b'"')).then_some((start, hashes))
}

/// Every function with a body in `code` (as [`code_only`] leaves it): its
/// name, first line (1-based) and length in lines.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let b = code.as_bytes();
    let line_at = |pos: usize| code[..pos].bytes().filter(|c| *c == b'\n').count() + 1;
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find("fn ") {
        let at = from + found;
        from = at + 3;
        if at > 0 && word(b[at - 1]) {
            continue;
        }
        let name: String = code[at + 3..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        let Some(open) = code[at..].find(['{', ';']).map(|p| at + p) else {
            continue;
        };
        if b[open] == b';' {
            continue;
        }
        let mut depth = 0usize;
        let mut end = open;
        for (p, c) in code[open..].bytes().enumerate() {
            match c {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + p;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((name, line_at(at), line_at(end) - line_at(at) + 1));
    }
    out
}

/// The functions over 100 lines outside tests that stay whole for now,
/// and why. "Not split yet" is a debt (issue 58), not a reason: the list
/// only shrinks.
const LONG_FUNCTIONS: &[(&str, &str)] = &[];

#[test]
fn no_function_outside_tests_is_over_100_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    let crates = [
        "gateway/src",
        "deploy/src",
        "pool-manager/src",
        "autoscaler/src",
        "examples/src",
        "benches/src",
        "tests/src",
    ];
    let mut stack: Vec<_> = crates.iter().map(|c| root.join(c)).collect();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a source folder") {
            let path = entry.expect("entry").path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if path.is_dir() && name != "tests" {
                stack.push(path);
            } else if name.ends_with(".rs") && name != "tests.rs" {
                files.push(path);
            }
        }
    }
    assert!(files.len() > 100, "the sources were found: {}", files.len());
    let mut long = Vec::new();
    let mut still_long = BTreeSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read a source");
        let code = code_only(&text);
        let code = code.split("#[cfg(test)]").next().unwrap_or_default();
        let rel = file
            .strip_prefix(&root)
            .expect("under the root")
            .display()
            .to_string();
        for (name, line, lines) in functions(code) {
            let key = format!("{rel}::{name}");
            if lines <= 100 {
                continue;
            }
            if LONG_FUNCTIONS.iter().any(|(k, _)| *k == key) {
                still_long.insert(key);
            } else {
                long.push(format!("{rel}:{line} {name}: {lines} lines"));
            }
        }
    }
    long.sort();
    assert!(
        long.is_empty(),
        "functions over 100 lines (split them, or add them to LONG_FUNCTIONS with why they read \
         better whole):\n{}",
        long.join("\n")
    );
    let stale: Vec<&str> = LONG_FUNCTIONS
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| !still_long.contains(*k))
        .collect();
    assert!(
        stale.is_empty(),
        "LONG_FUNCTIONS names functions that are no longer over 100 lines (take them out): {stale:?}"
    );
}

#[test]
fn function_lengths_are_read_past_braces_in_strings_and_comments() {
    let src = "fn a() {\n    let s = \"}}}\"; // }\n    let c = '}';\n    let r = r#\"{\"#;\n}\n\
               /* fn b() { */\nfn c<'a>(x: &'a str) -> &'a str {\n    x\n}\ntrait T { fn d(&self); }\n";
    let found = functions(&code_only(src));
    assert_eq!(
        found,
        [("a".to_string(), 1, 5), ("c".to_string(), 7, 3)],
        "{found:?}"
    );
}
