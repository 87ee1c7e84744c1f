//! The agent's configuration: TOML file, then `KVLOOP_AGENT_*` environment
//! variables and command-line flags (see `main.rs`) override single fields.
//! Every field has a default, given in its docstring.
//!
//! ```toml
//! agent_id = "node-a"
//! node_addr = "10.0.0.1"
//! http_listen = "10.0.0.1:9470"
//! socket_path = "/run/kvloop/agent.sock"
//! backend = { kind = "libfabric", provider = "tcp;ofi_rxm" }
//! push_period_ms = 1000
//!
//! [[peers]]
//! name = "node-b"
//! http = "10.0.0.2:9470"
//!
//! [[routers]]
//! url = "http://10.0.0.9:8000"
//! token = "s3cret"   # or KVLOOP_AGENT_ROUTER_TOKEN
//!
//! [[pairs]]
//! prefill_engine_id = "p0"
//! decode_engine_id = "d0"
//! decode_peer = "node-b"
//! bytes_per_token = 262144
//! ```
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use kvloop_costmodel::CostModelConfig;
use kvloop_dataplane::BackendConfig;
use kvloop_dataplane::fabric::FabricConfig;
use serde::{Deserialize, Serialize};

use crate::lease::LeaseConfig;

/// Agent configuration (TOML). Defaults in brackets.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Identity of this agent (node name) in threshold pushes and peer
    /// tables [the host name].
    pub agent_id: String,
    /// Address of this node on the KV network: side channels of hosted
    /// engines and of the probe engine bind to it [`127.0.0.1`].
    pub node_addr: IpAddr,
    /// HTTP listen address: `/metrics`, `/healthz`, and the versioned
    /// agent-to-agent API under `/v1/` [`127.0.0.1:9470`].
    pub http_listen: SocketAddr,
    /// Unix socket of the local API (mode 0600; only the same uid or root
    /// may talk to it) [`/run/kvloop/agent.sock`].
    pub socket_path: PathBuf,
    /// Transfer backend of every engine the agent runs
    /// [`{ kind = "libfabric", provider = "tcp;ofi_rxm" }`].
    pub backend: BackendConfig,
    /// READ timeout when a request gives none, ms [5000].
    pub read_timeout_ms: u64,
    /// Abandon a managed READ still in flight once recomputing its blocks
    /// would have finished (the reading engine's prefill model; never
    /// before 4x the path's prediction), or earlier, once it is overdue and
    /// its completed operations show the rest would take longer than
    /// recomputing: the engine recomputes, as after a timeout
    /// (`crate::overdue::abandon_after_ms`,
    /// `kvloop_router_api::abandon::abandon_on_progress`; counted as
    /// `kvloop_agent_reads{result="abandoned"}`) [true].
    pub abandon_slow_reads: bool,
    /// Threshold push period, ms [1000]. A refit that moves a pair's threshold
    /// or cost model (`kvloop_costmodel::urgent_push`) is pushed at once.
    pub push_period_ms: u64,
    /// `valid_for_ms` of pushed thresholds, as a multiple of the push period;
    /// must be below 3 [2.5].
    pub valid_for_periods: f64,
    /// First retry delay of a failed push, ms; doubles per attempt [100].
    pub push_retry_initial_ms: u64,
    /// Attempts per push and router (the next period pushes fresh values) [3].
    pub push_attempts: u32,
    /// Timeout of one push request, ms [1000].
    pub push_timeout_ms: u64,
    /// Fail `--check` and refuse to start when eBPF probes cannot load
    /// [false: fall back to user-space timing].
    pub require_ebpf: bool,
    /// The READ-site probes time every READ of at least
    /// `read_site_full_bytes` and one in `read_site_sample_every` of the
    /// smaller ones, counted that many times in the histograms (a probed
    /// READ costs about 2 µs of CPU) [32; 1 probes every READ].
    pub read_site_sample_every: u32,
    /// See `read_site_sample_every` [1048576].
    pub read_site_full_bytes: u64,
    /// Prefill servers timed in the kernel by the eBPF prefill probe
    /// (observe mode: stock engines that do not report their prefill
    /// timings); requests must carry `X-KVLoop-Tokens` (the router adds it)
    /// [none].
    pub prefill_ports: Vec<PrefillPort>,
    /// Lease policy of retained blocks.
    pub lease: LeaseConfig,
    /// Active probes.
    pub probe: ProbeConfig,
    /// Network state watch.
    pub network: NetworkConfig,
    /// Observe mode: the NIXL transfers of stock engines on this node.
    pub observe: ObserveConfig,
    /// Peer agents [none].
    pub peers: Vec<PeerConfig>,
    /// Routers to push thresholds to [none].
    pub routers: Vec<RouterTarget>,
    /// (P, D) pairs whose thresholds this agent computes [none].
    pub pairs: Vec<PairConfig>,
    /// The cost model (see `kvloop-costmodel`'s `CostModelConfig`).
    pub cost_model: CostModelConfig,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            agent_id: hostname(),
            node_addr: IpAddr::from([127, 0, 0, 1]),
            http_listen: "127.0.0.1:9470".parse().expect("valid"),
            socket_path: "/run/kvloop/agent.sock".into(),
            backend: BackendConfig::Libfabric(default_fabric()),
            read_timeout_ms: 5000,
            abandon_slow_reads: true,
            push_period_ms: 1000,
            valid_for_periods: 2.5,
            push_retry_initial_ms: 100,
            push_attempts: 3,
            push_timeout_ms: 1000,
            require_ebpf: false,
            read_site_sample_every: kvloop_common::usdt::DEFAULT_SITE_SAMPLE_EVERY,
            read_site_full_bytes: kvloop_common::usdt::DEFAULT_SITE_FULL_BYTES,
            prefill_ports: Vec::new(),
            lease: LeaseConfig::default(),
            probe: ProbeConfig::default(),
            network: NetworkConfig::default(),
            observe: ObserveConfig::default(),
            peers: Vec::new(),
            routers: Vec::new(),
            pairs: Vec::new(),
            cost_model: CostModelConfig::default(),
        }
    }
}

