//! Engine registry (docs/protocol.md Router rule 5): `engine_id` → HTTP address,
//! side-channel address, role, tp size, block size. Pure data; health is kept
//! by the server shell.
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::params::bracket_host;

/// Role of a registered engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill engine (P).
    Prefill,
    /// Decode engine (D).
    Decode,
}

fn one() -> u32 {
    1
}
fn sixteen() -> u32 {
    16
}

/// One `[[engines]]` entry of the router's TOML config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// The engine's id, as it writes it in `remote_engine_id` (vLLM's `engine_id`).
    pub engine_id: String,
    /// `prefill` or `decode`.
    pub role: Role,
    /// Base URL of its OpenAI-compatible server, e.g. `http://10.0.0.5:8000`
    /// or `http://[fd00::5]:8000`.
    pub http_url: String,
    /// Side-channel host written into `remote_host` (IPv6 literals are
    /// bracketed by the router).
    pub side_channel_host: String,
    /// Side-channel port (vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT`).
    pub side_channel_port: u16,
    /// Tensor-parallel size. Default 1.
    #[serde(default = "one")]
    pub tp_size: u32,
    /// Tokens per KV-cache block. Default 16 (vLLM's default block size).
    #[serde(default = "sixteen")]
    pub block_size_tokens: u32,
}

impl EngineConfig {
    /// An entry with tp size 1 and block size 16.
    pub fn new(
        engine_id: &str,
        role: Role,
        http_url: &str,
        side_channel_host: &str,
        side_channel_port: u16,
    ) -> Self {
        Self {
            engine_id: engine_id.into(),
            role,
            http_url: http_url.trim_end_matches('/').into(),
            side_channel_host: side_channel_host.into(),
            side_channel_port,
            tp_size: 1,
            block_size_tokens: 16,
        }
    }
}

/// A registered engine, with its side-channel host already bracketed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Engine {
    /// Engine id.
    pub engine_id: String,
    /// Role.
    pub role: Role,
    /// Base URL without a trailing slash.
    pub http_url: String,
    /// Side-channel host, IPv6 bracketed: the value written into `remote_host`.
    pub side_channel_host: String,
    /// Side-channel port.
    pub side_channel_port: u16,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Tokens per block.
    pub block_size_tokens: u32,
    /// `http_url` + `/tokenize`, `/v1/chat/completions`, `/v1/completions`,
    /// parsed once (a URL parsed per request cost about 3 % of the router's
    /// CPU in `chat_bench`).
    pub urls: EngineUrls,
}

/// An engine's endpoints the router calls per request, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineUrls {
    /// `POST /tokenize`.
    pub tokenize: url::Url,
    /// `POST /v1/chat/completions`.
    pub chat: url::Url,
    /// `POST /v1/completions`.
    pub completions: url::Url,
}

impl EngineUrls {
    /// The endpoints under `base` (no trailing slash); `None` when `base`
    /// is not a valid URL.
    pub fn new(base: &str) -> Option<Self> {
        let at = |path: &str| url::Url::parse(&format!("{base}{path}")).ok();
        Some(Self {
            tokenize: at("/tokenize")?,
            chat: at("/v1/chat/completions")?,
            completions: at("/v1/completions")?,
        })
    }
}

/// Registry errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// Two entries with one id.
    #[error("engines[{index}].engine_id: duplicate id {id:?}")]
    Duplicate {
        /// Position in the list.
        index: usize,
        /// The id.
        id: String,
    },
    /// A field is invalid.
    #[error("engines[{index}].{field}: {message}")]
    Invalid {
        /// Position in the list.
        index: usize,
        /// Field name.
        field: &'static str,
        /// What is expected.
        message: &'static str,
    },
    /// At most 65 535 engines.
    #[error("engines: at most 65535 entries")]
    TooMany,
}

/// All registered engines, indexed by position (a `u16`) and by id.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    engines: Vec<Engine>,
    by_id: HashMap<String, u16>,
}

impl Registry {
    /// Build from config entries.
    ///
    /// # Errors
    /// Duplicate ids, empty ids, URLs not starting with `http://`, tp size or
    /// block size 0, more than 65 535 engines.
    pub fn new(cfg: Vec<EngineConfig>) -> Result<Self, RegistryError> {
        if cfg.len() > u16::MAX as usize {
            return Err(RegistryError::TooMany);
        }
        let mut r = Registry::default();
        for (index, e) in cfg.into_iter().enumerate() {
            let bad = |field, message| RegistryError::Invalid {
                index,
                field,
                message,
            };
            if e.engine_id.is_empty() {
                return Err(bad("engine_id", "expected a non-empty string"));
            }
            let http_url = e.http_url.trim_end_matches('/').to_string();
            let urls = Some(&http_url)
                .filter(|u| u.starts_with("http://"))
                .and_then(|u| EngineUrls::new(u))
                .ok_or_else(|| bad("http_url", "expected an http:// URL"))?;
            if e.side_channel_host.is_empty() {
                return Err(bad(
                    "side_channel_host",
                    "expected a host name or IP literal",
                ));
            }
            if e.tp_size == 0 {
                return Err(bad("tp_size", "expected a positive integer"));
            }
            if e.block_size_tokens == 0 {
                return Err(bad("block_size_tokens", "expected a positive integer"));
            }
            if r.by_id.insert(e.engine_id.clone(), index as u16).is_some() {
                return Err(RegistryError::Duplicate {
                    index,
                    id: e.engine_id,
                });
            }
            r.engines.push(Engine {
                side_channel_host: bracket_host(&e.side_channel_host),
                http_url,
                urls,
                engine_id: e.engine_id,
                role: e.role,
                side_channel_port: e.side_channel_port,
                tp_size: e.tp_size,
                block_size_tokens: e.block_size_tokens,
            });
        }
        Ok(r)
    }

    /// Engine at `index`.
    pub fn get(&self, index: u16) -> Option<&Engine> {
        self.engines.get(index as usize)
    }

    /// Index of `engine_id`, if registered.
    pub fn index_of(&self, engine_id: &str) -> Option<u16> {
        self.by_id.get(engine_id).copied()
    }

    /// All engines in config order.
    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// Indices of the engines with `role`.
    pub fn with_role(&self, role: Role) -> Vec<u16> {
        (0..self.engines.len() as u16)
            .filter(|&i| self.engines[i as usize].role == role)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_duplicates_and_brackets_ipv6() {
        let r = Registry::new(vec![EngineConfig::new(
            "d0",
            Role::Decode,
            "http://[::1]:9/",
            "::1",
            5,
        )])
        .unwrap();
        assert_eq!(r.get(0).unwrap().side_channel_host, "[::1]");
        assert_eq!(r.get(0).unwrap().http_url, "http://[::1]:9");
        let e = Registry::new(vec![
            EngineConfig::new("d0", Role::Decode, "http://a:1", "a", 5),
            EngineConfig::new("d0", Role::Decode, "http://a:1", "a", 5),
        ])
        .unwrap_err();
        assert_eq!(
            e,
            RegistryError::Duplicate {
                index: 1,
                id: "d0".into()
            }
        );
    }
}
