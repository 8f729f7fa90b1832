//! `warmgate logs`: a replica's output through the API, and `-f` to
//! follow it.

use std::io::Write as _;
use std::time::Duration;

use super::client::{CallError, client_runtime, get_json};

/// How often `logs -f` asks for more.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

pub(super) fn logs(
    gateway: &str,
    name: &str,
    replica: Option<&str>,
    follow: bool,
    tail: usize,
) -> i32 {
    let rt = match client_runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    rt.block_on(async {
        // An app's, else a pool's.
        let mut query = format!("lines={tail}");
        if let Some(r) = replica {
            query.push_str(&format!("&replica={}", enc(r)));
        }
        let mut base = format!("/v1/apps/{}/logs", enc(name));
        let mut chunk = get_json(gateway, &format!("{base}?{query}")).await;
        if let Err(CallError::Answered {
            status: 404,
            message,
            ..
        }) = &chunk
            && message.contains("not found")
        {
            base = format!("/v1/pools/{}/logs", enc(name));
            chunk = get_json(gateway, &format!("{base}?{query}")).await;
        }
        let mut chunk = match chunk {
            Ok(v) => v,
            Err(e) => {
                eprintln!("error: {e}");
                return e.exit_code();
            }
        };
        let replica = chunk["replica"].as_str().unwrap_or_default().to_string();
        if follow {
            eprintln!("==> {replica} <==");
        }
        loop {
            print!("{}", chunk["text"].as_str().unwrap_or_default());
            let _ = std::io::stdout().flush();
            if !follow {
                return 0;
            }
            let next = chunk["next_offset"].as_u64().unwrap_or(0);
            let size = chunk["size"].as_u64().unwrap_or(0);
            if next >= size {
                tokio::select! {
                    _ = tokio::time::sleep(FOLLOW_EVERY) => {}
                    _ = tokio::signal::ctrl_c() => return 0,
                }
            }
            let path = format!("{base}?replica={}&offset={next}", enc(&replica));
            chunk = match get_json(gateway, &path).await {
                Ok(v) => v,
                Err(e) => {
                    eprintln!("error: {e}");
                    return e.exit_code();
                }
            };
        }
    })
}
