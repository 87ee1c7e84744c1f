//! Map keys, map values, ring-buffer events and the configuration struct shared
//! by the eBPF programs (`ebpf/kvloop-ebpf`) and the loader (`ebpf/probes`).
//!
//! All structs are `#[repr(C)]` with explicit padding fields so that the
//! kernel and user space agree byte for byte; layouts are checked in tests.

use crate::PEER_LEN;

/// Number of log2 latency slots in a [`LatencyHist`]. Slot `i` counts samples
/// with `2^i <= latency_ns < 2^(i+1)` (slot 0 also holds 0 ns); the last slot
/// holds everything above (`2^39` ns ≈ 9.2 min). Same scheme as bcc's
/// `funclatency` (`bpf_log2l`).
pub const LAT_SLOTS: usize = 40;

/// Bytes of a prefill request's head captured from the receive buffer and sent
/// with the prefill event, so that user space can read the
/// `X-KVLoop-Tokens` header. Power of two (the eBPF side masks with it).
pub const PREFILL_HEAD_LEN: usize = 512;

/// Maximum number of prefill ports the kernel filters on.
pub const MAX_PREFILL_PORTS: u32 = 16;

/// Where a transfer sample was measured.
pub mod site {
    /// kvloop dataplane USDT sites (`kvloop_probe_read_post` / `_done`).
    pub const KVLOOP: u8 = 1;
    /// NIXL library (`nixlAgent::postXferReq` → `getXferStatus`) in `libnixl.so`.
    pub const NIXL_LIB: u8 = 2;
    /// User-space timing of the agent's own transfers (eBPF unavailable).
    pub const USERSPACE: u8 = 3;

    /// Label used in metrics: `kvloop`, `nixl`, `userspace`, `unknown`.
    pub const fn label(site: u8) -> &'static str {
        match site {
            KVLOOP => "kvloop",
            NIXL_LIB => "nixl",
            USERSPACE => "userspace",
            _ => "unknown",
        }
    }
}

/// Event kinds in the ring buffer (first `u32` of every event).
pub mod event_kind {
    /// [`super::XferEvent`].
    pub const XFER: u32 = 1;
    /// [`super::PrefillEvent`].
    pub const PREFILL: u32 = 2;
    /// [`super::RetransmitEvent`].
    pub const RETRANSMIT: u32 = 3;
}

/// Indices of the per-CPU counters in the `COUNTERS` map.
pub mod counter {
    /// A transfer event could not be reserved in the ring buffer (full).
    pub const XFER_EVENT_DROPPED: u32 = 0;
    /// A prefill event could not be reserved in the ring buffer (full).
    pub const PREFILL_EVENT_DROPPED: u32 = 1;
    /// A retransmit event could not be reserved in the ring buffer (full).
    pub const RETRANSMIT_EVENT_DROPPED: u32 = 2;
    /// A READ post could not be recorded (pending map full).
    pub const XFER_PENDING_FULL: u32 = 3;
    /// A READ done arrived with no matching post (attached mid-READ, or evicted).
    pub const XFER_DONE_UNMATCHED: u32 = 4;
    /// A histogram slot could not be created (histogram map full).
    pub const HIST_FULL: u32 = 5;
    /// A probe read of user or kernel memory failed.
    pub const READ_FAILED: u32 = 6;
    /// Transfer samples (all, sampled or not).
    pub const XFER_SAMPLES: u32 = 7;
    /// Prefill samples.
    pub const PREFILL_SAMPLES: u32 = 8;
    /// TCP retransmits seen.
    pub const RETRANSMITS: u32 = 9;
    /// Prefill requests whose head bytes could not be captured.
    pub const PREFILL_HEAD_MISSED: u32 = 10;
    /// Number of counters.
    pub const COUNT: u32 = 12;
    /// Names used in metrics, by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "xfer_event_dropped",
        "prefill_event_dropped",
        "retransmit_event_dropped",
        "xfer_pending_full",
        "xfer_done_unmatched",
        "hist_full",
        "read_failed",
        "xfer_samples",
        "prefill_samples",
        "retransmits",
        "prefill_head_missed",
        "reserved",
    ];
}

/// Bit flags in [`ProbeConfig::enabled`].
pub mod enable {
    /// Transfer probes (kvloop sites and NIXL library).
    pub const XFER: u32 = 1;
    /// Prefill socket probes.
    pub const PREFILL: u32 = 2;
    /// TCP retransmit probe.
    pub const RETRANSMIT: u32 = 4;
}

