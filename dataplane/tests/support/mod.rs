//! Shared by the dataplane's integration tests: engines over memfd regions
//! whose every block holds a known pattern, and the pattern itself.
use std::net::SocketAddr;

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