fn default_fabric() -> FabricConfig {
    serde_json::from_str(r#"{"provider":"tcp;ofi_rxm"}"#).expect("valid fabric config")
}

/// Active probe READs between agents.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProbeConfig {
    /// Run active probes [true].
    pub enabled: bool,
    /// Side-channel port of the probe engine (0 = any) [0].
    pub side_channel_port: u16,
    /// Regions of the probe engine's layout (descriptors per block) [2].
    pub num_regions: u32,
    /// Blocks per region [64].
    pub num_blocks: u32,
    /// Bytes of one block in one region [65536].
    pub block_len_bytes: u64,
    /// Tokens per block (vLLM's `block_size`) [16].
    pub block_size_tokens: u32,
    /// Blocks in a small probe READ [1].
    pub small_blocks: u32,
    /// Blocks in a large probe READ (a long conversation turn) [32].
    pub large_blocks: u32,
    /// Probe also in the layouts of the engines registered here (managed
    /// mode): one more probe engine per distinct layout (descriptors per
    /// block id, bytes per descriptor, tokens per block; at most 4), its
    /// READs of about the configured READs' bytes, used with every peer
    /// that has the same shape (`crate::probe_plan`) [true].
    pub follow_engines: bool,
    /// Period between probe rounds (one small and one large READ per peer), ms [250]; a
    /// peer whose large probe READ was off its model by 2× is probed again after 50 ms,
    /// up to 4 times (`crate::probe_plan::confirm_again`).
    pub period_ms: u64,
    /// Rate limit of probe traffic per peer, bytes/s; a round is skipped
    /// while the budget is exhausted [67108864 (64 MiB/s)].
    pub max_bytes_per_s: u64,
    /// Alarm when a path's fitted bandwidth is below this share of what its
    /// provider should give [0.1].
    pub alarm_ratio: f64,
    /// Bandwidth the provider should give, bytes/s; 0 = from the provider
    /// (efa 12.5e9, tcp 1.25e8 × link Gbit/s from sysfs or 1.25e9, shm 5e9,
    /// NIXL UCX 1.25e9) [0].
    pub expected_bandwidth_bytes_per_s: f64,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            side_channel_port: 0,
            num_regions: 2,
            num_blocks: 64,
            block_len_bytes: 65536,
            block_size_tokens: 16,
            small_blocks: 1,
            large_blocks: 32,
            follow_engines: true,
            period_ms: 250,
            max_bytes_per_s: 64 << 20,
            alarm_ratio: 0.1,
            expected_bandwidth_bytes_per_s: 0.0,
        }
    }
}

