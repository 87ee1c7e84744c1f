//! Configuration of the libfabric backend, and the provider limits read
//! from `fi_info`.
use serde::{Deserialize, Serialize};

use crate::error::{DataplaneError, Result};

/// Configuration of the libfabric backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricConfig {
    /// libfabric provider: `efa`, `tcp;ofi_rxm`, `shm`. Default `tcp;ofi_rxm`.
    #[serde(default = "default_provider")]
    pub provider: String,
    /// Source address to bind (`node` of `fi_getinfo` with `FI_SOURCE`); needed
    /// for `tcp` so that the endpoint listens on the node's address. Default:
    /// none (provider's choice).
    #[serde(default)]
    pub bind_node: Option<String>,
    /// Rails: one endpoint (fabric, domain, endpoint, CQ, AV, and every
    /// region registered on that domain) per entry, each bound to this
    /// source address or node name (a NIC's address in production; here a
    /// veth's or a loopback address); `""` leaves the source to the provider
    /// (e.g. `shm`). A READ's bytes are spread across the rails, rail `k` of
    /// the reader reading from rail `k mod n` of an `n`-rail target. Empty
    /// (the default): one endpoint bound to `bind_node`. Exclusive with
    /// `bind_node`; at most [`MAX_RAILS`].
    #[serde(default)]
    pub rails: Vec<String>,
    /// A READ smaller than this many bytes per rail goes whole to one rail
    /// (rails taken in turn, READ by READ) instead of being split; bytes.
    /// Default 65536 (64 KiB: below that the extra posts and completions of
    /// a split cost more than the rails' bandwidth saves).
    #[serde(default = "default_rail_min_bytes")]
    pub rail_min_bytes: u64,
    /// Progress thread: spin this long after the last activity before
    /// waiting, µs. Default 200.
    #[serde(default = "default_spin_us")]
    pub spin_us: u64,
    /// Caller-driven progress: the task awaiting a READ polls the
    /// completion queue itself, yielding to other tasks between polls, for
    /// up to this long before the progress thread takes over, µs. 0 leaves
    /// every completion to the progress thread. Default 1000 (covers READs
    /// up to about 1 MiB at loopback speeds; longer ones finish on the
    /// thread).
    #[serde(default = "default_caller_spin_us")]
    pub caller_spin_us: u64,
    /// Poll the completion queue continuously, never parking: lowest latency
    /// for serving remote READs at the cost of one busy core. Default false
    /// (readers' hints keep the serving side awake while they READ).
    #[serde(default)]
    pub busy_poll: bool,
    /// Cap on IOVs per READ below the provider's `min(iov_limit,
    /// rma_iov_limit)`. Default: 1 for `shm` (measured here on libfabric 1.17:
    /// a 4-IOV READ of 4 KiB blocks takes a slow path of about 2 ms, while
    /// single-IOV READs complete in about 3 µs each), none otherwise.
    #[serde(default)]
    pub max_iovs_per_read: Option<usize>,
    /// Cap on bytes per `fi_readmsg` below the provider's `max_msg_size`;
    /// 0 for none. A READ's operations complete one by one, and that is
    /// how its progress shows while it runs
    /// ([`crate::backend::ReadProgress`]): over a path that just slowed,
    /// the agent abandons a READ once its first operations show the rest
    /// would outlast recomputing (`kvloop_router_api::abandon::abandon_on_progress`),
    /// which needs operations well below a READ's size. Default 1 MiB (a
    /// 27 MB turn is 27 operations; at 100 Mbit/s the first completes in
    /// about 85 ms).
    #[serde(default = "default_max_op_bytes")]
    pub max_op_bytes: u64,
    /// EFA only: `FI_OPT_EFA_RNR_RETRY` set before `fi_enable`; negative
    /// keeps the provider's default. Default 7 (the EFA hardware maximum,
    /// which lets the device retry receiver-not-ready instead of failing).
    #[serde(default = "default_efa_rnr_retry")]
    pub efa_rnr_retry: i32,
    /// Progress thread: first idle park, µs. Default 50.
    #[serde(default = "default_idle_sleep_us")]
    pub idle_sleep_us: u64,
    /// Progress thread: longest idle park after 10 ms without activity, µs.
    /// Bounds the extra latency of the first READ served after a quiet
    /// period. Default 500.
    #[serde(default = "default_idle_sleep_max_us")]
    pub idle_sleep_max_us: u64,
}

