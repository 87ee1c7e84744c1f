//! A raw libfabric READ loop with none of kvloop's layers (no bounds checks,
//! no futures, no progress thread: the caller posts and polls the completion
//! queue itself). It exists as the baseline of `kvloop bench read`, so that
//! the engine's overhead is measured against the provider in the same run.
use std::ffi::c_void;
use std::time::{Duration, Instant};

use super::FabricConfig;
use super::ffi::{Endpoint, Mr, fi_error_string, sys};
use super::state::OpCtx;
use crate::backend::{BackendMetadata, RemoteRegion};
use crate::error::{DataplaneError, Result};
use crate::region::RegionDesc;

/// A raw reader: its own endpoint, one registered local buffer, one peer.
pub struct RawReader {
    mr: Mr,
    ep: Endpoint,
    peer: u64,
    remote: Vec<RemoteRegion>,
}

impl RawReader {
    /// Opens an endpoint on `cfg.provider`, registers `local`, and inserts the
    /// peer described by `remote` (a libfabric engine's handshake metadata).
    ///
    /// # Errors
    /// As [`super::FabricBackend::new`]; [`DataplaneError::Config`] when
    /// `remote` is not libfabric metadata.
    pub fn new(cfg: &FabricConfig, local: RegionDesc, remote: &BackendMetadata) -> Result<Self> {
        let BackendMetadata::Libfabric {
            address, regions, ..
        } = remote
        else {
            return Err(DataplaneError::Config {
                field: "remote",
                expected: "libfabric backend metadata".into(),
            });
        };
        let ep = Endpoint::open(cfg, false)?;
        let mr = ep.register(&local, 0)?;
        let peer = ep.insert_peer(address)?;
        Ok(Self {
            mr,
            ep,
            peer,
            remote: regions.clone(),
        })
    }

    /// Provider limits of this endpoint.
    pub fn limits(&self) -> super::Limits {
        self.ep.limits
    }

    /// Runs `reads` READs, each a vector of `(remote region, remote offset,
    /// local offset, len)` chunks grouped `iovs_per_read` per `fi_readmsg`,
    /// keeping up to `outstanding` READs in flight. Returns each READ's
    /// latency (post of its first operation → completion of its last).
    ///
    /// # Errors
    /// [`DataplaneError::Backend`] on a failed post or completion;
    /// [`DataplaneError::Timeout`] when nothing completes for `timeout`.
    pub fn run(
        &self,
        reads: &[Vec<(u32, u64, u64, u64)>],
        outstanding: usize,
        timeout: Duration,
    ) -> Result<Vec<Duration>> {
        let per = self.ep.limits.iovs_per_read;
        let mut lat = vec![Duration::ZERO; reads.len()];
        let mut started = vec![Instant::now(); reads.len()];
        let mut remaining = vec![0usize; reads.len()];
        let mut next = 0;
        let mut in_flight = 0;
        let mut done = 0;
        let mut out = Vec::with_capacity(32);
        let mut last = Instant::now();
        while done < reads.len() {
            while next < reads.len() && in_flight < outstanding {
                let chunks = &reads[next];
                started[next] = Instant::now();
                remaining[next] = chunks.len().div_ceil(per);
                for g in chunks.chunks(per) {
                    let mut local = Vec::with_capacity(g.len());
                    let mut descs = Vec::with_capacity(g.len());
                    let mut rma = Vec::with_capacity(g.len());
                    for &(region, roff, loff, len) in g {
                        let rr = self.remote[region as usize];
                        local.push(sys::iovec {
                            iov_base: (self.mr.addr + loff) as *mut c_void,
                            iov_len: len as usize,
                        });
                        descs.push(self.mr.desc);
                        rma.push(sys::fi_rma_iov {
                            addr: rr.base_addr + roff,
                            len: len as usize,
                            key: rr.key,
                        });
                    }
                    let ctx = Box::into_raw(Box::new(OpCtx {
                        // SAFETY: fi_context2 is plain provider scratch space; all-zero is valid.
                        ctx: unsafe { std::mem::zeroed() },
                        read_id: next as u64,
                        bytes: 0,
                    }));
                    loop {
                        // SAFETY: IOVs point into our registration; ctx reclaimed at completion.
                        let r = unsafe {
                            self.ep
                                .post(self.peer, &local, &mut descs, &rma, ctx as *mut c_void)
                        };
                        if r == 0 {
                            break;
                        }
                        if r != -(sys::FI_EAGAIN as isize) {
                            return Err(DataplaneError::Backend {
                                backend: self.ep.name(),
                                op: "fi_readmsg",
                                code: r as i64,
                                message: fi_error_string(r as i64),
                            });
                        }
                        self.drain(
                            &mut out,
                            &mut remaining,
                            &mut lat,
                            &started,
                            &mut done,
                            &mut in_flight,
                        )?;
                    }
                }
                next += 1;
                in_flight += 1;
            }
            if self.drain(
                &mut out,
                &mut remaining,
                &mut lat,
                &started,
                &mut done,
                &mut in_flight,
            )? > 0
            {
                last = Instant::now();
            } else if last.elapsed() > timeout {
                return Err(DataplaneError::Timeout {
                    xfer_id: next as u64,
                    engine_id: "raw".into(),
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
        }
        Ok(lat)
    }

    fn drain(
        &self,
        out: &mut Vec<(*mut c_void, Option<DataplaneError>)>,
        remaining: &mut [usize],
        lat: &mut [Duration],
        started: &[Instant],
        done: &mut usize,
        in_flight: &mut usize,
    ) -> Result<usize> {
        out.clear();
        let n = self.ep.poll_cq(out);
        for (ctx, err) in out.drain(..) {
            // SAFETY: contexts are Box<OpCtx> leaked at post.
            let op = unsafe { Box::from_raw(ctx as *mut OpCtx) };
            if let Some(e) = err {
                return Err(e);
            }
            let i = op.read_id as usize;
            remaining[i] -= 1;
            if remaining[i] == 0 {
                lat[i] = started[i].elapsed();
                *done += 1;
                *in_flight -= 1;
            }
        }
        Ok(n)
    }
}
