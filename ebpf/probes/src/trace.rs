//! Live event stream (`kvloop trace`): decoded ring-buffer events with
//! filters on peer, direction and minimum latency.

use std::net::SocketAddr;
use std::time::Duration;

use kvloop_common::{Direction, PrefillEvent, RetransmitEvent, XferEvent, XferOp, event_kind};
use tokio::sync::broadcast;

use crate::state::{PrefillSample, XferSample, retransmit_peer};

/// Capacity of each subscriber's queue; a subscriber that falls further
/// behind loses the oldest events (reported by [`TraceStream::lagged`]).
pub const TRACE_QUEUE: usize = 4096;

/// One decoded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A READ / NIXL transfer completed.
    Xfer(XferSample),
    /// A prefill request got its first response bytes.
    Prefill(PrefillSample),
    /// A TCP segment to `peer` was retransmitted.
    Retransmit {
        /// Peer address and port.
        peer: SocketAddr,
        /// ns since boot.
        ts_ns: u64,
    },
}

impl Event {
    /// Decodes one ring-buffer record; `None` for a short or unknown record.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let kind = u32::from_ne_bytes(bytes.get(..4)?.try_into().ok()?);
        match kind {
            event_kind::XFER => {
                let e: XferEvent = read_pod(bytes)?;
                Some(Self::Xfer(XferSample::from_event(&e)))
            }
            event_kind::PREFILL => {
                let e: PrefillEvent = read_pod(bytes)?;
                Some(Self::Prefill(PrefillSample::from_event(&e)))
            }
            event_kind::RETRANSMIT => {
                let e: RetransmitEvent = read_pod(bytes)?;
                Some(Self::Retransmit {
                    peer: retransmit_peer(&e.key),
                    ts_ns: e.ts_ns,
                })
            }
            _ => None,
        }
    }

    /// Latency of the event (none for retransmits).
    pub fn latency(&self) -> Option<Duration> {
        match self {
            Self::Xfer(s) => Some(Duration::from_nanos(s.latency_ns)),
            Self::Prefill(s) => Some(Duration::from_nanos(s.latency_ns)),
            Self::Retransmit { .. } => None,
        }
    }

    /// One human-readable line (what `kvloop trace` prints).
    pub fn line(&self) -> String {
        match self {
            Self::Xfer(s) => format!(
                "xfer   src={} site={} pid={} id={} dir={} peer={} bytes={} descs={} latency_us={:.1} status={}",
                s.source.label(),
                s.site,
                s.tgid,
                s.id,
                // the NIXL library knows READ/WRITE, not D→P/P→D
                if s.direction == Direction::Unknown && s.op != XferOp::Unknown {
                    s.op.label()
                } else {
                    s.direction.label()
                },
                if s.peer.is_empty() { "-" } else { &s.peer },
                s.bytes,
                s.descriptors,
                s.latency_ns as f64 / 1e3,
                s.status
            ),
            Self::Prefill(s) => {
                let tokens = match &s.tokens {
                    Ok(t) => format!("prompt={} reused={}", t.prompt_tokens, t.reused_tokens),
                    Err(e) => format!("unattributed({e:?})"),
                };
                format!(
                    "prefill src={} port={} pid={} client={} latency_ms={:.3} {}",
                    s.source.label(),
                    s.port,
                    s.tgid,
                    s.peer.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                    s.latency_ns as f64 / 1e6,
                    tokens
                )
            }
            Self::Retransmit { peer, ts_ns } => format!("retrans peer={peer} ts_ns={ts_ns}"),
        }
    }
}

fn read_pod<T: Copy>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < std::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: T is a #[repr(C)] Copy struct valid for any bit pattern (the
    // kvloop-common event types), and the slice is long enough.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// Filters of a trace stream; `None` fields match everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceFilter {
    /// Peer: matches a transfer's engine id / NIXL agent name exactly, or a
    /// prefill's client / a retransmit's peer as `ip` or `ip:port`.
    pub peer: Option<String>,
    /// Only transfers in this direction (drops prefill and retransmit events).
    pub direction: Option<Direction>,
    /// Only events at least this slow (drops retransmit events).
    pub min_latency: Option<Duration>,
}

