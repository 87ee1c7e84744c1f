//! NIXL: uprobes and uretprobes on `nixlAgent::createXferReq`,
//! `postXferReq` and `getXferStatus` in `libnixl.so`. A transfer starts at
//! the post and ends at the first status other than "in progress" (the
//! post's own return or a later `getXferStatus`).
//!
//! At the post the request handle (`nixlXferReqH`) gives the transfer's
//! operation (READ/WRITE), its local descriptors (count and bytes) and the
//! remote agent's name, whichever call made the handle (`createXferReq`, or
//! `makeXferReq` from prepared lists as vLLM's NIXL connector does).
//! The descriptors are those NIXL posts to the backend, after it merged
//! contiguous ones (the count NIXL's own telemetry, `descCount`, reports).
//!
//! Layout of `nixlXferReqH` (NIXL `src/core/transfer_request.h`) in the
//! NIXL 1.5.1 builds kvloop and vLLM use (`nixl-cu12` and `nixl-cu13` 1.5.1
//! wheels, x86-64, libstdc++): `engine` at 0x00, `backendHandle` 0x08,
//! `initiatorDescs` (a `nixlDescList<nixlMetaDesc>`: vtable pointer, `type`,
//! then the `std::vector`'s begin/end/capacity) at 0x10 with the vector at
//! 0x20/0x28, `targetDescs` at 0x38, `remoteAgent` (`std::string`, cxx11 ABI:
//! data pointer, then length) at 0x60, `backendOp` (`nixl_xfer_op_t`) at
//! 0xb4. `nixlMetaDesc` is `nixlBasicDesc` {addr, len, devId: 8 bytes each}
//! plus a metadata pointer: 32 bytes, `len` at 8. Checked against the
//! wheels' `libnixl.so` (`nixlAgent::postXferReq` hands `&req->backendOp`,
//! `req + 0x10`, `req + 0x38`, `req + 0x60` and `req + 0x08` to the backend;
//! `createXferReq` counts `(*(req + 0x28) - *(req + 0x20)) >> 5`
//! descriptors); `ebpf/probes/tests/probes.rs` checks the values end to end.
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
    BackendKind, Direction, NixlCallArgs, NixlReqInfo, PEER_LEN, PendingKey, PendingXfer, XferOp,
    counter, enable, site,
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

/// Offsets in `nixlXferReqH` (module docs): the initiator descriptors'
/// vector (begin, end pointers).
const REQ_DESCS_BEGIN: u64 = 0x20;
const REQ_DESCS_END: u64 = 0x28;
/// `remoteAgent` (`std::string`: data pointer, then length).
const REQ_REMOTE_AGENT: u64 = 0x60;
/// `backendOp` (`nixl_xfer_op_t`, 4 bytes).
const REQ_BACKEND_OP: u64 = 0xb4;
/// `sizeof(nixlMetaDesc)` and the offset of its `len`.
const META_DESC_SIZE: u64 = 32;
const META_DESC_LEN: u64 = 8;
/// Descriptors whose lengths are summed one by one (a bounded loop for the
/// verifier); beyond this the byte count is extrapolated from the mean
/// length of these (KV descriptors of one transfer have equal lengths).
const MAX_SUMMED_DESCS: u64 = 512;
/// More descriptors than this in one request, or a vector whose size is not
/// a multiple of `META_DESC_SIZE`, means the handle was not read right (a
/// layout NIXL no longer has): no bytes or descriptors are reported.
const MAX_PLAUSIBLE_DESCS: u64 = 1 << 24;

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
    xfer_finish(key, &pend, status, now, 1);
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
        op: XferOp::Unknown as u8,
        _pad: [0; 1],
        peer: [0; PEER_LEN],
    };
    if let Some(info) = NIXL_REQS.get_ptr(req) {
        // SAFETY: map value pointer, valid for this run; a byte array.
        v.peer = unsafe { (*info).peer };
    }
    read_request(req, &mut v);
    xfer_begin(&nixl_key(req), &v);
    0
}

/// Reads the operation, descriptor count, bytes and remote agent name of
/// the request handle at `req` (layout in the module docs) into `v`; fields
/// it cannot read stay as they are.
#[inline(always)]
fn read_request(req: u64, v: &mut PendingXfer) {
    // SAFETY (every read below): bpf_probe_read_user reads any user address
    // with fault handling (an unmapped one is an error, left unread); the
    // values are plain integers, any bits are valid.
    // SAFETY: see above.
    if let Ok(op) = unsafe { bpf_probe_read_user((req + REQ_BACKEND_OP) as *const u32) } {
        v.op = XferOp::from_nixl(op) as u8;
    }
    // SAFETY: see above.
    let begin = unsafe { bpf_probe_read_user((req + REQ_DESCS_BEGIN) as *const u64) }.unwrap_or(0);
    // SAFETY: see above.
    let end = unsafe { bpf_probe_read_user((req + REQ_DESCS_END) as *const u64) }.unwrap_or(0);
    if begin != 0 && end >= begin && (end - begin) % META_DESC_SIZE == 0 {
        let count = (end - begin) / META_DESC_SIZE;
        if count <= MAX_PLAUSIBLE_DESCS {
            let summed = if count < MAX_SUMMED_DESCS {
                count
            } else {
                MAX_SUMMED_DESCS
            };
            let mut bytes = 0u64;
            let mut read = 0u64;
            let mut i = 0u64;
            while i < MAX_SUMMED_DESCS {
                if i >= summed {
                    break;
                }
                let at = begin + i * META_DESC_SIZE + META_DESC_LEN;
                // SAFETY: see above.
                match unsafe { bpf_probe_read_user(at as *const u64) } {
                    Ok(len) => bytes = bytes.wrapping_add(len),
                    Err(_) => break,
                }
                read += 1;
                i += 1;
            }
            if read == summed {
                if count > summed && summed > 0 {
                    bytes = bytes / summed * count;
                }
                v.bytes = bytes;
                v.descriptors = count as u32;
            } else {
                bump(counter::READ_FAILED);
            }
        }
    }
    // libstdc++ (cxx11 ABI) std::string: { char *data; size_t len; ... }
    // SAFETY: see above.
    let data = unsafe { bpf_probe_read_user((req + REQ_REMOTE_AGENT) as *const u64) }.unwrap_or(0);
    // SAFETY: see above.
    let len =
        unsafe { bpf_probe_read_user((req + REQ_REMOTE_AGENT + 8) as *const u64) }.unwrap_or(0);
    if data != 0 && len > 0 {
        let n = if len > PEER_LEN as u64 {
            PEER_LEN as u32
        } else {
            len as u32
        };
        if n > 0 && n <= PEER_LEN as u32 {
            let mut peer = [0u8; PEER_LEN];
            // SAFETY: the helper writes at most `n` <= PEER_LEN bytes into
            // `peer` (PEER_LEN bytes) and reads the user string with fault
            // handling.
            let rc = unsafe { raw_read_user(peer.as_mut_ptr() as *mut _, n, data as *const _) };
            if rc == 0 {
                v.peer = peer;
            }
        }
    }
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
