//! Weights streamed from object storage.
//!
//! A checkpoint is a prefix in an object store (`file://`, `s3://`, `gs://`,
//! `az://`, `memory://`) holding `*.safetensors` files and small side files.
//! [`Source`] reads an object with many ranged GETs in parallel, in order,
//! within a memory budget; [`Source::tensors`] parses the safetensors header
//! first and yields each tensor as soon as its bytes are complete, so a
//! worker can place tensor N while tensor N+1 is still arriving. [`Cache`]
//! keeps objects on local disk, keyed by what the store says about their
//! content and identity, so a second replica or a rollback never downloads them
//! again. [`Fanout`] feeds one download to many readers from memory, with
//! the cache file written beside them. [`AllowList`] says which checkpoint
//! URIs may be opened at all.

mod allow;
mod cache;
pub mod fanout;
pub mod header;
pub mod local_tree;
mod pull;
mod recycle;
mod source;

pub use allow::AllowList;
pub use cache::{Cache, CacheWriter, folder_bytes, parse_sha256sums, sha256_file};
pub use fanout::Fanout;
pub use header::{Header, TensorEntry};
pub use pull::{PullItem, PullReport, SHA256SUMS, checksums, plan, pull};
pub use recycle::Recycler;
pub use source::{Source, StreamConfig, Tensor};
