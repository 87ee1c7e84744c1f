//! TCP: retransmits counted per peer (address, port), from the
//! `tcp:tcp_retransmit_skb` tracepoint.
use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::{map, tracepoint},
    maps::PerCpuHashMap,
    programs::TracePointContext,
};
use kvloop_common::{RetransmitEvent, RetransmitKey, counter, enable, event_kind};

use crate::maps::{EVENTS, bump, config, submit_flags, tp_u16};

#[map]
static RETRANSMITS: PerCpuHashMap<RetransmitKey, u64> = PerCpuHashMap::with_max_entries(4096, 0);

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
        // SAFETY: read_at copies from the tracepoint record through
        // bpf_probe_read_kernel (faults return an error); the offset is the
        // field's in the tracepoint's format file; any bytes are valid.
        key.daddr = unsafe { ctx.read_at::<[u8; 16]>(cfg.rt_daddr_v6_off as usize) }.ok()?;
    } else {
        // SAFETY: as above, for the IPv4 address field.
        let a = unsafe { ctx.read_at::<[u8; 4]>(cfg.rt_daddr_off as usize) }.ok()?;
        key.daddr[0] = a[0];
        key.daddr[1] = a[1];
        key.daddr[2] = a[2];
        key.daddr[3] = a[3];
    }
    match RETRANSMITS.get_ptr_mut(key) {
        // SAFETY: this CPU's value of a per-CPU hash entry, valid for the run
        // (deletion is RCU-deferred), no concurrent writer on this CPU.
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
            // SAFETY: BPF helper without preconditions.
            ts_ns: unsafe { bpf_ktime_get_ns() },
            key,
        });
        e.submit(submit_flags());
    } else {
        bump(counter::RETRANSMIT_EVENT_DROPPED);
    }
    Some(())
}
