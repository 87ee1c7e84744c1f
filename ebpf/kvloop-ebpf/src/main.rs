//! kvloop's eBPF programs. Loaded and attached by `kvloop-probes`.
//!
//! | program | kind | attach point |
//! |---|---|---|
//! | `kvloop_read_post` | uprobe | `kvloop_probe_read_post` in any binary linking the dataplane |
//! | `kvloop_read_done` | uprobe | `kvloop_probe_read_done` |
//! | `nixl_create_enter` / `nixl_create_exit` | uprobe / uretprobe | `nixlAgent::createXferReq` in `libnixl.so` |
//! | `nixl_post_enter` / `nixl_post_exit` | uprobe / uretprobe | `nixlAgent::postXferReq` |
//! | `nixl_status_enter` / `nixl_status_exit` | uprobe / uretprobe | `nixlAgent::getXferStatus` |
//! | `prefill_recv` | tracepoint | `sock:sock_recv_length` |
//! | `prefill_send` | tracepoint | `sock:sock_send_length` |
//! | `sys_enter_read`, `sys_enter_recvfrom` | tracepoint | `syscalls:sys_enter_{read,recvfrom}` |
//! | `sys_exit_read`, `sys_exit_recvfrom` | tracepoint | `syscalls:sys_exit_{read,recvfrom}` |
//! | `tcp_retransmit` | tracepoint | `tcp:tcp_retransmit_skb` |
//!
//! Field offsets come from the `CONFIG` map, filled by the loader from the
//! tracepoint format files and BTF.
#![no_std]
#![no_main]

use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_user,
        generated::{
            bpf_probe_read_kernel as raw_read_kernel, bpf_probe_read_user as raw_read_user,
        },
    },
    macros::{map, tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{ProbeContext, RetProbeContext, TracePointContext},
};
use kvloop_common::{
    BackendKind, Direction, KV_SLOTS, KV_SLOTS_LOG2, KvSlot, LAT_SLOTS, LatencyHist,
    MAX_PREFILL_PORTS, NixlCallArgs, NixlReqInfo, PEER_LEN, PREFILL_HEAD_LEN, PendingKey,
    PendingXfer, PrefillEvent, PrefillHistKey, PrefillInflight, ProbeConfig, ReadProbeArgs,
    RetransmitEvent, RetransmitKey, SIZE_CLASS_UNKNOWN, XferEvent, XferHistKey, counter, enable,
    event_kind, lat_slot, site, size_class,
};

#[map]
static CONFIG: Array<ProbeConfig> = Array::with_max_entries(1, 0);

#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 20, 0);

#[map]
static PENDING: LruHashMap<PendingKey, PendingXfer> = LruHashMap::with_max_entries(65536, 0);

/// kvloop sites: post time of READs in flight in a direct-mapped table
/// indexed by a hash of (tgid, xfer_id); `read_done` carries every other
/// field. An array slot costs a few ns where a hash-map insert costs
/// ~300 ns on this VM (measured with BPF run-time stats). A slot reused by
/// another READ before the first completes makes that first completion
/// "unmatched" (counted); stale slots of dead processes are simply
/// overwritten.
#[map]
static KV_START: Array<KvSlot> = Array::with_max_entries(KV_SLOTS, 0);

#[map]
static XFER_HIST: PerCpuHashMap<XferHistKey, LatencyHist> =
    PerCpuHashMap::with_max_entries(4096, 0);

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

#[map]
static RETRANSMITS: PerCpuHashMap<RetransmitKey, u64> = PerCpuHashMap::with_max_entries(4096, 0);

/// NIXL: arguments of calls in progress (uprobe → uretprobe), by pid_tgid.
#[map]
static NIXL_CALLS: LruHashMap<u64, NixlCallArgs> = LruHashMap::with_max_entries(16384, 0);

/// NIXL: what `createXferReq` told us about a request handle.
#[map]
static NIXL_REQS: LruHashMap<u64, NixlReqInfo> = LruHashMap::with_max_entries(65536, 0);

/// Per-CPU scratch for values too large for the 512-byte stack.
#[map]
static SCRATCH: PerCpuArray<PrefillInflight> = PerCpuArray::with_max_entries(1, 0);

static ZERO_HIST: LatencyHist = LatencyHist::ZERO;

