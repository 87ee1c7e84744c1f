//! Prefill at the engine's socket: the first request bytes received on a
//! prefill port (`sock:sock_recv_length`) start the clock, the first response
//! bytes sent (`sock:sock_send_length`) stop it; the request's head (for the
//! `X-KVLoop-Tokens` header) is copied at the `read`/`recvfrom` syscall exit.
use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel,
        generated::{
            bpf_probe_read_kernel as raw_read_kernel, bpf_probe_read_user as raw_read_user,
        },
    },
    macros::{map, tracepoint},
    maps::{HashMap, LruHashMap, PerCpuArray, PerCpuHashMap},
    programs::TracePointContext,
};
use kvloop_common::{
    LatencyHist, MAX_PREFILL_PORTS, PREFILL_HEAD_LEN, PrefillEvent, PrefillHistKey,
    PrefillInflight, counter, enable, event_kind,
};

use crate::maps::{EVENTS, bump, config, hist_add, submit_flags, tgid, tp_u16, tp_u32, tp_u64};

#[map]
static PREFILL_HIST: PerCpuHashMap<PrefillHistKey, LatencyHist> =
    PerCpuHashMap::with_max_entries(64, 0);

/// Server ports whose sockets are timed as prefill requests (value unused).
#[map]
static PREFILL_PORTS: HashMap<u16, u8> = HashMap::with_max_entries(MAX_PREFILL_PORTS, 0);

/// Processes serving a prefill port (tgid → 1). The read/recvfrom syscall
/// hooks, which fire for every process on the node, return at once for
/// other processes. Filled by the loader (listeners found in /proc) and by
/// `prefill_recv` when it sees a server it did not know.
#[map]
static SERVER_TGIDS: HashMap<u32, u8> = HashMap::with_max_entries(1024, 0);

/// In-flight prefill requests, keyed by `struct sock *`.
#[map]
static PREFILL_INFLIGHT: LruHashMap<u64, PrefillInflight> = LruHashMap::with_max_entries(16384, 0);

/// User buffer of a read/recvfrom in progress, keyed by pid_tgid.
#[map]
static RECV_BUF: LruHashMap<u64, u64> = LruHashMap::with_max_entries(16384, 0);

/// Socket whose first request bytes are being received by this thread.
#[map]
static CAPTURE: LruHashMap<u64, u64> = LruHashMap::with_max_entries(4096, 0);

/// Per-CPU scratch for values too large for the 512-byte stack.
#[map]
static SCRATCH: PerCpuArray<PrefillInflight> = PerCpuArray::with_max_entries(1, 0);

const IPPROTO_TCP: u16 = 6;
const MSG_PEEK: i32 = 2;

/// `sock:sock_recv_length`: the first bytes of a request on a prefill port
/// start the clock (and arm the head capture at the syscall's exit).
#[tracepoint(category = "sock", name = "sock_recv_length")]
pub fn prefill_recv(ctx: TracePointContext) -> u32 {
    let _ = try_prefill_recv(&ctx);
    0
}

