//! The configuration reference (`docs/reference/config.md`), rendered from
//! the config's JSON schema: the derive that reads the file also names its
//! keys, types, defaults and doc comments, so the page cannot drift from
//! what `warmgate serve` accepts.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde_json::Value;

/// The config file's JSON schema.
pub fn config_schema() -> Value {
    serde_json::to_value(schemars::schema_for!(crate::Config)).expect("a schema is JSON")
}

/// One table of the file: its TOML header and the schema of its keys.
struct Section {
    /// `apps.health`; empty for the top level.
    path: String,
    /// An array of tables (`[[apps]]`).
    array: bool,
    schema: Value,
}

/// Keys whose schema carries no description, as `section.key`: the
/// reference must say what every key means.
pub fn undocumented_keys(schema: &Value) -> Vec<String> {
    let mut missing = Vec::new();
    for section in sections(schema) {
        for (key, prop) in properties(&section.schema) {
            if description(prop).is_empty() {
                missing.push(join(&section.path, key));
            }
        }
    }
    missing
}

/// Every key of the file, as `section.key`.
pub fn config_keys(schema: &Value) -> BTreeSet<String> {
    sections(schema)
        .iter()
        .flat_map(|s| properties(&s.schema).map(|(k, _)| join(&s.path, k)))
        .collect()
}

/// The Markdown page: a table per section of the file.
pub fn config_markdown(schema: &Value) -> String {
    let mut out = String::from(
        "# Configuration reference\n\n\
         <!-- Generated from the config's schema by `warmgate_deploy::reference`;\n\
         `WARMGATE_WRITE_REFERENCE=1 cargo nextest run -p warmgate-deploy --test reference`\n\
         writes it anew. Do not edit by hand. -->\n\n\
         `warmgate serve --config FILE` reads one TOML file. Every table refuses\n\
         keys it does not know, and `warmgate serve --check` validates a file\n\
         without starting anything. An app's and a pool's keys are also the\n\
         `spec` of the `ServingApp` and `WarmPool` resources and the bodies of\n\
         `PUT /v1/apps/{app}` and `PUT /v1/pools/{pool}` (as JSON).\n\n\
         - **Durations** are written as text: `\"500ms\"`, `\"30s\"`, `\"5m\"`, `\"1h 30m\"`.\n\
         - **Sizes** are a whole number of bytes or a text with a unit: `\"64MiB\"`,\n  \
         `\"500MB\"`, `\"16Gi\"`.\n\
         - **Relative paths** (`state_dir`, `file://` checkpoints) are resolved\n  \
         against the config file's folder.\n\
         - A key left out takes its default; `unset` means it is off or chosen at\n  \
         run time, as its meaning says.\n\n",
    );
    let all = sections(schema);
    out.push_str("Sections:");
    for s in &all {
        let _ = write!(out, " [`{}`](#{}),", header(s), anchor(s));
    }
    out.pop();
    out.push_str(".\n");
    for section in &all {
        let _ = write!(out, "\n## {}\n\n", header_title(section));
        let about = description(&section.schema);
        if !about.is_empty() {
            let _ = write!(out, "{about}\n\n");
        }
        out.push_str("| key | type | default | meaning |\n|---|---|---|---|\n");
        let required: BTreeSet<&str> = section.schema["required"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        for (key, prop) in properties(&section.schema) {
            let shape = resolve(schema, prop);
            let default = if required.contains(key.as_str()) {
                "required".to_string()
            } else {
                default_text(prop, &shape)
            };
            let _ = writeln!(
                out,
                "| `{key}` | {} | {} | {} |",
                type_text(schema, prop),
                default,
                cell(&description(prop)),
            );
        }
    }
    out
}

/// The sections, each followed by the tables it holds; a table shape
/// reached twice (a queue of apps and of pools) is listed under each path.
fn sections(schema: &Value) -> Vec<Section> {
    let mut out = Vec::new();
    push_section(
        schema,
        Section {
            path: String::new(),
            array: false,
            schema: schema.clone(),
        },
        &mut out,
    );
    out
}

fn push_section(root: &Value, section: Section, out: &mut Vec<Section>) {
    let nested: Vec<Section> = properties(&section.schema)
        .filter_map(|(key, prop)| {
            table_of(root, prop).map(|(table, array)| Section {
                path: join(&section.path, key),
                array,
                schema: table,
            })
        })
        .collect();
    out.push(section);
    for s in nested {
        push_section(root, s, out);
    }
}

fn properties(schema: &Value) -> impl Iterator<Item = (&String, &Value)> {
    schema["properties"].as_object().into_iter().flatten()
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn header(s: &Section) -> String {
    match (s.path.is_empty(), s.array) {
        (true, _) => "top level".into(),
        (false, true) => format!("[[{}]]", s.path),
        (false, false) => format!("[{}]", s.path),
    }
}

fn header_title(s: &Section) -> String {
    if s.path.is_empty() {
        "Top level".into()
    } else {
        format!("`{}`", header(s))
    }
}

/// GitHub's anchor of a section's heading.
fn anchor(s: &Section) -> String {
    header_title(s)
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '_' || c == '-' => Some(c),
            _ => None,
        })
        .collect()
}

/// A `$ref` followed, and an `Option`'s `anyOf [T, null]` unwrapped.
fn resolve(root: &Value, schema: &Value) -> Value {
    if let Some(name) = schema["$ref"].as_str() {
        let name = name.trim_start_matches("#/$defs/");
        return resolve(root, &root["$defs"][name]);
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(variants) = schema[key].as_array() {
            let some: Vec<&Value> = variants.iter().filter(|v| v["type"] != "null").collect();
            if let [one] = some.as_slice()
                && one.get("const").is_none()
            {
                return resolve(root, one);
            }
        }
    }
    schema.clone()
}

