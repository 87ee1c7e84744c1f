//! Test and benchmark helper for kvloop-probes: a process whose transfers the
//! probes observe from outside.
//!
//! ```text
//! kvloop-probe-helper usdt-reads <count> <work_us> <bytes> <peer>
//! kvloop-probe-helper nixl-read <count> <bytes>
//! kvloop-probe-helper nixl-prepped <count> <descs> <desc_bytes>
//! kvloop-probe-helper dataplane-reads <nixl|shm|tcp> <count> <bytes>
//! ```
//!
//! Both wait for one line on stdin (so the caller can attach first), print
//! `ready pid=<pid>` before waiting, then one line per READ:
//! `read id=<xfer_id> user_ns=<post→done ns> bytes=<bytes>`, then `done`.
//!
//! `usdt-reads` calls `kvloop_common::usdt::read_post` / `read_done` around
//! `work_us` µs of busy work (direction P→D, backend libfabric).
//! `dataplane-reads` starts two kvloop dataplane engines in this process
//! (`prefill-0` reads from `decode-0`, one block of `bytes` per READ) over the
//! NIXL-UCX backend or libfabric `shm` / `tcp;ofi_rxm`.
//! `nixl-read` makes DRAM→DRAM READs of `bytes` between two NIXL agents of
//! this process through the UCX backend (needs `LD_LIBRARY_PATH`,
//! `NIXL_PLUGIN_DIR`, `UCX_MODULES='^ib*'`; docs/recipes.md) and times
//! `postXferReq` → first successful `getXferStatus`.
//! `nixl-prepped` makes transfers the way vLLM's NIXL connector does:
//! descriptor lists prepared once (`prepXferDlist`), each request made from
//! them (`makeXferReq`, not `createXferReq`) over all `descs` descriptors of
//! `desc_bytes` each, alternately WRITE (even ids) and READ (odd ids), to
//! the agent `kvloop-target`. The descriptors are `desc_bytes` apart (NIXL
//! merges contiguous ones into one).
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvloop_common::{BackendKind, Direction, ReadProbeArgs, usdt};

fn wait_for_go() -> Result<()> {
    println!("ready pid={}", std::process::id());
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    Ok(())
}

