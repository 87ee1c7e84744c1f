//! Reading the offsets kvloop's programs need from the running kernel:
//! tracepoint format files (tracefs) and BTF (`/sys/kernel/btf/vmlinux`),
//! written into the programs' `CONFIG` map at load.

use kvloop_common::enable;

use crate::config::ProbeConfig;
use crate::tracefs::{self, field_offset};
use crate::{ProbeError, btf::Btf};

/// Reads every offset the programs need from tracefs format files and BTF.
pub(crate) fn read_offsets(cfg: &ProbeConfig) -> Result<kvloop_common::ProbeConfig, ProbeError> {
    let tfs = tracefs::ensure_tracefs()?;
    let recv = tracefs::read_format(&tfs, "sock", "sock_recv_length")?;
    let send = tracefs::read_format(&tfs, "sock", "sock_send_length")?;
    let enter_read = tracefs::read_format(&tfs, "syscalls", "sys_enter_read")?;
    let enter_recvfrom = tracefs::read_format(&tfs, "syscalls", "sys_enter_recvfrom")?;
    let exit_read = tracefs::read_format(&tfs, "syscalls", "sys_exit_read")?;
    let exit_recvfrom = tracefs::read_format(&tfs, "syscalls", "sys_exit_recvfrom")?;
    let rt = tracefs::read_format(&tfs, "tcp", "tcp_retransmit_skb")?;
    // sock_recv_length and sock_send_length share one event class; the
    // programs read both with the same offsets, so check they agree.
    for f in ["sk", "protocol", "ret", "flags"] {
        let a = field_offset(&recv, "sock:sock_recv_length", f)?;
        let b = field_offset(&send, "sock:sock_send_length", f)?;
        if a != b {
            return Err(ProbeError::Offsets(format!(
                "field `{f}` is at {a} in sock_recv_length but {b} in sock_send_length"
            )));
        }
    }
    let exit_ret = field_offset(&exit_read, "syscalls:sys_exit_read", "ret")?;
    if field_offset(&exit_recvfrom, "syscalls:sys_exit_recvfrom", "ret")? != exit_ret {
        return Err(ProbeError::Offsets(
            "`ret` differs between sys_exit_read and sys_exit_recvfrom".into(),
        ));
    }
    let btf = Btf::from_sys_fs()?;
    let mut enabled = 0;
    if cfg.transfer {
        enabled |= enable::XFER;
    }
    if cfg.prefill {
        enabled |= enable::PREFILL;
    }
    if cfg.retransmit {
        enabled |= enable::RETRANSMIT;
    }
    Ok(kvloop_common::ProbeConfig {
        enabled,
        xfer_sample_every: cfg.xfer_sample_every.max(1),
        sock_sk_off: field_offset(&recv, "sock:sock_recv_length", "sk")?,
        sock_protocol_off: field_offset(&recv, "sock:sock_recv_length", "protocol")?,
        sock_ret_off: field_offset(&recv, "sock:sock_recv_length", "ret")?,
        sock_flags_off: field_offset(&recv, "sock:sock_recv_length", "flags")?,
        skc_num_off: btf.member_offset("sock_common", "skc_num")?,
        skc_dport_off: btf.member_offset("sock_common", "skc_dport")?,
        skc_daddr_off: btf.member_offset("sock_common", "skc_daddr")?,
        sys_read_buf_off: field_offset(&enter_read, "syscalls:sys_enter_read", "buf")?,
        sys_recvfrom_buf_off: field_offset(&enter_recvfrom, "syscalls:sys_enter_recvfrom", "ubuf")?,
        sys_exit_ret_off: exit_ret,
        rt_family_off: field_offset(&rt, "tcp:tcp_retransmit_skb", "family")?,
        rt_dport_off: field_offset(&rt, "tcp:tcp_retransmit_skb", "dport")?,
        rt_daddr_off: field_offset(&rt, "tcp:tcp_retransmit_skb", "daddr")?,
        rt_daddr_v6_off: field_offset(&rt, "tcp:tcp_retransmit_skb", "daddr_v6")?,
    })
}

/// Lifts RLIMIT_MEMLOCK for map creation on kernels before 5.11.
pub(crate) fn raise_memlock() {
    let lim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain setrlimit with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        // Harmless on kernels >= 5.11 (memcg accounting), see RECIPES.
        tracing::debug!(
            "setrlimit(RLIMIT_MEMLOCK) failed: {}; continuing (kernel >= 5.11 accounts BPF memory by cgroup)",
            std::io::Error::last_os_error()
        );
    }
}
