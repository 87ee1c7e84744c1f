//! A READ whose caller drops its future while the provider still writes:
//! the destination blocks stay quarantined until the backend completes it,
//! so a new READ into them is refused instead of racing the late data.
//! Two engines in one process, each on a thread inside its own network
//! namespace, joined by a veth limited with `tc tbf` so the READ is slow.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvloop_dataplane::fabric::FabricConfig;
use kvloop_dataplane::*;
use kvloop_tests::{NodePair, require_root};

mod support;
use support::{pattern, read_request};

const BLOCKS: u32 = 16;
const BLOCK_LEN: u64 = 256 * 1024;

/// A tcp;ofi_rxm engine on `ip`, every block filled with `pattern(tag, ..)`.
async fn engine(id: &str, ip: std::net::Ipv4Addr, tag: u8) -> TransferEngine {
    let l = KvLayout {
        num_regions: 2,
        num_blocks: BLOCKS,
        block_len_bytes: BLOCK_LEN,
        block_size_tokens: 16,
    };
    let backend = BackendConfig::Libfabric(FabricConfig {
        provider: "tcp;ofi_rxm".into(),
        ..Default::default()
    });
    support::filled_engine(id, SocketAddr::new(ip.into(), 0), backend, l, 5000, tag).await
}

/// Whether local block `local` of `e` holds remote block `remote` of tag `tag`.
fn holds(e: &TransferEngine, local: u64, tag: u8, remote: u64) -> bool {
    (0..2).all(|r| {
        let mut got = vec![0u8; BLOCK_LEN as usize];
        e.region(r).read_at((local * BLOCK_LEN) as usize, &mut got);
        got == pattern(tag, r, remote, got.len())
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
#[ignore = "needs root (network namespaces, tc)"]
fn dropped_read_future_quarantines_blocks_until_the_backend_completes() {
    require_root("dropped_read_future_quarantines_blocks_until_the_backend_completes");
    let pair = NodePair::create(1000 + std::process::id() % 4000).expect("network namespaces");
    // 8 blocks × 2 regions × 256 KiB = 4 MiB at 40 Mbit/s: about 0.9 s.
    pair.limit_rate_b("40mbit").expect("tc tbf");
    let (addr_tx, addr_rx) = std::sync::mpsc::channel::<SocketAddr>();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (ns_b, addr_b) = (pair.ns_b.clone(), pair.addr_b);
    let owner = std::thread::spawn(move || {
        NodePair::join(&ns_b);
        runtime().block_on(async move {
            let d = engine("decode-0", addr_b, 2).await;
            addr_tx.send(d.side_channel_addr()).unwrap();
            let _ = stop_rx.await;
        });
    });
    let d_addr = addr_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("owner engine started");
    let (ns_a, addr_a) = (pair.ns_a.clone(), pair.addr_a);
    let reader = std::thread::spawn(move || {
        NodePair::join(&ns_a);
        runtime().block_on(async move {
            let p = engine("prefill-0", addr_a, 1).await;
            p.connect(d_addr).await.unwrap();
            // Remote 0..8 into local 0..8; dropped after 200 ms, mid-READ.
            let slow: Vec<(u64, u64)> = (0..8).map(|i| (i, i)).collect();
            let t0 = Instant::now();
            let slow_req = read_request("decode-0", &slow, 30_000);
            let cut = tokio::time::timeout(Duration::from_millis(200), p.read(&slow_req));
            assert!(
                cut.await.is_err(),
                "the READ finished within 200 ms: link not limited?"
            );
            assert_eq!(
                p.quarantined_blocks(),
                (0..8).collect::<Vec<u64>>(),
                "blocks of a READ whose future was dropped must be quarantined"
            );
            // A new READ into those blocks (other remote blocks) is refused.
            let again: Vec<(u64, u64)> = (0..8).map(|i| (i + 8, i)).collect();
            match p.read(&read_request("decode-0", &again, 30_000)).await {
                Err(DataplaneError::BlockQuarantined { block_id }) => assert!(block_id < 8),
                other => panic!("READ into quarantined blocks must be refused, got {other:?}"),
            }
            // Until the abandoned READ completes (its late data lands here).
            while !p.quarantined_blocks().is_empty() {
                assert!(
                    t0.elapsed() < Duration::from_secs(30),
                    "quarantine never ended"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            for b in 0..8 {
                assert!(
                    holds(&p, b, 2, b),
                    "late data of the abandoned READ, block {b}"
                );
            }
            // Handed out again: the new READ lands and nothing overwrites it.
            p.read(&read_request("decode-0", &again, 30_000))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            for b in 0..8 {
                assert!(holds(&p, b, 2, b + 8), "block {b} after the second READ");
            }
        });
    });
    let r = reader.join();
    let _ = stop_tx.send(());
    owner.join().unwrap();
    if let Err(e) = r {
        std::panic::resume_unwind(e);
    }
}