/// Network state watch.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// Watch links with rtnetlink [true].
    pub enabled: bool,
    /// Full link dump period (events arrive at once in between), ms [1000].
    pub poll_ms: u64,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            poll_ms: 1000,
        }
    }
}

/// Observe mode: stock engines (vLLM with NixlConnector) do their own
/// READs through their own `libnixl.so`; the agent times them with the NIXL
/// library probes and feeds them to the cost model
/// (`crate::observe::attribute` says which peer each is for).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ObserveConfig {
    /// `libnixl.so` files of the engines on this node (vLLM loads the one
    /// of its `nixl_cu12`/`nixl_cu13` wheel: `grep libnixl
    /// /proc/<engine pid>/maps` names it). Attached for every process
    /// using them; a file that is absent or fails to attach is retried
    /// every 5 s [none].
    pub nixl_libs: Vec<PathBuf>,
    /// Which processes' transfers count [`node`].
    pub scope: ObserveScope,
}

/// Which processes' NIXL transfers an agent in observe mode counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObserveScope {
    /// Every process on this node's kernel (one agent per node, the
    /// DaemonSet case).
    #[default]
    Node,
    /// Only processes in the agent's own network namespace: "nodes" that
    /// are network namespaces of one kernel (kvloop's own tests and demos).
    Netns,
}

/// A prefill engine's serving port on this node.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillPort {
    /// The prefill engine id the samples are recorded for.
    pub engine_id: String,
    /// Its HTTP serving port.
    pub port: u16,
}

/// A peer agent.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// Its `agent_id`; the cost model's peer id (`pairs[].decode_peer`).
    pub name: String,
    /// Its HTTP address (`http_listen`).
    pub http: SocketAddr,
    /// Local network interface the path to it uses; when it goes down the
    /// path is invalidated at once [none: found from the routing table by
    /// the peer's address].
    #[serde(default)]
    pub interface: Option<String>,
}

/// A router to push thresholds to.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterTarget {
    /// Base URL, e.g. `http://10.0.0.9:8000`, or a name resolved every push period and pushed at each of its addresses (a headless Service reaches every replica).
    pub url: String,
    /// Bearer token (the router's `admin_token`); `KVLOOP_AGENT_ROUTER_TOKEN`
    /// (flag `--router-token`) fills it for every router, over the file.
    /// Required from one of the two [none].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// A (P, D) pair whose threshold this agent computes (its prefill engine
/// lives on this node).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairConfig {
    /// Prefill engine id.
    pub prefill_engine_id: String,
    /// Decode engine id.
    pub decode_engine_id: String,
    /// Peer agent hosting the decode engine (`peers[].name`).
    pub decode_peer: String,
    /// KV bytes per token on the READ path (Qwen3-32B bf16: 262144).
    pub bytes_per_token: u64,
    /// Tokens per block [16].
    #[serde(default = "default_block_tokens")]
    pub block_size_tokens: u64,
    /// Descriptors (regions) per block [1].
    #[serde(default = "one")]
    pub regions_per_block: u64,
}

