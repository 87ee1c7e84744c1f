//! `kvloop demo cluster --hold`: after the report, the two router replicas
//! of each pushed policy (rr + adaptive, kvloop) run again on the cluster
//! (the P agents push to them; a fresh store prefix each), and the demo holds for `kvloop doctor` / `ping` / `top`
//! ([`crate::demo::hold`]).
use std::path::Path;

use anyhow::Result;
use kvloop_tests::netns_star::NodeStar;

use super::ClusterArgs;
use super::procs::{AGENT_PORT, Bins, Cluster, KVLOOP, RR_ADAPTIVE};
use crate::demo::hold::{self, Held, HeldNode};
use crate::demo::workload::wait_healthy;

/// Starts the held routers, holds, stops them.
///
/// # Errors
/// A router that does not start or become healthy; `hold.json` not written.
pub(super) async fn hold(
    a: &ClusterArgs,
    star: &NodeStar,
    bins: &Bins,
    cluster: &Cluster,
    logs: &Path,
    http: &reqwest::Client,
) -> Result<()> {
    hold::install_signals();
    // Both policies the P agents push to (every `[[routers]]` of their
    // configuration answers, as doctor checks).
    let mut routers = Vec::new();
    let mut urls = Vec::new();
    for spec in [RR_ADAPTIVE, KVLOOP] {
        let tag = format!("hold-{}", spec.port);
        let (r, u, _) = cluster.start_replicas(star, bins, &a.out_dir, logs, &spec, &tag)?;
        routers.extend(r);
        urls.extend(u);
    }
    for u in &urls {
        wait_healthy(http, u).await?;
    }
    // First a P node, then every D (its peers: ping goes P → D), then the
    // other Ps.
    let order = cluster
        .prefill
        .iter()
        .take(1)
        .chain(cluster.decode.iter())
        .chain(cluster.prefill.iter().skip(1));
    let nodes = order
        .map(|e| {
            let n = star.node(&e.id);
            let cfg = a.out_dir.join(format!("agent-{}.toml", e.id));
            HeldNode {
                name: format!("node-{}", e.id),
                netns: Some(n.ns.clone()),
                enter: ["ip", "netns", "exec", n.ns.as_str()]
                    .map(String::from)
                    .to_vec(),
                agent_http: format!("{}:{AGENT_PORT}", n.addr),
                agent_config: std::path::absolute(&cfg)
                    .unwrap_or(cfg)
                    .display()
                    .to_string(),
            }
        })
        .collect();
    let held = Held {
        pid: std::process::id(),
        nodes,
        routers: urls,
        engines: cluster
            .engines()
            .map(|e| (e.id.clone(), e.url.clone()))
            .collect(),
        commands: Vec::new(),
    }
    .with_commands();
    let r = hold::hold(&a.out_dir, &held, a.hold_max_s).await;
    drop(routers);
    r
}
