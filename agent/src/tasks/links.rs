//! The network watch's consumer: applies [`crate::netstate::watch`]'s
//! reports to the agent (link metrics, path invalidation, interfaces,
//! RDMA counters).
use std::collections::HashMap;
use std::sync::Arc;

use crate::agent::Agent;
use crate::netstate::{NetEvent, watch};

/// Runs the watch until aborted (dropping the receiver stops the watch).
pub async fn run(agent: Arc<Agent>) {
    let mut rx = watch(agent.config().network.poll_ms);
    let mut prev_up: HashMap<String, bool> = HashMap::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            NetEvent::Dump { links, addrs, rdma } => {
                agent.resolve_interfaces(&links, &addrs);
                agent.apply_links(&mut prev_up, &links);
                agent.record_rdma_counters(&rdma);
            }
            NetEvent::Link(l) => agent.apply_links(&mut prev_up, std::slice::from_ref(&l)),
        }
    }
}
