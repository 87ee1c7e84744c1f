//! Library part of the `kvloop` CLI: pieces shared with end-to-end tests and
//! demos (child `kvloop node` processes, network-namespace "nodes",
//! deterministic block patterns).
pub mod child;
pub mod doctor;
pub mod engine_args;
pub mod netns;
pub mod pattern;
pub mod ping;
pub mod top;
