//! The demo's workload: agentic conversations sent through one router per
//! mode (OFF, fixed, adaptive), with the slow-link scenario's mid-run
//! slowdown, and the engines' READ logs collected around every mode.
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvloop_loadgen::tokenizer::TokenCounter;
use kvloop_loadgen::{Conversation, agentic, client, report};
use serde_json::Value;

use kvloop_cli::child::ReadyChild;

use super::cluster::{self, ADMIN_TOKEN, Bins, Cluster};
use super::hold;
use super::report::{Summary, bucket_edges, new_entries};
use super::topology::{Topology, bin_dir, need_bin};
use super::{DemoArgs, FIXED_THRESHOLD_TOKENS, OFF_THRESHOLD_TOKENS};

/// The whole demo on this thread's runtime (node A's namespace).
pub(super) async fn run_async(a: &DemoArgs, topo: &Topology, slow_link: bool) -> Result<()> {
    let t_start = Instant::now();
    let dir = bin_dir(a)?;
    let bins = Bins {
        sim: need_bin(&dir, "kvloop-engine-sim")?,
        router: need_bin(&dir, "kvloop-router")?,
        agent: need_bin(&dir, "kvloop-agent")?,
    };
    let logs = a.out_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    check_modes(&a.modes)?;
    print_banner(a, topo, slow_link);
    let tok = TokenCounter::default_counter();
    let convs = conversations(a, &tok)?;
    let cluster = cluster::start(a, topo, &bins, &logs)?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let mut sum = Summary {
        rep: report::Report::new(bucket_edges(&a.prefix_tokens), tok.name()),
        thresholds: BTreeMap::new(),
        transfers: BTreeMap::new(),
        // Modes not run (none since the agents are always there; the
        // report keeps the field).
        skipped: Vec::new(),
        p_stats: Value::Null,
        d_stats: Value::Null,
    };
    let run = ModeCtx {
        a,
        topo,
        bins: &bins,
        cluster: &cluster,
        logs: &logs,
        http: &http,
        convs: &convs,
        tok: &tok,
        slow_link,
    };
    let mut last_router = None;
    for mode in &a.modes {
        // Each mode's router stops when the next one starts.
        last_router = Some(run.mode(mode, &mut sum).await?);
    }
    sum.p_stats = get_json(&http, &format!("{}/sim/stats", cluster.p_url)).await?;
    sum.d_stats = get_json(&http, &format!("{}/sim/stats", cluster.d_url)).await?;
    if !a.hold {
        drop(last_router.take());
        cluster.stop();
        return sum.finish(a, topo, slow_link, t_start);
    }
    let finished = sum.finish(a, topo, slow_link, t_start);
    if finished.is_ok() {
        let routers = match &last_router {
            Some(r) => vec![format!("http://{}", r.get("http")?)],
            None => Vec::new(),
        };
        hold::hold(&a.out_dir, &held(topo, &cluster, routers), a.hold_max_s).await?;
    }
    drop(last_router);
    cluster.stop();
    finished
}

/// What `--hold` leaves running: both nodes, their agents, the engines.
fn held(topo: &Topology, c: &Cluster, routers: Vec<String>) -> hold::Held {
    let ns = |b: bool| {
        topo.pair
            .as_ref()
            .map(|p| if b { p.ns_b.clone() } else { p.ns_a.clone() })
    };
    let nodes = [("node-a", false), ("node-b", true)]
        .into_iter()
        .enumerate()
        .map(|(i, (name, b))| hold::HeldNode {
            name: name.into(),
            enter: ns(b).map_or_else(Vec::new, |ns| {
                vec!["nsenter".into(), format!("--net=/run/netns/{ns}")]
            }),
            netns: ns(b),
            agent_http: c.agent_http[i].clone(),
            agent_config: std::path::absolute(&c.agent_configs[i])
                .unwrap_or_else(|_| c.agent_configs[i].clone())
                .display()
                .to_string(),
        })
        .collect();
    hold::Held {
        pid: std::process::id(),
        nodes,
        routers,
        engines: vec![
            ("p0".into(), c.p_url.clone()),
            ("d0".into(), c.d_url.clone()),
        ],
        commands: Vec::new(),
    }
    .with_commands()
}

fn check_modes(modes: &[String]) -> Result<()> {
    for m in modes {
        if !["OFF", "fixed", "adaptive"].contains(&m.as_str()) {
            bail!("--modes: unknown mode `{m}`; expected OFF, fixed, adaptive");
        }
    }
    Ok(())
}

