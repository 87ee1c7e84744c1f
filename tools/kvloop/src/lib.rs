//! Library part of the `kvloop` CLI: pieces shared with end-to-end tests and
//! demos (child `kvloop node` processes, network-namespace "nodes",
//! deterministic block patterns) and the operator tools (`doctor`, `ping`, `top`).
pub mod doctor;
pub mod engine_args;
pub mod pattern;
pub mod ping;
pub mod top;

/// Child processes announcing readiness (moved to the test-support crate,
/// which the demos share; `tests/src/child.rs`).
pub use kvloop_tests::child;
/// Network-namespace node pairs (`tests/src/netns.rs`).
pub use kvloop_tests::netns;