fn is_table(schema: &Value) -> bool {
    schema.get("properties").is_some()
}

/// The table a key opens, if it does: `(its schema, an array of tables)`.
fn table_of(root: &Value, prop: &Value) -> Option<(Value, bool)> {
    let shape = resolve(root, prop);
    if is_table(&shape) {
        return Some((shape, false));
    }
    if let Some(items) = shape.get("items") {
        let item = resolve(root, items);
        if is_table(&item) {
            return Some((item, true));
        }
    }
    None
}

fn type_text(root: &Value, prop: &Value) -> String {
    let shape = resolve(root, prop);
    if let Some((_, array)) = table_of(root, prop) {
        return if array { "array of tables" } else { "table" }.into();
    }
    shape_text(root, &shape)
}

fn shape_text(root: &Value, shape: &Value) -> String {
    if let Some(variants) = shape["oneOf"].as_array().or(shape["anyOf"].as_array()) {
        let names: Vec<String> = variants
            .iter()
            .filter(|v| v["type"] != "null")
            .map(|v| match v.get("const") {
                Some(c) => format!("`{}`", c.as_str().map_or(c.to_string(), str::to_string)),
                None => shape_text(root, &resolve(root, v)),
            })
            .collect();
        return names.join(" \\| ");
    }
    if let Some(values) = shape["enum"].as_array() {
        let names: Vec<String> = values
            .iter()
            .map(|c| format!("`{}`", c.as_str().map_or(c.to_string(), str::to_string)))
            .collect();
        return names.join(" \\| ");
    }
    if shape["format"] == "size" {
        return "size".into();
    }
    let types: Vec<&str> = match &shape["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .filter(|t| *t != "null")
            .collect(),
        _ => vec![],
    };
    match types.as_slice() {
        ["array"] => format!(
            "array of {}",
            plural(&shape_text(root, &resolve(root, &shape["items"])))
        ),
        ["object"] => match shape.get("additionalProperties") {
            Some(Value::Object(v)) => format!(
                "table of {}",
                plural(&shape_text(root, &resolve(root, &Value::Object(v.clone()))))
            ),
            _ => "table".into(),
        },
        ["integer"] => "integer".into(),
        ["number"] => "number".into(),
        ["string"] if duration_like(shape) => "duration".into(),
        [one] => (*one).into(),
        [] => "any".into(),
        many => many.join(" or "),
    }
}

fn plural(t: &str) -> String {
    match t {
        "string" | "integer" | "number" | "boolean" | "duration" | "size" => format!("{t}s"),
        other => other.to_string(),
    }
}

/// A text field whose default reads as a duration.
fn duration_like(shape: &Value) -> bool {
    shape["default"]
        .as_str()
        .is_some_and(|d| humantime::parse_duration(d).is_ok())
}

fn default_text(prop: &Value, shape: &Value) -> String {
    let Some(default) = prop.get("default").or(shape.get("default")) else {
        return "unset".into();
    };
    match default {
        Value::Null => "unset".into(),
        Value::Object(m) if m.is_empty() => "`{}`".into(),
        Value::Object(_) if is_table(shape) => "see its section".into(),
        Value::Array(a) if a.is_empty() => "`[]`".into(),
        Value::String(s) => format!("`\"{s}\"`"),
        other => format!("`{}`", toml_value(other)),
    }
}

fn toml_value(v: &Value) -> String {
    match v {
        Value::String(s) => format!("\"{s}\""),
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(toml_value).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(m) => format!(
            "{{ {} }}",
            m.iter()
                .map(|(k, v)| format!("{k} = {}", toml_value(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Value::Null => "unset".into(),
        other => other.to_string(),
    }
}

fn description(schema: &Value) -> String {
    let text = schema["description"].as_str().unwrap_or_default();
    let mut out = String::new();
    for para in text.split("\n\n") {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&para.split('\n').collect::<Vec<_>>().join(" "));
    }
    intra_doc_links(out.trim())
}

/// Rustdoc's ``[`Item`]`` links read as plain code on the page.
fn intra_doc_links(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("[`") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        match after.find("`]") {
            Some(end) if !after[end + 2..].starts_with('(') => {
                out.push_str(&after[..end + 1]);
                rest = &after[end + 2..];
            }
            _ => {
                out.push('[');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// A table cell: a `|` would end it.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_says_what_it_means() {
        let missing = undocumented_keys(&config_schema());
        assert!(
            missing.is_empty(),
            "keys without a doc comment: {missing:?}"
        );
    }

    #[test]
    fn the_sections_are_the_file_s_tables() {
        let keys = config_keys(&config_schema());
        for key in [
            "listen",
            "backend.kind",
            "backend.kubernetes.allowed_secrets",
            "limits.max_body_bytes",
            "apps.autoscale.scale_to_zero_after",
            "apps.adapters.models.checkpoint",
            "pools.queue.fairness",
            "tenants.api_key_sha256",
            "tls.cert",
        ] {
            assert!(keys.contains(key), "{key} missing from {keys:?}");
        }
    }

    #[test]
    fn rustdoc_links_become_code() {
        assert_eq!(
            intra_doc_links("see [`A::b()`] and [`c`](x)"),
            "see `A::b()` and [`c`](x)"
        );
    }
}
