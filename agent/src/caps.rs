//! Which Linux capability an eBPF failure lacks.
//!
//! When loading the probes or attaching their uprobes fails with `EPERM` /
//! `EACCES`, the agent names the capability missing from its effective set
//! (`CapEff` of `/proc/self/status`). Kernel rules (include/uapi/linux/capability.h
//! for the numbers):
//!
//! * `bpf()` maps and programs: `CAP_BPF` or `CAP_SYS_ADMIN` (`bpf_capable()`,
//!   Linux ≥ 5.8).
//! * perf events (tracepoints): `CAP_PERFMON` or `CAP_SYS_ADMIN`
//!   (`perfmon_capable()`).
//! * uprobes through `perf_event_open()`: `CAP_SYS_ADMIN` on Linux ≥ 6.16
//!   (kernel commit ba677dbe "perf: Revert to requiring CAP_SYS_ADMIN for
//!   uprobes", also in stable backports); `CAP_PERFMON` sufficed from 5.8 until
//!   then.
//!
//! Pure logic ([`parse_cap_eff`], [`parse_kernel_version`], [`missing`]) is
//! separate from reading `/proc` ([`explain`]).

/// `CAP_SYS_ADMIN` (21).
pub const CAP_SYS_ADMIN: u32 = 21;
/// `CAP_PERFMON` (38).
pub const CAP_PERFMON: u32 = 38;
/// `CAP_BPF` (39).
pub const CAP_BPF: u32 = 39;

/// First kernel (major, minor) that requires `CAP_SYS_ADMIN` for uprobes
/// (commit ba677dbe, Linux 6.16).
pub const UPROBE_SYS_ADMIN_SINCE: (u32, u32) = (6, 16);

/// What failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Loading programs and maps, attaching tracepoints ([`kvloop_probes::Probes::load`]).
    Load,
    /// Attaching the READ-site uprobes.
    Uprobe,
}

