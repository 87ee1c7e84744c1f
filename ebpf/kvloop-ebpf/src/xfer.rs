//! A completed transfer (from the READ sites or NIXL): its latency
//! histogram, always, and its event, sampled.
use aya_ebpf::{macros::map, maps::PerCpuHashMap};
use kvloop_common::{
    LatencyHist, PendingKey, PendingXfer, SIZE_CLASS_UNKNOWN, XferEvent, XferHistKey, counter,
    event_kind, site, size_class,
};

use crate::maps::{COUNTERS, EVENTS, bump, config, hist_add, submit_flags};

#[map]
static XFER_HIST: PerCpuHashMap<XferHistKey, LatencyHist> =
    PerCpuHashMap::with_max_entries(4096, 0);

/// Records a completed READ: histogram (always, counted `weight` times: the
/// READs a sampled site call stands for), event (sampled).
#[inline(always)]
pub fn xfer_finish(key: &PendingKey, pend: &PendingXfer, status: i32, now: u64, weight: u32) {
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
    hist_add(&XFER_HIST, &hkey, ns, pend.bytes, weight.max(1) as u64);
    bump(counter::XFER_SAMPLES);

    let every = cfg.xfer_sample_every;
    if every > 1 {
        // per-CPU sample counter in the reserved counter slot
        let mut take = false;
        if let Some(c) = COUNTERS.get_ptr_mut(counter::COUNT - 1) {
            // SAFETY: this CPU's slot of a per-CPU array, valid for the run,
            // no concurrent writer (migration disabled).
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
                op: pend.op,
                _pad: [0; 4],
                peer: pend.peer,
            });
            e.submit(submit_flags());
        }
        None => bump(counter::XFER_EVENT_DROPPED),
    }
}
