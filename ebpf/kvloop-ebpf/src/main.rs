//! kvloop's eBPF programs. Loaded and attached by `kvloop-probes`
//! (`ebpf/probes/src/loader.rs`). One module per probe family:
//!
//! | module | program | kind | attach point |
//! |---|---|---|---|
//! | [`sites`] | `kvloop_read_post` | uprobe | `kvloop_probe_read_post` in any binary linking the dataplane |
//! | [`sites`] | `kvloop_read_done` | uprobe | `kvloop_probe_read_done` |
//! | [`sites`] | `kvloop_noop` | uprobe | the same sites, for calibration (benchmark) |
//! | [`nixl`] | `nixl_create_enter` / `nixl_create_exit` | uprobe / uretprobe | `nixlAgent::createXferReq` in `libnixl.so` |
//! | [`nixl`] | `nixl_post_enter` / `nixl_post_exit` | uprobe / uretprobe | `nixlAgent::postXferReq` |
//! | [`nixl`] | `nixl_status_enter` / `nixl_status_exit` | uprobe / uretprobe | `nixlAgent::getXferStatus` |
//! | [`prefill`] | `prefill_recv` | tracepoint | `sock:sock_recv_length` |
//! | [`prefill`] | `prefill_send` | tracepoint | `sock:sock_send_length` |
//! | [`prefill`] | `sys_enter_read`, `sys_enter_recvfrom` | tracepoint | `syscalls:sys_enter_{read,recvfrom}` |
//! | [`prefill`] | `sys_exit_read`, `sys_exit_recvfrom` | tracepoint | `syscalls:sys_exit_{read,recvfrom}` |
//! | [`tcp`] | `tcp_retransmit` | tracepoint | `tcp:tcp_retransmit_skb` |
//!
//! [`maps`] holds the maps every family uses (configuration, counters, the
//! event ring) and [`xfer`] the recording of a completed transfer that the
//! READ sites and NIXL share. Field offsets come from the `CONFIG` map, filled
//! by the loader from the tracepoint format files and BTF.
#![no_std]
#![no_main]

mod maps;
mod nixl;
mod prefill;
mod sites;
mod tcp;
mod xfer;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
