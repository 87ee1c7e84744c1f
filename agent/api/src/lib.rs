//! The local API of kvloop's node agent (`kvloop-agent`), as engines see it.
//!
//! * [`proto`]: length-prefixed JSON frames on a Unix stream socket, with
//!   the memfds of KV regions passed as `SCM_RIGHTS`; the request, reply and
//!   event types.
//! * [`client`]: [`client::AgentClient`], what an engine in managed mode
//!   links (`kvloop-engine-sim`, a vLLM-side connector): register KV memory,
//!   connect to remote engines, READ, retain and release blocks, wait for
//!   owner notifications, report prefill timings.
//! * [`lease`]: lease records as the API reports them.
//! * [`peer`]: the agent-to-agent HTTP API's wire types (engines info,
//!   lease renewal, API version).
//! * [`reconnect`]: reconnecting with back-off after the agent restarted.
//!
//! Kept apart from the agent crate so that an engine links the protocol
//! without the agent's eBPF loader, cost model and network watchers.
#![deny(missing_docs)]
pub mod client;
pub mod lease;
pub mod peer;
pub mod proto;
pub mod reconnect;

pub use client::{AgentClient, ClientError};
