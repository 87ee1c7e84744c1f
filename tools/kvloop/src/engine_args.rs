//! Command-line flags that describe a transfer engine, shared by `node`,
//! `bench read` and `demo`.
use std::net::SocketAddr;

use clap::{Args, ValueEnum};
use kvloop_dataplane::fabric::FabricConfig;
use kvloop_dataplane::nixl::NixlConfig;
use kvloop_dataplane::{BackendConfig, EngineConfig, HostRegion, KvLayout, TransferEngine};

use crate::pattern;

/// Transfer backend selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// libfabric directly (`--provider`).
    Libfabric,
    /// NIXL (`--nixl-plugin`).
    Nixl,
}

/// Flags of one engine.
#[derive(Clone, Debug, Args)]
pub struct EngineArgs {
    /// Engine id (unique per cluster).
    #[arg(long, default_value = "engine-0")]
    pub engine_id: String,
    /// Side-channel listen address (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Transfer backend.
    #[arg(long, value_enum, default_value = "libfabric")]
    pub backend: BackendArg,
    /// libfabric provider: `efa`, `tcp;ofi_rxm`, `shm`.
    #[arg(long, default_value = "tcp;ofi_rxm")]
    pub provider: String,
    /// NIXL backend plugin: `UCX`, `LIBFABRIC`.
    #[arg(long, default_value = "UCX")]
    pub nixl_plugin: String,
    /// KV regions (e.g. layers).
    #[arg(long, default_value_t = 2)]
    pub num_regions: u32,
    /// Blocks per region.
    #[arg(long, default_value_t = 64)]
    pub num_blocks: u32,
    /// Bytes per block per region.
    #[arg(long, default_value_t = 65536)]
    pub block_bytes: u64,
    /// Tokens per block (vLLM `block_size`).
    #[arg(long, default_value_t = 16)]
    pub block_size_tokens: u32,
    /// Fill every block with the deterministic pattern of this tag (0: leave zeroed).
    #[arg(long, default_value_t = 0)]
    pub fill_tag: u64,
    /// libfabric: poll the completion queue continuously (one busy core).
    #[arg(long)]
    pub busy_poll: bool,
    /// libfabric rails: one endpoint per source address (comma-separated;
    /// an empty entry leaves the source to the provider, e.g. `shm`). A
    /// READ's bytes are spread across them. Default: one endpoint.
    #[arg(long, value_delimiter = ',')]
    pub rails: Vec<String>,
    /// Default READ timeout, ms.
    #[arg(long, default_value_t = 5000)]
    pub read_timeout_ms: u64,
}

impl EngineArgs {
    /// The KV layout.
    pub fn layout(&self) -> KvLayout {
        KvLayout {
            num_regions: self.num_regions,
            num_blocks: self.num_blocks,
            block_len_bytes: self.block_bytes,
            block_size_tokens: self.block_size_tokens,
        }
    }

    /// The backend configuration.
    pub fn backend_config(&self) -> BackendConfig {
        match self.backend {
            BackendArg::Libfabric => BackendConfig::Libfabric(FabricConfig {
                provider: self.provider.clone(),
                busy_poll: self.busy_poll,
                rails: self.rails.clone(),
                ..Default::default()
            }),
            BackendArg::Nixl => BackendConfig::Nixl(NixlConfig {
                plugin: self.nixl_plugin.clone(),
                ..Default::default()
            }),
        }
    }

    /// Allocates memfd regions, fills them, and starts the engine.
    pub async fn start(&self) -> anyhow::Result<TransferEngine> {
        let layout = self.layout();
        layout.validate()?;
        let regions = (0..layout.num_regions)
            .map(|r| {
                HostRegion::new(
                    &format!("{}-r{r}", self.engine_id),
                    layout.region_len_bytes() as usize,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        if self.fill_tag != 0 {
            let mut buf = vec![0u8; layout.block_len_bytes as usize];
            for (r, region) in regions.iter().enumerate() {
                for b in 0..layout.num_blocks as u64 {
                    pattern::fill(self.fill_tag, r as u64, b, &mut buf);
                    region.write_at((b * layout.block_len_bytes) as usize, &buf);
                }
            }
        }
        let cfg = EngineConfig {
            engine_id: self.engine_id.clone(),
            side_channel_addr: self.listen,
            backend: self.backend_config(),
            layout,
            read_timeout_ms: self.read_timeout_ms,
            handshake_timeout_ms: 5000,
        };
        Ok(TransferEngine::start(cfg, regions).await?)
    }

    /// Flags that recreate this engine in a child process (`kvloop node ...`),
    /// with another id, address and tag.
    pub fn child_args(&self, engine_id: &str, listen: &str, fill_tag: u64) -> Vec<String> {
        let backend = match self.backend {
            BackendArg::Libfabric => "libfabric",
            BackendArg::Nixl => "nixl",
        };
        [
            "--engine-id",
            engine_id,
            "--listen",
            listen,
            "--backend",
            backend,
            "--provider",
            &self.provider,
            "--nixl-plugin",
            &self.nixl_plugin,
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([
            "--num-regions".into(),
            self.num_regions.to_string(),
            "--num-blocks".into(),
            self.num_blocks.to_string(),
            "--block-bytes".into(),
            self.block_bytes.to_string(),
            "--block-size-tokens".into(),
            self.block_size_tokens.to_string(),
            "--fill-tag".into(),
            fill_tag.to_string(),
            "--read-timeout-ms".into(),
            self.read_timeout_ms.to_string(),
        ])
        .collect()
    }

    /// [`EngineArgs::child_args`] for a child with its own rails (`--rails`;
    /// none: one endpoint).
    pub fn child_args_with_rails(
        &self,
        engine_id: &str,
        listen: &str,
        fill_tag: u64,
        rails: &[String],
    ) -> Vec<String> {
        let mut v = self.child_args(engine_id, listen, fill_tag);
        if !rails.is_empty() {
            v.push(format!("--rails={}", rails.join(",")));
        }
        v
    }
}

/// Checks local blocks after a READ against the pattern of `(tag, region,
/// remote block)`; returns (verified, mismatched) block counts (one block
/// id counts once, across all its regions).
pub fn verify(
    engine: &TransferEngine,
    tag: u64,
    pairs: &[kvloop_dataplane::BlockPair],
) -> (u64, u64) {
    let l = engine.layout();
    let mut buf = vec![0u8; l.block_len_bytes as usize];
    let (mut ok, mut bad) = (0, 0);
    for p in pairs {
        let mut good = true;
        for r in 0..l.num_regions as usize {
            engine
                .region(r)
                .read_at((p.local * l.block_len_bytes) as usize, &mut buf);
            good &= pattern::matches(tag, r as u64, p.remote, &buf);
        }
        if good { ok += 1 } else { bad += 1 }
    }
    (ok, bad)
}