/// Ring-buffer notification policy: wake the reader only once this many
/// bytes are pending; below that the reader's periodic poll (every
/// `kvloop_probes::DRAIN_INTERVAL`) picks events up. A wakeup per event costs
/// an irq_work and a context switch, several µs per READ on a busy node.
const WAKEUP_BYTES: u64 = 256 * 1024;
const BPF_RB_AVAIL_DATA: u64 = 0;
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;

#[inline(always)]
fn submit_flags() -> u64 {
    if EVENTS.query(BPF_RB_AVAIL_DATA) >= WAKEUP_BYTES {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

#[inline(always)]
fn config() -> Option<&'static ProbeConfig> {
    CONFIG.get(0)
}

#[inline(always)]
fn bump(idx: u32) {
    if let Some(p) = COUNTERS.get_ptr_mut(idx) {
        unsafe { *p += 1 };
    }
}

#[inline(always)]
fn tgid() -> u32 {
    (bpf_get_current_pid_tgid() >> 32) as u32
}

#[inline(always)]
fn hist_add<K>(map: &PerCpuHashMap<K, LatencyHist>, key: &K, ns: u64, bytes: u64) {
    let mut p = map.get_ptr_mut(key);
    if p.is_none() {
        // by reference: a 344-byte copy would crowd the 512-byte BPF stack
        #[allow(clippy::needless_borrows_for_generic_args)]
        let inserted = map.insert(key, &ZERO_HIST, 0);
        if inserted.is_err() {
            bump(counter::HIST_FULL);
            return;
        }
        p = map.get_ptr_mut(key);
    }
    if let Some(h) = p {
        let slot = lat_slot(ns);
        unsafe {
            if slot < LAT_SLOTS {
                (*h).slots[slot] += 1;
            }
            (*h).count += 1;
            (*h).sum_ns += ns;
            (*h).sum_bytes += bytes;
        }
    }
}

// ---------------------------------------------------------------------------
// Transfer probes
// ---------------------------------------------------------------------------

#[inline(always)]
fn xfer_begin(key: &PendingKey, v: &PendingXfer) {
    if PENDING.insert(key, v, 0).is_err() {
        bump(counter::XFER_PENDING_FULL);
    }
}

/// Completes a pending NIXL transfer: looks it up, then [`xfer_finish`].
#[inline(always)]
fn xfer_end(key: &PendingKey, status: i32) {
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(p) = PENDING.get_ptr(key) else {
        bump(counter::XFER_DONE_UNMATCHED);
        return;
    };
    let pend = unsafe { *p };
    let _ = PENDING.remove(key);
    xfer_finish(key, &pend, status, now);
}

/// Records a completed READ: histogram (always), event (sampled).
#[inline(always)]
fn xfer_finish(key: &PendingKey, pend: &PendingXfer, status: i32, now: u64) {
    let Some(cfg) = config() else { return };
    let ns = now.saturating_sub(pend.start_ns);
    let hkey = XferHistKey {
        peer: pend.peer,
        direction: pend.direction,
        size_class: if key.site == site::NIXL_LIB as u32 && pend.bytes == 0 {
            SIZE_CLASS_UNKNOWN
        } else {
            size_class(pend.bytes)
        },
        site: key.site as u8,
        ok: (status == 0) as u8,
        _pad: [0; 4],
    };
    hist_add(&XFER_HIST, &hkey, ns, pend.bytes);
    bump(counter::XFER_SAMPLES);

    let every = cfg.xfer_sample_every;
    if every > 1 {
        // per-CPU sample counter in the reserved counter slot
        let mut take = false;
        if let Some(c) = COUNTERS.get_ptr_mut(counter::COUNT - 1) {
            unsafe {
                *c += 1;
                take = *c % every as u64 == 0;
            }
        }
        if !take {
            return;
        }
    }
    match EVENTS.reserve::<XferEvent>(0) {
        Some(mut e) => {
            e.write(XferEvent {
                kind: event_kind::XFER,
                tgid: key.tgid,
                id: key.id,
                start_ns: pend.start_ns,
                end_ns: now,
                bytes: pend.bytes,
                descriptors: pend.descriptors,
                status,
                direction: pend.direction,
                backend: pend.backend,
                site: key.site as u8,
                _pad: [0; 5],
                peer: pend.peer,
            });
            e.submit(submit_flags());
        }
        None => bump(counter::XFER_EVENT_DROPPED),
    }
}

#[inline(always)]
fn read_args(ctx: &ProbeContext) -> Option<ReadProbeArgs> {
    let p: *const ReadProbeArgs = ctx.arg(0)?;
    match unsafe { bpf_probe_read_user(p) } {
        Ok(a) => Some(a),
        Err(_) => {
            bump(counter::READ_FAILED);
            None
        }
    }
}

/// Slot of (tgid, xfer_id) in `KV_START`: Fibonacci hashing, top bits.
#[inline(always)]
fn kv_slot(tgid: u32, xfer_id: u64) -> u32 {
    let h = (xfer_id ^ ((tgid as u64) << 40)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (h >> (64 - KV_SLOTS_LOG2)) as u32
}

/// uprobe at `kvloop_probe_read_post(const ReadProbeArgs *args, u64 xfer_id)`:
/// records the post time of (tgid, `xfer_id`); `xfer_id` comes in the second
/// argument register, so the post reads no user memory.
#[uprobe]
pub fn kvloop_read_post(ctx: ProbeContext) -> u32 {
    let Some(cfg) = config() else { return 0 };
    if cfg.enabled & enable::XFER == 0 {
        return 0;
    }
    let start_ns = unsafe { bpf_ktime_get_ns() };
    let Some(xfer_id) = ctx.arg::<u64>(1) else {
        return 0;
    };
    let me = tgid();
    if let Some(slot) = KV_START.get_ptr_mut(kv_slot(me, xfer_id)) {
        unsafe {
            (*slot).tgid = me;
            (*slot).xfer_id = xfer_id;
            (*slot).start_ns = start_ns;
        }
    }
    0
}

/// uprobe at `kvloop_probe_read_done(const ReadProbeArgs *)`.
#[uprobe]
pub fn kvloop_read_done(ctx: ProbeContext) -> u32 {
    let Some(cfg) = config() else { return 0 };
    if cfg.enabled & enable::XFER == 0 {
        return 0;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(a) = read_args(&ctx) else { return 0 };
    let key = PendingKey {
        tgid: tgid(),
        site: site::KVLOOP as u32,
        id: a.xfer_id,
    };
    let Some(slot) = KV_START.get_ptr_mut(kv_slot(key.tgid, a.xfer_id)) else {
        return 0;
    };
    let start_ns = unsafe {
        if (*slot).tgid != key.tgid || (*slot).xfer_id != a.xfer_id || (*slot).start_ns == 0 {
            bump(counter::XFER_DONE_UNMATCHED);
            return 0;
        }
        let t = (*slot).start_ns;
        (*slot).start_ns = 0;
        t
    };
    let pend = PendingXfer {
        start_ns,
        bytes: a.bytes,
        descriptors: a.descriptors,
        direction: a.direction,
        backend: a.backend,
        _pad: [0; 2],
        peer: a.peer,
    };
    xfer_finish(&key, &pend, a.status as i32, now);
    0
}

/// Empty program for calibration: attached to the USDT sites by the
/// benchmark to measure the uprobe mechanism's own cost on this machine.
#[uprobe]
pub fn kvloop_noop(_ctx: ProbeContext) -> u32 {
    0
}

/// NIXL status values (`nixl_status_t`): 0 success, 1 in progress, < 0 error.
const NIXL_IN_PROG: i32 = 1;

/// uprobe at `nixlAgent::createXferReq(this, const nixl_xfer_op_t &op,
/// const nixl_xfer_dlist_t &local, const nixl_xfer_dlist_t &remote,
/// const std::string &remote_agent, nixlXferReqH *&req_hndl, const nixl_opt_args_t *)`.
#[uprobe]
pub fn nixl_create_enter(ctx: ProbeContext) -> u32 {
    let Some(cfg) = config() else { return 0 };
    if cfg.enabled & enable::XFER == 0 {
        return 0;
    }
    let op: u64 = ctx.arg(1).unwrap_or(0);
    let remote_agent: u64 = ctx.arg(4).unwrap_or(0);
    let req: u64 = ctx.arg(5).unwrap_or(0);
    let args = NixlCallArgs {
        req,
        remote_agent,
        op,
    };
    let _ = NIXL_CALLS.insert(bpf_get_current_pid_tgid(), args, 0);
    0
}

/// uretprobe of `nixlAgent::createXferReq`: on success, remembers the peer
/// name and operation of the new request handle.
#[uretprobe]
pub fn nixl_create_exit(ctx: RetProbeContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let Some(p) = NIXL_CALLS.get_ptr(id) else {
        return 0;
    };
    let args = unsafe { *p };
    let _ = NIXL_CALLS.remove(id);
    let ret: i32 = ctx.ret();
    if ret != 0 {
        return 0;
    }
    let Ok(handle) = (unsafe { bpf_probe_read_user(args.req as *const u64) }) else {
        bump(counter::READ_FAILED);
        return 0;
    };
    let op: u32 = unsafe { bpf_probe_read_user(args.op as *const u32) }.unwrap_or(0);
    // libstdc++ (cxx11 ABI) std::string: { char *data; size_t len; ... }
    let data: u64 = unsafe { bpf_probe_read_user(args.remote_agent as *const u64) }.unwrap_or(0);
    let len: u64 =
        unsafe { bpf_probe_read_user((args.remote_agent + 8) as *const u64) }.unwrap_or(0);
    let mut info = NixlReqInfo {
        peer: [0; PEER_LEN],
        op,
        _pad: 0,
    };
    if data != 0 && len > 0 {
        let n = if len > PEER_LEN as u64 {
            PEER_LEN as u32
        } else {
            len as u32
        };
        if n > 0 && n <= PEER_LEN as u32 {
            unsafe { raw_read_user(info.peer.as_mut_ptr() as *mut _, n, data as *const _) };
        }
    }
    let _ = NIXL_REQS.insert(handle, info, 0);
    0
}

#[inline(always)]
fn nixl_remember_req(ctx: &ProbeContext) -> Option<u64> {
    let req: u64 = ctx.arg(1)?;
    let args = NixlCallArgs {
        req,
        remote_agent: 0,
        op: 0,
    };
    let _ = NIXL_CALLS.insert(bpf_get_current_pid_tgid(), args, 0);
    Some(req)
}

#[inline(always)]
fn nixl_key(req: u64) -> PendingKey {
    PendingKey {
        tgid: tgid(),
        site: site::NIXL_LIB as u32,
        id: req,
    }
}

/// uprobe at `nixlAgent::postXferReq(this, nixlXferReqH *req, const nixl_opt_args_t *)`:
/// the READ (or WRITE) starts.
#[uprobe]
pub fn nixl_post_enter(ctx: ProbeContext) -> u32 {
    let Some(cfg) = config() else { return 0 };
    if cfg.enabled & enable::XFER == 0 {
        return 0;
    }
    let start_ns = unsafe { bpf_ktime_get_ns() };
    let Some(req) = nixl_remember_req(&ctx) else {
        return 0;
    };
    let mut v = PendingXfer {
        start_ns,
        bytes: 0,
        descriptors: 0,
        direction: Direction::Unknown as u8,
        backend: BackendKind::Nixl as u8,
        _pad: [0; 2],
        peer: [0; PEER_LEN],
    };
    if let Some(info) = NIXL_REQS.get_ptr(req) {
        v.peer = unsafe { (*info).peer };
    }
    xfer_begin(&nixl_key(req), &v);
    0
}

#[inline(always)]
fn nixl_ret(ctx: &RetProbeContext) {
    let id = bpf_get_current_pid_tgid();
    let Some(p) = NIXL_CALLS.get_ptr(id) else {
        return;
    };
    let req = unsafe { (*p).req };
    let _ = NIXL_CALLS.remove(id);
    let ret: i32 = ctx.ret();
    if ret == NIXL_IN_PROG {
        return;
    }
    let key = nixl_key(req);
    if PENDING.get_ptr(key).is_none() {
        // getXferStatus on a request posted before we attached, or polled
        // again after completion.
        return;
    }
    xfer_end(&key, ret);
}

/// uretprobe of `nixlAgent::postXferReq`: NIXL_SUCCESS (0) means the transfer
/// completed inside the post; < 0 is an error; 1 (in progress) waits for
/// `getXferStatus`.
#[uretprobe]
pub fn nixl_post_exit(ctx: RetProbeContext) -> u32 {
    nixl_ret(&ctx);
    0
}

/// uprobe at `nixlAgent::getXferStatus(this, nixlXferReqH *req)`.
#[uprobe]
pub fn nixl_status_enter(ctx: ProbeContext) -> u32 {
    let Some(cfg) = config() else { return 0 };
    if cfg.enabled & enable::XFER == 0 {
        return 0;
    }
    let _ = nixl_remember_req(&ctx);
    0
}

/// uretprobe of `nixlAgent::getXferStatus`: the first status other than
/// "in progress" completes the READ.
#[uretprobe]
pub fn nixl_status_exit(ctx: RetProbeContext) -> u32 {
    nixl_ret(&ctx);
    0
}

// ---------------------------------------------------------------------------
// Prefill probes
// ---------------------------------------------------------------------------

const IPPROTO_TCP: u16 = 6;
const MSG_PEEK: i32 = 2;

#[inline(always)]
fn tp_u32(ctx: &TracePointContext, off: u32) -> Option<u32> {
    unsafe { ctx.read_at::<u32>(off as usize).ok() }
}

#[inline(always)]
fn tp_u64(ctx: &TracePointContext, off: u32) -> Option<u64> {
    unsafe { ctx.read_at::<u64>(off as usize).ok() }
}

#[inline(always)]
fn tp_u16(ctx: &TracePointContext, off: u32) -> Option<u16> {
    unsafe { ctx.read_at::<u16>(off as usize).ok() }
}

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
    let now = unsafe { bpf_ktime_get_ns() };
    let dport: u16 =
        unsafe { bpf_probe_read_kernel((sk + cfg.skc_dport_off as u64) as *const u16) }
            .unwrap_or(0);
    let daddr: u32 =
        unsafe { bpf_probe_read_kernel((sk + cfg.skc_daddr_off as u64) as *const u32) }
            .unwrap_or(0);
    let s = SCRATCH.get_ptr_mut(0)?;
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
    let now = unsafe { bpf_ktime_get_ns() };
    let start = unsafe { (*p).start_ns };
    let port = unsafe { (*p).port };
    let ns = now.saturating_sub(start);
    hist_add(&PREFILL_HIST, &PrefillHistKey { port, _pad: [0; 6] }, ns, 0);
    bump(counter::PREFILL_SAMPLES);
    match EVENTS.reserve::<PrefillEvent>(0) {
        Some(mut e) => {
            let ep = e.as_mut_ptr();
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
    let sk = unsafe { *sk };
    let _ = CAPTURE.remove(id);
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
    let rc = unsafe { raw_read_user((*inf).head.as_mut_ptr() as *mut _, n, buf as *const _) };
    if rc == 0 {
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

// ---------------------------------------------------------------------------
// Network probes
// ---------------------------------------------------------------------------

/// `tcp:tcp_retransmit_skb`: count retransmits per peer (address, port).
#[tracepoint(category = "tcp", name = "tcp_retransmit_skb")]
pub fn tcp_retransmit(ctx: TracePointContext) -> u32 {
    let _ = try_tcp_retransmit(&ctx);
    0
}

#[inline(always)]
fn try_tcp_retransmit(ctx: &TracePointContext) -> Option<()> {
    let cfg = config()?;
    if cfg.enabled & enable::RETRANSMIT == 0 {
        return None;
    }
    let family = tp_u16(ctx, cfg.rt_family_off)?;
    let dport = tp_u16(ctx, cfg.rt_dport_off)?;
    let mut key = RetransmitKey {
        family,
        dport,
        _pad: 0,
        daddr: [0; 16],
    };
    if family == 10 {
        key.daddr = unsafe { ctx.read_at::<[u8; 16]>(cfg.rt_daddr_v6_off as usize) }.ok()?;
    } else {
        let a = unsafe { ctx.read_at::<[u8; 4]>(cfg.rt_daddr_off as usize) }.ok()?;
        key.daddr[0] = a[0];
        key.daddr[1] = a[1];
        key.daddr[2] = a[2];
        key.daddr[3] = a[3];
    }
    match RETRANSMITS.get_ptr_mut(key) {
        Some(c) => unsafe { *c += 1 },
        None => {
            let _ = RETRANSMITS.insert(key, 1u64, 0);
        }
    }
    bump(counter::RETRANSMITS);
    if let Some(mut e) = EVENTS.reserve::<RetransmitEvent>(0) {
        e.write(RetransmitEvent {
            kind: event_kind::RETRANSMIT,
            _pad: 0,
            ts_ns: unsafe { bpf_ktime_get_ns() },
            key,
        });
        e.submit(submit_flags());
    } else {
        bump(counter::RETRANSMIT_EVENT_DROPPED);
    }
    Some(())
}

#[allow(dead_code)]
fn _unused(ctx: &ProbeContext) -> *mut core::ffi::c_void {
    ctx.as_ptr()
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