impl PairConfig {
    /// The cost model's pair as configured (the KV shape from
    /// `bytes_per_token`, `block_size_tokens`, `regions_per_block`).
    pub fn spec(&self) -> kvloop_costmodel::PairSpec {
        kvloop_costmodel::PairSpec {
            prefill_engine_id: self.prefill_engine_id.clone(),
            decode_engine_id: self.decode_engine_id.clone(),
            decode_peer: self.decode_peer.clone(),
            shape: kvloop_costmodel::KvShape {
                bytes_per_token: self.bytes_per_token,
                block_size_tokens: self.block_size_tokens,
                regions_per_block: self.regions_per_block,
            },
        }
    }
}

fn default_block_tokens() -> u64 {
    16
}
fn one() -> u64 {
    1
}

/// A bad config value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// TOML syntax or unknown/mistyped field (the message names it).
    #[error("agent config: {0}")]
    // Not `#[from]`: the message already carries the TOML error, and a
    // source as well would print it twice in an error chain.
    Toml(toml::de::Error),
    /// A field has an invalid value.
    #[error("agent config: `{field}`: expected {expected}")]
    Invalid {
        /// The field.
        field: String,
        /// What was expected.
        expected: String,
    },
    /// The cost model section.
    #[error("agent config: {0}")]
    CostModel(#[from] kvloop_costmodel::ConfigError),
}

impl From<toml::de::Error> for ConfigError {
    fn from(e: toml::de::Error) -> Self {
        ConfigError::Toml(e)
    }
}

fn invalid(field: impl Into<String>, expected: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        expected: expected.into(),
    }
}

impl AgentConfig {
    /// Parses and validates TOML text.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn from_toml(s: &str) -> Result<Self, ConfigError> {
        let c = Self::parse_toml(s)?;
        c.validate()?;
        Ok(c)
    }

    /// Parses TOML text without the cross-field checks of
    /// [`Self::validate`] (for overriding fields from the environment and
    /// flags first; call `validate` afterwards).
    ///
    /// # Errors
    /// [`ConfigError::Toml`] naming an unknown or mistyped field.
    pub fn parse_toml(s: &str) -> Result<Self, ConfigError> {
        Ok(toml::from_str(s)?)
    }

    /// Sets the bearer token of every `routers[]` entry (from
    /// `KVLOOP_AGENT_ROUTER_TOKEN` / `--router-token`; the Kubernetes
    /// DaemonSet passes it from the router's Secret).
    pub fn set_router_token(&mut self, token: &str) {
        for r in &mut self.routers {
            r.token = Some(token.to_string());
        }
    }

    /// `valid_for_ms` of pushed thresholds.
    pub fn valid_for_ms(&self) -> u64 {
        (self.push_period_ms as f64 * self.valid_for_periods) as u64
    }

    /// Checks cross-field rules.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.agent_id.is_empty() {
            return Err(invalid("agent_id", "a non-empty node name"));
        }
        if self.push_period_ms == 0 {
            return Err(invalid("push_period_ms", "a period > 0 ms"));
        }
        if !(self.valid_for_periods > 0.0 && self.valid_for_periods < 3.0) {
            return Err(invalid(
                "valid_for_periods",
                "a factor in (0, 3): valid_for_ms must stay below 3 × push_period_ms",
            ));
        }
        if self.push_attempts == 0 {
            return Err(invalid("push_attempts", "at least 1"));
        }
        let p = &self.probe;
        if p.num_regions == 0 || p.num_blocks == 0 || p.block_len_bytes == 0 {
            return Err(invalid(
                "probe.num_regions/num_blocks/block_len_bytes",
                "values > 0",
            ));
        }
        if p.small_blocks == 0 || p.large_blocks == 0 || p.large_blocks > p.num_blocks {
            return Err(invalid(
                "probe.small_blocks/large_blocks",
                format!("1..={} blocks (probe.num_blocks)", p.num_blocks),
            ));
        }
        if p.period_ms == 0 {
            return Err(invalid("probe.period_ms", "a period > 0 ms"));
        }
        for (i, lib) in self.observe.nixl_libs.iter().enumerate() {
            if !lib.is_absolute() {
                return Err(invalid(
                    format!("observe.nixl_libs[{i}]"),
                    format!("an absolute path of a libnixl.so, got `{}`", lib.display()),
                ));
            }
        }
        for (i, r) in self.routers.iter().enumerate() {
            if !(r.url.starts_with("http://") || r.url.starts_with("https://")) {
                return Err(invalid(
                    format!("routers[{i}].url"),
                    "an http:// or https:// URL",
                ));
            }
            if r.token.as_deref().is_none_or(str::is_empty) {
                return Err(invalid(
                    format!("routers[{i}].token"),
                    "a bearer token (the router's admin_token), in the file or from \
                     KVLOOP_AGENT_ROUTER_TOKEN / --router-token",
                ));
            }
        }
        for (i, pair) in self.pairs.iter().enumerate() {
            if pair.bytes_per_token == 0
                || pair.block_size_tokens == 0
                || pair.regions_per_block == 0
            {
                return Err(invalid(
                    format!("pairs[{i}].bytes_per_token/block_size_tokens/regions_per_block"),
                    "values > 0",
                ));
            }
            if !self.peers.iter().any(|p| p.name == pair.decode_peer) {
                return Err(invalid(
                    format!("pairs[{i}].decode_peer"),
                    format!("one of peers[].name, got `{}`", pair.decode_peer),
                ));
            }
        }
        self.cost_model.validate()?;
        Ok(())
    }
}

