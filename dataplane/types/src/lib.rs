//! kvloop's light KV-cache types, shared by the transfer engine
//! (`kvloop-dataplane`, which re-exports all of them at the same paths) and
//! by crates that must not link libfabric, NIXL or bindgen (the agent's
//! client API that engines link).
//!
//! * [`layout`]: region set × `num_blocks` × `block_len_bytes`, block pairs,
//!   coalescing into segments.
//! * [`request`]: a READ request, its owner notification and its outcome.
//! * [`notify`]: owner notification strings and their tracker.
//! * [`region`]: memfd-backed host memory, and regions as backends see them.
//! * [`sidechannel`]: the side channel's messages and pure frame decoding.
//! * [`error`]: the dataplane's error type.
pub mod error;
pub mod layout;
pub mod notify;
pub mod region;
pub mod request;
pub mod sidechannel;

pub use error::{DataplaneError, ErrorSource, Result, Side};
pub use layout::{BlockPair, KvLayout, Segment};
pub use notify::Notification;
pub use region::{HostRegion, MemoryKind, RegionDesc};
pub use request::{OwnerNotify, ReadOutcome, ReadRequest};
