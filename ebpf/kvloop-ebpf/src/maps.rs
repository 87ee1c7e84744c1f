//! Maps and helpers shared by every probe family: the configuration the
//! loader writes, per-CPU counters, the event ring buffer and latency
//! histograms, tracepoint field readers.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::map,
    maps::{Array, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::TracePointContext,
};
use kvloop_common::{LAT_SLOTS, LatencyHist, ProbeConfig, counter, lat_slot};

#[map]
pub static CONFIG: Array<ProbeConfig> = Array::with_max_entries(1, 0);

#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 20, 0);

static ZERO_HIST: LatencyHist = LatencyHist::ZERO;

/// Ring-buffer notification policy: wake the reader only once this many
/// bytes are pending; below that the reader's periodic poll (every
/// `kvloop_probes::DRAIN_INTERVAL`) picks events up. A wakeup per event costs
/// an irq_work and a context switch, several µs per READ on a busy node.
const WAKEUP_BYTES: u64 = 256 * 1024;
const BPF_RB_AVAIL_DATA: u64 = 0;
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;

/// Flags for `RingBufEntry::submit` under the policy above.
#[inline(always)]
pub fn submit_flags() -> u64 {
    if EVENTS.query(BPF_RB_AVAIL_DATA) >= WAKEUP_BYTES {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

/// The loader's configuration (None before it wrote it).
#[inline(always)]
pub fn config() -> Option<&'static ProbeConfig> {
    CONFIG.get(0)
}

/// Adds one to counter `idx` (`kvloop_common::counter`) on this CPU.
#[inline(always)]
pub fn bump(idx: u32) {
    if let Some(p) = COUNTERS.get_ptr_mut(idx) {
        // SAFETY: `p` points at this CPU's slot of a per-CPU array, valid for
        // the whole program run; BPF programs run with migration disabled, so
        // no other writer touches this slot meanwhile.
        unsafe { *p += 1 };
    }
}

/// Process id (tgid) of the current task.
#[inline(always)]
pub fn tgid() -> u32 {
    (bpf_get_current_pid_tgid() >> 32) as u32
}

/// Adds one sample of `ns` (and `bytes`) to the histogram of `key` in `map`,
/// creating it if needed (counted in `HIST_FULL` when the map is full).
#[inline(always)]
pub fn hist_add<K>(map: &PerCpuHashMap<K, LatencyHist>, key: &K, ns: u64, bytes: u64, weight: u64) {
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
        // SAFETY: `h` points at this CPU's value of a per-CPU hash map entry,
        // valid for the program run (an entry deleted concurrently stays
        // allocated until an RCU grace period after the program ends); the
        // slot index is bounds-checked.
        unsafe {
            if slot < LAT_SLOTS {
                (*h).slots[slot] += weight;
            }
            (*h).count += weight;
            (*h).sum_ns += ns * weight;
            (*h).sum_bytes += bytes * weight;
        }
    }
}

/// The `u32` at byte `off` of a tracepoint record.
#[inline(always)]
pub fn tp_u32(ctx: &TracePointContext, off: u32) -> Option<u32> {
    // SAFETY: read_at copies through bpf_probe_read_kernel, which handles
    // faults (an error, read as None); `off` is the field's offset in the
    // tracepoint's format file (the loader checked it); any bits are valid.
    unsafe { ctx.read_at::<u32>(off as usize).ok() }
}

/// The `u64` at byte `off` of a tracepoint record.
#[inline(always)]
pub fn tp_u64(ctx: &TracePointContext, off: u32) -> Option<u64> {
    // SAFETY: as in `tp_u32`.
    unsafe { ctx.read_at::<u64>(off as usize).ok() }
}

/// The `u16` at byte `off` of a tracepoint record.
#[inline(always)]
pub fn tp_u16(ctx: &TracePointContext, off: u32) -> Option<u16> {
    // SAFETY: as in `tp_u32`.
    unsafe { ctx.read_at::<u16>(off as usize).ok() }
}
