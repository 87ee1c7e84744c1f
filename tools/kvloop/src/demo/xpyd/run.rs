//! One policy's run: its two replicas, the client, the events (replica
//! kill and restart, one path degraded and restored), and what the engines
//! logged meanwhile.
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use kvloop_cli::child::ReadyChild;
use kvloop_loadgen::Conversation;
use kvloop_tests::netns_star::NodeStar;
use serde_json::Value;

use super::super::workload::{in_force_pairs, wait_healthy};
use super::drive::Drive;
use super::procs::{Bins, Cluster, PolicySpec};
use super::{ClusterArgs, Event, PolicyRun, get_json, unix_ms};

/// What a policy's run needs.
pub(super) struct RunCtx<'a> {
    pub(super) a: &'a ClusterArgs,
    pub(super) star: &'a NodeStar,
    pub(super) bins: &'a Bins,
    pub(super) cluster: &'a Cluster,
    pub(super) logs: &'a Path,
    pub(super) http: &'a reqwest::Client,
    pub(super) scenario: &'a str,
    /// Kill/restart a replica and degrade/restore a path mid-run.
    pub(super) events: bool,
}

/// Progress points of the events (share of the run's requests).
const KILL_AT: f64 = 0.30;
const DEGRADE_AT: f64 = 0.40;
const RESTART_AT: f64 = 0.55;
const RESTORE_AT: f64 = 0.70;

fn slug(spec: &PolicySpec) -> String {
    spec.name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect::<String>()
        .replace("--", "-")
}