impl AgentConfig {
    /// Whether peers can reach the side channels of the engines this agent
    /// hosts: they are bound on `node_addr` and that address is what
    /// `kv_transfer_params` carry as `remote_host`. Refused: an unspecified
    /// (`0.0.0.0`, `::`), multicast or broadcast `node_addr`, and a
    /// loopback `node_addr` while a peer (other than this agent's own
    /// `peers[]` entry) is on a non-loopback address.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `node_addr` and the peer that cannot
    /// reach it.
    pub fn check_side_channel_reachable(&self) -> Result<(), ConfigError> {
        let a = self.node_addr;
        let broadcast = matches!(a, IpAddr::V4(v4) if v4.is_broadcast());
        if a.is_unspecified() || a.is_multicast() || broadcast {
            return Err(invalid(
                "node_addr",
                format!(
                    "this node's unicast address (engines' side channels are bound on it and \
                     named in kv_transfer_params as remote_host), got {a}"
                ),
            ));
        }
        if a.is_loopback()
            && let Some((i, p)) = self
                .peers
                .iter()
                .enumerate()
                .find(|(_, p)| !p.http.ip().is_loopback() && !is_own_peer_entry(self, p))
        {
            return Err(invalid(
                "node_addr",
                format!(
                    "an address peers can reach: {a} is a loopback address, but peers[{i}] \
                     (`{}`) is at {}, so engines' side channels on {a} are unreachable from it",
                    p.name,
                    p.http.ip()
                ),
            ));
        }
        Ok(())
    }
}

/// Whether a `peers[]` entry is this agent itself: same name as `agent_id`,
/// or its HTTP address is this agent's `http_listen` (or `node_addr` with
/// the `http_listen` port, for a wildcard listen address).
pub fn is_own_peer_entry(cfg: &AgentConfig, p: &PeerConfig) -> bool {
    if p.name == cfg.agent_id {
        return true;
    }
    let own = cfg.http_listen;
    p.http == own
        || (p.http.port() == own.port()
            && (p.http.ip() == cfg.node_addr
                || (own.ip().is_unspecified() && p.http.ip().is_loopback())))
}