fn busy(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn usdt_reads(count: u64, work_us: u64, bytes: u64, peer: &str) -> Result<()> {
    wait_for_go()?;
    let base = (std::process::id() as u64) << 32;
    for i in 0..count {
        let mut a = ReadProbeArgs {
            xfer_id: base | i,
            bytes,
            descriptors: 4,
            direction: Direction::PrefillToDecode as u8,
            backend: BackendKind::Libfabric as u8,
            status: 0,
            peer: ReadProbeArgs::peer_from_str(peer),
            weight: 1,
            _pad: [0; 4],
        };
        let t = Instant::now();
        usdt::read_post(&a);
        busy(Duration::from_micros(work_us));
        a.status = kvloop_common::status::OK;
        usdt::read_done(&a);
        let ns = t.elapsed().as_nanos();
        println!("read id={} user_ns={ns} bytes={bytes}", a.xfer_id);
    }
    println!("done");
    Ok(())
}

/// Two NIXL agents in this process with a UCX backend each: `agent` posts
/// the transfers, `kvloop-target` owns the remote memory.
struct UcxAgents {
    agent: nixl_sys::Agent,
    target: nixl_sys::Agent,
    opt: nixl_sys::OptArgs,
    target_opt: nixl_sys::OptArgs,
    /// Kept alive for the agents' lifetime.
    _backends: [nixl_sys::Backend; 2],
}

impl UcxAgents {
    fn new(name: &str) -> Result<Self> {
        use nixl_sys::{Agent, OptArgs};
        if nixl_sys::is_stub() {
            bail!(
                "nixl-sys is the stub: libnixl_capi.so not found (set LD_LIBRARY_PATH to the NIXL libs)"
            );
        }
        let agent = Agent::new(name).with_context(|| format!("Agent::new({name})"))?;
        let target = Agent::new("kvloop-target").context("Agent::new(target)")?;
        let (_m, params) = agent
            .get_plugin_params("UCX")
            .context("UCX plugin params")?;
        let b1 = agent
            .create_backend("UCX", &params)
            .with_context(|| format!("UCX backend ({name})"))?;
        let b2 = target
            .create_backend("UCX", &params)
            .context("UCX backend (target)")?;
        let mut opt = OptArgs::new()?;
        opt.add_backend(&b1)?;
        let mut target_opt = OptArgs::new()?;
        target_opt.add_backend(&b2)?;
        Ok(Self {
            agent,
            target,
            opt,
            target_opt,
            _backends: [b1, b2],
        })
    }
}

/// Posts `req` and polls it until it completes (at most 10 s): the ns from
/// post to completion. `what` names it in the error.
fn post_and_wait(agent: &nixl_sys::Agent, req: &nixl_sys::XferRequest, what: &str) -> Result<u128> {
    let t = Instant::now();
    let mut in_prog = agent.post_xfer_req(req, None)?;
    let deadline = t + Duration::from_secs(10);
    while in_prog {
        match agent.get_xfer_status(req)? {
            nixl_sys::XferStatus::Success => in_prog = false,
            nixl_sys::XferStatus::InProgress => {
                if Instant::now() > deadline {
                    bail!("{what} not complete after 10 s");
                }
            }
        }
    }
    Ok(t.elapsed().as_nanos())
}

fn nixl_read(count: u64, bytes: usize) -> Result<()> {
    use nixl_sys::{MemType, NixlRegistration, SystemStorage, XferDescList, XferOp};
    let UcxAgents {
        agent: reader,
        target,
        opt,
        target_opt: opt2,
        _backends,
    } = UcxAgents::new("kvloop-reader")?;
    let mut local = SystemStorage::new(bytes)?;
    let mut remote = SystemStorage::new(bytes)?;
    local.memset(0);
    remote.memset(0x5a);
    local.register(&reader, Some(&opt))?;
    remote.register(&target, Some(&opt2))?;
    let md = target.get_local_md()?;
    let remote_name = reader.load_remote_md(&md)?;
    wait_for_go()?;
    for i in 0..count {
        let ns = {
            let mut ldl = XferDescList::new(MemType::Dram)?;
            ldl.add_storage_desc(&local)?;
            let mut rdl = XferDescList::new(MemType::Dram)?;
            rdl.add_storage_desc(&remote)?;
            let req = reader.create_xfer_req(XferOp::Read, &ldl, &rdl, &remote_name, None)?;
            post_and_wait(&reader, &req, &format!("READ {i}"))?
        };
        if !local.as_slice().iter().all(|&b| b == 0x5a) {
            bail!("READ {i}: data mismatch");
        }
        local.memset(0);
        println!("read id={i} user_ns={ns} bytes={bytes}");
    }
    println!("done");
    Ok(())
}

fn nixl_prepped(count: u64, descs: usize, desc_bytes: usize) -> Result<()> {
    use nixl_sys::{MemType, NixlRegistration, SystemStorage, XferDescList, XferOp};
    let UcxAgents {
        agent,
        target,
        opt,
        target_opt: opt2,
        _backends,
    } = UcxAgents::new("kvloop-prepper")?;
    let total = descs * desc_bytes;
    // descriptor d at 2 * d * desc_bytes: a gap after each, so none merge
    let mut local = SystemStorage::new(2 * total)?;
    let mut remote = SystemStorage::new(2 * total)?;
    local.memset(0x11);
    remote.memset(0x5a);
    local.register(&agent, Some(&opt))?;
    remote.register(&target, Some(&opt2))?;
    let md = target.get_local_md()?;
    let remote_name = agent.load_remote_md(&md)?;
    let list = |base: usize| -> Result<XferDescList<'static>> {
        let mut l = XferDescList::new(MemType::Dram)?;
        for d in 0..descs {
            l.add_desc(base + 2 * d * desc_bytes, desc_bytes, 0);
        }
        Ok(l)
    };
    let lbase = local.as_slice().as_ptr() as usize;
    let rbase = remote.as_slice().as_ptr() as usize;
    // "" names the local agent (NIXL_INIT_AGENT).
    let local_h = agent.prepare_xfer_dlist("", &list(lbase)?, Some(&opt))?;
    let remote_h = agent.prepare_xfer_dlist(&remote_name, &list(rbase)?, Some(&opt))?;
    let idx: Vec<i32> = (0..descs as i32).collect();
    wait_for_go()?;
    for i in 0..count {
        let op = if i % 2 == 0 {
            XferOp::Write
        } else {
            XferOp::Read
        };
        let req = agent.make_xfer_req(op, &local_h, &idx, &remote_h, &idx, None)?;
        let ns = post_and_wait(&agent, &req, &format!("transfer {i}"))?;
        println!("read id={i} user_ns={ns} bytes={total}");
    }
    if !local.as_slice().iter().all(|&b| b == 0x11) {
        bail!("data mismatch after the WRITE/READ round trips");
    }
    println!("done");
    Ok(())
}

