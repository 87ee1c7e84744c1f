//! Configuration of a [`crate::TransferEngine`]: its id, side channel,
//! backend, layout and timeouts (deserialized from the operator's file or
//! built in code).
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::fabric::FabricConfig;
use crate::layout::KvLayout;
use crate::nixl::NixlConfig;

/// Which backend an engine uses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum BackendConfig {
    /// libfabric directly.
    Libfabric(FabricConfig),
    /// NIXL with a backend plugin.
    Nixl(NixlConfig),
}

/// Configuration of a [`TransferEngine`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Engine id, unique in the cluster (vLLM's `engine_id`).
    pub engine_id: String,
    /// Side-channel listen address; port 0 picks a free port.
    pub side_channel_addr: SocketAddr,
    /// Backend.
    pub backend: BackendConfig,
    /// KV layout of the regions handed to [`TransferEngine::start`].
    pub layout: KvLayout,
    /// READ timeout when a request gives none, ms. Default 5000.
    #[serde(default = "default_read_timeout_ms")]
    pub read_timeout_ms: u64,
    /// Handshake timeout, ms. Default 5000.
    #[serde(default = "default_handshake_timeout_ms")]
    pub handshake_timeout_ms: u64,
}

fn default_read_timeout_ms() -> u64 {
    5000
}
fn default_handshake_timeout_ms() -> u64 {
    5000
}
