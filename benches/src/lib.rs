//! Load harnesses for warmgate's benchmarks. The binaries are:
//!
//! - `echo-upstream`: a minimal hyper server that follows the worker
//!   contract; the same upstream sits behind warmgate and behind nginx.
//! - `loadgen`: an open-loop load generator that measures latency from each
//!   request's scheduled send time, so a stalled server cannot hide its
//!   queueing (no coordinated omission).
//!
//! `benches/proxy.sh` wires them together with nginx and wrk.
