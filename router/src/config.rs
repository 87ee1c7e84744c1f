//! The router's TOML configuration. Every field has a default (shown in its
//! docstring); `kvloop-router` flags override the file.
//!
//! ```toml
//! listen = "127.0.0.1:8000"          # client-facing address
//! admin_token = "s3cret"             # bearer token for PUT /admin/thresholds, POST /admin/pulls/{abandoned,read} ("" = disabled)
//! kv_recompute_threshold = 64        # static threshold, tokens (vLLM default)
//! store = "memory"                   # or "redis://127.0.0.1:6379/0" (shared by replicas)
//! policy = "round_robin"             # or "predicted_ttft"
//!
//! [[engines]]
//! engine_id = "p0"
//! role = "prefill"
//! http_url = "http://127.0.0.1:8100"
//! side_channel_host = "127.0.0.1"
//! side_channel_port = 5600
//!
//! [[engines]]
//! engine_id = "d0"
//! role = "decode"
//! http_url = "http://[::1]:8200"
//! side_channel_host = "::1"
//! side_channel_port = 5601
//! tp_size = 1
//! block_size_tokens = 16
//! ```
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::registry::EngineConfig;

/// How the prefix safety check compares prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PrefixCheckMode {
    /// Token ids from the prefill engine's `/tokenize` (plus the message
    /// history for the generated tail); falls back to `history` per request
    /// when `/tokenize` fails.
    Tokens,
    /// Message history (chat) or prompt text (completions) only.
    History,
}

impl PrefixCheckMode {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixCheckMode::Tokens => "tokens",
            PrefixCheckMode::History => "history",
        }
    }
}

/// The conversation store backend named by [`RouterConfig::store`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreBackend<'a> {
    /// In this process (`"memory"`).
    Memory,
    /// Redis at this URL (`redis://`, `rediss://`, `unix://`, `redis+unix://`).
    Redis(&'a str),
}

/// How P and D are chosen for a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Policy {
    /// Round robin over healthy engines, pull-vs-recompute by the threshold
    /// rule (vLLM's proxy behaviour).
    RoundRobin,
    /// Lowest predicted TTFT over healthy prefill engines, pull-vs-recompute
    /// jointly, D by load (`crate::select`); falls back to round robin and the
    /// threshold rule where no valid cost model exists.
    PredictedTtft,
}

impl Policy {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::PredictedTtft => "predicted_ttft",
        }
    }
}