/// Configuration written by the loader into the `CONFIG` array (index 0)
/// before any program is attached. Tracepoint field offsets come from
/// `/sys/kernel/tracing/events/<category>/<name>/format`, `struct sock_common`
/// offsets from BTF (`/sys/kernel/btf/vmlinux`); nothing is hard-coded.
/// All offsets are in bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeConfig {
    /// Bit set of [`enable`] flags; 0 disables every program.
    pub enabled: u32,
    /// Emit one transfer event out of every `xfer_sample_every` (1 = all).
    pub xfer_sample_every: u32,
    /// `sock:sock_{recv,send}_length`: offset of `sk` (pointer).
    pub sock_sk_off: u32,
    /// `sock:sock_{recv,send}_length`: offset of `protocol` (u16).
    pub sock_protocol_off: u32,
    /// `sock:sock_{recv,send}_length`: offset of `ret` (i32, bytes or -errno).
    pub sock_ret_off: u32,
    /// `sock:sock_{recv,send}_length`: offset of `flags` (i32, MSG_*).
    pub sock_flags_off: u32,
    /// `struct sock_common.skc_num` (u16, local port, host order), from BTF.
    pub skc_num_off: u32,
    /// `struct sock_common.skc_dport` (u16, peer port, network order), from BTF.
    pub skc_dport_off: u32,
    /// `struct sock_common.skc_daddr` (u32, IPv4 peer, network order), from BTF.
    pub skc_daddr_off: u32,
    /// `syscalls:sys_enter_read`: offset of `buf`.
    pub sys_read_buf_off: u32,
    /// `syscalls:sys_enter_recvfrom`: offset of `ubuf`.
    pub sys_recvfrom_buf_off: u32,
    /// `syscalls:sys_exit_{read,recvfrom}`: offset of `ret` (i64).
    pub sys_exit_ret_off: u32,
    /// `tcp:tcp_retransmit_skb`: offset of `family` (u16).
    pub rt_family_off: u32,
    /// `tcp:tcp_retransmit_skb`: offset of `dport` (u16, host order).
    pub rt_dport_off: u32,
    /// `tcp:tcp_retransmit_skb`: offset of `daddr` ([u8; 4]).
    pub rt_daddr_off: u32,
    /// `tcp:tcp_retransmit_skb`: offset of `daddr_v6` ([u8; 16]).
    pub rt_daddr_v6_off: u32,
}

/// log2 of the number of slots of the in-flight table of the kvloop sites.
pub const KV_SLOTS_LOG2: u32 = 16;
/// Slots of the in-flight table of the kvloop sites (65,536).
pub const KV_SLOTS: u32 = 1 << KV_SLOTS_LOG2;

/// One slot of the kvloop sites' in-flight table: which READ and when it was
/// posted (`start_ns` = 0: free).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvSlot {
    /// Process that posted.
    pub tgid: u32,
    /// Padding.
    pub _pad: u32,
    /// `xfer_id` of the READ.
    pub xfer_id: u64,
    /// Post time, ns since boot; 0 when the slot is free.
    pub start_ns: u64,
}

/// Key of a pending READ (between post and done).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PendingKey {
    /// Process id (tgid) that posted the READ.
    pub tgid: u32,
    /// [`crate::site`] value.
    pub site: u32,
    /// `xfer_id` (kvloop sites) or request handle address (NIXL).
    pub id: u64,
}

/// Value of a pending READ.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingXfer {
    /// `bpf_ktime_get_ns()` at post, ns (CLOCK_MONOTONIC).
    pub start_ns: u64,
    /// Payload bytes (0 when unknown).
    pub bytes: u64,
    /// Descriptor count (0 when unknown).
    pub descriptors: u32,
    /// [`crate::Direction`] byte.
    pub direction: u8,
    /// [`crate::BackendKind`] byte.
    pub backend: u8,
    /// [`crate::XferOp`] byte (NIXL library probes).
    pub op: u8,
    /// Padding.
    pub _pad: [u8; 1],
    /// Peer engine id / NIXL remote agent name, NUL-padded.
    pub peer: [u8; PEER_LEN],
}

