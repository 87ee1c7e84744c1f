//! READ sites: uprobes on `kvloop_probe_read_post` / `kvloop_probe_read_done`,
//! the two no-op functions kvloop's dataplane calls around every READ
//! (`ebpf/common/src/usdt.rs`, called from `dataplane/src/engine.rs`), in
//! any binary that links it.
use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user},
    macros::{map, uprobe},
    maps::Array,
    programs::ProbeContext,
};
use kvloop_common::{
    KV_SLOTS, KV_SLOTS_LOG2, KvSlot, PendingKey, PendingXfer, ReadProbeArgs, XferOp, counter,
    enable, site,
};

use crate::maps::{bump, config, tgid};
use crate::xfer::xfer_finish;

/// kvloop sites: post time of READs in flight in a direct-mapped table
/// indexed by a hash of (tgid, xfer_id); `read_done` carries every other
/// field. An array slot costs a few ns where a hash-map insert costs
/// ~300 ns on this VM (measured with BPF run-time stats). A slot reused by
/// another READ before the first completes makes that first completion
/// "unmatched" (counted); stale slots of dead processes are simply
/// overwritten.
#[map]
static KV_START: Array<KvSlot> = Array::with_max_entries(KV_SLOTS, 0);

#[inline(always)]
fn read_args(ctx: &ProbeContext) -> Option<ReadProbeArgs> {
    let p: *const ReadProbeArgs = ctx.arg(0)?;
    // SAFETY: bpf_probe_read_user copies from any user address with fault
    // handling (an unmapped address returns an error, read as None);
    // ReadProbeArgs is plain old data, every bit pattern is valid.
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
    // SAFETY: BPF helper without preconditions.
    let start_ns = unsafe { bpf_ktime_get_ns() };
    let Some(xfer_id) = ctx.arg::<u64>(1) else {
        return 0;
    };
    let me = tgid();
    if let Some(slot) = KV_START.get_ptr_mut(kv_slot(me, xfer_id)) {
        // SAFETY: `slot` points into the array map, valid for the program's
        // life. Another CPU may write the same slot at once (two READs
        // hashing alike): the fields are plain integers, and `read_done`
        // checks tgid and xfer_id, so a mix is at worst an unmatched
        // completion, never unsound.
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
    // SAFETY: BPF helper without preconditions.
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
    // SAFETY: `slot` points into the array map (valid for the program's
    // life); concurrent writers only store plain integers (see read_post).
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
        op: XferOp::Unknown as u8,
        _pad: [0; 1],
        peer: a.peer,
    };
    xfer_finish(&key, &pend, a.status as i32, now, a.weight);
    0
}

/// Empty program for calibration: attached to the USDT sites by the
/// benchmark to measure the uprobe mechanism's own cost on this machine.
#[uprobe]
pub fn kvloop_noop(_ctx: ProbeContext) -> u32 {
    0
}
