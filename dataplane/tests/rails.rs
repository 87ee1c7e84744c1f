//! Rails over real providers in one process: engines with two endpoints
//! (tcp;ofi_rxm bound to 127.0.0.1 and 127.0.0.2; shm twice) READ
//! byte-exact blocks, every rail carries part of a large READ, and engines
//! with different rail counts (or none) read each other.
use std::time::Duration;

use kvloop_dataplane::fabric::FabricConfig;
use kvloop_dataplane::*;

mod support;

use support::{check_block, read_request, wait_for_peer};

fn layout() -> KvLayout {
    KvLayout {
        num_regions: 2,
        num_blocks: 64,
        block_len_bytes: 64 << 10,
        block_size_tokens: 16,
    }
}

fn fabric(provider: &str, rails: &[&str]) -> BackendConfig {
    BackendConfig::Libfabric(FabricConfig {
        provider: provider.into(),
        rails: rails.iter().map(|r| r.to_string()).collect(),
        ..Default::default()
    })
}

async fn engine(id: &str, backend: BackendConfig, tag: u8) -> TransferEngine {
    support::filled_engine(
        id,
        "127.0.0.1:0".parse().unwrap(),
        backend,
        layout(),
        10_000,
        tag,
    )
    .await
}

async fn read(e: &TransferEngine, peer: &str, pairs: &[(u64, u64)]) -> ReadOutcome {
    e.read(&read_request(peer, pairs, 10_000))
        .await
        .expect("READ succeeds")
}

/// The reader (`reader_rails`) READs from the target (`target_rails`):
/// one large READ split across the reader's rails, byte-exact, then small
/// READs that go whole to one rail in turn. Returns the reader's per-rail
/// bytes of the large READ.
async fn reads_over_rails(
    provider: &str,
    reader_rails: &[&str],
    target_rails: &[&str],
) -> Vec<u64> {
    let p = engine("prefill-0", fabric(provider, reader_rails), 1).await;
    let d = engine("decode-0", fabric(provider, target_rails), 2).await;
    p.connect(d.side_channel_addr()).await.unwrap();
    let n = reader_rails.len().max(1);
    assert_eq!(p.rail_bytes().len(), n);
    assert!(p.rail_bytes().iter().all(|&b| b == 0));
    // 32 blocks × 2 regions × 64 KiB = 4 MiB in one READ, non-contiguous
    // remote blocks (every other one) into contiguous local ones.
    let pairs: Vec<(u64, u64)> = (0..32).map(|i| (2 * i, 32 + i)).collect();
    let before = p.rail_bytes();
    let out = read(&p, "decode-0", &pairs).await;
    let after = p.rail_bytes();
    let per_rail: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(per_rail.iter().sum::<u64>(), out.bytes, "{per_rail:?}");
    for &(remote, local) in &pairs {
        check_block(&p, local, 2, remote);
    }
    // Small READs (one 64 KiB block per region: 128 KiB, below 64 KiB per
    // rail only with one rail) stay byte-exact too, whatever rail they take.
    for i in 0..8u64 {
        read(&p, "decode-0", &[(i, i)]).await;
        check_block(&p, i, 2, i);
    }
    // And the other way: the target READs the reader through the same
    // handshake.
    wait_for_peer(&d).await;
    // (The reader's blocks 16..32 still hold its own pattern.)
    let back: Vec<(u64, u64)> = (0..16).map(|i| (16 + i, i)).collect();
    read(&d, "prefill-0", &back).await;
    for &(remote, local) in &back {
        check_block(&d, local, 1, remote);
    }
    per_rail
}

