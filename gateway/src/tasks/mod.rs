//! Task pools: the fair queue, the split of a shared pool's slots between
//! requests and tasks (and a request's way through a shared pool), the pool that dispatches tasks to workers'
//! `/invoke` and syncs their weights, a task's record, and the journal
//! that keeps async tasks across a restart.

pub mod batches;
pub mod cancel;
pub mod journal;
pub mod ordered;
pub mod pool;
pub mod queue;
pub mod record;
pub mod shared;
pub mod split;
pub mod store;
pub mod weight_sync;

pub use pool::Pool;
