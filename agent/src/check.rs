//! `kvloop-agent --check`: readiness of the parts the agent needs, as JSON.
//!
//! `{"ready": bool, "parts": {"backend": {...}, "ebpf": {...},
//! "privilege": {...}, "side_channel": {...}, "socket_dir": {...}}}`; each part has `ok`,
//! `required` and `detail`. Not ready when a required part is missing: the
//! backend always; eBPF only with `require_ebpf = true` (otherwise the agent
//! falls back to user-space timing).
use std::net::SocketAddr;

use kvloop_dataplane::{EngineConfig, HostRegion, KvLayout, TransferEngine};
use serde::Serialize;

use crate::config::AgentConfig;

/// One checked part.
#[derive(Clone, Debug, Serialize)]
pub struct Part {
    /// Works.
    pub ok: bool,
    /// Needed for the agent to run.
    pub required: bool,
    /// What was found, or why not.
    pub detail: String,
}

/// The report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// No required part missing.
    pub ready: bool,
    /// Parts by name.
    pub parts: std::collections::BTreeMap<String, Part>,
}

/// Whether peers can reach engines' side channels on `node_addr`
/// ([`AgentConfig::check_side_channel_reachable`]); required.
pub fn side_channel_part(cfg: &AgentConfig) -> Part {
    match cfg.check_side_channel_reachable() {
        Ok(()) => Part {
            ok: true,
            required: true,
            detail: format!("engines' side channels on {} (node_addr)", cfg.node_addr),
        },
        Err(e) => Part {
            ok: false,
            required: true,
            detail: e.to_string(),
        },
    }
}

/// Runs the checks (starts a one-page transfer engine with the configured
/// backend on the node address; loads the eBPF probes and unloads them).
pub async fn run(cfg: &AgentConfig) -> Report {
    let mut parts = std::collections::BTreeMap::new();
    let layout = KvLayout {
        num_regions: 1,
        num_blocks: 1,
        block_len_bytes: 4096,
        block_size_tokens: 16,
    };
    let backend = match HostRegion::new("check", 4096) {
        Ok(r) => {
            let ecfg = EngineConfig {
                engine_id: format!("check.{}", cfg.agent_id),
                side_channel_addr: SocketAddr::new(cfg.node_addr, 0),
                backend: cfg.backend.clone(),
                layout,
                read_timeout_ms: 1000,
                handshake_timeout_ms: 1000,
            };
            match TransferEngine::start(ecfg, vec![r]).await {
                Ok(e) => Part {
                    ok: true,
                    required: true,
                    detail: format!("{} on {}", e.backend_name(), cfg.node_addr),
                },
                Err(e) => Part {
                    ok: false,
                    required: true,
                    detail: e.to_string(),
                },
            }
        }
        Err(e) => Part {
            ok: false,
            required: true,
            detail: format!("memfd region: {e}"),
        },
    };
    parts.insert("backend".into(), backend);
    parts.insert("side_channel".into(), side_channel_part(cfg));
    let pc = kvloop_probes::ProbeConfig {
        transfer: true,
        prefill: false,
        retransmit: false,
        ..Default::default()
    };
    let ebpf = match tokio::task::spawn_blocking(move || {
        kvloop_probes::Probes::load(pc).map(|p| {
            let attach = p.attach_transfer_sites("/proc/self/exe", None);
            (p, attach)
        })
    })
    .await
    {
        Ok(Ok((_p, Ok(())))) => Part {
            ok: true,
            required: cfg.require_ebpf,
            detail: "eBPF probes load and the READ-site uprobes attach".into(),
        },
        Ok(Ok((_p, Err(e)))) => Part {
            ok: false,
            required: cfg.require_ebpf,
            detail: format!(
                "attaching READ probes failed: {} (the agent falls back to user-space timing of \
                 its READs)",
                crate::caps::explain(&e.to_string(), crate::caps::Stage::Uprobe)
            ),
        },
        Ok(Err(e)) => Part {
            ok: false,
            required: cfg.require_ebpf,
            detail: format!(
                "{} (the agent falls back to user-space timing)",
                crate::caps::explain(&e.to_string(), crate::caps::Stage::Load)
            ),
        },
        Err(e) => Part {
            ok: false,
            required: cfg.require_ebpf,
            detail: e.to_string(),
        },
    };
    parts.insert("ebpf".into(), ebpf);
    let cap_eff = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| crate::caps::parse_cap_eff(&s))
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .and_then(|s| crate::caps::parse_kernel_version(&s));
    let lacking = [crate::caps::Stage::Load, crate::caps::Stage::Uprobe]
        .into_iter()
        .find_map(|st| crate::caps::missing(cap_eff, kernel, st));
    parts.insert(
        "privilege".into(),
        Part {
            ok: lacking.is_none(),
            required: false,
            detail: match lacking {
                None => format!("CapEff {cap_eff:#x}: eBPF programs, tracepoints and uprobes"),
                Some(cap) => format!("CapEff {cap_eff:#x}: missing capability {cap}"),
            },
        },
    );
    let dir = cfg
        .socket_path
        .parent()
        .map(|p| p.to_path_buf())
        .unwrap_or_else(|| "/".into());
    let sock_ok = std::fs::create_dir_all(&dir).is_ok()
        && nix::unistd::access(&dir, nix::unistd::AccessFlags::W_OK).is_ok();
    parts.insert(
        "socket_dir".into(),
        Part {
            ok: sock_ok,
            required: true,
            detail: format!(
                "{} {}",
                dir.display(),
                if sock_ok { "writable" } else { "not writable" }
            ),
        },
    );
    let ready = parts.values().all(|p| p.ok || !p.required);
    Report { ready, parts }
}