fn print_banner(a: &DemoArgs, topo: &Topology, slow_link: bool) {
    println!(
        "kvloop demo{}: node A {} (router, P) / node B {} (D), {}",
        if slow_link { " slow-link" } else { "" },
        topo.ip_a,
        topo.ip_b,
        topo.describe()
    );
    println!(
        "profile {} at time scale {}, KV {} B/token (scaled), conversations: prefixes {:?} × {} × {} turns",
        a.profile,
        a.time_scale,
        a.kv_bytes_per_token,
        a.prefix_tokens,
        a.conversations_per_prefix,
        a.turns
    );
}

/// Conversations (real source files of this machine, nothing downloaded).
fn conversations(a: &DemoArgs, tok: &TokenCounter) -> Result<Vec<Conversation>> {
    let corpus = agentic::SourceCorpus::discover(&agentic::default_source_roots(), 4000)
        .context("finding source files for the agentic conversations")?;
    let spec = agentic::AgenticSpec {
        prefix_tokens: a.prefix_tokens.clone(),
        conversations_per_prefix: a.conversations_per_prefix,
        user_turns: a.turns,
        tool_output_tokens: a.tool_output_tokens,
        tool_output_fraction: a.tool_output_fraction,
        answer_tokens: a.answer_tokens,
        seed: a.seed,
    };
    Ok(agentic::generate_agentic(&spec, &corpus, tok)?)
}

/// What every mode's run needs.
struct ModeCtx<'a> {
    a: &'a DemoArgs,
    topo: &'a Topology,
    bins: &'a Bins,
    cluster: &'a Cluster,
    logs: &'a std::path::Path,
    http: &'a reqwest::Client,
    convs: &'a [Conversation],
    tok: &'a TokenCounter,
    slow_link: bool,
}