#[inline(always)]
fn try_prefill_recv(ctx: &TracePointContext) -> Option<()> {
    let cfg = config()?;
    if cfg.enabled & enable::PREFILL == 0 {
        return None;
    }
    let protocol = tp_u16(ctx, cfg.sock_protocol_off)?;
    if protocol != IPPROTO_TCP {
        return None;
    }
    let ret = tp_u32(ctx, cfg.sock_ret_off)? as i32;
    let flags = tp_u32(ctx, cfg.sock_flags_off)? as i32;
    if ret <= 0 || flags & MSG_PEEK != 0 {
        return None;
    }
    let sk = tp_u64(ctx, cfg.sock_sk_off)?;
    // SAFETY: bpf_probe_read_kernel copies from any kernel address with fault
    // handling; `sk` is the tracepoint's `struct sock *`, the offset comes
    // from BTF (the loader).
    let port: u16 =
        unsafe { bpf_probe_read_kernel((sk + cfg.skc_num_off as u64) as *const u16) }.ok()?;
    PREFILL_PORTS.get_ptr(port)?;
    let me = tgid();
    if SERVER_TGIDS.get_ptr(me).is_none() {
        // first request seen from this server process: its head bytes are
        // captured from the next request on (the syscall entry is past)
        let _ = SERVER_TGIDS.insert(me, 1u8, 0);
    }
    if PREFILL_INFLIGHT.get_ptr(sk).is_some() {
        return None; // continuation of a request already being timed
    }
    // SAFETY: BPF helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: as for `port` above (faults handled, offsets from BTF).
    let dport: u16 =
        unsafe { bpf_probe_read_kernel((sk + cfg.skc_dport_off as u64) as *const u16) }
            .unwrap_or(0);
    // SAFETY: as for `port` above.
    let daddr: u32 =
        unsafe { bpf_probe_read_kernel((sk + cfg.skc_daddr_off as u64) as *const u32) }
            .unwrap_or(0);
    let s = SCRATCH.get_ptr_mut(0)?;
    // SAFETY: `s` is this CPU's slot of a per-CPU array, valid for the run,
    // no concurrent writer (migration disabled).
    unsafe {
        (*s).start_ns = now;
        (*s).first_recv_bytes = ret as u64;
        (*s).tgid = tgid();
        (*s).port = port;
        (*s).peer_port = u16::from_be(dport);
        (*s).peer_addr4 = daddr;
        (*s).head_len = 0;
    }
    // by reference: the value (544 bytes) does not fit on the BPF stack
    // SAFETY: `s` is valid (above) and PrefillInflight is plain old data:
    // the map copies it.
    #[allow(clippy::needless_borrows_for_generic_args)]
    let inserted = PREFILL_INFLIGHT.insert(sk, unsafe { &*s }, 0);
    if inserted.is_err() {
        return None;
    }
    let _ = CAPTURE.insert(bpf_get_current_pid_tgid(), sk, 0);
    Some(())
}

/// `sock:sock_send_length`: the first response bytes on a socket with a
/// request in flight stop the clock.
#[tracepoint(category = "sock", name = "sock_send_length")]
pub fn prefill_send(ctx: TracePointContext) -> u32 {
    let _ = try_prefill_send(&ctx);
    0
}

#[inline(always)]
fn try_prefill_send(ctx: &TracePointContext) -> Option<()> {
    let cfg = config()?;
    if cfg.enabled & enable::PREFILL == 0 {
        return None;
    }
    let sk = tp_u64(ctx, cfg.sock_sk_off)?;
    let p = PREFILL_INFLIGHT.get_ptr(sk)?;
    let ret = tp_u32(ctx, cfg.sock_ret_off)? as i32;
    if ret <= 0 {
        return None;
    }
    // SAFETY: BPF helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: `p` points at the map's value, valid for this run (deletion is
    // RCU-deferred); plain integer fields.
    let (start, port) = unsafe { ((*p).start_ns, (*p).port) };
    let ns = now.saturating_sub(start);
    hist_add(&PREFILL_HIST, &PrefillHistKey { port, _pad: [0; 6] }, ns, 0, 1);
    bump(counter::PREFILL_SAMPLES);
    match EVENTS.reserve::<PrefillEvent>(0) {
        Some(mut e) => {
            let ep = e.as_mut_ptr();
            // SAFETY: `ep` points at a reserved ring-buffer entry of
            // size_of::<PrefillEvent>() bytes that only this program writes
            // until submit; the helper copies size_of::<PrefillInflight>()
            // bytes from the map value `p` (valid, above) into its `req`
            // field, which has exactly that size.
            unsafe {
                (*ep).kind = event_kind::PREFILL;
                (*ep)._pad = 0;
                (*ep).start_ns = start;
                (*ep).end_ns = now;
                raw_read_kernel(
                    &mut (*ep).req as *mut PrefillInflight as *mut _,
                    core::mem::size_of::<PrefillInflight>() as u32,
                    p as *const _,
                );
            }
            e.submit(submit_flags());
        }
        None => bump(counter::PREFILL_EVENT_DROPPED),
    }
    let _ = PREFILL_INFLIGHT.remove(sk);
    Some(())
}

