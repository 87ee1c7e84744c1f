//! Configuration of one simulated engine: its role, KV mode, tokenizer and
//! every simulation knob ([`SimConfig`], also the binary's command line).
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Where an engine's KV lives and who performs its READs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvMode {
    /// No KV memory: READs are simulated by [`crate::transfer::SimulatedTransfer`] (a sleep).
    None,
    /// Real memfd KV regions and an in-process transfer engine that does the
    /// engine's own READs (observe mode, like stock vLLM with NIXL).
    Inproc,
    /// Real memfd KV regions registered with the node agent
    /// (`--agent-socket`), which serves them, keeps their leases and does the
    /// engine's READs (managed mode).
    Agent,
}

/// How prompts become tokens (both roles must agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per whitespace-separated word ([`crate::tokenizer::tokenize_text`]).
    Words,
    /// Word pieces ([`crate::tokenizer::tokenize_pieces`]): about as many tokens as a BPE
    /// tokenizer (cl100k) on source code, still prefix-stable at word boundaries.
    Pieces,
}

/// Where a streaming D puts its `kv_transfer_params`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum StreamParams {
    /// A chunk of their own, `{"choices":[],"kv_transfer_params":...}`,
    /// after the finish chunk and before `data: [DONE]`.
    OwnChunk,
    /// On the chunk that carries `finish_reason`.
    FinishChunk,
    /// Not in the stream at all (stock vLLM 0.32.0 streaming).
    None,
}

/// Role of a simulated engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill engine (P): computes the prompt, returns one token and its params.
    Prefill,
    /// Decode engine (D): generates the answer and keeps its blocks for the next turn.
    Decode,
}

