//! NIXL: uprobes and uretprobes on `nixlAgent::createXferReq`,
//! `postXferReq` and `getXferStatus` in `libnixl.so`. A transfer starts at
//! the post and ends at the first status other than "in progress" (the
//! post's own return or a later `getXferStatus`).
use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
        generated::bpf_probe_read_user as raw_read_user,
    },
    macros::{map, uprobe, uretprobe},
    maps::LruHashMap,
    programs::{ProbeContext, RetProbeContext},
};
use kvloop_common::{
    BackendKind, Direction, NixlCallArgs, NixlReqInfo, PEER_LEN, PendingKey, PendingXfer, counter,
    enable, site,
};

use crate::maps::{bump, config, tgid};
use crate::xfer::xfer_finish;

/// Transfers posted and not yet completed, by (tgid, site, request handle).
#[map]
static PENDING: LruHashMap<PendingKey, PendingXfer> = LruHashMap::with_max_entries(65536, 0);

/// NIXL: arguments of calls in progress (uprobe → uretprobe), by pid_tgid.
#[map]
static NIXL_CALLS: LruHashMap<u64, NixlCallArgs> = LruHashMap::with_max_entries(16384, 0);

/// NIXL: what `createXferReq` told us about a request handle.
#[map]
static NIXL_REQS: LruHashMap<u64, NixlReqInfo> = LruHashMap::with_max_entries(65536, 0);

/// NIXL status values (`nixl_status_t`): 0 success, 1 in progress, < 0 error.
const NIXL_IN_PROG: i32 = 1;

#[inline(always)]
fn xfer_begin(key: &PendingKey, v: &PendingXfer) {
    if PENDING.insert(key, v, 0).is_err() {
        bump(counter::XFER_PENDING_FULL);
    }
}

/// Completes a pending NIXL transfer: looks it up, then [`xfer_finish`].
#[inline(always)]
fn xfer_end(key: &PendingKey, status: i32) {
    // SAFETY: BPF helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(p) = PENDING.get_ptr(key) else {
        bump(counter::XFER_DONE_UNMATCHED);
        return;
    };
    // SAFETY: map value pointer, valid for this run (deletion is
    // RCU-deferred); PendingXfer is plain old data, copied before removal.
    let pend = unsafe { *p };
    let _ = PENDING.remove(key);
    xfer_finish(key, &pend, status, now);
}

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
    // SAFETY: map value pointer, valid for this run; plain old data.
    let args = unsafe { *p };
    let _ = NIXL_CALLS.remove(id);
    let ret: i32 = ctx.ret();
    if ret != 0 {
        return 0;
    }
    // SAFETY: bpf_probe_read_user reads any user address with fault handling.
    let Ok(handle) = (unsafe { bpf_probe_read_user(args.req as *const u64) }) else {
        bump(counter::READ_FAILED);
        return 0;
    };
    // SAFETY: as above.
    let op: u32 = unsafe { bpf_probe_read_user(args.op as *const u32) }.unwrap_or(0);
    // libstdc++ (cxx11 ABI) std::string: { char *data; size_t len; ... }
    // SAFETY: as above.
    let data: u64 = unsafe { bpf_probe_read_user(args.remote_agent as *const u64) }.unwrap_or(0);
    // SAFETY: as above.
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
            // SAFETY: the helper writes at most `n` <= PEER_LEN bytes into
            // `info.peer` (PEER_LEN bytes on this stack) and reads the user
            // string with fault handling.
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
    // SAFETY: BPF helper without preconditions.
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
        // SAFETY: map value pointer, valid for this run; a byte array.
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
    // SAFETY: map value pointer, valid for this run; a plain u64.
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
