//! Where the demo's nodes are (two namespaces or loopback) and where its
//! binaries are.
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use kvloop_cli::netns::NodePair;

use super::DemoArgs;

/// Where the nodes are.
pub(super) struct Topology {
    /// The namespaces when root (none on loopback).
    pub(super) pair: Option<NodePair>,
    /// Node A's address (router, P).
    pub(super) ip_a: IpAddr,
    /// Node B's address (D).
    pub(super) ip_b: IpAddr,
}

impl Topology {
    /// `program` as a command on node A or (`node_b`) B.
    pub(super) fn cmd(&self, node_b: bool, program: &Path) -> Command {
        match &self.pair {
            Some(p) => NodePair::command_in(if node_b { &p.ns_b } else { &p.ns_a }, program),
            None => Command::new(program),
        }
    }
    /// The topology in words.
    pub(super) fn describe(&self) -> &'static str {
        if self.pair.is_some() {
            "two network namespaces joined by a veth"
        } else {
            "loopback"
        }
    }
    /// `tc -n <ns B> args`.
    pub(super) fn tc(&self, args: &[&str]) -> Result<()> {
        let Some(p) = &self.pair else {
            bail!("the slow-link scenario needs two namespaces (root, without --loopback)")
        };
        let out = Command::new("tc")
            .args(["-n", &p.ns_b])
            .args(args)
            .output()
            .context("running tc")?;
        if !out.status.success() {
            bail!(
                "tc {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
    /// Lowers node B's egress to `rate` (tc tbf).
    pub(super) fn limit(&self, rate: &str) -> Result<()> {
        self.pair.as_ref().expect("checked").limit_rate_b(rate)
    }
    /// Removes node B's egress limit, if any.
    pub(super) fn unlimit(&self) {
        if let Some(p) = &self.pair {
            let _ = self.tc(&["qdisc", "del", "dev", &p.dev_b, "root"]);
        }
    }
}

/// Directory of the demo's binaries (`--bin-dir`, else next to this one).
pub(super) fn bin_dir(a: &DemoArgs) -> Result<PathBuf> {
    match &a.bin_dir {
        Some(d) => Ok(d.clone()),
        None => Ok(std::env::current_exe()?
            .parent()
            .context("binary directory")?
            .to_path_buf()),
    }
}

/// `dir/name`, or an error naming the build command when missing.
pub(super) fn need_bin(dir: &Path, name: &str) -> Result<PathBuf> {
    let p = dir.join(name);
    if !p.exists() {
        bail!(
            "{} not found: build it first (`cargo build --release -p kvloop-engine-sim -p kvloop-router`, or `make build`) or set KVLOOP_BIN_DIR",
            p.display()
        );
    }
    Ok(p)
}

/// A free TCP port on `ip` (bound and released; used for the adaptive
/// router, whose URL the agent must know before it starts).
pub(super) fn free_port(ip: IpAddr) -> Result<u16> {
    Ok(std::net::TcpListener::bind((ip, 0))?.local_addr()?.port())
}
