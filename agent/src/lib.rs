//! Per-node kvloop agent
