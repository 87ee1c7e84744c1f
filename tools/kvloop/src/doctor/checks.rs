//! The verdicts of `kvloop doctor`: pure functions from [`Facts`] to
//! [`Check`]s (no I/O; unit-tested below with each failure injected).
use serde::Serialize;

use super::facts::{Backend, Facts, cap};

/// Outcome of one check; ordered from best to worst.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// Fine.
    Pass,
    /// Not applicable (nothing to check: no `--pid`, no peers).
    Skip,
    /// Works, below what production needs, or could not be verified.
    Warn,
    /// Broken: kvloop (or the engines' transfers) will fail or be slow.
    Fail,
}

impl Level {
    /// The word printed for it.
    pub fn word(self) -> &'static str {
        match self {
            Level::Pass => "pass",
            Level::Skip => "skip",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        }
    }

    /// Exit status of `kvloop doctor` whose worst result is this: 0 for
    /// pass/skip, 1 for warn, 2 for fail.
    pub fn exit_code(self) -> i32 {
        match self {
            Level::Pass | Level::Skip => 0,
            Level::Warn => 1,
            Level::Fail => 2,
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Short name (`libfabric`, `efa`, `capabilities`, ...).
    pub name: &'static str,
    /// The verdict.
    pub level: Level,
    /// What was found.
    pub detail: String,
    /// What to do about it (absent on pass/skip).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

fn ok(name: &'static str, detail: impl Into<String>) -> Check {
    Check {
        name,
        level: Level::Pass,
        detail: detail.into(),
        fix: None,
    }
}

fn skip(name: &'static str, detail: impl Into<String>) -> Check {
    Check {
        name,
        level: Level::Skip,
        detail: detail.into(),
        fix: None,
    }
}

fn bad(
    name: &'static str,
    level: Level,
    detail: impl Into<String>,
    fix: impl Into<String>,
) -> Check {
    Check {
        name,
        level,
        detail: detail.into(),
        fix: Some(fix.into()),
    }
}

/// Every check, in report order.
pub fn all(f: &Facts) -> Vec<Check> {
    vec![
        libfabric(f),
        efa(f),
        rdma_read(f),
        nixl_plugins(f),
        engine_backend(f),
        memlock(f),
        hugepages(f),
        capabilities(f),
        btf(f),
        tracefs(f),
        uprobes(f),
        side_channels(f),
        routers(f),
        clocks(f),
    ]
}

/// The worst level of `checks` ([`Level::Pass`] when empty).
pub fn worst(checks: &[Check]) -> Level {
    checks.iter().map(|c| c.level).max().unwrap_or(Level::Pass)
}

fn has_efa(f: &Facts) -> bool {
    f.rdma_devices
        .as_ref()
        .is_ok_and(|d| d.iter().any(|d| d.is_efa()))
}

/// libfabric providers available and the one the agent chose.
pub fn libfabric(f: &Facts) -> Check {
    const N: &str = "libfabric";
    let (backend, source) = &f.backend;
    let chosen = match backend {
        Backend::Libfabric { provider } => provider.clone(),
        // NIXL's LIBFABRIC plugin uses libfabric's efa provider.
        Backend::Nixl { plugin } if plugin == "LIBFABRIC" => "efa".to_string(),
        Backend::Nixl { plugin } => {
            return skip(
                N,
                format!("backend NIXL {plugin} ({source}): libfabric unused"),
            );
        }
    };
    let provs = match &f.fi_providers {
        Ok(p) => p,
        Err(e) => {
            return bad(
                N,
                Level::Warn,
                format!("chosen provider `{chosen}` ({source}); providers not listed: {e}"),
                "install libfabric's fi_info (EFA installer: /opt/amazon/efa/bin) to list providers",
            );
        }
    };
    let missing: Vec<&str> = chosen
        .split(';')
        .filter(|c| !provs.iter().any(|p| p == c))
        .collect();
    let list = provs.join(",");
    if !missing.is_empty() {
        return bad(
            N,
            Level::Fail,
            format!(
                "chosen provider `{chosen}` ({source}) lacks {}; available: {list}",
                missing.join(",")
            ),
            "use the EFA installer's libfabric (LD_LIBRARY_PATH starting with /opt/amazon/efa/lib), \
             or set backend.provider to an available provider",
        );
    }
    if has_efa(f) && !chosen.split(';').any(|c| c == "efa") {
        return bad(
            N,
            Level::Warn,
            format!("an EFA device is present but the chosen provider is `{chosen}` ({source})"),
            "set backend = { kind = \"libfabric\", provider = \"efa\" } in agent.toml",
        );
    }
    ok(
        N,
        format!("chosen `{chosen}` ({source}); available: {list}"),
    )
}

/// EFA devices and their counters.
pub fn efa(f: &Facts) -> Check {
    const N: &str = "efa";
    let devs = match &f.rdma_devices {
        Ok(d) => d,
        Err(e) => {
            return bad(
                N,
                Level::Warn,
                format!("/sys/class/infiniband: {e}"),
                "mount /sys/class/infiniband into the agent (host path, read-only)",
            );
        }
    };
    let efa: Vec<_> = devs.iter().filter(|d| d.is_efa()).collect();
    if efa.is_empty() {
        let others: Vec<&str> = devs.iter().map(|d| d.name.as_str()).collect();
        return bad(
            N,
            Level::Warn,
            if others.is_empty() {
                "no EFA device (no RDMA device at all): transfers use TCP or shared memory".into()
            } else {
                format!("no EFA device (other RDMA devices: {})", others.join(","))
            },
            "on EC2, attach an EFA interface (Kubernetes: request vpc.amazonaws.com/efa); \
             elsewhere this is expected",
        );
    }
    let mut parts = Vec::new();
    let mut unreadable = Vec::new();
    for d in &efa {
        match &d.counters {
            Ok(n) => parts.push(format!("{} ({n} counters)", d.name)),
            Err(e) => unreadable.push(format!("{}: {e}", d.name)),
        }
    }
    if !unreadable.is_empty() {
        return bad(
            N,
            Level::Warn,
            format!("EFA counters unreadable: {}", unreadable.join("; ")),
            "mount /sys/class/infiniband read-only into the agent (kvloop_agent_rdma_counter)",
        );
    }
    ok(N, parts.join(", "))
}

/// Hardware or emulated RDMA read.
pub fn rdma_read(f: &Facts) -> Check {
    const N: &str = "rdma_read";
    if !has_efa(f) {
        return bad(
            N,
            Level::Warn,
            "no RDMA device: READs are emulated in software by the provider (tcp/shm)",
            "expected without EFA; on EFA instances see the `efa` check",
        );
    }
    match f.efa_use_device_rdma.as_deref() {
        Some("0") => bad(
            N,
            Level::Fail,
            "FI_EFA_USE_DEVICE_RDMA=0: the efa provider emulates fi_read with two-sided messages",
            "set FI_EFA_USE_DEVICE_RDMA=1 (p4d, p5, p5en have hardware RDMA read)",
        ),
        Some("1") => ok(N, "FI_EFA_USE_DEVICE_RDMA=1: hardware RDMA read"),
        other => bad(
            N,
            Level::Warn,
            format!(
                "FI_EFA_USE_DEVICE_RDMA {}: the provider decides per device (emulated on \
                 instance types without RDMA read)",
                other.map_or("unset".to_string(), |v| format!("= `{v}`"))
            ),
            "set FI_EFA_USE_DEVICE_RDMA=1 so that a device without RDMA read fails loudly",
        ),
    }
}

fn backend_plugin(f: &Facts) -> Option<&str> {
    match &f.backend.0 {
        Backend::Nixl { plugin } => Some(plugin),
        Backend::Libfabric { .. } => None,
    }
}

/// NIXL plugin directory and the plugin the agent needs.
pub fn nixl_plugins(f: &Facts) -> Check {
    const N: &str = "nixl_plugins";
    let need = backend_plugin(f);
    let level = if need.is_some() {
        Level::Fail
    } else {
        Level::Warn
    };
    let Some(dir) = &f.nixl_plugin_dir else {
        return bad(
            N,
            level,
            "NIXL_PLUGIN_DIR is not set",
            "export NIXL_PLUGIN_DIR=<nixl>/.nixl_cu12.mesonpy.libs/plugins (scripts/bootstrap.sh nixl)",
        );
    };
    let found = match &f.nixl_plugins {
        Ok(p) => p,
        Err(e) => {
            return bad(
                N,
                level,
                format!("{}: {e}", dir.display()),
                "point NIXL_PLUGIN_DIR at the directory holding libplugin_LIBFABRIC.so",
            );
        }
    };
    if let Some(p) = need
        && !found.iter().any(|x| x == p)
    {
        return bad(
            N,
            Level::Fail,
            format!(
                "{}: plugin {p} (the agent's backend) missing; found: {}",
                dir.display(),
                found.join(",")
            ),
            format!("install NIXL with the {p} plugin, or change backend.plugin"),
        );
    }
    if !found.iter().any(|x| x == "LIBFABRIC") {
        return bad(
            N,
            Level::Warn,
            format!(
                "{}: no LIBFABRIC plugin (found: {})",
                dir.display(),
                found.join(",")
            ),
            "NIXL on EFA needs its LIBFABRIC plugin: install a NIXL build with it",
        );
    }
    ok(N, format!("{}: {}", dir.display(), found.join(",")))
}

/// Each engine's NIXL backend: LIBFABRIC, not UCX, on EFA.
pub fn engine_backend(f: &Facts) -> Check {
    const N: &str = "engine_backend";
    let efa = has_efa(f);
    let mut found = Vec::new();
    if let Some(p) = backend_plugin(f) {
        found.push((format!("agent ({})", f.backend.1), p.to_string()));
    }
    if let Some((pid, r)) = &f.engine_plugins {
        match r {
            Ok(ps) if ps.is_empty() => {}
            Ok(ps) => found.extend(ps.iter().map(|p| (format!("pid {pid}"), p.clone()))),
            Err(e) => {
                return bad(
                    N,
                    Level::Warn,
                    format!("pid {pid}: {e}"),
                    "run doctor as root or with CAP_SYS_PTRACE (host PID namespace)",
                );
            }
        }
    }
    if found.is_empty() {
        return skip(
            N,
            "no NIXL engine seen (agent on libfabric; no --pid using NIXL)",
        );
    }
    let text = found
        .iter()
        .map(|(w, p)| format!("{w}: {p}"))
        .collect::<Vec<_>>()
        .join(", ");
    if efa && found.iter().any(|(_, p)| p == "UCX") {
        return bad(
            N,
            Level::Fail,
            format!("{text}: UCX on EFA falls back to TCP (TTFT > 2.5 s vs 0.6-0.8 s reported)"),
            "use NIXL's LIBFABRIC backend: agent backend.plugin = \"LIBFABRIC\"; vLLM \
             kv_connector_extra_config {\"backends\": [\"LIBFABRIC\"]}",
        );
    }
    ok(
        N,
        if efa {
            text
        } else {
            format!("{text} (no EFA here)")
        },
    )
}

/// `RLIMIT_MEMLOCK`, with `CAP_IPC_LOCK` lifting it.
pub fn memlock(f: &Facts) -> Check {
    const N: &str = "memlock";
    let lim = match f.memlock_bytes {
        None => return ok(N, "RLIMIT_MEMLOCK unlimited"),
        Some(b) => b,
    };
    let txt = format!("RLIMIT_MEMLOCK {} KiB", lim >> 10);
    if cap::has(f.cap_eff, cap::IPC_LOCK) {
        return ok(N, format!("{txt}, lifted by CAP_IPC_LOCK"));
    }
    let fix = "add CAP_IPC_LOCK (agent.capabilities) or raise the limit (ulimit -l unlimited; \
               LimitMEMLOCK=infinity)";
    if has_efa(f) {
        bad(
            N,
            Level::Fail,
            format!("{txt} without CAP_IPC_LOCK: EFA memory registration fails past it"),
            fix,
        )
    } else {
        bad(
            N,
            Level::Warn,
            format!("{txt} without CAP_IPC_LOCK (tcp/shm do not pin; EFA registration would fail)"),
            fix,
        )
    }
}

/// Reserved huge pages (libfabric's EFA provider uses them for its buffers).
pub fn hugepages(f: &Facts) -> Check {
    const N: &str = "hugepages";
    match f.hugepages_total {
        Some(n) if n > 0 => ok(N, format!("{n} huge pages reserved")),
        n => {
            let txt = n.map_or("HugePages_Total unknown".into(), |_| {
                "no huge pages reserved".to_string()
            });
            if has_efa(f) {
                bad(
                    N,
                    Level::Warn,
                    format!("{txt}: the efa provider falls back to 4 KiB pages for its buffers"),
                    "reserve some: sysctl -w vm.nr_hugepages=1024 (or FI_EFA_USE_HUGE_PAGE=0 \
                     to silence)",
                )
            } else {
                ok(N, format!("{txt} (not needed without EFA)"))
            }
        }
    }
}

fn cap_names(eff: u64) -> String {
    [
        (cap::SYS_ADMIN, "CAP_SYS_ADMIN"),
        (cap::BPF, "CAP_BPF"),
        (cap::PERFMON, "CAP_PERFMON"),
        (cap::SYS_PTRACE, "CAP_SYS_PTRACE"),
        (cap::IPC_LOCK, "CAP_IPC_LOCK"),
    ]
    .iter()
    .filter(|(c, _)| cap::has(eff, *c))
    .map(|(_, n)| *n)
    .collect::<Vec<_>>()
    .join(",")
}

/// eBPF capabilities: BPF and PERFMON (or SYS_ADMIN), and SYS_ADMIN for
/// uprobes from Linux 6.16 on; SYS_PTRACE for engines in other containers.
pub fn capabilities(f: &Facts) -> Check {
    const N: &str = "capabilities";
    let e = f.cap_eff;
    let admin = cap::has(e, cap::SYS_ADMIN);
    let have = format!("CapEff {e:#x} ({})", cap_names(e));
    let new_caps = f.kernel.is_none_or(|k| k >= (5, 8));
    let bpf_caps = new_caps && cap::has(e, cap::BPF) && cap::has(e, cap::PERFMON);
    if !(admin || bpf_caps) {
        return bad(
            N,
            Level::Fail,
            format!(
                "{have}: eBPF programs cannot load (need CAP_BPF+CAP_PERFMON or CAP_SYS_ADMIN)"
            ),
            "add SYS_ADMIN to agent.capabilities (it covers BPF and PERFMON)",
        );
    }
    let uprobe_needs_admin = f.kernel.is_none_or(|k| k >= (6, 16));
    if uprobe_needs_admin && !admin {
        return bad(
            N,
            Level::Fail,
            format!(
                "{have}: missing CAP_SYS_ADMIN; uprobes need it on Linux >= 6.16 (kernel {})",
                f.kernel
                    .map_or("unknown".into(), |(a, b)| format!("{a}.{b}"))
            ),
            "add SYS_ADMIN to agent.capabilities, or set require_ebpf = false (user-space timing)",
        );
    }
    if !cap::has(e, cap::SYS_PTRACE) {
        return bad(
            N,
            Level::Warn,
            format!("{have}: missing CAP_SYS_PTRACE: no uprobes into engines of other containers"),
            "add SYS_PTRACE to agent.capabilities (observe mode)",
        );
    }
    ok(N, have)
}

/// Kernel BTF.
pub fn btf(f: &Facts) -> Check {
    if f.btf {
        ok("btf", "/sys/kernel/btf/vmlinux readable")
    } else {
        bad(
            "btf",
            Level::Fail,
            "/sys/kernel/btf/vmlinux missing: struct offsets of the probes cannot be resolved",
            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y; mount /sys/kernel/btf into the agent",
        )
    }
}

/// tracefs mount.
pub fn tracefs(f: &Facts) -> Check {
    match &f.tracefs {
        Some(p) => ok("tracefs", format!("{} mounted", p.display())),
        None => bad(
            "tracefs",
            Level::Fail,
            "tracefs not mounted at /sys/kernel/tracing or /sys/kernel/debug/tracing",
            "mount -t tracefs nodev /sys/kernel/tracing (and mount it into the agent)",
        ),
    }
}

/// Uprobes on the `--pid` engine.
pub fn uprobes(f: &Facts) -> Check {
    const N: &str = "uprobes";
    let Some(u) = &f.uprobe else {
        return skip(N, "no engine named (--pid PID)");
    };
    match &u.result {
        Ok(syms) => ok(
            N,
            format!(
                "pid {}: {} uprobes attach on {}",
                u.pid,
                syms.len(),
                u.target
            ),
        ),
        Err(e) => {
            let fix = if e.contains("ermission") || e.contains("EPERM") || e.contains("EACCES") {
                "run with CAP_SYS_ADMIN (uprobes need it on Linux >= 6.16) and CAP_SYS_PTRACE"
            } else {
                "the binary must be unstripped and link kvloop's dataplane or libnixl.so"
            };
            bad(
                N,
                Level::Fail,
                format!("pid {} ({}): {e}", u.pid, u.target),
                fix,
            )
        }
    }
}

#[path = "checks_net.rs"]
mod net;
pub use net::{CLOCK_WARN_MS, clocks, routers, side_channels};

#[cfg(test)]
#[path = "checks_tests.rs"]
mod tests;
