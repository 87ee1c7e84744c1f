//! kvloop's per-node agent (`kvloop-agent`).
//!
//! * [`agent`]: shared state; hosted engines (managed mode), leases, events.
//! * [`server`]: the local API on a Unix socket (`SO_PEERCRED` check); its
//!   wire types ([`proto`]) and the client library engines link
//!   ([`client::AgentClient`]) live in `kvloop-agent-api`, re-exported here.
//! * [`lease`]: pure lease table (TTL, reader renewals, safety margin).
//! * [`tasks`]: peer discovery, active probes, cost model updates,
//!   threshold pushes, eBPF sample drain.
//! * [`probe_plan`]: shapes of active probe READs, following the engines'
//!   registered layouts (pure).
//! * [`pulls`]: pull outcomes per engine pair and the failing-pair alarm.
//! * [`netstate`]: rtnetlink link state, sysfs speed, RDMA counters,
//!   path invalidation.
//! * [`garbage`]: rate-limited warnings about garbage from clients.
//! * [`observe`]: which peer a kernel-timed transfer is for (pure).
//! * [`overdue`]: lower-bound samples of READs in flight past their
//!   path's prediction (pure).
//! * [`http`]: `/metrics`, `/healthz`, agent-to-agent `/v1/` API.
//! * [`caps`]: which Linux capability an eBPF permission failure lacks.
//! * [`check`]: `kvloop-agent --check` readiness report.
#![deny(missing_docs)]
pub mod agent;
pub mod caps;
pub mod check;
pub mod config;
pub mod cuda;
pub mod garbage;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod netstate;
pub mod observe;
pub mod overdue;
pub mod probe_plan;
pub mod pulls;
pub mod server;
pub mod tasks;

pub use kvloop_agent_api::{client, proto};

pub use agent::Agent;
pub use client::AgentClient;
pub use config::AgentConfig;
