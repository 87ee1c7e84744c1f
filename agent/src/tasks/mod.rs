//! The agent's background tasks, one module each: peer discovery
//! ([`discovery`]), active probes ([`probes`]), cost-model refits
//! ([`model`]), threshold pushes ([`push`]), abandoned-pull notices ([`notices`]), lease expiry ([`leases`]), the
//! eBPF sample drain ([`ebpf`]), observe mode's NIXL attach ([`observe`]) and the network watch ([`links`]). Each is
//! a tokio task driving the agent's methods at its own timer; none blocks
//! another (a router that is down only delays its own push task). The
//! timers follow the sans-IO cores: the model task sleeps until the cost
//! model's `poll_timeout`, the lease task until the lease table's next
//! expiry.
use std::sync::Arc;

use crate::agent::{AbortOnDrop, Agent};

pub mod discovery;
pub mod ebpf;
pub mod leases;
pub mod links;
pub mod model;
pub mod notices;
pub mod observe;
pub mod probes;
pub mod push;

pub use probes::RateLimit;

/// Starts every task; dropping the result stops them.
pub fn spawn_all(agent: &Arc<Agent>) -> Vec<AbortOnDrop> {
    let mut v = vec![
        AbortOnDrop(tokio::spawn(discovery::run(agent.clone()))),
        AbortOnDrop(tokio::spawn(model::run(agent.clone()))),
        AbortOnDrop(tokio::spawn(push::run(agent.clone()))),
        AbortOnDrop(tokio::spawn(notices::run(agent.clone()))),
        AbortOnDrop(tokio::spawn(leases::run(agent.clone()))),
        AbortOnDrop(tokio::spawn(ebpf::run(agent.clone()))),
        AbortOnDrop(tokio::spawn(observe::run(agent.clone()))),
    ];
    if agent.probe_engine().is_some() {
        v.push(AbortOnDrop(tokio::spawn(probes::run(agent.clone()))));
    }
    if agent.config().network.enabled {
        v.push(AbortOnDrop(tokio::spawn(links::run(agent.clone()))));
    }
    v
}
