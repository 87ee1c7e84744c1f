//! Helpers shared by the dataplane's integration tests.
pub mod netns;
