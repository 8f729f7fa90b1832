//! Task pools: the fair queue, the pool that dispatches tasks to workers'
//! `/invoke` and syncs their weights, a task's record, and the journal
//! that keeps async tasks across a restart.

pub mod journal;
pub mod pool;
pub mod queue;
pub mod record;

pub use pool::Pool;