#[cfg(feature = "dataplane")]
fn dataplane_reads(backend: &str, count: u64, bytes: u64) -> Result<()> {
    use kvloop_dataplane::fabric::FabricConfig;
    use kvloop_dataplane::nixl::NixlConfig;
    use kvloop_dataplane::{
        BackendConfig, BlockPair, EngineConfig, HostRegion, KvLayout, ReadRequest, TransferEngine,
    };
    let backend = match backend {
        "nixl" => BackendConfig::Nixl(NixlConfig::default()),
        "shm" => BackendConfig::Libfabric(FabricConfig {
            provider: "shm".into(),
            ..Default::default()
        }),
        "tcp" => BackendConfig::Libfabric(FabricConfig {
            provider: "tcp;ofi_rxm".into(),
            bind_node: Some("127.0.0.1".into()),
            ..Default::default()
        }),
        other => bail!("<backend>: expected nixl, shm or tcp, got `{other}`"),
    };
    let layout = KvLayout {
        num_regions: 1,
        num_blocks: 8,
        block_len_bytes: bytes,
        block_size_tokens: 16,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let start = |id: &'static str| {
            let backend = backend.clone();
            async move {
                let regions = vec![HostRegion::new(
                    &format!("{id}-0"),
                    layout.region_len_bytes() as usize,
                )?];
                TransferEngine::start(
                    EngineConfig {
                        engine_id: id.into(),
                        side_channel_addr: "127.0.0.1:0".parse().unwrap(),
                        backend,
                        layout,
                        read_timeout_ms: 10_000,
                        handshake_timeout_ms: 10_000,
                    },
                    regions,
                )
                .await
                .with_context(|| format!("starting engine {id}"))
            }
        };
        let p = start("prefill-0").await?;
        let d = start("decode-0").await?;
        p.connect(d.side_channel_addr())
            .await
            .context("handshake")?;
        wait_for_go()?;
        for i in 0..count {
            let t = Instant::now();
            let out = p
                .read(&ReadRequest {
                    peer_engine_id: "decode-0".into(),
                    blocks: vec![BlockPair {
                        remote: i % 8,
                        local: (i + 1) % 8,
                    }],
                    direction: Direction::DecodeToPrefill,
                    notify: None,
                    timeout_ms: None,
                })
                .await
                .with_context(|| format!("READ {i}"))?;
            let ns = t.elapsed().as_nanos();
            println!("read id={} user_ns={ns} bytes={}", out.xfer_id, out.bytes);
        }
        println!("done");
        Ok(())
    })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, what: &str| -> Result<u64> {
        args.get(i)
            .ok_or_else(|| anyhow::anyhow!("missing <{what}>"))?
            .parse()
            .with_context(|| format!("<{what}>: expected a non-negative integer"))
    };
    match args.first().map(String::as_str) {
        Some("usdt-reads") => usdt_reads(
            num(1, "count")?,
            num(2, "work_us")?,
            num(3, "bytes")?,
            args.get(4).map(String::as_str).unwrap_or("decode-0"),
        ),
        #[cfg(feature = "dataplane")]
        Some("dataplane-reads") => dataplane_reads(
            args.get(1).map(String::as_str).unwrap_or("nixl"),
            num(2, "count")?,
            num(3, "bytes")?,
        ),
        Some("nixl-read") => nixl_read(num(1, "count")?, num(2, "bytes")? as usize),
        Some("nixl-prepped") => nixl_prepped(
            num(1, "count")?,
            num(2, "descs")? as usize,
            num(3, "desc_bytes")? as usize,
        ),
        _ => bail!(
            "usage: kvloop-probe-helper usdt-reads <count> <work_us> <bytes> <peer> | nixl-read <count> <bytes> | nixl-prepped <count> <descs> <desc_bytes> | dataplane-reads <nixl|shm|tcp> <count> <bytes>"
        ),
    }
}