/// Router configuration (TOML). Defaults in brackets.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    /// Client-facing listen address [`127.0.0.1:8000`].
    pub listen: SocketAddr,
    /// Bearer token of `PUT /admin/thresholds` and `POST /admin/pulls/{abandoned,read}` (the agents') [`""`: endpoints answer 401].
    pub admin_token: String,
    /// Header carrying the tenant [`x-tenant-id`].
    pub tenant_header: String,
    /// Tenant of requests without that header [`default`].
    pub default_tenant: String,
    /// D's `decoder_kv_blocks_ttl`, ms [480000, vLLM's default 480 s].
    pub decoder_kv_blocks_ttl_ms: u64,
    /// Safety margin subtracted from that TTL for stored entries, ms [30000].
    pub ttl_safety_margin_ms: u64,
    /// Maximum stored conversations (LRU beyond) [1000000].
    pub store_capacity: usize,
    /// Static recompute threshold, tokens [64, vLLM's `kv_recompute_threshold` default].
    pub kv_recompute_threshold: u64,
    /// Prefix safety check [`tokens`].
    pub prefix_check: PrefixCheckMode,
    /// Tokenize (engine `/tokenize`) also requests without a conversation id,
    /// so that every prefill request carries `X-KVLoop-Tokens` for the prefill
    /// probe; costs one extra round trip to P per request [false].
    pub tokenize_every_request: bool,
    /// Period of engine health checks (`GET /health`), ms [2000].
    pub health_interval_ms: u64,
    /// Timeout of one health check, ms [1000].
    pub health_timeout_ms: u64,
    /// Consecutive failed health checks (a timeout, an error status, a
    /// broken connection) before a healthy engine is marked unhealthy; a
    /// refused connection (nothing listening) marks it at once, and one good
    /// check marks it healthy again: a busy engine answers `/health` late
    /// now and then, a dead one refuses (default as SGLang's model gateway's
    /// `health_failure_threshold`) [3].
    pub health_failure_threshold: u32,
    /// Warm-up after start, ms: `GET /health` answers 503 (`status:
    /// "warming"`) until an agent's first threshold push with a pair is
    /// applied (`PUT /admin/thresholds`) or this long has passed, whichever
    /// comes first. A readiness probe on `/health` then holds traffic back from a
    /// new replica until it has the agents' thresholds and cost models:
    /// without them it places turns round robin with the static threshold,
    /// pulling over paths it cannot cost. As Envoy's `initial_fetch_timeout`
    /// for its first configuration. Agents must reach a replica that is not
    /// ready yet (the Helm chart's headless Service publishes not-ready
    /// addresses). 0: no warm-up [0].
    pub warmup_ms: u64,
    /// Connect timeout to engines, ms [2000].
    pub connect_timeout_ms: u64,
    /// Pooled connections to engines idle longer than this are closed, not
    /// reused, ms: vLLM's API server closes keep-alive connections after 5 s
    /// idle (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, uvicorn's `timeout_keep_alive`),
    /// and a busy engine may close one just as a request arrives on it (the
    /// request fails with the connection closed) [4000].
    pub upstream_idle_timeout_ms: u64,
    /// Timeout of a prefill request (headers and body), ms [600000].
    pub prefill_timeout_ms: u64,
    /// Timeout until a decode engine's response headers, ms [600000].
    pub decode_timeout_ms: u64,
    /// Maximum request body, bytes [67108864].
    pub max_body_bytes: usize,
    /// Conversation store: `"memory"` or a Redis URL such as
    /// `redis://127.0.0.1:6379/0` [`memory`].
    pub store: String,
    /// Redis connections (multiplexed, used round robin) [4].
    pub store_pool_size: usize,
    /// Timeout of one Redis command, ms; past it the turn recomputes [100].
    pub store_timeout_ms: u64,
    /// Timeout of one Redis connection attempt, ms [1000].
    pub store_connect_timeout_ms: u64,
    /// First reconnection back-off, ms (doubles, with jitter) [50].
    pub store_reconnect_min_ms: u64,
    /// Largest reconnection back-off, ms [5000].
    pub store_reconnect_max_ms: u64,
    /// Prefix of the router's Redis keys (replicas sharing conversations use
    /// the same one) [`kvloop`].
    pub store_key_prefix: String,
    /// P/D selection policy [`round_robin`].
    pub policy: Policy,
    /// Answer every routed request with an `x-kvloop-route` header: why P
    /// and D were chosen, pull or recompute, the predicted times of the
    /// chosen and the runner-up option (`router/src/explain.rs`).
    /// Names engines to clients: for debugging and demos [false].
    pub route_header: bool,
    /// Period of polling the engines' `/metrics`, ms: the prefill engines'
    /// queue (`vllm:num_requests_waiting` + `running`) under
    /// `predicted_ttft`, the decode engines' KV usage under `predicted_ttft`
    /// or adaptive retention; 0: off (each replica counts only its own
    /// requests; retention assumes `retention.default_kv_usage`) [250].
    pub load_interval_ms: u64,
    /// Period of sharing this replica's prefill lines with the other
    /// replicas through a Redis store, ms: what each has sent to each
    /// prefill engine and the compute it predicted, so that `queue(P)` sums
    /// every replica's outstanding prefills, not only this one's and P's
    /// polled count (`router/src/load_share.rs`); only under
    /// `predicted_ttft` with `store = "redis://..."`; 0: off [50].
    pub load_share_interval_ms: u64,
    /// Decode-side retention (`[retention]`, issue 15): `mode` (`fixed`:
    /// vLLM's fixed TTL, the router tells D nothing; `early_release`: D is
    /// told to release every stored turn nobody will pull; `adaptive`:
    /// also each hold's lease from the measured inter-turn gaps, renewed
    /// while it pays) and its bounds; see `kvloop_retention::RetentionConfig`
    /// and docs/operator-guide.md, "Decode-side retention" [adaptive].
    pub retention: kvloop_retention::RetentionConfig,
    /// Worker threads of the router's runtime: one event loop serves every
    /// request without waking other threads (`chat_bench`, 2 shared cores,
    /// 400 req/s, same run: the router's system time per request 180–210 µs
    /// with 1 worker, 220–310 µs with 2; that bench read system time only
    /// until 2026-12-06). One worker spends about 1 ms of CPU per chat
    /// request on that VM (docs/operator-guide.md, "Router CPU"), so it
    /// carries several hundred requests per second: scale with replicas,
    /// or raise this past that [1].
    pub worker_threads: usize,
    /// Registered engines [none].
    pub engines: Vec<EngineConfig>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8000".parse().expect("valid"),
            admin_token: String::new(),
            tenant_header: "x-tenant-id".into(),
            default_tenant: "default".into(),
            decoder_kv_blocks_ttl_ms: 480_000,
            ttl_safety_margin_ms: 30_000,
            store_capacity: 1_000_000,
            kv_recompute_threshold: crate::thresholds::DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS,
            prefix_check: PrefixCheckMode::Tokens,
            tokenize_every_request: false,
            health_interval_ms: 2_000,
            health_timeout_ms: 1_000,
            health_failure_threshold: 3,
            connect_timeout_ms: 2_000,
            upstream_idle_timeout_ms: 4_000,
            warmup_ms: 0,
            prefill_timeout_ms: 600_000,
            decode_timeout_ms: 600_000,
            max_body_bytes: 64 << 20,
            store: "memory".into(),
            store_pool_size: 4,
            store_timeout_ms: 100,
            store_connect_timeout_ms: 1_000,
            store_reconnect_min_ms: 50,
            store_reconnect_max_ms: 5_000,
            store_key_prefix: "kvloop".into(),
            policy: Policy::RoundRobin,
            route_header: false,
            load_interval_ms: 250,
            load_share_interval_ms: 50,
            retention: kvloop_retention::RetentionConfig::default(),
            worker_threads: 1,
            engines: Vec::new(),
        }
    }
}