/// Configuration of one simulated engine. Every field has a default suited to
/// tests; numbers are simulation knobs, not measurements.
#[derive(Clone, Debug, clap::Args)]
pub struct SimConfig {
    /// Role of this engine.
    #[arg(long, value_enum, default_value = "prefill")]
    pub role: Role,
    /// Engine id (`remote_engine_id` in the params it emits).
    #[arg(long, default_value = "sim-0")]
    pub engine_id: String,
    /// Model name served (`/v1/models`).
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// OpenAI-compatible HTTP listen address (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub http_addr: SocketAddr,
    /// Side-channel listen address (lease checks and READ notifications).
    /// Not listened on in `--kv-mode agent`: the agent's side channel
    /// serves the engine's blocks there.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub side_channel_addr: SocketAddr,
    /// Host written into `remote_host` (default: the side-channel IP, bracketed if IPv6).
    #[arg(long)]
    pub advertised_host: Option<String>,
    /// Prefill cost per computed token, microseconds (real sleep).
    #[arg(long, default_value_t = 20)]
    pub prefill_us_per_token: u64,
    /// Simulated READ cost per transferred token, microseconds (real sleep).
    #[arg(long, default_value_t = 2)]
    pub transfer_us_per_token: u64,
    /// Delay between streamed output tokens, microseconds.
    #[arg(long, default_value_t = 0)]
    pub decode_us_per_token: u64,
    /// How long D keeps a finished request's blocks, ms (vLLM default 480 s).
    #[arg(long, default_value_t = 480_000)]
    pub decoder_kv_blocks_ttl_ms: u64,
    /// How long P holds its blocks after a prefill waiting for D's READ, ms (vLLM: 30 s).
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// An emitter declines a READ of blocks expiring within this margin, ms (vLLM: 5 s).
    #[arg(long, default_value_t = 5_000)]
    pub expiry_margin_ms: u64,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size_tokens: u32,
    /// Blocks in the simulated KV cache.
    #[arg(long, default_value_t = 1 << 20)]
    pub num_blocks: u32,
    /// Tensor-parallel size reported in the params.
    #[arg(long, default_value_t = 1)]
    pub tp_size: u32,
    /// Decode-context-parallel size reported in the params (`dcp_size`;
    /// vLLM: `decode_context_parallel_size`, default 1).
    #[arg(long, default_value_t = 1)]
    pub dcp_size: u32,
    /// Pipeline-parallel size reported in the params (`pp_size`; vLLM:
    /// `pipeline_parallel_size`, default 1).
    #[arg(long, default_value_t = 1)]
    pub pp_size: u32,
    /// D, streaming: where the answer's `kv_transfer_params` go (vLLM
    /// versions differ): `own-chunk` (a chunk of their own with empty
    /// `choices`, before `[DONE]`), `finish-chunk` (on the chunk that carries
    /// `finish_reason`), `none` (not streamed, as stock vLLM 0.32.0; D still
    /// holds the blocks until their TTL).
    #[arg(long, value_enum, default_value = "own-chunk")]
    pub stream_params: StreamParams,
    /// Output tokens when the request has no `max_tokens`.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u64,
    /// P-side recompute threshold (tokens): below it P recomputes even with params.
    /// 0 leaves the decision to the router.
    #[arg(long, default_value_t = 0)]
    pub kv_recompute_threshold_tokens: u64,
    /// Do not serve `/tokenize` (404), like an engine without that endpoint.
    #[arg(long)]
    pub no_tokenize: bool,
    /// Prefill cost profile (`qwen3-32b-h200`, `glm-5-fp8-h200`); replaces
    /// `prefill_us_per_token` with `t0 + new × (a + b × (ctx + new/2))` (see [`crate::profile`]).
    #[arg(long)]
    pub profile: Option<String>,
    /// Multiplies every simulated compute time (prefill, decode); 0.5 runs
    /// twice as fast as real time. Transfers are real and never scaled.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// KV memory and READs: `none` (simulated), `inproc` (real memfd KV and
    /// in-process READs), `agent` (real memfd KV managed by the node agent
    /// at `--agent-socket`).
    #[arg(long, value_enum, default_value = "none")]
    pub kv_mode: KvMode,
    /// KV bytes per token over all layers (scaled; see [`crate::kv`]). Default
    /// 2048 = 4 layers × 512 B (real Qwen3-32B: 256 KiB, 32 KiB per GPU at TP 8).
    #[arg(long, default_value_t = 2048)]
    pub kv_bytes_per_token: u64,
    /// Simulated layers (one memory region each).
    #[arg(long, default_value_t = 4)]
    pub kv_layers: u32,
    /// KV capacity in tokens with real KV memory (caps `num_blocks`).
    #[arg(long, default_value_t = 262_144)]
    pub kv_capacity_tokens: u64,
    /// libfabric provider of the in-process transfer engine (`inproc`; in
    /// `agent` mode the agent's configured backend is used).
    #[arg(long, default_value = "tcp;ofi_rxm")]
    pub kv_provider: String,
    /// Transfer-engine side-channel address (default: the side-channel IP,
    /// port 0). In `agent` mode only its port is used (0: the agent picks),
    /// on the agent's node address.
    #[arg(long)]
    pub kv_listen: Option<SocketAddr>,
    /// READ timeout, ms.
    #[arg(long, default_value_t = 5_000)]
    pub kv_read_timeout_ms: u64,
    /// Tokenizer: `words` or `pieces`.
    #[arg(long, value_enum, default_value = "words")]
    pub tokenizer: TokenizerKind,
    /// Unix socket of the node agent (`kvloop-agent`). Required by
    /// `--kv-mode agent` (the KV memory is registered there); in any mode a
    /// prefill engine reports every prefill's (prompt tokens, reused tokens,
    /// latency) to it, which feeds the agent's cost model.
    #[arg(long)]
    pub agent_socket: Option<std::path::PathBuf>,
    /// Prefills computed at once (P); later ones wait in arrival order, as
    /// requests queue behind a busy GPU. 0: no limit (each prefill computes
    /// as if alone). READs of D's blocks happen before the wait, as vLLM
    /// loads remote KV before scheduling the request.
    #[arg(long, default_value_t = 0)]
    pub prefill_concurrency: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            role: Role::Prefill,
            engine_id: "sim-0".into(),
            model: "sim-model".into(),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            side_channel_addr: "127.0.0.1:0".parse().unwrap(),
            advertised_host: None,
            prefill_us_per_token: 20,
            transfer_us_per_token: 2,
            decode_us_per_token: 0,
            decoder_kv_blocks_ttl_ms: 480_000,
            lease_ms: 30_000,
            expiry_margin_ms: 5_000,
            block_size_tokens: 16,
            num_blocks: 1 << 20,
            tp_size: 1,
            dcp_size: 1,
            pp_size: 1,
            stream_params: StreamParams::OwnChunk,
            default_max_tokens: 16,
            kv_recompute_threshold_tokens: 0,
            no_tokenize: false,
            profile: None,
            time_scale: 1.0,
            kv_mode: KvMode::None,
            kv_bytes_per_token: 2048,
            kv_layers: 4,
            kv_capacity_tokens: 262_144,
            kv_provider: "tcp;ofi_rxm".into(),
            kv_listen: None,
            kv_read_timeout_ms: 5_000,
            tokenizer: TokenizerKind::Words,
            agent_socket: None,
            prefill_concurrency: 0,
        }
    }
}
