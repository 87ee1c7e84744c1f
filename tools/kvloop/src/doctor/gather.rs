//! The I/O edge of `kvloop doctor`: reads sysfs, procfs, `fi_info`, the
//! agent's configuration and HTTP API, the routers and the peers, and fills
//! [`Facts`]. Nothing here judges; [`super::checks`] does.
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use super::DoctorArgs;
use super::facts::{Backend, ClockProbe, Facts, RdmaDevice, RouterProbe, UprobeProbe};

/// What `kvloop doctor` reads from the agent's `agent.toml` (a lenient
/// subset of the agent's own configuration: unknown keys are ignored).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct AgentToml {
    /// `agent_id`.
    pub agent_id: Option<String>,
    /// `node_addr` (the agent's default: 127.0.0.1).
    pub node_addr: Option<IpAddr>,
    /// `http_listen`.
    pub http_listen: Option<SocketAddr>,
    /// `backend`.
    pub backend: Option<BackendToml>,
    /// `[[peers]]`.
    pub peers: Vec<PeerToml>,
    /// `[[routers]]`.
    pub routers: Vec<RouterToml>,
    /// `[probe]`.
    pub probe: ProbeToml,
}

/// `backend = { kind = ..., ... }`.
#[derive(Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BackendToml {
    /// `kind = "libfabric"`.
    Libfabric {
        /// `provider` [`tcp;ofi_rxm`].
        #[serde(default = "default_provider")]
        provider: String,
    },
    /// `kind = "nixl"`.
    Nixl {
        /// `plugin` [`UCX`].
        #[serde(default = "default_plugin")]
        plugin: String,
    },
}

fn default_provider() -> String {
    "tcp;ofi_rxm".into()
}

fn default_plugin() -> String {
    "UCX".into()
}

/// `[[peers]]`.
#[derive(Debug, Deserialize)]
pub struct PeerToml {
    /// `name`.
    pub name: String,
    /// `http`.
    pub http: SocketAddr,
}

/// `[[routers]]`.
#[derive(Debug, Deserialize)]
pub struct RouterToml {
    /// `url`.
    pub url: String,
    /// `token`.
    #[serde(default)]
    pub token: Option<String>,
}

/// `[probe]`.
#[derive(Debug, Deserialize)]
#[serde(default)]
pub struct ProbeToml {
    /// `enabled` [true].
    pub enabled: bool,
    /// `side_channel_port` [0].
    pub side_channel_port: u16,
}

impl Default for ProbeToml {
    fn default() -> Self {
        Self {
            enabled: true,
            side_channel_port: 0,
        }
    }
}

/// `GET /v1/engines` of an agent (the fields doctor and ping use).
#[derive(Debug, Deserialize)]
pub struct EnginesInfo {
    /// The agent's id.
    pub agent_id: String,
    /// Its probe engine, when probes run.
    pub probe: Option<EngineAddr>,
    /// Hosted engines.
    #[serde(default)]
    pub engines: Vec<EngineAddr>,
}

/// An engine id and its side channel.
#[derive(Debug, Deserialize)]
pub struct EngineAddr {
    /// Engine id.
    pub engine_id: String,
    /// Side-channel address.
    pub side_channel: SocketAddr,
}

/// Reads and parses `path`.
///
/// # Errors
/// The read or TOML error, naming the file.
pub fn read_config(path: &Path) -> anyhow::Result<AgentToml> {
    let text =
        std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Fetches `GET http://{agent}/v1/engines`.
///
/// # Errors
/// The HTTP or JSON error.
pub async fn engines(client: &reqwest::Client, agent: &str) -> Result<EnginesInfo, String> {
    let r = client
        .get(format!("http://{agent}/v1/engines"))
        .send()
        .await
        .map_err(|e| format!("GET http://{agent}/v1/engines: {}", short(&e)))?;
    if !r.status().is_success() {
        return Err(format!("GET http://{agent}/v1/engines: {}", r.status()));
    }
    r.json().await.map_err(|e| format!("/v1/engines: {e}"))
}

/// Provider names of `fi_info -l`.
pub fn parse_fi_info_list(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.trim().strip_suffix(':'))
        .map(str::to_string)
        .collect()
}

fn fi_providers() -> Result<Vec<String>, String> {
    let o = std::process::Command::new("fi_info")
        .arg("-l")
        .output()
        .map_err(|e| format!("fi_info: {e}"))?;
    if !o.status.success() {
        return Err(format!("fi_info -l: {}", o.status));
    }
    Ok(parse_fi_info_list(&String::from_utf8_lossy(&o.stdout)))
}