/// Config errors.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// TOML syntax or an unknown/mistyped field (the message names it).
    #[error("config: {0}")]
    // Not `#[from]`: the message already carries the TOML error, and a
    // source as well would print it twice in an error chain.
    Toml(toml::de::Error),
    /// A `[retention]` bound is invalid (the message names it).
    #[error("config: {0}")]
    Retention(String),
    /// A field has an invalid value.
    #[error("config: {field}: {message}")]
    Invalid {
        /// Field.
        field: &'static str,
        /// Expected.
        message: &'static str,
    },
}

impl From<toml::de::Error> for ConfigError {
    fn from(e: toml::de::Error) -> Self {
        ConfigError::Toml(e)
    }
}

impl RouterConfig {
    /// Parse TOML text.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn from_toml(s: &str) -> Result<Self, ConfigError> {
        let c: RouterConfig = toml::from_str(s)?;
        c.validate()?;
        Ok(c)
    }

    /// Check cross-field rules.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.retention.validate().map_err(ConfigError::Retention)?;
        if self.ttl_safety_margin_ms >= self.decoder_kv_blocks_ttl_ms {
            return Err(ConfigError::Invalid {
                field: "ttl_safety_margin_ms",
                message: "expected less than decoder_kv_blocks_ttl_ms",
            });
        }
        if self.worker_threads == 0 {
            return Err(ConfigError::Invalid {
                field: "worker_threads",
                message: "expected a positive integer",
            });
        }
        if self.store_capacity == 0 {
            return Err(ConfigError::Invalid {
                field: "store_capacity",
                message: "expected a positive integer",
            });
        }
        if let StoreBackend::Redis(url) = self.store_backend() {
            if ::redis::Client::open(url).is_err() {
                return Err(ConfigError::Invalid {
                    field: "store",
                    message: "expected \"memory\" or a valid Redis URL (redis://host:port/db)",
                });
            }
        } else if self.store != "memory" {
            return Err(ConfigError::Invalid {
                field: "store",
                message: "expected \"memory\" or a Redis URL (redis://, rediss://, unix://)",
            });
        }
        for (field, v) in [
            (
                "health_failure_threshold",
                u64::from(self.health_failure_threshold),
            ),
            ("store_pool_size", self.store_pool_size as u64),
            ("store_timeout_ms", self.store_timeout_ms),
            ("store_connect_timeout_ms", self.store_connect_timeout_ms),
            ("store_reconnect_min_ms", self.store_reconnect_min_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid {
                    field,
                    message: "expected a positive integer",
                });
            }
        }
        if self.store_pool_size > 256 {
            return Err(ConfigError::Invalid {
                field: "store_pool_size",
                message: "expected at most 256 connections",
            });
        }
        if self.store_reconnect_max_ms < self.store_reconnect_min_ms {
            return Err(ConfigError::Invalid {
                field: "store_reconnect_max_ms",
                message: "expected at least store_reconnect_min_ms",
            });
        }
        if self.store_key_prefix.is_empty() {
            return Err(ConfigError::Invalid {
                field: "store_key_prefix",
                message: "expected a non-empty prefix",
            });
        }
        if self.tenant_header.is_empty() {
            return Err(ConfigError::Invalid {
                field: "tenant_header",
                message: "expected a header name",
            });
        }
        Ok(())
    }

    /// The store backend [`RouterConfig::store`] names (`Memory` also for an
    /// invalid value, which [`RouterConfig::validate`] rejects).
    pub fn store_backend(&self) -> StoreBackend<'_> {
        const SCHEMES: [&str; 4] = ["redis://", "rediss://", "unix://", "redis+unix://"];
        if SCHEMES.iter().any(|p| self.store.starts_with(p)) {
            StoreBackend::Redis(&self.store)
        } else {
            StoreBackend::Memory
        }
    }

    /// TTL of stored conversation entries, ms.
    pub fn store_ttl_ms(&self) -> u64 {
        self.decoder_kv_blocks_ttl_ms - self.ttl_safety_margin_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_parses() {
        let c = RouterConfig::from_toml(include_str!("../router.example.toml")).unwrap();
        assert_eq!(c.engines.len(), 2);
        crate::registry::Registry::new(c.engines).unwrap();
    }

    #[test]
    fn parses_and_names_unknown_fields() {
        let c = RouterConfig::from_toml(
            "admin_token = \"t\"\n[[engines]]\nengine_id = \"p0\"\nrole = \"prefill\"\nhttp_url = \"http://127.0.0.1:1\"\nside_channel_host = \"::1\"\nside_channel_port = 5\n",
        )
        .unwrap();
        assert_eq!(c.kv_recompute_threshold, 64);
        assert_eq!(c.engines[0].tp_size, 1);
        let e = RouterConfig::from_toml("kv_recompute_treshold = 3").unwrap_err();
        assert!(e.to_string().contains("kv_recompute_treshold"), "{e}");
    }

    #[test]
    fn store_and_policy_options() {
        let c = RouterConfig::default();
        assert_eq!(c.store_backend(), StoreBackend::Memory);
        assert_eq!(c.policy, Policy::RoundRobin);
        let c = RouterConfig::from_toml(
            "store = \"redis://127.0.0.1:6390/2\"\nstore_pool_size = 2\npolicy = \"predicted_ttft\"\n",
        )
        .unwrap();
        assert_eq!(
            c.store_backend(),
            StoreBackend::Redis("redis://127.0.0.1:6390/2")
        );
        assert_eq!(c.policy, Policy::PredictedTtft);
        for (toml, field) in [
            ("store = \"memcached://x\"", "store"),
            ("store = \"redis://[bad\"", "store"),
            ("store_pool_size = 0", "store_pool_size"),
            ("store_timeout_ms = 0", "store_timeout_ms"),
            ("store_reconnect_max_ms = 1", "store_reconnect_max_ms"),
            ("store_key_prefix = \"\"", "store_key_prefix"),
            ("policy = \"fastest\"", "policy"),
        ] {
            let e = RouterConfig::from_toml(toml).unwrap_err().to_string();
            assert!(e.contains(field), "{toml}: {e}");
        }
    }
}
