//! A promotion's evaluation gate: what it is run against, and its verdict
//! as the promotion's next event. The gate's command itself runs in
//! [`crate::gate`].

use warmgate_deploy::revision::Event;

use super::Promotions;
use crate::serving::served::Served;

/// What an evaluation gate is run against.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Evaluated<'a> {
    /// A revision of the app, pinned by `X-Warmgate-Revision`.
    Revision(&'a str),
    /// A revision of an adapter, by the model name that pins it
    /// (`name@n`), on the app's serving revision.
    Adapter {
        /// That name.
        model: &'a str,
        /// The app's serving revision (`WARMGATE_EVAL_REVISION`).
        revision: &'a str,
    },
}

impl Promotions {
    /// The evaluation gate, when the app has one: `Ready` when it passes,
    /// `Unhealthy` with its output when it fails or runs out of time.
    pub(crate) async fn gate(&self, app: &Served, what: Evaluated<'_>) -> Event {
        let whole = app.spec();
        let spec = &whole.promotion;
        if spec.gate_command.is_empty() && spec.gate_url.is_none() {
            return Event::Ready;
        }
        let (rev, model) = match what {
            Evaluated::Revision(rev) => (rev, None),
            Evaluated::Adapter { model, revision } => (revision, Some(model)),
        };
        let endpoint = format!("http://{}/apps/{}", self.host.reach, app.name);
        let run = async {
            if let Some((program, args)) = spec.gate_command.split_first() {
                // As a worker, not as the gateway: see `crate::gate`. It
                // gets what the app's workers are given (`env`), and where
                // to evaluate.
                let mut vars: Vec<(&str, String)> = whole
                    .env
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.clone()))
                    .collect();
                vars.extend([
                    ("WARMGATE_EVAL_URL", endpoint.clone()),
                    (
                        "WARMGATE_EVAL_OPENAI_BASE",
                        format!("http://{}/v1", self.host.reach),
                    ),
                    ("WARMGATE_EVAL_REVISION", rev.to_string()),
                    ("WARMGATE_EVAL_APP", app.name.clone()),
                ]);
                if let Some(model) = model {
                    vars.push(("WARMGATE_EVAL_MODEL", model.to_string()));
                }
                crate::gate::run(program, args, &vars, self.host.workdir.as_deref()).await?;
            }
            if let Some(url) = &spec.gate_url {
                let body = match model {
                    None => serde_json::json!({
                        "app": app.name,
                        "revision": rev,
                        "endpoint": endpoint,
                        "openai_base": format!("http://{}/v1", self.host.reach),
                        "headers": {"X-Warmgate-Revision": rev},
                    }),
                    Some(model) => serde_json::json!({
                        "app": app.name,
                        "revision": rev,
                        "model": model,
                        "endpoint": endpoint,
                        "openai_base": format!("http://{}/v1", self.host.reach),
                        "headers": {"X-Warmgate-Revision": rev},
                    }),
                };
                let status = self.upstream.post_json(url, &body).await?;
                if !(200..300).contains(&status) {
                    return Err(format!("{url} answered {status}"));
                }
            }
            Ok(())
        };
        match tokio::time::timeout(spec.gate_timeout, run).await {
            Ok(Ok(())) => Event::Ready,
            Ok(Err(why)) => Event::Unhealthy(format!("the evaluation gate failed: {why}")),
            Err(_) => Event::Unhealthy(format!(
                "the evaluation gate did not finish within {}",
                humantime::format_duration(spec.gate_timeout)
            )),
        }
    }
}
