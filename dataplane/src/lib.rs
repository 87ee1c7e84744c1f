//! kvloop's KV-cache block transfer engine.
//!
//! * [`region`]: memfd-backed host memory (and CUDA memory with feature `cuda`).
//! * [`layout`]: region set × `num_blocks` × `block_len_bytes`, descriptor
//!   index `region × num_blocks + block_id`, coalescing into segments.
//! * [`engine::TransferEngine`]: side-channel handshake with compatibility
//!   checks, bounds-checked READs with timeout and owner notification.
//! * Backends: [`fabric`] (libfabric: `efa`, `tcp;ofi_rxm`, `shm`) and
//!   [`nixl`] (NIXL `UCX` / `LIBFABRIC`).
pub mod backend;
pub mod config;
pub mod engine;
pub mod error;
pub mod fabric;
pub mod layout;
pub mod nixl;
pub mod notify;
mod quarantine;
pub mod region;
pub mod sidechannel;

pub use engine::{
    BackendConfig, EngineConfig, OwnerNotify, ReadOutcome, ReadRequest, TransferEngine,
};
pub use error::{DataplaneError, ErrorSource, Result};
pub use layout::{BlockPair, KvLayout};
pub use region::HostRegion;
