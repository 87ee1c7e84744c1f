//! Samples and histograms (decoded from kernel records or timed in user
//! space), shared by the loader, the metrics collector and the trace streams.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use kvloop_common::{
    Direction, LAT_SLOTS, LatencyHist, PEER_LEN, PrefillEvent, RetransmitKey, SIZE_CLASS_UNKNOWN,
    XferEvent, XferHistKey, XferOp, lat_slot, site,
};

use crate::Source;
use crate::attribution::{self, TokenCounts, Unattributed};

/// Peer bytes (NUL-padded) as a string.
pub(crate) fn peer_str(p: &[u8; PEER_LEN]) -> String {
    let end = p.iter().position(|&b| b == 0).unwrap_or(PEER_LEN);
    String::from_utf8_lossy(&p[..end]).into_owned()
}

/// A log2 latency histogram as read from the kernel (summed over CPUs) or
/// built in user space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Count per slot; slot `i` holds latencies in `[2^i, 2^(i+1))` ns (slot 0
    /// also 0 ns; the last slot everything above).
    pub slots: [u64; LAT_SLOTS],
    /// Samples.
    pub count: u64,
    /// Sum of latencies, ns.
    pub sum_ns: u64,
    /// Sum of bytes (transfers), 0 for prefill.
    pub sum_bytes: u64,
}

impl Default for HistogramSnapshot {
    fn default() -> Self {
        Self {
            slots: [0; LAT_SLOTS],
            count: 0,
            sum_ns: 0,
            sum_bytes: 0,
        }
    }
}

impl HistogramSnapshot {
    pub(crate) fn add(&mut self, h: &LatencyHist) {
        for (a, b) in self.slots.iter_mut().zip(h.slots.iter()) {
            *a += b;
        }
        self.count += h.count;
        self.sum_ns += h.sum_ns;
        self.sum_bytes += h.sum_bytes;
    }

    pub(crate) fn observe(&mut self, ns: u64, bytes: u64) {
        self.slots[lat_slot(ns)] += 1;
        self.count += 1;
        self.sum_ns += ns;
        self.sum_bytes += bytes;
    }

    /// Upper bound of slot `i`, seconds (`2^(i+1)` ns); `+Inf` for the last.
    pub fn slot_upper_seconds(i: usize) -> f64 {
        if i + 1 >= LAT_SLOTS {
            f64::INFINITY
        } else {
            (1u64 << (i + 1)) as f64 * 1e-9
        }
    }

    /// Quantile `q` in [0, 1] as the upper bound of the slot holding it, ns
    /// (a factor-of-2 estimate, as log2 histograms give). `None` when empty.
    pub fn quantile_upper_ns(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let target = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.slots.iter().enumerate() {
            seen += c;
            if seen >= target {
                return Some(if i + 1 >= 64 {
                    u64::MAX
                } else {
                    1u64 << (i + 1)
                });
            }
        }
        None
    }

    /// Mean latency, ns. `None` when empty.
    pub fn mean_ns(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum_ns as f64 / self.count as f64)
    }
}

/// Labels of a transfer histogram: (direction, peer, size class), where it
/// was measured, success.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct XferHistLabels {
    /// D→P, P→D, probe, unknown (NIXL library probes do not know it).
    pub direction: Direction,
    /// Peer engine id (kvloop) or NIXL remote agent name; empty when unknown.
    pub peer: String,
    /// `floor(log2(bytes))`; `None` when bytes are unknown (NIXL library).
    pub size_class: Option<u8>,
    /// `kvloop`, `nixl` or `userspace` ([`kvloop_common::site::label`]).
    pub site: &'static str,
    /// The READ succeeded.
    pub ok: bool,
    /// Kernel or user-space timing.
    pub source: Source,
}

impl XferHistLabels {
    pub(crate) fn from_key(k: &XferHistKey, source: Source) -> Self {
        Self {
            direction: Direction::from_u8(k.direction),
            peer: peer_str(&k.peer),
            size_class: (k.size_class != SIZE_CLASS_UNKNOWN).then_some(k.size_class),
            site: site::label(k.site),
            ok: k.ok == 1,
            source,
        }
    }
}

/// One READ (or NIXL transfer) as measured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XferSample {
    /// Kernel or user-space timing.
    pub source: Source,
    /// `kvloop`, `nixl` or `userspace`.
    pub site: &'static str,
    /// Process that made the READ.
    pub tgid: u32,
    /// `xfer_id` (kvloop) or request handle address (NIXL).
    pub id: u64,
    /// Post time, ns since boot (CLOCK_MONOTONIC); 0 for user-space samples
    /// that did not give one.
    pub start_ns: u64,
    /// Post → completion, ns.
    pub latency_ns: u64,
    /// Payload bytes; 0 = unknown (the NIXL library probes read them from
    /// the request's local descriptors).
    pub bytes: u64,
    /// Descriptor count; 0 = unknown.
    pub descriptors: u32,
    /// Direction of the READ (kvloop sites; `Unknown` at the NIXL library).
    pub direction: Direction,
    /// NIXL operation (READ/WRITE) at the NIXL library; `Unknown` elsewhere.
    pub op: XferOp,
    /// Peer engine id / NIXL remote agent name ("" when unknown).
    pub peer: String,
    /// 0 = success; negative errno-style (kvloop) or `nixl_status_t` (NIXL).
    pub status: i32,
}

