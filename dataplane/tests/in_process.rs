//! Two engines in one process, over real providers: READs both ways with
//! byte-exact verification, notifications, bounds checks, refused handshakes.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use kvloop_common::Direction;
use kvloop_dataplane::fabric::FabricConfig;
use kvloop_dataplane::nixl::NixlConfig;
use kvloop_dataplane::*;

mod support;

fn layout(num_blocks: u32, block_len: u64) -> KvLayout {
    KvLayout {
        num_regions: 2,
        num_blocks,
        block_len_bytes: block_len,
        block_size_tokens: 16,
    }
}

use support::{check_block, wait_for_peer};

async fn engine(id: &str, backend: BackendConfig, l: KvLayout, tag: u8) -> TransferEngine {
    support::filled_engine(id, "127.0.0.1:0".parse().unwrap(), backend, l, 5000, tag).await
}

async fn both_directions(backend: BackendConfig) {
    let l = layout(32, 16 * 1024);
    let p = engine("prefill-0", backend.clone(), l, 1).await;
    let d = engine("decode-0", backend, l, 2).await;
    let md = p.connect(d.side_channel_addr()).await.unwrap();
    assert_eq!(md.engine_id, "decode-0");
    // D's side learns P from the same handshake.
    wait_for_peer(&d).await;
    let mut notifs = d.subscribe_notifications();
    // D→P: prefill reads decode's retained blocks 3,4,5,9 into its 10..14.
    let pairs: Vec<BlockPair> = [(3, 10), (4, 11), (5, 12), (9, 20)]
        .iter()
        .map(|&(remote, local)| BlockPair { remote, local })
        .collect();
    let out = p
        .read(&ReadRequest {
            peer_engine_id: "decode-0".into(),
            blocks: pairs.clone(),
            direction: Direction::DecodeToPrefill,
            notify: Some(OwnerNotify {
                owner_request_id: "cmpl-d-1".into(),
                count: 1,
            }),
            timeout_ms: None,
        })
        .await
        .unwrap();
    assert_eq!(out.bytes, 4 * 2 * 16 * 1024);
    assert_eq!(out.descriptors, 8);
    for pr in &pairs {
        check_block(&p, pr.local, 2, pr.remote);
    }
    let n = tokio::time::timeout(Duration::from_secs(5), notifs.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            n.from_engine_id.as_str(),
            n.owner_request_id.as_str(),
            n.count
        ),
        ("prefill-0", "cmpl-d-1", 1)
    );
    // P→D: decode reads prefill's fresh blocks, over the same handshake.
    let pairs = vec![
        BlockPair {
            remote: 0,
            local: 31,
        },
        BlockPair {
            remote: 1,
            local: 30,
        },
    ];
    d.read(&ReadRequest {
        peer_engine_id: "prefill-0".into(),
        blocks: pairs.clone(),
        direction: Direction::PrefillToDecode,
        notify: None,
        timeout_ms: None,
    })
    .await
    .unwrap();
    for pr in &pairs {
        check_block(&d, pr.local, 1, pr.remote);
    }
    // Out of range and unknown peers are refused before posting.
    let e = p
        .read(&ReadRequest {
            peer_engine_id: "decode-0".into(),
            blocks: vec![BlockPair {
                remote: 32,
                local: 0,
            }],
            direction: Direction::DecodeToPrefill,
            notify: None,
            timeout_ms: None,
        })
        .await
        .unwrap_err();
    assert!(matches!(e, DataplaneError::BlockOutOfRange { .. }), "{e}");
    let e = p
        .read(&ReadRequest {
            peer_engine_id: "decode-9".into(),
            blocks: vec![BlockPair {
                remote: 0,
                local: 0,
            }],
            direction: Direction::DecodeToPrefill,
            notify: None,
            timeout_ms: None,
        })
        .await
        .unwrap_err();
    assert!(matches!(e, DataplaneError::UnknownPeer { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_rxm_both_directions() {
    both_directions(BackendConfig::Libfabric(FabricConfig {
        provider: "tcp;ofi_rxm".into(),
        ..Default::default()
    }))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_both_directions() {
    both_directions(BackendConfig::Libfabric(FabricConfig {
        provider: "shm".into(),
        ..Default::default()
    }))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the NIXL runtime (scripts/bootstrap.sh nixl)"]
async fn nixl_ucx_both_directions() {
    both_directions(BackendConfig::Nixl(NixlConfig::default())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_layouts_are_refused_at_handshake() {
    let b = BackendConfig::Libfabric(FabricConfig {
        provider: "tcp;ofi_rxm".into(),
        ..Default::default()
    });
    let p = engine("p-mm", b.clone(), layout(8, 4096), 1).await;
    let d = engine("d-mm", b, layout(8, 8192), 2).await;
    let e = p
        .connect(d.side_channel_addr())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("block_len_bytes"), "{e}");
    assert!(p.peers().is_empty());
    assert!(d.peers().is_empty());
}

/// Dropping an engine while a READ into its memory is in flight neither
/// crashes nor frees memory under the provider: the backend quiesces first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_an_engine_with_a_read_in_flight_is_safe() {
    let b = BackendConfig::Libfabric(FabricConfig {
        provider: "tcp;ofi_rxm".into(),
        ..Default::default()
    });
    let l = KvLayout {
        num_regions: 1,
        num_blocks: 64,
        block_len_bytes: 1 << 20,
        block_size_tokens: 16,
    };
    let d = engine("d-drop", b.clone(), l, 2).await;
    for round in 0..3 {
        let p = engine(&format!("p-drop-{round}"), b.clone(), l, 1).await;
        p.connect(d.side_channel_addr()).await.unwrap();
        let p2 = p.clone();
        let t = tokio::spawn(async move {
            p2.read(&ReadRequest {
                peer_engine_id: "d-drop".into(),
                blocks: (0..64)
                    .map(|i| BlockPair {
                        remote: i,
                        local: i,
                    })
                    .collect(),
                direction: Direction::DecodeToPrefill,
                notify: None,
                timeout_ms: None,
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(1 + round)).await;
        t.abort();
        let _ = t.await;
        tokio::task::spawn_blocking(move || drop(p)).await.unwrap();
    }
    // The serving engine still works for a new reader.
    let p = engine("p-drop-after", b, l, 1).await;
    p.connect(d.side_channel_addr()).await.unwrap();
    p.read(&ReadRequest {
        peer_engine_id: "d-drop".into(),
        blocks: vec![BlockPair {
            remote: 5,
            local: 6,
        }],
        direction: Direction::DecodeToPrefill,
        notify: None,
        timeout_ms: None,
    })
    .await
    .unwrap();
    check_block(&p, 6, 2, 5);
}

/// A peer that goes away while this engine keeps READing from it (a peer
/// agent exiting while it is probed): the side channel's close removes the
/// peer concurrently with READs being posted to it. Each READ either
/// completes or fails (peer gone, timeout); the process does not crash, and
/// a new peer under the same id is served afterwards. Bounded: 6 rounds of
/// at most 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_leaving_while_reads_are_posted_to_it_is_safe() {
    let b = BackendConfig::Libfabric(FabricConfig {
        provider: "tcp;ofi_rxm".into(),
        ..Default::default()
    });
    let l = KvLayout {
        num_regions: 1,
        num_blocks: 32,
        block_len_bytes: 64 << 10,
        block_size_tokens: 16,
    };
    let reader = engine("p-reader", b.clone(), l, 1).await;
    for round in 0..6u64 {
        let owner = engine("d-leaving", b.clone(), l, 2).await;
        reader.connect(owner.side_channel_addr()).await.unwrap();
        let r2 = reader.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU32::new(0));
        let (stop2, ok2) = (stop.clone(), ok.clone());
        let reads = tokio::spawn(async move {
            let mut failed = 0u32;
            let t0 = std::time::Instant::now();
            while !stop2.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(3) {
                let r = r2
                    .read(&ReadRequest {
                        peer_engine_id: "d-leaving".into(),
                        blocks: (0..8)
                            .map(|i| BlockPair {
                                remote: i,
                                local: i,
                            })
                            .collect(),
                        direction: Direction::Probe,
                        notify: None,
                        timeout_ms: Some(500),
                    })
                    .await;
                if r.is_ok() {
                    ok2.fetch_add(1, Ordering::Relaxed);
                } else {
                    failed += 1;
                }
            }
            failed
        });
        // Leave while READs are being posted: after the first completed
        // one, at a different point of the loop each round.
        for _ in 0..200 {
            if ok.load(Ordering::Relaxed) > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(3 * round)).await;
        tokio::task::spawn_blocking(move || drop(owner))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.store(true, Ordering::Relaxed);
        let failed = reads.await.unwrap();
        let ok = ok.load(Ordering::Relaxed);
        assert!(
            ok > 0,
            "round {round}: no READ completed before the peer left"
        );
        assert!(
            failed > 0,
            "round {round}: READs to a peer that left kept succeeding ({ok})"
        );
        assert!(reader.peer_metadata("d-leaving").is_none());
    }
    // A new peer under the same id is read correctly.
    let owner = engine("d-leaving", b, l, 2).await;
    reader.connect(owner.side_channel_addr()).await.unwrap();
    reader
        .read(&ReadRequest {
            peer_engine_id: "d-leaving".into(),
            blocks: vec![BlockPair {
                remote: 3,
                local: 4,
            }],
            direction: Direction::DecodeToPrefill,
            notify: None,
            timeout_ms: None,
        })
        .await
        .unwrap();
    check_block(&reader, 4, 2, 3);
}
