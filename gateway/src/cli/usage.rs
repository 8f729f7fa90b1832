//! `warmgate usage`: tokens used, by tenant, app, model and time, from
//! `GET /v1/usage`.

use serde_json::Value;

use super::Output;
use super::client::{client_runtime, get_json};

/// What `warmgate usage` asks for.
pub(super) struct UsageAsk<'a> {
    pub since: &'a str,
    pub until: Option<&'a str>,
    pub bucket: &'a str,
    pub by: &'a str,
    pub tenant: Option<&'a str>,
    pub app: Option<&'a str>,
    pub model: Option<&'a str>,
}

impl UsageAsk<'_> {
    /// The query string of `GET /v1/usage`.
    fn query(&self) -> String {
        let enc = |s: &str| {
            percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
        };
        let mut q = format!(
            "since={}&bucket={}&group_by={}",
            enc(self.since),
            enc(self.bucket),
            enc(self.by)
        );
        for (k, v) in [
            ("until", self.until),
            ("tenant", self.tenant),
            ("app", self.app),
            ("model", self.model),
        ] {
            if let Some(v) = v {
                q.push_str(&format!("&{k}={}", enc(v)));
            }
        }
        q
    }
}

pub(super) fn usage(gateway: &str, ask: &UsageAsk<'_>, output: Output) -> i32 {
    let rt = match client_runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    rt.block_on(async {
        match get_json(gateway, &format!("/v1/usage?{}", ask.query())).await {
            Ok(v) if output == Output::Json => {
                println!("{v:#}");
                0
            }
            Ok(v) => {
                print!("{}", render_usage(&v));
                0
            }
            Err(e) => {
                eprintln!("error: {e}");
                e.exit_code()
            }
        }
    })
}

/// The rows as aligned columns: the bucket and the groups asked for, then
/// requests and tokens; a last line with the totals.
pub fn render_usage(v: &Value) -> String {
    let rows = v["data"].as_array().cloned().unwrap_or_default();
    let has = |key: &str| rows.iter().any(|r| r.get(key).is_some());
    let keys: Vec<&str> = ["start", "tenant", "app", "model"]
        .into_iter()
        .filter(|k| has(k))
        .collect();
    let counts = [
        ("REQUESTS", "requests"),
        ("NO USAGE", "requests_without_usage"),
        ("PROMPT", "prompt_tokens"),
        ("CACHED", "cached_tokens"),
        ("COMPLETION", "completion_tokens"),
        ("TOTAL", "total_tokens"),
    ];
    let mut table: Vec<Vec<String>> = Vec::new();
    table.push(
        keys.iter()
            .map(|k| k.to_uppercase())
            .chain(counts.iter().map(|(h, _)| h.to_string()))
            .collect(),
    );
    let mut totals = [0u64; 6];
    for r in &rows {
        let mut line: Vec<String> = keys
            .iter()
            .map(|k| r[*k].as_str().unwrap_or("").to_string())
            .collect();
        for (i, (_, key)) in counts.iter().enumerate() {
            let n = r[*key].as_u64().unwrap_or(0);
            totals[i] += n;
            line.push(n.to_string());
        }
        table.push(line);
    }
    if rows.len() > 1 {
        let mut line: Vec<String> = keys.iter().map(|_| String::new()).collect();
        if let Some(first) = line.first_mut() {
            *first = "total".into();
        }
        line.extend(totals.iter().map(u64::to_string));
        table.push(line);
    }
    let widths: Vec<usize> = (0..table[0].len())
        .map(|c| table.iter().map(|l| l[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for line in &table {
        let cells: Vec<String> = line
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if c < keys.len() {
                    format!("{cell:<w$}", w = widths[c])
                } else {
                    format!("{cell:>w$}", w = widths[c])
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    if rows.is_empty() {
        out.push_str(&format!(
            "no usage since {}\n",
            v["since"].as_str().unwrap_or("")
        ));
    }
    if v["truncated"] == Value::Bool(true) {
        out.push_str("(more rows matched; narrow --since or --by)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_aligned_and_totalled() {
        let v = serde_json::json!({"since": "x", "data": [
            {"tenant": "team-a", "requests": 3, "requests_without_usage": 0, "prompt_tokens": 120, "cached_tokens": 64, "completion_tokens": 30, "total_tokens": 150},
            {"tenant": "-", "requests": 1, "requests_without_usage": 1, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        ], "truncated": false});
        let out = render_usage(&v);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 4, "{out}");
        assert!(lines[0].starts_with("TENANT  REQUESTS"), "{out}");
        assert!(
            lines[1].starts_with("team-a") && lines[1].ends_with("150"),
            "{out}"
        );
        assert!(
            lines[3].starts_with("total") && lines[3].ends_with("150"),
            "{out}"
        );
        let none = render_usage(&serde_json::json!({"since": "2026-12-07T00:00:00Z", "data": []}));
        assert!(
            none.contains("no usage since 2026-12-07T00:00:00Z"),
            "{none}"
        );
    }
}