impl RunCtx<'_> {
    pub(super) async fn run(
        &self,
        spec: &PolicySpec,
        convs: &Arc<Vec<Conversation>>,
    ) -> Result<PolicyRun> {
        let tag = format!("{}-{}", &self.scenario[..4], slug(spec));
        let (started, urls, config) = self.cluster.start_replicas(
            self.star,
            self.bins,
            &self.a.out_dir,
            self.logs,
            spec,
            &tag,
        )?;
        let mut routers: Vec<Option<_>> = started.into_iter().map(Some).collect();
        for u in &urls {
            wait_healthy(self.http, u).await?;
        }
        if spec.pushed {
            let want = self.cluster.prefill.len() * self.cluster.decode.len();
            for u in &urls {
                let t = Instant::now();
                let (n, abandoning) = wait_pushed(self.http, u, want).await;
                println!(
                    "  {}: {n}/{want} pair thresholds pushed by the agents in force at {u} (after {:.1} s; {abandoning} with agents that abandon slow READs)",
                    spec.name,
                    t.elapsed().as_secs_f64()
                );
            }
        }
        let before = self.snapshot().await?;
        let requests: usize = convs.iter().map(Conversation::user_turns).sum();
        println!(
            "policy {} ({}): {requests} requests, {} in flight, replicas {} and {} …",
            spec.name, self.scenario, self.a.concurrency, urls[0], urls[1]
        );
        let drive = Arc::new(Drive::new(
            self.http.clone(),
            urls.clone(),
            &tag,
            self.a.answer_tokens,
            self.a.max_policy_s,
        ));
        let t0 = Instant::now();
        let mut events = Vec::new();
        {
            let d2 = drive.clone();
            let c2 = convs.clone();
            let conc = self.a.concurrency;
            let run = tokio::spawn(async move { d2.run(&c2, conc).await });
            tokio::pin!(run);
            let mut plan: Vec<(f64, &str)> = if self.events {
                vec![
                    (KILL_AT, "kill"),
                    (DEGRADE_AT, "degrade"),
                    (RESTART_AT, "restart"),
                    (RESTORE_AT, "restore"),
                ]
            } else {
                Vec::new()
            };
            loop {
                tokio::select! {
                    r = &mut run => { r?; break; }
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
                let done = drive.done.load(Ordering::Relaxed);
                while let Some(&(at, what)) = plan.first() {
                    if (done as f64) < at * requests as f64 {
                        break;
                    }
                    plan.remove(0);
                    let label = self
                        .event(what, &mut routers, (spec, &urls[1]), &config, &tag, &drive)
                        .await?;
                    println!("  t+{:.1} s: {label}", t0.elapsed().as_secs_f64());
                    events.push(Event {
                        what: label,
                        t_ms: t0.elapsed().as_secs_f64() * 1e3,
                        unix_ms: unix_ms(),
                        done,
                    });
                }
            }
            // Events not reached (a short run): the path is restored anyway.
            if plan.iter().any(|p| p.1 == "restore") && !plan.iter().any(|p| p.1 == "degrade") {
                self.star.unlimit("d0");
            }
        }
        let wall_s = t0.elapsed().as_secs_f64();
        let records = std::mem::take(&mut *drive.records.lock().expect("records"));
        let failed = records.iter().filter(|r| r.error.is_some()).count();
        println!(
            "policy {}: {} requests in {wall_s:.1} s, {failed} failed",
            spec.name,
            records.len()
        );
        let after = self.snapshot().await?;
        // The replicas' metrics, for the record (logs/metrics-<run>-<i>.txt).
        for (i, u) in urls.iter().enumerate() {
            if let Ok(r) = self.http.get(format!("{u}/metrics")).send().await
                && let Ok(t) = r.text().await
            {
                let _ = std::fs::write(self.logs.join(format!("metrics-{tag}-{i}.txt")), t);
            }
        }
        drop(routers);
        let mut prefills = Vec::new();
        let mut reads = Vec::new();
        for (id, (p0, r0)) in &before {
            let (p1, r1) = &after[id];
            prefills.extend(new_entries(p0, p1).into_iter().map(|p| (id.clone(), p)));
            reads.extend(new_entries(r0, r1).into_iter().map(|r| (id.clone(), r)));
        }
        Ok(PolicyRun {
            policy: spec.name,
            scenario: self.scenario.to_string(),
            wall_s,
            records,
            prefills,
            reads,
            events,
        })
    }

    /// Carries out one event; returns what was done, in words.
    async fn event(
        &self,
        what: &str,
        routers: &mut [Option<ReadyChild>],
        (spec, url_1): (&PolicySpec, &str),
        config: &Path,
        tag: &str,
        drive: &Drive,
    ) -> Result<String> {
        Ok(match what {
            "kill" => {
                if let Some(mut r) = routers[1].take() {
                    let pid = r.pid();
                    r.kill();
                    format!("router replica 1 (pid {pid}) SIGKILLed")
                } else {
                    "router replica 1 already down".into()
                }
            }
            "restart" => {
                let log = self.logs.join(format!("router-{tag}-restarted-1.log"));
                let r = self
                    .cluster
                    .start_router(self.star, self.bins, config, spec, 1, &log)?;
                let pid = r.pid();
                routers[1] = Some(r);
                // Back in the client's rotation once ready, as behind a
                // readiness probe (warmed up where agents push to it).
                let t = Instant::now();
                wait_healthy(self.http, url_1).await?;
                drive.mark_up(1);
                format!(
                    "router replica 1 restarted (pid {pid}), ready after {} ms",
                    t.elapsed().as_millis()
                )
            }
            "degrade" => {
                self.star
                    .limit_path("d0", self.star.node("p0").addr, &self.a.degrade_rate)?;
                format!("path d0→p0 lowered to {}", self.a.degrade_rate)
            }
            "restore" => {
                self.star.unlimit("d0");
                "path d0→p0 restored".into()
            }
            other => bail!("unknown event {other}"),
        })
    }

    /// Every engine's prefill log and READ log, by engine id.
    async fn snapshot(&self) -> Result<std::collections::BTreeMap<String, (Value, Value)>> {
        let mut m = std::collections::BTreeMap::new();
        for e in self.cluster.engines() {
            let p = if e.id.starts_with('p') {
                get_json(self.http, &format!("{}/sim/prefills", e.url)).await?
            } else {
                Value::Array(Vec::new())
            };
            let r = get_json(self.http, &format!("{}/sim/reads", e.url)).await?;
            m.insert(e.id.clone(), (p, r));
        }
        Ok(m)
    }
}

/// Entries of `after` beyond `before` (logs only grow; both capped alike).
fn new_entries(before: &Value, after: &Value) -> Vec<Value> {
    let n = before.as_array().map_or(0, Vec::len);
    after
        .as_array()
        .map(|a| a.iter().skip(n).cloned().collect())
        .unwrap_or_default()
}

/// Waits (up to 30 s) until `want` pushed pair thresholds are in force at
/// `url`; returns how many are, and how many of their models say the
/// pushing agent abandons slow READs (`abandons_slow_reads`).
async fn wait_pushed(http: &reqwest::Client, url: &str, want: usize) -> (usize, usize) {
    let t = Instant::now();
    loop {
        let pairs = in_force_pairs(http, url).await.unwrap_or_default();
        if pairs.len() >= want || t.elapsed() > Duration::from_secs(30) {
            let abandoning = pairs
                .iter()
                .filter(|p| p["model"]["abandons_slow_reads"] == true)
                .count();
            return (pairs.len(), abandoning);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
