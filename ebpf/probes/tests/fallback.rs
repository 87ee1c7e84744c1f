//! The probes' fallback without eBPF (no root needed): every sample is
//! timed in user space and labelled so, in the trace, the snapshot and the
//! Prometheus families.
use std::time::Duration;

use kvloop_common::Direction;
use kvloop_probes::{Probes, Source, TraceFilter};

const HELPER: &str = env!("CARGO_BIN_EXE_kvloop-probe-helper");

#[test]
fn fallback_labels_every_sample_userspace() {
    let p = Probes::userspace("test: no eBPF");
    assert_eq!(p.source(), Source::Userspace);
    assert!(p.attach_transfer_sites(HELPER, None).is_err());
    let args = kvloop_common::ReadProbeArgs {
        xfer_id: 1,
        bytes: 4096,
        descriptors: 1,
        direction: Direction::DecodeToPrefill as u8,
        backend: kvloop_common::BackendKind::Libfabric as u8,
        status: 0,
        peer: kvloop_common::ReadProbeArgs::peer_from_str("decode-9"),
        weight: 1,
        _pad: [0; 4],
    };
    let mut trace = p.trace(TraceFilter::default());
    p.observe_read_userspace(&args, Duration::from_micros(30));
    let ev = trace.try_next().expect("event");
    assert!(ev.line().contains("src=userspace"), "{}", ev.line());
    let snap = p.snapshot();
    assert_eq!(snap.xfers.len(), 1);
    assert_eq!(snap.xfers[0].source, Source::Userspace);
    assert_eq!(snap.xfers[0].latency_ns, 30_000);
    let mut reg = prometheus_client::registry::Registry::default();
    p.register_metrics(&mut reg);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
    assert!(text.contains("source=\"userspace\""), "{text}");
    assert!(
        text.contains("kvloop_probe_source_info{source=\"userspace\"} 1"),
        "{text}"
    );
}