/// Parses the `CapEff:` line of `/proc/<pid>/status` (hex bit mask).
pub fn parse_cap_eff(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// Parses `/proc/sys/kernel/osrelease` (`6.18.44-foo`) into (major, minor).
pub fn parse_kernel_version(osrelease: &str) -> Option<(u32, u32)> {
    let mut it = osrelease.trim().split(['.', '-']);
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

/// Whether an error message is a permission failure (`EPERM` or `EACCES`).
pub fn is_permission_error(message: &str) -> bool {
    message.contains("Operation not permitted")
        || message.contains("Permission denied")
        || message.contains("os error 1)")
        || message.contains("os error 13)")
}

fn has(cap_eff: u64, cap: u32) -> bool {
    cap_eff & (1u64 << cap) != 0
}

/// The capability `stage` lacks with effective set `cap_eff` on kernel
/// `kernel` (major, minor; `None` = unknown, taken as new), with its reason;
/// `None` when every capability it needs is held (the failure has another
/// cause).
pub fn missing(cap_eff: u64, kernel: Option<(u32, u32)>, stage: Stage) -> Option<String> {
    let sys_admin = has(cap_eff, CAP_SYS_ADMIN);
    let uprobes_need_sys_admin = kernel.is_none_or(|k| k >= UPROBE_SYS_ADMIN_SINCE);
    let bpf = sys_admin || has(cap_eff, CAP_BPF);
    let perfmon = sys_admin || has(cap_eff, CAP_PERFMON);
    match stage {
        Stage::Load if !bpf && uprobes_need_sys_admin => Some(
            "CAP_SYS_ADMIN (eBPF maps/programs need CAP_BPF or CAP_SYS_ADMIN, and the READ-site \
             uprobes need CAP_SYS_ADMIN on Linux ≥ 6.16)"
                .into(),
        ),
        Stage::Load if !bpf => {
            Some("CAP_BPF (or CAP_SYS_ADMIN; eBPF maps and programs need it)".into())
        }
        Stage::Load if !perfmon => {
            Some("CAP_PERFMON (or CAP_SYS_ADMIN; perf events of the tracepoints need it)".into())
        }
        Stage::Load => None,
        Stage::Uprobe if !sys_admin && uprobes_need_sys_admin => {
            Some("CAP_SYS_ADMIN (uprobes need it on Linux ≥ 6.16)".into())
        }
        Stage::Uprobe if !perfmon => {
            Some("CAP_PERFMON (or CAP_SYS_ADMIN; uprobes need it before Linux 6.16)".into())
        }
        Stage::Uprobe => None,
    }
}

/// `error`, with `; missing capability …` appended when it is a permission
/// failure and this process's effective set (`/proc/self/status`) lacks a
/// capability `stage` needs on the running kernel.
pub fn explain(error: &str, stage: Stage) -> String {
    if !is_permission_error(error) {
        return error.to_string();
    }
    let cap_eff = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| parse_cap_eff(&s));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .and_then(|s| parse_kernel_version(&s));
    match cap_eff.and_then(|c| missing(c, kernel, stage)) {
        Some(cap) => format!("{error}; missing capability {cap}"),
        None => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tkvloop-agent\nCapInh:\t0000000000000000\nCapPrm:\t0000000000284000\n\
                          CapEff:\t0000000000284000\nCapBnd:\t0000000000284000\n";

    fn mask(caps: &[u32]) -> u64 {
        caps.iter().map(|c| 1u64 << c).sum()
    }

    #[test]
    fn proc_fields_parse() {
        // IPC_LOCK (14), SYS_PTRACE (19), SYS_ADMIN (21).
        assert_eq!(parse_cap_eff(STATUS), Some(mask(&[14, 19, 21])));
        assert_eq!(parse_cap_eff("Name: x\n"), None);
        assert_eq!(parse_kernel_version("6.18.44-fc-v595\n"), Some((6, 18)));
        assert_eq!(parse_kernel_version("5.15.0"), Some((5, 15)));
        assert_eq!(parse_kernel_version("garbage"), None);
    }

    #[test]
    fn permission_errors_are_recognized() {
        assert!(is_permission_error(
            "loading eBPF program `x`: the BPF_PROG_LOAD syscall failed: Operation not permitted (os error 1)"
        ));
        assert!(is_permission_error(
            "attaching `kvloop_read_post` to /x:sym: perf_event_open failed: Permission denied (os error 13)"
        ));
        assert!(!is_permission_error("field offsets: no such field"));
    }

    #[test]
    fn the_missing_capability_is_named_per_stage_and_kernel() {
        let new = Some((6, 18));
        let old = Some((6, 1));
        // The DaemonSet's set without SYS_ADMIN: nothing loads.
        let no_admin = mask(&[14, 19]);
        let m = missing(no_admin, new, Stage::Load).unwrap();
        assert!(m.starts_with("CAP_SYS_ADMIN"), "{m}");
        assert!(
            missing(no_admin, old, Stage::Load)
                .unwrap()
                .starts_with("CAP_BPF")
        );
        // BPF + PERFMON: programs load, uprobes need SYS_ADMIN on >= 6.16 only.
        let bpf_perfmon = mask(&[14, 19, CAP_BPF, CAP_PERFMON]);
        assert_eq!(missing(bpf_perfmon, new, Stage::Load), None);
        assert_eq!(
            missing(bpf_perfmon, new, Stage::Uprobe).unwrap(),
            "CAP_SYS_ADMIN (uprobes need it on Linux ≥ 6.16)"
        );
        assert_eq!(missing(bpf_perfmon, old, Stage::Uprobe), None);
        assert!(
            missing(mask(&[CAP_BPF]), new, Stage::Load)
                .unwrap()
                .starts_with("CAP_PERFMON")
        );
        assert!(
            missing(mask(&[CAP_BPF]), old, Stage::Uprobe)
                .unwrap()
                .starts_with("CAP_PERFMON")
        );
        // SYS_ADMIN covers everything.
        let admin = mask(&[CAP_SYS_ADMIN]);
        assert_eq!(missing(admin, new, Stage::Load), None);
        assert_eq!(missing(admin, new, Stage::Uprobe), None);
        // Unknown kernel: taken as new.
        assert!(missing(bpf_perfmon, None, Stage::Uprobe).is_some());
    }

    #[test]
    fn explain_leaves_other_errors_alone() {
        assert_eq!(
            explain("field offsets: nope", Stage::Load),
            "field offsets: nope"
        );
    }
}
