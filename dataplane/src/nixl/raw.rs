//! A raw NIXL READ loop with none of kvloop's layers (no bounds checks, no
//! futures, no progress thread, no backend mutex: the caller builds, posts
//! and polls transfer requests itself). It exists as the NIXL baseline of
//! `kvloop bench read`, so that the NIXL backend's overhead is measured
//! against NIXL itself on the same plugin and descriptor lists, in the same
//! run.
use std::time::{Duration, Instant};

use nixl_sys::{Agent, MemType, RegistrationHandle, XferDescList, XferOp, XferRequest, XferStatus};

use super::{Desc, NixlConfig, default_lib_dir, load_runtime, nixl_err};
use crate::backend::{BackendMetadata, RemoteRegion};
use crate::error::{DataplaneError, Result};
use crate::region::{MemoryKind, RegionDesc};

/// A raw reader: its own NIXL agent, one registered local buffer, one peer.
pub struct RawNixlReader {
    agent: Agent,
    _reg: RegistrationHandle,
    plugin: String,
    local: RegionDesc,
    remote_agent: String,
    remote: Vec<RemoteRegion>,
}

impl RawNixlReader {
    /// Creates an agent with `cfg.plugin`, registers `local` and loads the
    /// peer described by `remote` (a NIXL engine's handshake metadata).
    ///
    /// # Errors
    /// [`DataplaneError::NixlUnavailable`] without the runtime;
    /// [`DataplaneError::Backend`] when NIXL refuses;
    /// [`DataplaneError::Config`] when `remote` is not NIXL metadata.
    pub fn new(cfg: &NixlConfig, local: RegionDesc, remote: &BackendMetadata) -> Result<Self> {
        let BackendMetadata::Nixl {
            metadata, regions, ..
        } = remote
        else {
            return Err(DataplaneError::Config {
                field: "remote",
                expected: "NIXL backend metadata".into(),
            });
        };
        load_runtime(&cfg.lib_dir.clone().unwrap_or_else(default_lib_dir))?;
        let p = &cfg.plugin;
        let agent = Agent::new(&format!("kvloop-raw-{}", std::process::id()))
            .map_err(|e| nixl_err(p, "createAgent", e))?;
        let (_mems, params) = agent
            .get_plugin_params(p)
            .map_err(|e| nixl_err(p, "getPluginParams", e))?;
        agent
            .create_backend(p, &params)
            .map_err(|e| nixl_err(p, "createBackend", e))?;
        let reg = agent
            .register_memory(
                &Desc {
                    addr: local.addr,
                    len: local.len_bytes,
                    kind: local.kind,
                },
                None,
            )
            .map_err(|e| nixl_err(p, "registerMem", e))?;
        let remote_agent = agent
            .load_remote_md(metadata)
            .map_err(|e| nixl_err(p, "loadRemoteMD", e))?;
        Ok(Self {
            agent,
            _reg: reg,
            plugin: p.clone(),
            local,
            remote_agent,
            remote: regions.clone(),
        })
    }

    /// Runs `reads` READs, each a vector of `(remote region, remote offset,
    /// local offset, len)` descriptors (one transfer request per READ),
    /// keeping up to `outstanding` in flight. Returns each READ's latency
    /// (request built and posted → status `Success`).
    ///
    /// # Errors
    /// [`DataplaneError::Backend`] on a failed request;
    /// [`DataplaneError::Timeout`] when nothing completes for `timeout`.
    pub fn run(
        &self,
        reads: &[Vec<(u32, u64, u64, u64)>],
        outstanding: usize,
        timeout: Duration,
    ) -> Result<Vec<Duration>> {
        let p = &self.plugin;
        let mem = match self.local.kind {
            MemoryKind::Host => MemType::Dram,
            MemoryKind::Cuda { .. } => MemType::Vram,
        };
        let dev = match self.local.kind {
            MemoryKind::Host => 0,
            MemoryKind::Cuda { device } => device as u64,
        };
        let mut lat = vec![Duration::ZERO; reads.len()];
        let mut in_flight: Vec<(usize, Instant, XferRequest)> = Vec::with_capacity(outstanding);
        let mut next = 0;
        let mut done = 0;
        let mut last = Instant::now();
        while done < reads.len() {
            while next < reads.len() && in_flight.len() < outstanding {
                let t = Instant::now();
                let mut local =
                    XferDescList::new(mem).map_err(|e| nixl_err(p, "xferDescList", e))?;
                let mut remote =
                    XferDescList::new(mem).map_err(|e| nixl_err(p, "xferDescList", e))?;
                for &(region, roff, loff, len) in &reads[next] {
                    let rr = &self.remote[region as usize];
                    local.add_desc((self.local.addr + loff) as usize, len as usize, dev);
                    remote.add_desc((rr.base_addr + roff) as usize, len as usize, rr.device_id);
                }
                let req = self
                    .agent
                    .create_xfer_req(XferOp::Read, &local, &remote, &self.remote_agent, None)
                    .map_err(|e| nixl_err(p, "createXferReq", e))?;
                self.agent
                    .post_xfer_req(&req, None)
                    .map_err(|e| nixl_err(p, "postXferReq", e))?;
                in_flight.push((next, t, req));
                next += 1;
            }
            let before = done;
            let mut i = 0;
            while i < in_flight.len() {
                match self.agent.get_xfer_status(&in_flight[i].2) {
                    Ok(XferStatus::InProgress) => i += 1,
                    Ok(XferStatus::Success) => {
                        let (n, t, _req) = in_flight.swap_remove(i);
                        lat[n] = t.elapsed();
                        done += 1;
                    }
                    Err(e) => return Err(nixl_err(p, "getXferStatus", e)),
                }
            }
            if done > before {
                last = Instant::now();
            } else if last.elapsed() > timeout {
                return Err(DataplaneError::Timeout {
                    xfer_id: next as u64,
                    engine_id: "raw-nixl".into(),
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
        }
        Ok(lat)
    }
}