impl TraceFilter {
    /// Builds a filter from command-line values (`kvloop trace --peer P
    /// --direction d2p --min-latency-us 100`): `direction` is one of `d2p`,
    /// `p2d`, `probe`, `unknown`; `min_latency_us` in µs.
    ///
    /// Errors: [`crate::ProbeError::Invalid`] naming `direction`.
    pub fn from_cli(
        peer: Option<String>,
        direction: Option<&str>,
        min_latency_us: Option<u64>,
    ) -> Result<Self, crate::ProbeError> {
        let direction = match direction {
            None => None,
            Some("d2p") => Some(Direction::DecodeToPrefill),
            Some("p2d") => Some(Direction::PrefillToDecode),
            Some("probe") => Some(Direction::Probe),
            Some("unknown") => Some(Direction::Unknown),
            Some(other) => {
                return Err(crate::ProbeError::Invalid {
                    field: "direction",
                    message: format!("`{other}`: expected d2p, p2d, probe or unknown"),
                });
            }
        };
        Ok(Self {
            peer,
            direction,
            min_latency: min_latency_us.map(Duration::from_micros),
        })
    }

    /// Whether `ev` passes the filter.
    pub fn matches(&self, ev: &Event) -> bool {
        if let Some(d) = self.direction {
            match ev {
                Event::Xfer(s) if s.direction == d => {}
                _ => return false,
            }
        }
        if let Some(min) = self.min_latency {
            match ev.latency() {
                Some(l) if l >= min => {}
                _ => return false,
            }
        }
        if let Some(p) = &self.peer {
            let addr_match = |a: &SocketAddr| a.to_string() == *p || a.ip().to_string() == *p;
            let ok = match ev {
                Event::Xfer(s) => s.peer == *p,
                Event::Prefill(s) => s.peer.as_ref().is_some_and(addr_match),
                Event::Retransmit { peer, .. } => addr_match(peer),
            };
            if !ok {
                return false;
            }
        }
        true
    }
}

/// A filtered subscription to the live event stream.
pub struct TraceStream {
    pub(crate) rx: broadcast::Receiver<Event>,
    pub(crate) filter: TraceFilter,
    pub(crate) lagged: u64,
}

