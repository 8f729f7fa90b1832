//! `warmgate cancel`: a task, or what is left of a batch, cancelled
//! through the API (`DELETE /v1/tasks/{id}`, `DELETE /v1/batches/{id}`).

use std::time::Duration;

use super::client::api;

/// How long the gateway may take to record a running task's end.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(30);

pub(super) fn cancel(gateway: &str, id: &str, batch: bool) -> i32 {
    let enc = percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC);
    let path = if batch {
        format!("/v1/batches/{enc}")
    } else {
        format!("/v1/tasks/{enc}")
    };
    match api(gateway, http::Method::DELETE, &path, None, CANCEL_TIMEOUT) {
        Ok(_) if batch => {
            println!("batch {id} cancelled");
            0
        }
        Ok(v) => {
            let was = v["cancelled"].as_str().unwrap_or("");
            let state = v["state"].as_str().unwrap_or("");
            match was {
                "" => println!("task {id}: {state}"),
                _ => println!("task {id}: {state} (it was {was})"),
            }
            0
        }
        Err(code) => code,
    }
}