/// Key of a transfer latency histogram: (direction, peer, size class) plus
/// where it was measured and whether the READ succeeded.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct XferHistKey {
    /// Peer engine id, NUL-padded.
    pub peer: [u8; PEER_LEN],
    /// [`crate::Direction`] byte.
    pub direction: u8,
    /// `floor(log2(bytes))`, 0 for 0 or 1 byte; 255 when bytes are unknown.
    pub size_class: u8,
    /// [`site`] value.
    pub site: u8,
    /// 1 when status was 0 (success), else 0.
    pub ok: u8,
    /// Padding.
    pub _pad: [u8; 4],
}

/// Size class meaning "bytes unknown" (NIXL library probes).
pub const SIZE_CLASS_UNKNOWN: u8 = 255;

/// Log2 latency histogram (per CPU in the kernel; user space sums CPUs).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencyHist {
    /// Counts per log2 slot of nanoseconds (see [`LAT_SLOTS`]).
    pub slots: [u64; LAT_SLOTS],
    /// Number of samples.
    pub count: u64,
    /// Sum of latencies, ns.
    pub sum_ns: u64,
    /// Sum of bytes (transfer histograms; 0 for prefill).
    pub sum_bytes: u64,
}

impl LatencyHist {
    /// An empty histogram.
    pub const ZERO: Self = Self {
        slots: [0; LAT_SLOTS],
        count: 0,
        sum_ns: 0,
        sum_bytes: 0,
    };
}

/// `floor(log2(v))` for `v >= 1`, 0 for 0; as bcc's `bpf_log2l`.
#[inline(always)]
pub const fn log2_floor(v: u64) -> u32 {
    if v == 0 { 0 } else { 63 - v.leading_zeros() }
}

/// Histogram slot of a latency in ns (clamped to the last slot).
#[inline(always)]
pub const fn lat_slot(ns: u64) -> usize {
    let s = log2_floor(ns) as usize;
    if s >= LAT_SLOTS { LAT_SLOTS - 1 } else { s }
}

/// Size class of a READ's byte count (`floor(log2(bytes))`).
#[inline(always)]
pub const fn size_class(bytes: u64) -> u8 {
    log2_floor(bytes) as u8
}

/// Key of the prefill latency histogram (per local server port).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PrefillHistKey {
    /// Local (server) port, host order.
    pub port: u16,
    /// Padding.
    pub _pad: [u8; 6],
}

/// Transfer event in the ring buffer (kind [`event_kind::XFER`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XferEvent {
    /// [`event_kind::XFER`].
    pub kind: u32,
    /// Process id (tgid) that made the READ.
    pub tgid: u32,
    /// `xfer_id` (kvloop sites) or request handle address (NIXL).
    pub id: u64,
    /// Post time, ns since boot (CLOCK_MONOTONIC, `bpf_ktime_get_ns`).
    pub start_ns: u64,
    /// Completion time, ns since boot.
    pub end_ns: u64,
    /// Payload bytes (0 = unknown).
    pub bytes: u64,
    /// Descriptor count (0 = unknown).
    pub descriptors: u32,
    /// Status at completion (0 = success; negative errno-style or NIXL status).
    pub status: i32,
    /// [`crate::Direction`] byte.
    pub direction: u8,
    /// [`crate::BackendKind`] byte.
    pub backend: u8,
    /// [`site`] value.
    pub site: u8,
    /// [`crate::XferOp`] byte (NIXL library probes; 0 elsewhere).
    pub op: u8,
    /// Padding.
    pub _pad: [u8; 4],
    /// Peer engine id, NUL-padded.
    pub peer: [u8; PEER_LEN],
}

/// In-flight prefill request on a server socket (kernel side state).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillInflight {
    /// First request bytes received, ns since boot.
    pub start_ns: u64,
    /// Bytes in the first receive.
    pub first_recv_bytes: u64,
    /// Server process (tgid) that received.
    pub tgid: u32,
    /// Local port, host order.
    pub port: u16,
    /// Peer port, host order.
    pub peer_port: u16,
    /// Peer IPv4 address, network order (0 for IPv6 peers).
    pub peer_addr4: u32,
    /// Bytes captured in `head`.
    pub head_len: u32,
    /// First bytes of the request as received by the server.
    pub head: [u8; PREFILL_HEAD_LEN],
}