/// Every rail carried a share of the large READ within 4 KiB of even.
fn assert_balanced(per_rail: &[u64]) {
    let total: u64 = per_rail.iter().sum();
    let even = total / per_rail.len() as u64;
    for &b in per_rail {
        assert!(b.abs_diff(even) <= 4096, "per-rail bytes {per_rail:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_two_rails_on_two_loopback_addresses_both_carry_bytes() {
    let rails = ["127.0.0.1", "127.0.0.2"];
    let per_rail = reads_over_rails("tcp;ofi_rxm", &rails, &rails).await;
    assert_eq!(per_rail.len(), 2);
    assert_balanced(&per_rail);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_two_rails_both_carry_bytes() {
    let per_rail = reads_over_rails("shm", &["", ""], &["", ""]).await;
    assert_eq!(per_rail.len(), 2);
    assert_balanced(&per_rail);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rails_pair_with_a_target_of_fewer_rails_or_none() {
    // Two reader rails on a one-rail target: both read its one endpoint.
    let per_rail = reads_over_rails("tcp;ofi_rxm", &["127.0.0.1", "127.0.0.2"], &[]).await;
    assert_balanced(&per_rail);
    // No rails on a two-rail target: the reader's one endpoint reads rail 0.
    let per_rail = reads_over_rails("tcp;ofi_rxm", &[], &["127.0.0.1", "127.0.0.2"]).await;
    assert_eq!(per_rail.len(), 1);
}

#[tokio::test]
async fn rails_with_bind_node_are_refused_naming_the_field() {
    let regions = vec![HostRegion::new("r0", 4096).unwrap()];
    let cfg = EngineConfig {
        engine_id: "x".into(),
        side_channel_addr: "127.0.0.1:0".parse().unwrap(),
        backend: BackendConfig::Libfabric(FabricConfig {
            provider: "tcp;ofi_rxm".into(),
            bind_node: Some("127.0.0.1".into()),
            rails: vec!["127.0.0.1".into(), "127.0.0.2".into()],
            ..Default::default()
        }),
        layout: KvLayout {
            num_regions: 1,
            num_blocks: 1,
            block_len_bytes: 4096,
            block_size_tokens: 16,
        },
        read_timeout_ms: 1000,
        handshake_timeout_ms: 1000,
    };
    let e = TransferEngine::start(cfg, regions)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("rails"), "{e}");
}

/// A READ whose part on one rail cannot complete (that rail names an
/// endpoint that is gone) fails as a whole, after the other rail's part
/// completed, instead of reporting success or hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rail_fails_the_whole_read() {
    use kvloop_dataplane::backend::{BackendMetadata, Completion, TransferBackend};
    use kvloop_dataplane::fabric::FabricBackend;
    use kvloop_dataplane::layout::Segment;
    use kvloop_dataplane::region::RegionDesc;

    let len = 4usize << 20;
    let src = HostRegion::new("rails-src", len).unwrap();
    let dst = HostRegion::new("rails-dst", len).unwrap();
    let two = FabricConfig {
        provider: "tcp;ofi_rxm".into(),
        rails: vec!["127.0.0.1".into(), "127.0.0.2".into()],
        busy_poll: true,
        ..Default::default()
    };
    let target = FabricBackend::new(two.clone(), &[RegionDesc::from(&src)]).unwrap();
    let gone = FabricBackend::new(
        FabricConfig {
            rails: vec!["127.0.0.2".into()],
            ..two.clone()
        },
        &[RegionDesc::from(&dst)],
    )
    .unwrap();
    let gone_address = match gone.metadata() {
        BackendMetadata::Libfabric { address, .. } => address,
        other => panic!("{other:?}"),
    };
    drop(gone);
    let reader = FabricBackend::new(two, &[RegionDesc::from(&dst)]).unwrap();
    let mut md = target.metadata();
    let BackendMetadata::Libfabric { rails, .. } = &mut md else {
        panic!("libfabric metadata")
    };
    rails[0].address = gone_address;
    reader.check_peer("target", &md).unwrap();
    let slot = reader.add_peer("target", &md).unwrap();
    let (done, rx) = Completion::new();
    let seg = Segment {
        region: 0,
        remote_offset: 0,
        local_offset: 0,
        len_bytes: len as u64,
    };
    reader.post_read(slot, &[seg], done);
    let r = tokio::time::timeout(Duration::from_secs(30), rx)
        .await
        .expect("the READ resolves")
        .expect("the READ is completed, not dropped");
    let e = r.expect_err("a READ with a failed rail fails");
    assert!(
        matches!(e, DataplaneError::Backend { .. }),
        "unexpected error: {e}"
    );
    // The rail that worked carried its half.
    let bytes = reader.rail_bytes();
    assert_eq!(bytes[0], len as u64 / 2, "{bytes:?}");
    assert_eq!(bytes[1], 0, "{bytes:?}");
}
