//! Real KV memory for the simulator: memfd regions registered either with an
//! in-process [`TransferEngine`] (observe mode: the engine does its own READs,
//! as stock vLLM does with NIXL) or with the node agent (managed mode, see
//! [`crate::managed`]), deterministic KV content, byte-exact
//! verification of every block that arrives, and a [`KvTransfer`] that really
//! READs the emitter's blocks.
//!
//! # Layout and scaling
//!
//! One region per simulated layer (`kv_layers`), each holding `num_blocks`
//! blocks of `block_size_tokens × slot_bytes` bytes, where
//! `slot_bytes = kv_bytes_per_token / kv_layers` is one token's K and V in one
//! layer. The real Qwen3-32B KV is 64 layers × 8 KV heads × 128 (head dim)
//! × 2 (K, V) × 2 B (bf16) = 256 KiB per token, 32 KiB per GPU at TP 8. The
//! demo scales this down to 2 KiB per token (4 layers × 512 B) so that a 24k-token
//! READ over a veth on a 2-core machine moves 48 MiB and costs tens of ms,
//! the order of the published 30–130 ms D→P transfers over EFA.
//!
//! # Content
//!
//! The bytes of token slot (token id `t`, position `p`, layer `l`) are a
//! pure function of `(t, p, l)` ([`fill_slot`]): an engine writes them when a
//! prefill computes tokens, and a reader checks every block it READs against
//! what it would have computed for its own prompt. A mismatched block makes
//! the reader recompute; wrong KV is never served.
use std::net::SocketAddr;
use std::sync::Arc;

use kvloop_common::Direction;
use kvloop_dataplane::fabric::FabricConfig;
use kvloop_dataplane::{
    BackendConfig, EngineConfig, HostRegion, KvLayout, TransferEngine,
    engine::{OwnerNotify, ReadRequest as DpReadRequest},
};
use serde_json::Value;

use crate::managed::{AgentLink, Registration};
use crate::transfer::{
    KvTransfer, ReadFuture, ReadRequest, TransferError, claim_on_side_channel, side_channel_http,
};

/// Shape of the simulated KV cache.
#[derive(Clone, Debug)]
pub struct KvShape {
    /// KV bytes per token over all layers (a multiple of `8 × layers`).
    pub bytes_per_token: u64,
    /// Layers (one memory region each).
    pub layers: u32,
    /// Tokens per block.
    pub block_size_tokens: u32,
    /// Blocks per region.
    pub num_blocks: u32,
}

impl KvShape {
    /// Bytes of one token in one layer.
    pub fn slot_bytes(&self) -> usize {
        (self.bytes_per_token / u64::from(self.layers)) as usize
    }

    /// The dataplane layout.
    pub fn layout(&self) -> KvLayout {
        KvLayout {
            num_regions: self.layers,
            num_blocks: self.num_blocks,
            block_len_bytes: self.slot_bytes() as u64 * u64::from(self.block_size_tokens),
            block_size_tokens: self.block_size_tokens,
        }
    }

    /// Checks the shape.
    ///
    /// # Errors
    /// A message naming the bad field.
    pub fn validate(&self) -> Result<(), String> {
        if self.layers == 0 {
            return Err("kv_layers: expected at least 1".into());
        }
        if self.bytes_per_token == 0
            || !self
                .bytes_per_token
                .is_multiple_of(8 * u64::from(self.layers))
        {
            return Err(format!(
                "kv_bytes_per_token: expected a positive multiple of 8 × kv_layers ({}), got {}",
                8 * self.layers,
                self.bytes_per_token
            ));
        }
        if self.block_size_tokens == 0 || self.num_blocks == 0 {
            return Err("block_size_tokens / kv capacity: expected at least 1".into());
        }
        Ok(())
    }
}