/// The host name, or `"kvloop-agent"`.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kvloop-agent".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_peers(node_addr: &str, peers: &[(&str, &str)]) -> AgentConfig {
        let mut c = AgentConfig::from_toml("agent_id = \"a\"").unwrap();
        c.node_addr = node_addr.parse().unwrap();
        c.peers = peers
            .iter()
            .map(|(n, h)| PeerConfig {
                name: n.to_string(),
                http: h.parse().unwrap(),
                interface: None,
            })
            .collect();
        c
    }

    #[test]
    fn a_side_channel_peers_cannot_reach_is_refused_naming_node_addr() {
        // Everything on loopback (one host): fine; a routable node address: fine.
        assert!(
            with_peers("127.0.0.1", &[("b", "127.0.0.1:9471")])
                .check_side_channel_reachable()
                .is_ok()
        );
        assert!(
            with_peers("10.0.0.1", &[("b", "10.0.0.2:9470")])
                .check_side_channel_reachable()
                .is_ok()
        );
        // This agent's own entry on another address does not count.
        assert!(
            with_peers("127.0.0.1", &[("a", "10.0.0.1:9470")])
                .check_side_channel_reachable()
                .is_ok()
        );
        let e = with_peers(
            "127.0.0.1",
            &[("b", "127.0.0.1:9471"), ("c", "10.0.0.3:9470")],
        )
        .check_side_channel_reachable()
        .unwrap_err()
        .to_string();
        assert!(e.contains("node_addr"), "{e}");
        assert!(e.contains("peers[1]") && e.contains("10.0.0.3"), "{e}");
        for bad in ["0.0.0.0", "::", "224.0.0.1", "255.255.255.255"] {
            let e = with_peers(bad, &[])
                .check_side_channel_reachable()
                .unwrap_err()
                .to_string();
            assert!(e.contains("node_addr") && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn defaults_parse_and_unknown_fields_are_named() {
        let c = AgentConfig::from_toml("agent_id = \"a\"").unwrap();
        assert_eq!(c.push_period_ms, 1000);
        assert!(c.valid_for_ms() < 3 * c.push_period_ms);
        let e = AgentConfig::from_toml("push_perod_ms = 5").unwrap_err();
        assert!(e.to_string().contains("push_perod_ms"), "{e}");
        let e = AgentConfig::from_toml("valid_for_periods = 3.0").unwrap_err();
        assert!(e.to_string().contains("valid_for_periods"), "{e}");
    }

    #[test]
    fn pair_must_name_a_peer() {
        let t = r#"
            [[pairs]]
            prefill_engine_id = "p0"
            decode_engine_id = "d0"
            decode_peer = "nobody"
            bytes_per_token = 1024
        "#;
        let e = AgentConfig::from_toml(t).unwrap_err();
        assert!(e.to_string().contains("pairs[0].decode_peer"), "{e}");
    }

    #[test]
    fn router_token_comes_from_the_file_or_the_environment() {
        let t = "[[routers]]\nurl = \"http://10.0.0.9:8000\"\n";
        let e = AgentConfig::from_toml(t).unwrap_err();
        assert!(e.to_string().contains("routers[0].token"), "{e}");
        assert!(e.to_string().contains("KVLOOP_AGENT_ROUTER_TOKEN"), "{e}");
        let mut c = AgentConfig::parse_toml(t).unwrap();
        c.set_router_token("t0ken");
        c.validate().unwrap();
        assert_eq!(c.routers[0].token.as_deref(), Some("t0ken"));
        let c = AgentConfig::from_toml(&format!("{t}token = \"file\"\n")).unwrap();
        assert_eq!(c.routers[0].token.as_deref(), Some("file"));
        let e = AgentConfig::from_toml(&format!("{t}token = \"\"\n")).unwrap_err();
        assert!(e.to_string().contains("routers[0].token"), "{e}");
    }

    #[test]
    fn backend_is_the_dataplane_form() {
        let c = AgentConfig::from_toml("backend = { kind = \"libfabric\", provider = \"shm\" }")
            .unwrap();
        match c.backend {
            BackendConfig::Libfabric(f) => assert_eq!(f.provider, "shm"),
            other => panic!("{other:?}"),
        }
    }
}