/// Most rails one engine opens.
pub const MAX_RAILS: usize = 16;

fn default_rail_min_bytes() -> u64 {
    64 << 10
}
fn default_provider() -> String {
    "tcp;ofi_rxm".into()
}
fn default_spin_us() -> u64 {
    200
}
fn default_caller_spin_us() -> u64 {
    1000
}
fn default_idle_sleep_us() -> u64 {
    50
}
fn default_max_op_bytes() -> u64 {
    1 << 20
}
fn default_efa_rnr_retry() -> i32 {
    7
}
fn default_idle_sleep_max_us() -> u64 {
    500
}

impl Default for FabricConfig {
    fn default() -> Self {
        Self {
            provider: default_provider(),
            bind_node: None,
            rails: Vec::new(),
            rail_min_bytes: default_rail_min_bytes(),
            spin_us: default_spin_us(),
            caller_spin_us: default_caller_spin_us(),
            idle_sleep_us: default_idle_sleep_us(),
            idle_sleep_max_us: default_idle_sleep_max_us(),
            efa_rnr_retry: default_efa_rnr_retry(),
            max_iovs_per_read: None,
            max_op_bytes: default_max_op_bytes(),
            busy_poll: false,
        }
    }
}

impl FabricConfig {
    /// The source node of each endpoint to open, first rail first: `rails`
    /// (`""` as `None`), or `bind_node` alone when there are no rails.
    ///
    /// # Errors
    /// [`DataplaneError::Config`] naming `rails` when both `rails` and
    /// `bind_node` are set or there are more than [`MAX_RAILS`] rails.
    pub fn rail_nodes(&self) -> Result<Vec<Option<String>>> {
        if self.rails.is_empty() {
            return Ok(vec![self.bind_node.clone()]);
        }
        if self.bind_node.is_some() {
            return Err(DataplaneError::Config {
                field: "rails",
                expected: "either `rails` or `bind_node`, not both (list the first rail's address in `rails`)".into(),
            });
        }
        if self.rails.len() > MAX_RAILS {
            return Err(DataplaneError::Config {
                field: "rails",
                expected: format!("at most {MAX_RAILS} rails, got {}", self.rails.len()),
            });
        }
        Ok(self
            .rails
            .iter()
            .map(|r| (!r.is_empty()).then(|| r.clone()))
            .collect())
    }
}

/// Provider limits read from `fi_info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Maximum outstanding transmit operations (`tx_attr->size`).
    pub tx_size: usize,
    /// IOVs per READ (`min(iov_limit, rma_iov_limit)`, at least 1).
    pub iovs_per_read: usize,
    /// Maximum bytes per READ (`ep_attr->max_msg_size`).
    pub max_msg_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rails_default_to_one_endpoint_on_bind_node() {
        let c = FabricConfig::default();
        assert_eq!(c.rail_nodes().unwrap(), [None]);
        let c = FabricConfig {
            bind_node: Some("10.0.0.1".into()),
            ..Default::default()
        };
        assert_eq!(c.rail_nodes().unwrap(), [Some("10.0.0.1".to_string())]);
        // An existing config without rails keeps working unchanged.
        let c: FabricConfig = serde_json::from_str(r#"{"provider": "shm"}"#).unwrap();
        assert!(c.rails.is_empty());
        assert_eq!(c.rail_min_bytes, 64 << 10);
    }

    #[test]
    fn rails_list_their_nodes_and_refuse_bad_combinations() {
        let c = FabricConfig {
            rails: vec!["127.0.0.1".into(), "".into()],
            ..Default::default()
        };
        assert_eq!(
            c.rail_nodes().unwrap(),
            [Some("127.0.0.1".to_string()), None]
        );
        let both = FabricConfig {
            bind_node: Some("127.0.0.1".into()),
            ..c.clone()
        };
        let e = both.rail_nodes().unwrap_err().to_string();
        assert!(e.contains("rails"), "{e}");
        let many = FabricConfig {
            rails: vec![String::new(); MAX_RAILS + 1],
            ..Default::default()
        };
        let e = many.rail_nodes().unwrap_err().to_string();
        assert!(e.contains("rails") && e.contains("17"), "{e}");
    }
}