fn rdma_devices(root: &Path) -> Result<Vec<RdmaDevice>, String> {
    let rd = match std::fs::read_dir(root) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e.to_string()),
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let p = e.path();
        let driver = std::fs::read_link(p.join("device/driver"))
            .ok()
            .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()));
        let counters = (|| -> Result<usize, String> {
            let mut n = 0;
            for port in std::fs::read_dir(p.join("ports")).map_err(|e| e.to_string())? {
                let port = port.map_err(|e| e.to_string())?;
                n += std::fs::read_dir(port.path().join("hw_counters"))
                    .map_err(|e| format!("{}: {e}", port.path().join("hw_counters").display()))?
                    .count();
            }
            Ok(n)
        })();
        out.push(RdmaDevice {
            name: e.file_name().to_string_lossy().into_owned(),
            driver,
            counters,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// `libplugin_<NAME>.so` names in `dir`.
fn plugins_in(dir: &Path) -> Result<Vec<String>, String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| e.to_string())?
        .flatten()
        .filter_map(|e| plugin_name(&e.file_name().to_string_lossy()))
        .collect();
    v.sort();
    v.dedup();
    Ok(v)
}

/// `UCX` for `libplugin_UCX.so` (also a path ending in it).
pub fn plugin_name(file: &str) -> Option<String> {
    let base = file.rsplit('/').next()?;
    base.strip_prefix("libplugin_")?
        .strip_suffix(".so")
        .map(str::to_string)
}

/// NIXL plugins and the `libnixl.so` path mapped into a process, from the
/// text of its `/proc/<pid>/maps`.
pub fn parse_maps(maps: &str) -> (Vec<String>, Option<String>) {
    let mut plugins = Vec::new();
    let mut nixl = None;
    for l in maps.lines() {
        let Some(path) = l.split_whitespace().nth(5) else {
            continue;
        };
        if let Some(p) = plugin_name(path) {
            plugins.push(p);
        } else if path
            .rsplit('/')
            .next()
            .is_some_and(|b| b.starts_with("libnixl.so"))
        {
            nixl = Some(path.to_string());
        }
    }
    plugins.sort();
    plugins.dedup();
    (plugins, nixl)
}

/// `CapEff` of a `/proc/<pid>/status` text.
pub fn parse_cap_eff(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// `(major, minor)` of a kernel release (`6.18.2-arch1`).
pub fn parse_kernel(release: &str) -> Option<(u32, u32)> {
    let mut it = release.trim().split(['.', '-']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// `HugePages_Total` of a `/proc/meminfo` text.
pub fn parse_hugepages(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("HugePages_Total:"))
        .and_then(|v| v.trim().parse().ok())
}

fn memlock() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    (rc == 0 && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

fn tracefs() -> Option<PathBuf> {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("events").is_dir())
}

fn uprobe(pid: u32) -> UprobeProbe {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"));
    let nixl = maps.as_ref().ok().and_then(|m| parse_maps(m).1);
    let target = match &nixl {
        Some(p) => format!("/proc/{pid}/root{p}"),
        None => format!("/proc/{pid}/exe"),
    };
    let result = match maps {
        Err(e) => Err(format!("/proc/{pid}/maps: {e}")),
        Ok(_) => {
            let pc = kvloop_probes::ProbeConfig {
                transfer: true,
                prefill: false,
                retransmit: false,
                ..Default::default()
            };
            match kvloop_probes::Probes::load(pc) {
                Err(e) => Err(format!("loading the eBPF probes: {e}")),
                Ok(p) => {
                    let r = if nixl.is_some() {
                        p.attach_nixl(&target, Some(pid)).map_err(|e| e.to_string())
                    } else {
                        p.attach_transfer_sites(&target, Some(pid))
                            .map(|()| {
                                kvloop_common::usdt::SYMBOLS
                                    .iter()
                                    .map(|s| s.to_string())
                                    .collect()
                            })
                            .map_err(|e| e.to_string())
                    };
                    let _ = p.detach_all();
                    r
                }
            }
        }
    };
    UprobeProbe {
        pid,
        target,
        result,
    }
}

async fn router(client: &reqwest::Client, url: &str, token: Option<&str>) -> RouterProbe {
    let base = url.trim_end_matches('/');
    let health = client
        .get(format!("{base}/health"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| short(&e));
    let mut put = client
        .put(format!("{base}/admin/thresholds"))
        .header("content-type", "application/json")
        .body("{}");
    if let Some(t) = token {
        put = put.bearer_auth(t);
    }
    let token_status = match &health {
        Ok(_) => put
            .send()
            .await
            .map(|r| r.status().as_u16())
            .map_err(|e| short(&e)),
        Err(e) => Err(e.clone()),
    };
    RouterProbe {
        url: url.to_string(),
        health,
        token_set: token.is_some(),
        token: token_status,
    }
}

/// A reqwest error with its causes (reqwest's own text is only the first).
pub fn short(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s = format!("{s}: {c}");
        src = c.source();
    }
    s
}

/// The peer's clock minus ours, ms, and its uncertainty, from a `Date`
/// header value received between `t0` and `t1` (seconds since the epoch).
///
/// `Date` truncates to the second, so the peer's time at the answer lies in
/// `[date, date + 1)`: the estimate is its middle against the middle of the
/// request, with ±500 ms plus half the round trip.
pub fn clock_offset(date_epoch_s: u64, t0: f64, t1: f64) -> (f64, f64) {
    let mid = (t0 + t1) / 2.0;
    let off = (date_epoch_s as f64 + 0.5 - mid) * 1e3;
    (off, 500.0 + (t1 - t0) * 1e3 / 2.0)
}

async fn clock(client: &reqwest::Client, name: &str, http: SocketAddr) -> ClockProbe {
    let now = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let t0 = now();
    let r = client.get(format!("http://{http}/healthz")).send().await;
    let t1 = now();
    let offset = match r {
        Err(e) => Err(short(&e)),
        Ok(r) => r
            .headers()
            .get("date")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| httpdate::parse_http_date(v).ok())
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| clock_offset(d.as_secs(), t0, t1))
            .ok_or_else(|| "no Date header in the answer".to_string()),
    };
    ClockProbe {
        peer: name.to_string(),
        offset,
    }
}

