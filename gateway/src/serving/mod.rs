//! The app data plane: an app as users see it (its revisions and traffic
//! split), one revision's slots and hold queue, and the pipeline that
//! takes a request from the split to a replica and back.

pub mod adapter_files;
pub mod adapter_load;
pub mod adapter_split;
pub mod adapters;
pub mod buffered;
pub(crate) mod crash_loop;
pub mod dispatch;
pub mod engine_load;
pub mod engine_routes;
pub mod json_body;
pub mod outlier;
pub mod pipeline;
pub mod proxy;
pub mod route;
pub mod served;

pub use served::Served;
