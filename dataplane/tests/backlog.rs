//! READs with more operations than the provider's queue holds (a vLLM-shaped
//! READ: many regions × many blocks, none contiguous) complete byte-exact:
//! what does not fit waits in the backend's backlog and is posted as
//! completions free room, on a single-threaded runtime where the awaiting
//! tasks drive the completion queue themselves, and with caller-driven
//! progress off (the progress thread alone).
use std::time::Duration;

use kvloop_common::Direction;
use kvloop_dataplane::fabric::FabricConfig;
use kvloop_dataplane::*;

mod support;

/// Regions × blocks × bytes: `shm` posts one IOV per operation and holds
/// 1,024 operations; `tcp;ofi_rxm` posts 4 IOVs and holds 2,048 (libfabric
/// 1.17 here, `fi_info -v`). 32 regions × 300 strided blocks = 9,600
/// descriptors: 9,600 operations on `shm`, 2,400 on `tcp;ofi_rxm`.
const REGIONS: u32 = 32;
const BLOCKS: u32 = 608;
const BLOCK_BYTES: u64 = 1024;
const READ_BLOCKS: u64 = 300;

fn layout() -> KvLayout {
    KvLayout {
        num_regions: REGIONS,
        num_blocks: BLOCKS,
        block_len_bytes: BLOCK_BYTES,
        block_size_tokens: 16,
    }
}

async fn engine(id: &str, fabric: FabricConfig, tag: u8) -> TransferEngine {
    let addr = "127.0.0.1:0".parse().unwrap();
    let backend = BackendConfig::Libfabric(fabric);
    support::filled_engine(id, addr, backend, layout(), 20_000, tag).await
}

/// Block pairs of READ `k` of `n`: remote 2i, local 2i+1 interleaved by `k`
/// (strided on both sides, so nothing coalesces; no local block twice).
fn pairs(k: u64, n: u64) -> Vec<BlockPair> {
    let per = READ_BLOCKS / n;
    (0..per)
        .map(|i| {
            let j = i * n + k;
            BlockPair {
                remote: 2 * j,
                local: 2 * j + 1,
            }
        })
        .collect()
}

fn check(e: &TransferEngine, pairs: &[BlockPair]) {
    let mut got = vec![0u8; BLOCK_BYTES as usize];
    for p in pairs {
        for r in 0..REGIONS as usize {
            e.region(r)
                .read_at((p.local * BLOCK_BYTES) as usize, &mut got);
            assert!(
                got == support::pattern(2, r, p.remote, got.len()),
                "region {r} local block {} (from remote {})",
                p.local,
                p.remote
            );
        }
    }
}

/// `n` concurrent READs together covering [`READ_BLOCKS`] blocks, verified.
async fn reads_over_the_queue_depth(fabric: FabricConfig, n: u64) {
    let p = engine("prefill-0", fabric.clone(), 1).await;
    let d = engine("decode-0", fabric, 2).await;
    p.connect(d.side_channel_addr()).await.unwrap();
    let mut reads = tokio::task::JoinSet::new();
    for k in 0..n {
        let p = p.clone();
        reads.spawn(async move {
            let blocks = pairs(k, n);
            let out = p
                .read(&ReadRequest {
                    peer_engine_id: "decode-0".into(),
                    blocks: blocks.clone(),
                    direction: Direction::DecodeToPrefill,
                    notify: None,
                    timeout_ms: None,
                })
                .await
                .unwrap_or_else(|e| panic!("READ {k} of {n}: {e}"));
            assert_eq!(out.descriptors as u64, blocks.len() as u64 * REGIONS as u64);
            blocks
        });
    }
    let done = tokio::time::timeout(Duration::from_secs(60), reads.join_all())
        .await
        .expect("READs finished within 60 s");
    for blocks in &done {
        check(&p, blocks);
    }
}

fn fabric(provider: &str, caller_spin_us: u64) -> FabricConfig {
    FabricConfig {
        provider: provider.into(),
        caller_spin_us,
        ..Default::default()
    }
}

#[tokio::test]
async fn shm_one_read_beyond_the_queue_depth_on_one_thread() {
    reads_over_the_queue_depth(fabric("shm", 1000), 1).await;
}

#[tokio::test]
async fn shm_concurrent_reads_beyond_the_queue_depth_on_one_thread() {
    reads_over_the_queue_depth(fabric("shm", 1000), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_reads_beyond_the_queue_depth_progress_thread_only() {
    reads_over_the_queue_depth(fabric("shm", 0), 3).await;
}

#[tokio::test]
async fn tcp_rxm_reads_beyond_the_queue_depth_on_one_thread() {
    reads_over_the_queue_depth(fabric("tcp;ofi_rxm", 1000), 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_rxm_reads_beyond_the_queue_depth_progress_thread_only() {
    reads_over_the_queue_depth(fabric("tcp;ofi_rxm", 0), 1).await;
}