/// Gathers every fact (blocking parts on the blocking pool).
///
/// # Errors
/// An unreadable or invalid `--config` file.
pub async fn gather(a: &DoctorArgs) -> anyhow::Result<Facts> {
    let cfg = match &a.config {
        Some(p) => Some(read_config(p)?),
        None => None,
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(a.timeout_ms))
        .build()?;
    let source = a
        .config
        .as_ref()
        .map_or("default".to_string(), |p| p.display().to_string());
    let backend = match cfg.as_ref().and_then(|c| c.backend.as_ref()) {
        Some(BackendToml::Libfabric { provider }) => Backend::Libfabric {
            provider: provider.clone(),
        },
        Some(BackendToml::Nixl { plugin }) => Backend::Nixl {
            plugin: plugin.clone(),
        },
        None => Backend::Libfabric {
            provider: default_provider(),
        },
    };
    let nixl_plugin_dir = a
        .nixl_plugin_dir
        .clone()
        .or_else(|| std::env::var_os("NIXL_PLUGIN_DIR").map(PathBuf::from));
    let nixl_plugins = match &nixl_plugin_dir {
        Some(d) => plugins_in(d),
        None => Err("not set".into()),
    };
    let engine_plugins = a.pid.map(|pid| {
        (
            pid,
            std::fs::read_to_string(format!("/proc/{pid}/maps"))
                .map(|m| parse_maps(&m).0)
                .map_err(|e| format!("/proc/{pid}/maps: {e}")),
        )
    });
    let uprobe = match a.pid {
        Some(pid) => Some(tokio::task::spawn_blocking(move || uprobe(pid)).await?),
        None => None,
    };
    let agent = a.agent.clone().or_else(|| {
        cfg.as_ref()
            .and_then(|c| c.http_listen)
            .map(|s| s.to_string())
    });
    let side_channels = match (&agent, &cfg) {
        (Some(ag), _) => engines(&client, ag).await.map(|i| {
            i.probe
                .into_iter()
                .chain(i.engines)
                .map(|e| (e.engine_id, e.side_channel))
                .collect()
        }),
        (None, Some(c)) => Ok(if c.probe.enabled {
            let ip = c.node_addr.unwrap_or(IpAddr::from([127, 0, 0, 1]));
            vec![(
                "node_addr".to_string(),
                SocketAddr::new(ip, c.probe.side_channel_port),
            )]
        } else {
            Vec::new()
        }),
        (None, None) => Err("no --agent and no --config".into()),
    };
    let peers: Vec<(String, SocketAddr)> = cfg
        .as_ref()
        .map(|c| c.peers.iter().map(|p| (p.name.clone(), p.http)).collect())
        .unwrap_or_default();
    let env_token = std::env::var("KVLOOP_AGENT_ROUTER_TOKEN").ok();
    let mut routers = Vec::new();
    for r in cfg
        .as_ref()
        .map(|c| c.routers.as_slice())
        .unwrap_or_default()
    {
        let tok = env_token.as_deref().or(r.token.as_deref());
        routers.push(router(&client, &r.url, tok).await);
    }
    let mut clocks = Vec::new();
    for (n, h) in &peers {
        clocks.push(clock(&client, n, *h).await);
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    Ok(Facts {
        fi_providers: fi_providers(),
        backend: (backend, source),
        rdma_devices: rdma_devices(Path::new("/sys/class/infiniband")),
        efa_use_device_rdma: std::env::var("FI_EFA_USE_DEVICE_RDMA").ok(),
        nixl_plugin_dir,
        nixl_plugins,
        engine_plugins,
        memlock_bytes: memlock(),
        hugepages_total: std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| parse_hugepages(&m)),
        cap_eff: parse_cap_eff(&status).unwrap_or(0),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .and_then(|s| parse_kernel(&s)),
        btf: std::fs::File::open("/sys/kernel/btf/vmlinux").is_ok(),
        tracefs: tracefs(),
        uprobe,
        side_channels,
        peers,
        routers,
        clocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsers_read_real_texts() {
        let fi =
            "psm2:\n    version: 117.0\ntcp:\n    version: 117.0\nofi_rxm:\n    version: 117.0\n";
        assert_eq!(parse_fi_info_list(fi), ["psm2", "tcp", "ofi_rxm"]);
        let maps = "7f00-7f01 r-xp 00000000 08:01 12 /opt/nixl/lib/libnixl.so\n\
                    7f02-7f03 r-xp 00000000 08:01 13 /opt/nixl/plugins/libplugin_UCX.so\n\
                    7f04-7f05 rw-p 00000000 00:00 0 \n";
        let (p, n) = parse_maps(maps);
        assert_eq!(p, ["UCX"]);
        assert_eq!(n.as_deref(), Some("/opt/nixl/lib/libnixl.so"));
        assert_eq!(
            parse_cap_eff("Name:\tx\nCapEff:\t000001ffffffffff\n"),
            Some(0x1ff_ffff_ffff)
        );
        assert_eq!(parse_kernel("6.18.2-arch1-1\n"), Some((6, 18)));
        assert_eq!(parse_hugepages("HugePages_Total:       0\n"), Some(0));
        assert_eq!(
            plugin_name("libplugin_LIBFABRIC.so").as_deref(),
            Some("LIBFABRIC")
        );
        assert_eq!(plugin_name("libnixl.so"), None);
    }

    #[test]
    fn clock_offset_is_the_middle_of_both_intervals() {
        // Date 1000 s; request from 1000.2 to 1000.4: peer in [1000, 1001),
        // estimate 1000.5 against 1000.3.
        let (off, unc) = clock_offset(1000, 1000.2, 1000.4);
        assert!((off - 200.0).abs() < 1e-6, "{off}");
        assert!((unc - 600.0).abs() < 1e-6, "{unc}");
    }

    #[test]
    fn lenient_config_reads_the_agent_keys_it_needs() {
        let c: AgentToml = toml::from_str(
            "agent_id = \"a\"\nnode_addr = \"10.0.0.1\"\nbackend = { kind = \"nixl\", plugin = \"LIBFABRIC\" }\n\
             push_period_ms = 5\n[[peers]]\nname = \"b\"\nhttp = \"10.0.0.2:9470\"\ninterface = \"eth0\"\n\
             [[routers]]\nurl = \"http://r:8000\"\n[probe]\nside_channel_port = 5600\nnum_blocks = 4\n",
        )
        .unwrap();
        assert!(
            matches!(c.backend, Some(BackendToml::Nixl { ref plugin }) if plugin == "LIBFABRIC")
        );
        assert_eq!(c.peers[0].http.port(), 9470);
        assert_eq!(c.probe.side_channel_port, 5600);
        assert!(c.routers[0].token.is_none());
    }
}