fn mix(mut x: u64) -> u64 {
    // splitmix64 finalizer
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Writes the deterministic KV bytes of (token id, position, layer) into
/// `out` (length a multiple of 8).
pub fn fill_slot(out: &mut [u8], token: u32, position: u64, layer: u32) {
    let seed = mix((u64::from(token) << 32)
        ^ position.wrapping_mul(0x9e37_79b9)
        ^ (u64::from(layer) << 56));
    for (j, chunk) in out.chunks_exact_mut(8).enumerate() {
        let w = (seed ^ (j as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .wrapping_mul(0xd6e8_feb8_6659_fd93);
        chunk.copy_from_slice(&(w ^ (w >> 32)).to_le_bytes());
    }
}

/// Result of checking READ blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerifyOutcome {
    /// Blocks whose every token slot in every layer matched.
    pub verified_blocks: u64,
    /// Blocks with at least one differing byte.
    pub mismatched_blocks: u64,
}

/// Who holds an engine's KV regions and does its READs.
enum Backing {
    /// An in-process transfer engine (observe mode; it owns the regions).
    Inproc(TransferEngine),
    /// The node agent (managed mode): the engine keeps its memfd mappings,
    /// the agent maps the same pages and does the READs.
    Agent {
        regions: Vec<HostRegion>,
        registration: Arc<Registration>,
    },
}

/// An engine's KV memory and who moves it.
pub struct KvMemory {
    backing: Backing,
    shape: KvShape,
    connect_lock: tokio::sync::Mutex<()>,
}

fn new_regions(engine_id: &str, shape: &KvShape) -> Result<Vec<HostRegion>, String> {
    shape.validate()?;
    let layout = shape.layout();
    (0..shape.layers)
        .map(|l| {
            HostRegion::new(
                &format!("kvloop-sim-{engine_id}-l{l}"),
                layout.region_len_bytes() as usize,
            )
            .map_err(|e| format!("memfd region {l}: {e}"))
        })
        .collect()
}

impl KvMemory {
    /// Creates `shape.layers` memfd regions and starts a transfer engine on
    /// them (libfabric `provider`, side channel on `listen`).
    ///
    /// # Errors
    /// A message naming the failing step (shape, memfd, backend).
    pub async fn start(
        engine_id: &str,
        shape: KvShape,
        provider: &str,
        listen: SocketAddr,
        read_timeout_ms: u64,
    ) -> Result<Self, String> {
        let regions = new_regions(engine_id, &shape)?;
        let cfg = EngineConfig {
            engine_id: engine_id.to_string(),
            side_channel_addr: listen,
            backend: BackendConfig::Libfabric(FabricConfig {
                provider: provider.to_string(),
                bind_node: provider.starts_with("tcp").then(|| listen.ip().to_string()),
                ..Default::default()
            }),
            layout: shape.layout(),
            read_timeout_ms,
            handshake_timeout_ms: 5000,
        };
        let engine = TransferEngine::start(cfg, regions)
            .await
            .map_err(|e| format!("transfer engine ({provider}): {e}"))?;
        Ok(Self {
            backing: Backing::Inproc(engine),
            shape,
            connect_lock: tokio::sync::Mutex::new(()),
        })
    }

    /// Creates `shape.layers` memfd regions and registers them with the node
    /// agent behind `link` (managed mode); `side_channel_port` 0/`None` lets
    /// the agent pick its side-channel port.
    ///
    /// # Errors
    /// A message naming the failing step (shape, memfd, agent).
    pub async fn register_with_agent(
        engine_id: &str,
        shape: KvShape,
        link: Arc<AgentLink>,
        side_channel_port: Option<u16>,
    ) -> Result<Self, String> {
        let regions = new_regions(engine_id, &shape)?;
        let registration = Arc::new(
            Registration::register(link, engine_id, shape.layout(), &regions, side_channel_port)
                .await?,
        );
        Ok(Self {
            backing: Backing::Agent {
                regions,
                registration,
            },
            shape,
            connect_lock: tokio::sync::Mutex::new(()),
        })
    }

    /// KV region of layer `l` (this process's mapping).
    pub fn region(&self, l: usize) -> &HostRegion {
        match &self.backing {
            Backing::Inproc(e) => e.region(l),
            Backing::Agent { regions, .. } => &regions[l],
        }
    }

    /// The in-process transfer engine (observe mode only).
    pub fn transfer_engine(&self) -> Option<&TransferEngine> {
        match &self.backing {
            Backing::Inproc(e) => Some(e),
            Backing::Agent { .. } => None,
        }
    }

    /// The registration with the node agent (managed mode only).
    pub fn registration(&self) -> Option<&Arc<Registration>> {
        match &self.backing {
            Backing::Inproc(_) => None,
            Backing::Agent { registration, .. } => Some(registration),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &KvShape {
        &self.shape
    }

    /// The side-channel address readers connect to: the in-process transfer
    /// engine's, or the one the agent serves this engine's blocks on.
    pub fn dataplane_addr(&self) -> SocketAddr {
        match &self.backing {
            Backing::Inproc(e) => e.side_channel_addr(),
            Backing::Agent { registration, .. } => registration.side_channel(),
        }
    }

    /// Bytes one block id covers over all layers.
    pub fn bytes_per_block(&self) -> u64 {
        self.shape.layout().bytes_per_block_id()
    }

    /// Writes the KV of `tokens[from..to]` (positions `from..to`) into the
    /// blocks `block_ids` (block `i` holds positions `i × block_size ..`).
    /// Positions without a block are skipped.
    pub fn write_tokens(&self, block_ids: &[u32], tokens: &[u32], from: usize, to: usize) {
        let bs = self.shape.block_size_tokens as usize;
        let sb = self.shape.slot_bytes();
        let block_len = sb * bs;
        let to = to.min(tokens.len()).min(block_ids.len() * bs);
        let mut buf = vec![0u8; block_len];
        let mut p = from;
        while p < to {
            let b = p / bs;
            let end = ((b + 1) * bs).min(to);
            let first_slot = p % bs;
            let n = end - p;
            for l in 0..self.shape.layers {
                for k in 0..n {
                    fill_slot(
                        &mut buf[k * sb..(k + 1) * sb],
                        tokens[p + k],
                        (p + k) as u64,
                        l,
                    );
                }
                let off = block_ids[b] as usize * block_len + first_slot * sb;
                self.region(l as usize).write_at(off, &buf[..n * sb]);
            }
            p = end;
        }
    }

    /// Checks the first `n` token slots (positions `0..n`) held in
    /// `block_ids` against `tokens`, block by block.
    pub fn verify_tokens(&self, block_ids: &[u32], tokens: &[u32], n: usize) -> VerifyOutcome {
        let bs = self.shape.block_size_tokens as usize;
        let sb = self.shape.slot_bytes();
        let block_len = sb * bs;
        let n = n.min(tokens.len());
        let mut got = vec![0u8; block_len];
        let mut want = vec![0u8; block_len];
        let mut out = VerifyOutcome::default();
        for (b, id) in block_ids.iter().enumerate().take(n.div_ceil(bs)) {
            let slots = (n - b * bs).min(bs);
            let mut ok = true;
            for l in 0..self.shape.layers {
                self.region(l as usize)
                    .read_at(*id as usize * block_len, &mut got[..slots * sb]);
                for k in 0..slots {
                    let p = b * bs + k;
                    fill_slot(&mut want[k * sb..(k + 1) * sb], tokens[p], p as u64, l);
                }
                if got[..slots * sb] != want[..slots * sb] {
                    ok = false;
                    break;
                }
            }
            if ok {
                out.verified_blocks += 1;
            } else {
                out.mismatched_blocks += 1;
            }
        }
        out
    }

    /// Connects to the peer at `addr` unless `engine_id` is connected already.
    async fn ensure_connected(&self, engine_id: &str, addr: SocketAddr) -> Result<(), String> {
        let _g = self.connect_lock.lock().await;
        let engine = self
            .transfer_engine()
            .ok_or_else(|| "managed mode: the node agent connects to peers".to_string())?;
        if engine.peer_metadata(engine_id).is_some() {
            return Ok(());
        }
        engine
            .connect(addr)
            .await
            .map(|_| ())
            .map_err(|e| format!("connect {engine_id} at {addr}: {e}"))
    }
}

/// The observe-mode [`KvTransfer`]: claims the emitter's blocks over its
/// side channel (`POST /kv/read` with `defer_release`; the emitter keeps the
/// blocks until the owner notification), then READs them with the
/// in-process transfer engine into the reader's blocks and notifies the owner
/// (`"<request id>:1"`), which frees them.
pub struct DataplaneTransfer {
    http: reqwest::Client,
    kv: Arc<KvMemory>,
    direction: Direction,
    read_timeout_ms: u64,
}

impl DataplaneTransfer {
    /// A transfer for a reader in `direction` (`DecodeToPrefill` for a P
    /// engine, `PrefillToDecode` for D).
    pub fn new(kv: Arc<KvMemory>, direction: Direction, read_timeout_ms: u64) -> Self {
        Self {
            http: side_channel_http(),
            kv,
            direction,
            read_timeout_ms,
        }
    }
}

impl KvTransfer for DataplaneTransfer {
    fn read(&self, req: ReadRequest) -> ReadFuture<'_> {
        Box::pin(async move {
            let blocks = req.block_pairs()?;
            let v = claim_on_side_channel(&self.http, &req, true).await?;
            let addr: SocketAddr = v
                .get("dataplane_addr")
                .and_then(Value::as_str)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| {
                    TransferError::SideChannel(format!(
                        "{}:{}: claim answer without a dataplane_addr (ip:port): {v}",
                        req.remote_host, req.remote_port
                    ))
                })?;
            self.kv
                .ensure_connected(&req.remote_engine_id, addr)
                .await
                .map_err(TransferError::Transfer)?;
            let dp = DpReadRequest {
                peer_engine_id: req.remote_engine_id.clone(),
                blocks,
                direction: self.direction,
                notify: Some(OwnerNotify {
                    owner_request_id: req.remote_request_id.clone(),
                    count: 1,
                }),
                timeout_ms: Some(self.read_timeout_ms),
            };
            let engine = self.kv.transfer_engine().ok_or_else(|| {
                TransferError::Transfer("managed mode: READs go through the node agent".into())
            })?;
            engine.read(&dp).await.map_err(|e| match e {
                e @ kvloop_dataplane::DataplaneError::Timeout { .. } => {
                    TransferError::Abandoned(e.to_string())
                }
                e => TransferError::Transfer(e.to_string()),
            })?;
            Ok(req.num_tokens)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_content_depends_on_token_position_and_layer() {
        let mut a = [0u8; 64];
        let mut b = [0u8; 64];
        fill_slot(&mut a, 1, 2, 3);
        fill_slot(&mut b, 1, 2, 3);
        assert_eq!(a, b);
        for (t, p, l) in [(2, 2, 3), (1, 3, 3), (1, 2, 4)] {
            fill_slot(&mut b, t, p, l);
            assert_ne!(a, b, "({t},{p},{l})");
        }
    }

    #[test]
    fn shape_is_validated() {
        let s = KvShape {
            bytes_per_token: 2048,
            layers: 4,
            block_size_tokens: 16,
            num_blocks: 8,
        };
        assert!(s.validate().is_ok());
        assert_eq!(s.slot_bytes(), 512);
        assert_eq!(s.layout().block_len_bytes, 8192);
        let bad = KvShape {
            bytes_per_token: 100,
            ..s
        };
        assert!(bad.validate().unwrap_err().contains("kv_bytes_per_token"));
    }
}