impl TraceStream {
    /// Next matching event; `None` once the probes are dropped.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            match self.rx.recv().await {
                Ok(ev) if self.filter.matches(&ev) => return Some(ev),
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(n)) => self.lagged += n,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }

    /// Next matching event already queued, without waiting.
    pub fn try_next(&mut self) -> Option<Event> {
        loop {
            match self.rx.try_recv() {
                Ok(ev) if self.filter.matches(&ev) => return Some(ev),
                Ok(_) => {}
                Err(broadcast::error::TryRecvError::Lagged(n)) => self.lagged += n,
                Err(_) => return None,
            }
        }
    }

    /// Waits up to `timeout` for the next matching event (for callers without
    /// a tokio runtime, such as tests and the CLI's blocking mode).
    pub fn next_timeout(&mut self, timeout: Duration) -> Option<Event> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(ev) = self.try_next() {
                return Some(ev);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Events this subscriber lost because it fell behind.
    pub fn lagged(&self) -> u64 {
        self.lagged
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Source;

    fn xfer(peer: &str, dir: Direction, lat: u64) -> Event {
        Event::Xfer(XferSample {
            source: Source::Ebpf,
            site: "kvloop",
            tgid: 1,
            id: 2,
            start_ns: 0,
            latency_ns: lat,
            bytes: 65536,
            descriptors: 4,
            direction: dir,
            op: XferOp::Unknown,
            peer: peer.into(),
            status: 0,
        })
    }

    #[test]
    fn filters() {
        let all = TraceFilter::default();
        let e = xfer("decode-0", Direction::PrefillToDecode, 5_000);
        assert!(all.matches(&e));
        let f = TraceFilter {
            peer: Some("decode-0".into()),
            direction: Some(Direction::PrefillToDecode),
            min_latency: Some(Duration::from_micros(5)),
        };
        assert!(f.matches(&e));
        assert!(!f.matches(&xfer("decode-1", Direction::PrefillToDecode, 5_000)));
        assert!(!f.matches(&xfer("decode-0", Direction::DecodeToPrefill, 5_000)));
        assert!(!f.matches(&xfer("decode-0", Direction::PrefillToDecode, 4_999)));
        let r = Event::Retransmit {
            peer: "10.77.0.2:5000".parse().unwrap(),
            ts_ns: 1,
        };
        let by_ip = TraceFilter {
            peer: Some("10.77.0.2".into()),
            ..Default::default()
        };
        assert!(by_ip.matches(&r));
        assert!(!f.matches(&r));
    }

    #[test]
    fn filter_from_cli() {
        let f = TraceFilter::from_cli(Some("d0".into()), Some("d2p"), Some(100)).unwrap();
        assert_eq!(f.direction, Some(Direction::DecodeToPrefill));
        assert_eq!(f.min_latency, Some(Duration::from_micros(100)));
        let e = TraceFilter::from_cli(None, Some("up"), None).unwrap_err();
        assert!(e.to_string().contains("direction"), "{e}");
        assert_eq!(
            TraceFilter::from_cli(None, None, None).unwrap(),
            TraceFilter::default()
        );
    }

    #[test]
    fn decodes_xfer_event() {
        let e = XferEvent {
            kind: event_kind::XFER,
            tgid: 7,
            id: 9,
            start_ns: 100,
            end_ns: 350,
            bytes: 4096,
            descriptors: 2,
            status: 0,
            direction: Direction::DecodeToPrefill as u8,
            backend: 2,
            site: kvloop_common::site::KVLOOP,
            op: 0,
            _pad: [0; 4],
            peer: kvloop_common::ReadProbeArgs::peer_from_str("d0"),
        };
        // SAFETY: viewing a repr(C) struct as bytes
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&e as *const XferEvent).cast::<u8>(),
                size_of::<XferEvent>(),
            )
        };
        match Event::decode(bytes).unwrap() {
            Event::Xfer(s) => {
                assert_eq!(s.latency_ns, 250);
                assert_eq!(s.peer, "d0");
                assert_eq!(s.direction, Direction::DecodeToPrefill);
                assert!(Event::Xfer(s).line().contains("dir=d2p"));
            }
            other => panic!("{other:?}"),
        }
        assert!(Event::decode(&bytes[..10]).is_none());
    }

    /// A NIXL library event carries the operation, bytes, descriptors and
    /// remote agent read from the request handle; the line shows them.
    #[test]
    fn nixl_event_shows_operation_bytes_and_peer() {
        let e = XferEvent {
            kind: event_kind::XFER,
            tgid: 7,
            id: 0x5000,
            start_ns: 100,
            end_ns: 1100,
            bytes: 1 << 20,
            descriptors: 3,
            status: 0,
            direction: Direction::Unknown as u8,
            backend: kvloop_common::BackendKind::Nixl as u8,
            site: kvloop_common::site::NIXL_LIB,
            op: XferOp::Write as u8,
            _pad: [0; 4],
            peer: kvloop_common::ReadProbeArgs::peer_from_str("engine-d"),
        };
        // SAFETY: viewing a repr(C) plain-old-data struct as its bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&e as *const XferEvent).cast::<u8>(),
                size_of::<XferEvent>(),
            )
        };
        let Some(Event::Xfer(s)) = Event::decode(bytes) else {
            panic!("not an xfer event");
        };
        assert_eq!(s.op, XferOp::Write);
        let line = Event::Xfer(s).line();
        assert!(
            line.contains("site=nixl")
                && line.contains("dir=write")
                && line.contains("peer=engine-d")
                && line.contains("bytes=1048576")
                && line.contains("descs=3"),
            "{line}"
        );
    }
}
