//! Shared by the dataplane's integration tests: engines over memfd regions
//! whose every block holds a known pattern, the pattern itself, and the
//! checks and requests the tests share.
// Each test file includes this module and uses part of it.
#![allow(dead_code)]
use std::net::SocketAddr;
use std::time::Duration;

use kvloop_common::Direction;

use kvloop_dataplane::*;

/// Deterministic content of (engine tag, region, block): `len` bytes.
pub fn pattern(tag: u8, region: usize, block: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 31 + block * 7 + region as u64 * 13 + tag as u64) as u8)
        .collect()
}

/// Starts engine `id` on `addr` with `backend` over fresh memfd regions of
/// `layout`, every block filled with [`pattern`]`(tag, ..)`. Panics naming
/// the engine when it does not start.
pub async fn filled_engine(
    id: &str,
    addr: SocketAddr,
    backend: BackendConfig,
    layout: KvLayout,
    read_timeout_ms: u64,
    tag: u8,
) -> TransferEngine {
    let regions = (0..layout.num_regions)
        .map(|r| HostRegion::new(&format!("{id}-{r}"), layout.region_len_bytes() as usize).unwrap())
        .collect();
    let e = TransferEngine::start(
        EngineConfig {
            engine_id: id.into(),
            side_channel_addr: addr,
            backend,
            layout,
            read_timeout_ms,
            handshake_timeout_ms: 5000,
        },
        regions,
    )
    .await
    .unwrap_or_else(|e| panic!("engine {id} failed to start: {e}"));
    let len = layout.block_len_bytes as usize;
    for r in 0..layout.num_regions as usize {
        for b in 0..layout.num_blocks as u64 {
            e.region(r)
                .write_at(b as usize * len, &pattern(tag, r, b, len));
        }
    }
    e
}

/// Asserts that `e`'s block `local` holds, in every region, the pattern of
/// block `remote` of the engine tagged `src_tag`.
pub fn check_block(e: &TransferEngine, local: u64, src_tag: u8, remote: u64) {
    let l = e.layout();
    for r in 0..l.num_regions as usize {
        let mut got = vec![0u8; l.block_len_bytes as usize];
        e.region(r)
            .read_at((local * l.block_len_bytes) as usize, &mut got);
        assert!(
            got == pattern(src_tag, r, remote, got.len()),
            "region {r} local block {local} differs from remote block {remote}"
        );
    }
}

/// A D→P READ of `pairs` (remote, local) from `peer`.
pub fn read_request(peer: &str, pairs: &[(u64, u64)], timeout_ms: u64) -> ReadRequest {
    ReadRequest {
        peer_engine_id: peer.into(),
        blocks: pairs
            .iter()
            .map(|&(remote, local)| BlockPair { remote, local })
            .collect(),
        direction: Direction::DecodeToPrefill,
        notify: None,
        timeout_ms: Some(timeout_ms),
    }
}

/// Waits (up to 1 s) until `e` learned a peer from a handshake the other
/// side started.
pub async fn wait_for_peer(e: &TransferEngine) {
    for _ in 0..100 {
        if !e.peers().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