impl XferSample {
    pub(crate) fn from_event(e: &XferEvent) -> Self {
        Self {
            source: Source::Ebpf,
            site: site::label(e.site),
            tgid: e.tgid,
            id: e.id,
            start_ns: e.start_ns,
            latency_ns: e.end_ns.saturating_sub(e.start_ns),
            bytes: e.bytes,
            descriptors: e.descriptors,
            direction: Direction::from_u8(e.direction),
            op: XferOp::from_u8(e.op),
            peer: peer_str(&e.peer),
            status: e.status,
        }
    }
}

/// One prefill request on a configured server port: first request bytes
/// received → first response bytes sent on the same socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillSample {
    /// Kernel timing (the only source for prefill).
    pub source: Source,
    /// Server (local) port.
    pub port: u16,
    /// Client address (IPv4 only; `None` for IPv6 clients).
    pub peer: Option<SocketAddr>,
    /// Server process.
    pub tgid: u32,
    /// First request bytes received, ns since boot.
    pub start_ns: u64,
    /// Request → first response bytes, ns.
    pub latency_ns: u64,
    /// Bytes of the first receive.
    pub first_recv_bytes: u64,
    /// Token counts from the `X-KVLoop-Tokens` header, or why not.
    pub tokens: Result<TokenCounts, Unattributed>,
}

impl PrefillSample {
    pub(crate) fn from_event(e: &PrefillEvent) -> Self {
        let r = &e.req;
        let n = (r.head_len as usize).min(r.head.len());
        let peer = (r.peer_addr4 != 0).then(|| {
            SocketAddr::new(
                IpAddr::V4(Ipv4Addr::from(u32::from_be(r.peer_addr4))),
                r.peer_port,
            )
        });
        Self {
            source: Source::Ebpf,
            port: r.port,
            peer,
            tgid: r.tgid,
            start_ns: e.start_ns,
            latency_ns: e.end_ns.saturating_sub(e.start_ns),
            first_recv_bytes: r.first_recv_bytes,
            tokens: attribution::attribute(&r.head[..n]),
        }
    }
}

/// TCP retransmits to one peer since the probes were loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetransmitCount {
    /// Peer address and port.
    pub peer: SocketAddr,
    /// Retransmitted segments.
    pub count: u64,
}

pub(crate) fn retransmit_peer(k: &RetransmitKey) -> SocketAddr {
    let ip = if k.family == 10 {
        IpAddr::V6(Ipv6Addr::from(k.daddr))
    } else {
        IpAddr::V4(Ipv4Addr::new(
            k.daddr[0], k.daddr[1], k.daddr[2], k.daddr[3],
        ))
    };
    SocketAddr::new(ip, k.dport)
}

/// Everything the probes measured, for the agent's cost model.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Cumulative transfer latency histograms since load.
    pub xfer_histograms: Vec<(XferHistLabels, HistogramSnapshot)>,
    /// Cumulative prefill latency histograms per server port (kernel side,
    /// every request, attributed or not).
    pub prefill_histograms: Vec<(u16, HistogramSnapshot)>,
    /// Transfer samples received since the previous snapshot (ring-buffer
    /// events, sampled per `ProbeConfig::xfer_sample_every`, plus user-space
    /// samples).
    pub xfers: Vec<XferSample>,
    /// Prefill samples received since the previous snapshot (every request).
    pub prefills: Vec<PrefillSample>,
    /// TCP retransmits per peer since load.
    pub retransmits: Vec<RetransmitCount>,
    /// Kernel counters (drops, unmatched completions, ...) by name, plus
    /// `samples_dropped` (user-space buffer overflow).
    pub counters: Vec<(&'static str, u64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles() {
        let mut h = HistogramSnapshot::default();
        for _ in 0..90 {
            h.observe(1000, 0); // slot 9: [512, 1024)
        }
        for _ in 0..10 {
            h.observe(1_000_000, 0); // slot 19
        }
        assert_eq!(h.quantile_upper_ns(0.5), Some(1024));
        assert_eq!(h.quantile_upper_ns(0.95), Some(1 << 20));
        assert_eq!(h.mean_ns(), Some((90.0 * 1000.0 + 10.0 * 1e6) / 100.0));
        assert_eq!(HistogramSnapshot::default().quantile_upper_ns(0.5), None);
        assert!(HistogramSnapshot::slot_upper_seconds(LAT_SLOTS - 1).is_infinite());
        assert_eq!(HistogramSnapshot::slot_upper_seconds(9), 1024e-9);
    }
}