#[inline(always)]
fn enter_recv(ctx: &TracePointContext, buf_off: u32) {
    let Some(cfg) = config() else { return };
    if cfg.enabled & enable::PREFILL == 0 || SERVER_TGIDS.get_ptr(tgid()).is_none() {
        return;
    }
    if let Some(buf) = tp_u64(ctx, buf_off) {
        let _ = RECV_BUF.insert(bpf_get_current_pid_tgid(), buf, 0);
    }
}

#[inline(always)]
fn exit_recv(ctx: &TracePointContext) {
    let Some(cfg) = config() else { return };
    if cfg.enabled & enable::PREFILL == 0 {
        return;
    }
    let id = bpf_get_current_pid_tgid();
    if SERVER_TGIDS.get_ptr((id >> 32) as u32).is_none() {
        return;
    }
    let Some(sk) = CAPTURE.get_ptr(id) else {
        let _ = RECV_BUF.remove(id);
        return;
    };
    // SAFETY: map value pointer, valid for this run; a plain u64.
    let sk = unsafe { *sk };
    let _ = CAPTURE.remove(id);
    // SAFETY: map value pointer, valid for this run; a plain u64.
    let buf = RECV_BUF.get_ptr(id).map(|b| unsafe { *b });
    let _ = RECV_BUF.remove(id);
    let ret = tp_u64(ctx, cfg.sys_exit_ret_off).unwrap_or(0) as i64;
    let (Some(buf), Some(inf)) = (buf, PREFILL_INFLIGHT.get_ptr_mut(sk)) else {
        bump(counter::PREFILL_HEAD_MISSED);
        return;
    };
    if ret <= 0 {
        bump(counter::PREFILL_HEAD_MISSED);
        return;
    }
    let mut n = ret as u32;
    if n > PREFILL_HEAD_LEN as u32 {
        n = PREFILL_HEAD_LEN as u32;
    }
    let n = n & (PREFILL_HEAD_LEN as u32 * 2 - 1);
    if n == 0 || n > PREFILL_HEAD_LEN as u32 {
        return;
    }
    // SAFETY: the helper writes at most `n` <= PREFILL_HEAD_LEN bytes into
    // `head` (PREFILL_HEAD_LEN bytes) of the map value `inf` (valid for this
    // run) and reads the user buffer with fault handling.
    let rc = unsafe { raw_read_user((*inf).head.as_mut_ptr() as *mut _, n, buf as *const _) };
    if rc == 0 {
        // SAFETY: as above.
        unsafe { (*inf).head_len = n };
    } else {
        bump(counter::PREFILL_HEAD_MISSED);
    }
}

/// `syscalls:sys_enter_read`: remember the user buffer.
#[tracepoint(category = "syscalls", name = "sys_enter_read")]
pub fn sys_enter_read(ctx: TracePointContext) -> u32 {
    if let Some(cfg) = config() {
        enter_recv(&ctx, cfg.sys_read_buf_off);
    }
    0
}

/// `syscalls:sys_enter_recvfrom`: remember the user buffer.
#[tracepoint(category = "syscalls", name = "sys_enter_recvfrom")]
pub fn sys_enter_recvfrom(ctx: TracePointContext) -> u32 {
    if let Some(cfg) = config() {
        enter_recv(&ctx, cfg.sys_recvfrom_buf_off);
    }
    0
}

/// `syscalls:sys_exit_read`: copy the head of a prefill request.
#[tracepoint(category = "syscalls", name = "sys_exit_read")]
pub fn sys_exit_read(ctx: TracePointContext) -> u32 {
    exit_recv(&ctx);
    0
}

/// `syscalls:sys_exit_recvfrom`: copy the head of a prefill request.
#[tracepoint(category = "syscalls", name = "sys_exit_recvfrom")]
pub fn sys_exit_recvfrom(ctx: TracePointContext) -> u32 {
    exit_recv(&ctx);
    0
}