/// Prefill event in the ring buffer (kind [`event_kind::PREFILL`]): one per
/// request (not sampled).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillEvent {
    /// [`event_kind::PREFILL`].
    pub kind: u32,
    /// Padding.
    pub _pad: u32,
    /// First request bytes received, ns since boot.
    pub start_ns: u64,
    /// First response bytes sent, ns since boot.
    pub end_ns: u64,
    /// The state at completion, head bytes included.
    pub req: PrefillInflight,
}

/// Key of the per-peer TCP retransmit counter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RetransmitKey {
    /// Address family (2 = AF_INET, 10 = AF_INET6).
    pub family: u16,
    /// Peer port, host order.
    pub dport: u16,
    /// Padding.
    pub _pad: u32,
    /// Peer address: IPv4 in the first 4 bytes, or IPv6.
    pub daddr: [u8; 16],
}

/// Retransmit event in the ring buffer (kind [`event_kind::RETRANSMIT`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetransmitEvent {
    /// [`event_kind::RETRANSMIT`].
    pub kind: u32,
    /// Padding.
    pub _pad: u32,
    /// Time, ns since boot.
    pub ts_ns: u64,
    /// Peer.
    pub key: RetransmitKey,
}

/// Arguments of an in-progress NIXL library call, kept between a uprobe and
/// its uretprobe (keyed by pid_tgid).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NixlCallArgs {
    /// Request handle (`nixlXferReqH*`), or the address of the `req_hndl`
    /// out-parameter for `createXferReq`.
    pub req: u64,
    /// `createXferReq`: address of the `std::string` remote agent name.
    pub remote_agent: u64,
    /// `createXferReq`: address of the `nixl_xfer_op_t` operation.
    pub op: u64,
}

/// What the NIXL probes know about a request handle from `createXferReq`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlReqInfo {
    /// Remote agent name, NUL-padded.
    pub peer: [u8; PEER_LEN],
    /// `nixl_xfer_op_t`: 0 = READ, 1 = WRITE.
    pub op: u32,
    /// Padding.
    pub _pad: u32,
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // Every type below is #[repr(C)], Copy, made of integers and byte arrays
    // only, hence valid for any bit pattern (what aya::Pod requires).
    // SAFETY: ProbeConfig is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for ProbeConfig {}
    // SAFETY: PendingKey is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for PendingKey {}
    // SAFETY: PendingXfer is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for PendingXfer {}
    // SAFETY: XferHistKey is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for XferHistKey {}
    // SAFETY: LatencyHist is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for LatencyHist {}
    // SAFETY: PrefillHistKey is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for PrefillHistKey {}
    // SAFETY: RetransmitKey is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for RetransmitKey {}
    // SAFETY: NixlReqInfo is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for NixlReqInfo {}
    // SAFETY: NixlCallArgs is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for NixlCallArgs {}
    // SAFETY: KvSlot is #[repr(C)] plain old data (see above).
    unsafe impl aya::Pod for KvSlot {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{offset_of, size_of};

    #[test]
    fn layouts() {
        assert_eq!(size_of::<XferHistKey>(), PEER_LEN + 8);
        assert_eq!(size_of::<PendingKey>(), 16);
        assert_eq!(size_of::<XferEvent>(), 56 + PEER_LEN);
        assert_eq!(offset_of!(XferEvent, peer), 56);
        assert_eq!(size_of::<PrefillInflight>(), 32 + PREFILL_HEAD_LEN);
        assert_eq!(size_of::<PrefillEvent>(), 24 + size_of::<PrefillInflight>());
        assert_eq!(size_of::<RetransmitKey>(), 24);
        assert_eq!(size_of::<LatencyHist>(), (LAT_SLOTS + 3) * 8);
        assert!(PREFILL_HEAD_LEN.is_power_of_two());
        assert_eq!(size_of::<KvSlot>(), 24);
        assert_eq!(KV_SLOTS, 65536);
    }

    #[test]
    fn log2_slots() {
        assert_eq!(lat_slot(0), 0);
        assert_eq!(lat_slot(1), 0);
        assert_eq!(lat_slot(2), 1);
        assert_eq!(lat_slot(1023), 9);
        assert_eq!(lat_slot(1024), 10);
        assert_eq!(lat_slot(u64::MAX), LAT_SLOTS - 1);
        assert_eq!(size_class(65536), 16);
        assert_eq!(size_class(65537), 16);
    }
}