impl ModeCtx<'_> {
    /// Runs `mode` behind its own router and adds its run, threshold and
    /// READs to `sum`; returns the router, still running.
    async fn mode(&self, mode: &str, sum: &mut Summary) -> Result<ReadyChild> {
        let threshold = match mode {
            "OFF" => OFF_THRESHOLD_TOKENS,
            // adaptive: static 64 until the agent's first push.
            _ => FIXED_THRESHOLD_TOKENS,
        };
        let (c, http) = (self.cluster, self.http);
        let router = cluster::start_router(self.topo, self.bins, c, self.logs, mode, threshold)?;
        let router_url = format!("http://{}", router.get("http")?);
        wait_healthy(http, &router_url).await?;
        if mode == "adaptive" {
            self.wait_pushed_threshold(&router_url).await;
        }
        let p_before = get_json(http, &format!("{}/sim/reads", c.p_url)).await?;
        let d_before = get_json(http, &format!("{}/sim/reads", c.d_url)).await?;
        let requests: usize = self.convs.iter().map(|c| c.user_turns()).sum();
        if mode == "adaptive" {
            println!(
                "mode {mode}: agent-pushed threshold (static {threshold} until a push), {requests} requests …"
            );
        } else {
            println!("mode {mode}: threshold {threshold} tokens, {requests} requests …");
        }
        let t_mode = Instant::now();
        let run = self.run_clients(mode, &router_url, requests).await?;
        self.topo.unlimit();
        let failed = run.records.iter().filter(|r| r.error.is_some()).count();
        println!(
            "mode {mode}: done in {:.1} s, {failed} failed",
            t_mode.elapsed().as_secs_f64()
        );
        let pushed = if mode == "adaptive" {
            router_threshold(http, &router_url).await
        } else {
            Some(threshold)
        };
        sum.thresholds.insert(mode.to_string(), pushed);
        let p_after = get_json(http, &format!("{}/sim/reads", c.p_url)).await?;
        let d_after = get_json(http, &format!("{}/sim/reads", c.d_url)).await?;
        sum.transfers.insert(
            mode.to_string(),
            (
                new_entries(&p_before, &p_after),
                new_entries(&d_before, &d_after),
            ),
        );
        sum.rep.push(run);
        Ok(router)
    }

    /// The agent pushes every 500 ms once its model is fitted. In
    /// slow-link, an earlier mode's slowdown may still be in the agent's
    /// model: waits until the threshold reflects the restored link (below
    /// 4096 tokens) so the slowdown is seen again.
    async fn wait_pushed_threshold(&self, router_url: &str) {
        let t = Instant::now();
        let mut th = None;
        while t.elapsed() < Duration::from_secs(30) {
            th = router_threshold(self.http, router_url).await;
            if th.is_some_and(|v| !self.slow_link || v < 4096) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        match th {
            Some(v) => println!(
                "  agent-pushed threshold in force: {v} tokens (after {:.1} s)",
                t.elapsed().as_secs_f64()
            ),
            None => {
                println!("  no agent-pushed threshold within 30 s: the router uses its static 64")
            }
        }
    }

    /// The conversations through the router, one at a time; in slow-link
    /// the link is lowered half-way.
    async fn run_clients(
        &self,
        mode: &str,
        router_url: &str,
        requests: usize,
    ) -> Result<client::ModeRun> {
        let mut cfg = client::ClientConfig::new(router_url);
        cfg.model = Some("sim-model".into());
        cfg.max_concurrency = 1;
        cfg.max_duration = Duration::from_secs(self.a.max_mode_s);
        cfg.request_timeout = Duration::from_secs(60);
        cfg.max_output_tokens = Some(self.a.answer_tokens);
        cfg.tag_ids_with_mode = true;
        let run_fut = client::run_mode(mode, self.convs, &cfg, self.tok);
        if !self.slow_link {
            return Ok(run_fut.await?);
        }
        // Lower the link once half of this mode's requests reached P
        // (conversations run shortest prefix first, so the longest ones
        // run on the slow link).
        let stats_url = format!("{}/sim/stats", self.cluster.p_url);
        let p_base = get_json(self.http, &stats_url).await?["requests"]
            .as_u64()
            .unwrap_or(0);
        let switch_at = p_base + (requests as u64).div_ceil(2);
        let half = async {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if let Ok(v) = get_json(self.http, &stats_url).await
                    && v["requests"].as_u64().unwrap_or(0) >= switch_at
                {
                    break;
                }
            }
        };
        tokio::pin!(run_fut);
        tokio::select! {
            r = &mut run_fut => return Ok(r?),
            _ = half => {}
        }
        self.topo.limit(&self.a.slow_rate)?;
        println!("  link B→A lowered to {} (tc tbf)", self.a.slow_rate);
        if mode != "adaptive" {
            return Ok(run_fut.await?);
        }
        tokio::select! {
            r = &mut run_fut => Ok(r?),
            _ = self.watch_threshold(router_url) => unreachable!(),
        }
    }

    /// Prints every change of the router's threshold after the slowdown
    /// (never returns).
    async fn watch_threshold(&self, router_url: &str) {
        let t = Instant::now();
        let mut last = None;
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let v = router_threshold(self.http, router_url).await;
            if v != last {
                println!(
                    "  t+{:.1} s after the slowdown: threshold {} tokens",
                    t.elapsed().as_secs_f64(),
                    v.map_or("(none in force)".into(), |v| v.to_string())
                );
                last = v;
            }
        }
    }
}

/// `GET url` as JSON (2xx only).
pub(super) async fn get_json(http: &reqwest::Client, url: &str) -> Result<Value> {
    let r = http
        .get(url)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    if !r.status().is_success() {
        bail!("GET {url}: {}", r.status());
    }
    r.json().await.with_context(|| format!("GET {url}: JSON"))
}
/// Waits up to 20 s for the router's `/health` to answer 2xx.
pub(super) async fn wait_healthy(http: &reqwest::Client, url: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if http
            .get(format!("{url}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("router at {url} not healthy within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The (p0, d0) threshold in force at the router, if any.
async fn router_threshold(http: &reqwest::Client, url: &str) -> Option<u64> {
    // The (p0, d0) entry when it is in force (pushed and not lapsed).
    in_force_pairs(http, url).await?.iter().find_map(|p| {
        (p["prefill_engine_id"] == "p0" && p["decode_engine_id"] == "d0")
            .then(|| p["threshold_tokens"].as_u64())
            .flatten()
    })
}

/// The pushed pair thresholds in force at the router at `url`
/// (`GET /admin/thresholds` with the demos' token); `None` when it does
/// not answer.
pub(super) async fn in_force_pairs(http: &reqwest::Client, url: &str) -> Option<Vec<Value>> {
    let v: Value = http
        .get(format!("{url}/admin/thresholds"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    Some(
        v["pairs"]
            .as_array()?
            .iter()
            .filter(|p| p["in_force"] == true)
            .cloned()
            .collect(),
    )
}
