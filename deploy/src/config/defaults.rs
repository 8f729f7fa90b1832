//! Default values, each with the reason for it.

use std::time::Duration;

/// Loopback only: a gateway that can start processes must not be reachable
/// from the network unless the operator says so.
pub const LISTEN: &str = "127.0.0.1:8080";
/// A dot-folder beside the config, like `.git`: easy to find, easy to ignore.
pub const STATE_DIR: &str = ".warmgate";
/// Kubernetes' default `terminationGracePeriodSeconds`: long enough for a
/// model server to finish a streamed completion.
pub const STOP_GRACE: Duration = Duration::from_secs(30);
/// Large enough for a batch of embeddings inputs or a long chat history,
/// small enough that a client cannot make the gateway buffer gigabytes.
pub const MAX_BODY_BYTES: u64 = 16 * 1024 * 1024;
/// A task body is held in the gateway until a replica takes it (unlike
/// an inference body, which goes straight on), so its bound is tighter:
/// 8 MiB is thousands of rollout inputs in one batch; larger batches
/// can be split.
pub const MAX_TASK_BODY_BYTES: u64 = 8 * 1024 * 1024;
/// Inputs of the tasks accepted and not ended, over every pool: 100,000
/// queued rollouts of a few KiB each, while a burst of large inputs
/// cannot push the gateway past a few hundred MB.
pub const MAX_PENDING_TASK_BYTES: u64 = 256 * 1024 * 1024;
/// Inference bodies read into memory and not yet handed to a replica
/// (held in an app's queue, or starting to be sent), over every app:
/// the hold queue bounds their count, this their bytes, so a thousand
/// held 16 MiB bodies cannot take 16 GiB.
pub const MAX_BUFFERED_BODY_BYTES: u64 = 512 * 1024 * 1024;
/// Outputs of finished async tasks kept in memory for `GET /v1/tasks`;
/// the oldest go first (the journal still has them, up to 1 MiB each).
/// 64 MiB holds thousands of typical results and keeps the gateway small.
pub const MAX_TASK_RESULTS_BYTES: u64 = 64 * 1024 * 1024;
/// Disk kept by the async-task journal; the oldest rows go first. 1 GiB
/// holds 100,000 results of 10 KiB without filling a small state disk.
pub const MAX_JOURNAL_BYTES: u64 = 1024 * 1024 * 1024;
/// The usage ledger: 16 MiB, some 150,000 rows (one tenant, app and model
/// in one hour each): 17 months of ten of them busy every hour.
pub const MAX_USAGE_BYTES: u64 = 16 << 20;
/// A GPU model server batches well up to a handful of concurrent requests;
/// 8 keeps latency predictable without leaving the GPU idle.
pub const CONCURRENCY: u32 = 8;
/// Loading multi-GB weights onto a GPU can take minutes.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(300);
/// The worker contract's health path.
pub const HEALTH_PATH: &str = "/healthz";
/// Kubernetes' default liveness period is 10 s; 2 s finds a hung
/// worker within seconds, and one probe costs the worker microseconds.
pub const HEALTH_PERIOD: Duration = Duration::from_secs(2);
/// A healthy worker answers its health path in milliseconds.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// Kubernetes' default: three failures in a row, so one slow answer
/// does not replace a replica.
pub const HEALTH_FAILURES: u32 = 3;
/// Scale to zero by default: idle GPUs are the bill.
pub const MIN: u32 = 0;
/// A small cap, so a traffic spike cannot take every GPU on the box.
pub const MAX: u32 = 4;
/// Knative's `container-concurrency-target-percentage`: aim at 70% of the
/// hard limit so bursts find a free slot.
pub const TARGET_UTILIZATION: f64 = 0.7;
/// Knative's `scale-to-zero-grace-period` plus its stable window: a minute
/// without traffic before the last replica goes, under `"auto"` until
/// the app's cold start and idle spells are known.
pub const SCALE_TO_ZERO_AFTER: Duration = Duration::from_secs(60);
/// Knative's stable window.
pub const STABLE_WINDOW: Duration = Duration::from_secs(60);
/// Knative's panic window (10% of the stable window).
pub const PANIC_WINDOW: Duration = Duration::from_secs(6);
/// 16 ranged GETs of 8 MiB: past the per-connection cap of S3-like
/// stores (about 100 MB/s each) without a flood of small requests.
pub const WEIGHTS_CONCURRENCY: usize = 16;
/// See [`WEIGHTS_CONCURRENCY`].
pub const WEIGHTS_PART_SIZE: u64 = 8 * 1024 * 1024;
/// Four times the default in-flight bytes.
pub const WEIGHTS_MEMORY_LIMIT: u64 = 512 * 1024 * 1024;
/// Room for a handful of 7B-parameter checkpoints in bf16.
pub const WEIGHTS_CACHE_MAX: u64 = 100 * 1024 * 1024 * 1024;
/// A warm pool keeps one replica warm: the point is that rollouts never
/// wait for a cold start.
pub const POOL_MIN: u32 = 1;
/// As for apps.
pub const POOL_MAX: u32 = 4;
/// Rollout workers step an environment and run a policy: a few tasks
/// at once keep them busy.
pub const POOL_CONCURRENCY: u32 = 4;
/// Union's ReusePolicy default idle TTL: five minutes between bursts of
/// an RL loop keeps the pool warm across a training step.
pub const IDLE_TTL: Duration = Duration::from_secs(300);
/// Two retries: enough for a flaky environment, few enough that a bug
/// fails quickly.
pub const TASK_RETRIES: u32 = 2;
/// Rollouts are seconds to minutes long.
pub const TASK_TIMEOUT: Duration = Duration::from_secs(300);
/// Long enough to stream a large checkpoint over a slow link; short
/// enough that a stuck replica is replaced within a training step.
pub const WEIGHT_SYNC_TIMEOUT: Duration = Duration::from_secs(600);
/// Share of a pool's slots its app's requests are sure of.
pub const INFERENCE_SHARE: f64 = 0.5;
/// Large enough for a whole batch of rollouts.
pub const POOL_MAX_PENDING: u32 = 100_000;
/// A canary bakes for a minute: long enough to see errors at modest
/// traffic, short enough to keep promotions quick.
pub const BAKE: Duration = Duration::from_secs(60);
/// 5% failed answers on the canary sends traffic back.
pub const MAX_ERROR_RATE: f64 = 0.05;
/// The marker PyTorch Lightning-style checkpointers and our examples
/// write last.
pub const MARKER: &str = "_COMPLETE";
/// Listing a prefix every 10 s costs nothing and catches an epoch's
/// checkpoint long before anyone looks.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(10);
/// An evaluation of a few minutes fits; longer ones belong in training.
pub const GATE_TIMEOUT: Duration = Duration::from_secs(600);
/// Twenty answers before judging: one early error is not 100%.
pub const MIN_REQUESTS: u64 = 20;
/// Knative's `max-scale-up-rate`: in practice unbounded, because too few
/// replicas cost latency at once.
pub const MAX_SCALE_UP_RATE: f64 = 1000.0;
/// Knative's `max-scale-down-rate`: at most half the replicas go per
/// tick, so one dip in a noisy signal cannot empty the app.
pub const MAX_SCALE_DOWN_RATE: f64 = 2.0;
/// Knative's panic threshold: 200% of current capacity.
pub const PANIC_THRESHOLD: f64 = 2.0;
/// Enough to absorb a burst while an app wakes from zero.
pub const MAX_PENDING: u32 = 1000;
/// Long enough to cover a cold start that loads weights.
pub const QUEUE_TIMEOUT: Duration = Duration::from_secs(120);
/// Far above what one gateway serves at once, far below the file
/// descriptors a default `ulimit -n` of 65536 allows.
pub const MAX_CONNECTIONS: u32 = 10_000;
/// nginx's `client_header_timeout` is 60 s; half of it is ample for any
/// real client and frees a slowloris socket sooner.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// nginx's `send_timeout` and `client_body_timeout`: a minute without a
/// byte moving on a request body or a response.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// A queue wait of `apps.queue.timeout` (120 s) plus a slow first token;
/// a streamed answer may then run on, bounded by `idle_timeout`.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
