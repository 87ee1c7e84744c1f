//! The cluster demo's report: the tables (TTFT per policy and scenario,
//! decisions, bytes, regret, events, blocks verified), `report.json` and
//! `ttft.png`.
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::Instant;

use anyhow::Result;
use serde_json::{Value, json};

use super::drive::{Rec, route_field};
use super::oracle::{Costed, Line, Profile, Span, Turn, TurnLoss, quantile, regret};
use super::{ClusterArgs, PolicyRun};

/// Where the links are.
pub(super) struct Topology {
    pub(super) slow_path: String,
    pub(super) slow_rate: String,
    pub(super) degrade_path: String,
    pub(super) degrade_rate: String,
    pub(super) router_addrs: Vec<std::net::IpAddr>,
}

/// One policy's numbers.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    scenario: String,
    policy: String,
    requests: usize,
    failed: usize,
    ttft_p50_ms: f64,
    ttft_p90_ms: f64,
    ttft_p99_ms: f64,
    pulled: usize,
    recomputed: usize,
    reasons: BTreeMap<String, usize>,
    d2p_bytes: u64,
    p2d_bytes: u64,
    regret: f64,
    best_chosen: usize,
    costed: usize,
    wall_s: f64,
    /// The turns that cost the most over the oracle, one line each.
    worst_turns: Vec<String>,
}

fn f(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(0.0)
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

/// Per (P, D, degraded) transfer lines of a scenario's runs: every
/// successful D→P READ, joined to its prefill (engine request id) and
/// route (previous D).
fn path_lines(
    runs: &[&PolicyRun],
    windows: &[(f64, f64)],
) -> HashMap<(String, String, bool), Line> {
    let mut pts: HashMap<(String, String, bool), Vec<(u64, f64)>> = HashMap::new();
    for r in runs {
        let routes: HashMap<&str, &Rec> = r
            .records
            .iter()
            .map(|x| (x.request_id.as_str(), x))
            .collect();
        // A READ's engine request id → its prefill (router request id, time).
        let pre_of: HashMap<&str, &Value> = r
            .prefills
            .iter()
            .map(|(_, p)| (s(p, "engine_request_id"), p))
            .collect();
        for (p_id, read) in &r.reads {
            if s(read, "direction") != "d2p" || read.get("error").is_some_and(|e| !e.is_null()) {
                continue;
            }
            let tokens = read.get("tokens").and_then(Value::as_u64).unwrap_or(0);
            let Some(pre) = pre_of.get(s(read, "request_id")) else {
                continue;
            };
            let Some(prev) = routes
                .get(s(pre, "request_id"))
                .and_then(|x| x.route.as_deref())
                .and_then(|l| route_field(l, "prev_decode"))
            else {
                continue;
            };
            let at = f(pre, "arrived_unix_ms");
            let degraded = windows.iter().any(|(a, b)| at >= *a && at < *b);
            if tokens > 0 {
                pts.entry((p_id.clone(), prev.to_string(), degraded))
                    .or_default()
                    .push((tokens, f(read, "transfer_ms")));
            }
        }
    }
    pts.into_iter()
        .filter_map(|(k, v)| Line::fit(&v).map(|l| (k, l)))
        .collect()
}

fn degraded_windows(run: &PolicyRun) -> Vec<(f64, f64)> {
    let start = run
        .events
        .iter()
        .find(|e| e.what.contains("lowered"))
        .map(|e| e.unix_ms);
    let end = run
        .events
        .iter()
        .find(|e| e.what.contains("restored"))
        .map_or(f64::INFINITY, |e| e.unix_ms);
    start.map(|s| vec![(s, end)]).unwrap_or_default()
}

fn row(
    run: &PolicyRun,
    lines: &HashMap<(String, String, bool), Line>,
    profile: &Profile,
    prefills: &[String],
) -> Row {
    let ok: Vec<&Rec> = run.records.iter().filter(|r| r.error.is_none()).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    // The run's start, Unix ms (each record: sent at `t_ms` after it).
    let start_ms = run.records.first().map_or(0.0, |r| r.sent_unix_ms - r.t_ms);
    let mut reasons = BTreeMap::new();
    let (mut pulled, mut recomputed) = (0, 0);
    for r in &ok {
        if let Some(l) = &r.route {
            let key = format!(
                "{} / {}",
                route_field(l, "reason").unwrap_or("?"),
                route_field(l, "decision").unwrap_or("?")
            );
            *reasons.entry(key).or_insert(0) += 1;
            if route_field(l, "action") == Some("pull") {
                pulled += 1;
            } else {
                recomputed += 1;
            }
        }
    }
    let bytes = |dir: &str| -> u64 {
        run.reads
            .iter()
            .filter(|(_, r)| s(r, "direction") == dir)
            .map(|(_, r)| r.get("bytes").and_then(Value::as_u64).unwrap_or(0))
            .sum()
    };
    let pre: HashMap<&str, &Value> = run
        .prefills
        .iter()
        .map(|(_, p)| (s(p, "request_id"), p))
        .collect();
    let spans: Vec<Span> = run
        .prefills
        .iter()
        .map(|(engine, p)| Span {
            prefill: engine.clone(),
            ready_ms: f(p, "arrived_unix_ms") + f(p, "read_ms"),
            start_ms: f(p, "compute_start_unix_ms"),
            end_ms: f(p, "compute_end_unix_ms"),
        })
        .collect();
    let windows = degraded_windows(run);
    let turns: Vec<Turn> = ok
        .iter()
        .filter_map(|r| {
            let l = r.route.as_deref()?;
            let p = pre.get(r.request_id.as_str())?;
            let pulled = route_field(l, "action") == Some("pull");
            Some(Turn {
                request_id: r.request_id.clone(),
                at_ms: f(p, "arrived_unix_ms") - 0.001,
                prompt_tokens: p.get("prompt_tokens").and_then(Value::as_u64)?,
                reusable_tokens: route_field(l, "reusable")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
                prev_decode: route_field(l, "prev_decode").map(str::to_string),
                prefill: route_field(l, "prefill")?.to_string(),
                pulled,
                read_failed_after_ms: (pulled
                    && f(p, "read_ms") > 0.0
                    && p.get("reused_tokens").and_then(Value::as_u64) == Some(0))
                .then(|| f(p, "read_ms")),
            })
        })
        .collect();
    let rg = regret(&turns, &spans, prefills, profile, |p, d, t| {
        let degraded = windows.iter().any(|(a, b)| t >= *a && t < *b);
        lines
            .get(&(p.to_string(), d.to_string(), degraded))
            .or_else(|| lines.get(&(p.to_string(), d.to_string(), false)))
            .copied()
    });
    Row {
        scenario: run.scenario.clone(),
        policy: run.policy.to_string(),
        requests: run.records.len(),
        failed: run.records.len() - ok.len(),
        ttft_p50_ms: quantile(&ttft, 0.5),
        ttft_p90_ms: quantile(&ttft, 0.9),
        ttft_p99_ms: quantile(&ttft, 0.99),
        pulled,
        recomputed,
        reasons,
        d2p_bytes: bytes("d2p"),
        p2d_bytes: bytes("p2d"),
        regret: rg.ratio(),
        best_chosen: rg.best_chosen,
        costed: rg.turns,
        wall_s: run.wall_s,
        worst_turns: rg.worst.iter().map(|w| worst_line(w, start_ms)).collect(),
    }
}

/// One costly turn in words: when, the choice and the oracle's, their costs.
fn worst_line(w: &TurnLoss, start_unix_ms: f64) -> String {
    let opt = |c: &Costed| {
        format!(
            "{} {} ({:.0} ms)",
            c.prefill,
            if c.pull { "pull" } else { "recompute" },
            c.cost_ms
        )
    };
    format!(
        "{} at {:.1} s: chose {}, oracle {}: +{:.0} ms",
        w.request_id,
        (w.at_ms - start_unix_ms) / 1e3,
        opt(&w.chosen),
        opt(&w.best),
        w.loss_ms()
    )
}

/// What each event did in `run`, in words.
fn event_lines(run: &PolicyRun) -> Vec<String> {
    let mut out = Vec::new();
    let at = |what: &str| {
        run.events
            .iter()
            .find(|e| e.what.contains(what))
            .map(|e| e.t_ms)
    };
    if let (Some(k), r) = (at("SIGKILL"), at("restarted")) {
        let r = r.unwrap_or(f64::INFINITY);
        let failed = run.records.iter().filter(|x| x.error.is_some()).count();
        let retried_ok = run
            .records
            .iter()
            .filter(|x| x.retry && x.error.is_none())
            .count();
        let over = run.records.iter().filter(|x| x.failed_over).count();
        let lost = run
            .records
            .iter()
            // A retry is the turn that was in flight on the killed replica
            // (which may have taken its stored turn already): not a later one.
            .filter(|x| x.turn > 0 && x.t_ms >= k && x.error.is_none() && !x.retry)
            .filter(|x| {
                x.route.as_deref().and_then(|l| route_field(l, "decision")) == Some("no_entry")
            })
            .count();
        out.push(format!(
            "replica 1 killed at {:.1} s, back at {:.1} s: {failed} requests failed (in flight on it), {retried_ok} retried on replica 0 and answered, {over} sent to replica 0 while it was down; {lost} later turns found no stored turn (reuse lost beyond the turns in flight)",
            k / 1e3,
            r / 1e3
        ));
    }
    if let Some(dg) = at("lowered") {
        let rs = at("restored").unwrap_or(f64::INFINITY);
        let window = |a: f64, b: f64| -> (usize, usize) {
            let sel: Vec<&Rec> = run
                .records
                .iter()
                .filter(|x| x.t_ms >= a && x.t_ms < b && x.error.is_none())
                .filter(|x| {
                    x.route
                        .as_deref()
                        .and_then(|l| route_field(l, "prev_decode"))
                        == Some("d0")
                })
                .collect();
            let via = sel
                .iter()
                .filter(|x| {
                    let l = x.route.as_deref().unwrap_or("");
                    route_field(l, "prefill") == Some("p0")
                        && route_field(l, "action") == Some("pull")
                })
                .count();
            (via, sel.len())
        };
        let (b, bn) = window(0.0, dg);
        let (d, dn) = window(dg, rs);
        let (a, an) = window(rs, f64::INFINITY);
        out.push(format!(
            "d0→p0 lowered at {:.1} s, restored at {:.1} s: turns whose KV was on d0 pulled over d0→p0: {b}/{bn} before, {d}/{dn} while lowered, {a}/{an} after",
            dg / 1e3,
            rs / 1e3
        ));
    }
    out
}

/// Prints the tables and writes `report.json` and `ttft.png`.
pub(super) fn finish(
    a: &ClusterArgs,
    topo: &Topology,
    runs: &[PolicyRun],
    stats: &[(String, Value)],
    t_start: Instant,
) -> Result<()> {
    let p_stats = stats
        .iter()
        .find(|(id, _)| id.starts_with('p'))
        .map(|x| &x.1);
    let prof = p_stats
        .and_then(|v| v.get("profile"))
        .cloned()
        .unwrap_or(Value::Null);
    let profile = Profile {
        t0_ms: f(&prof, "t0_ms"),
        a_ms_per_token: f(&prof, "a_ms_per_token"),
        b_ms_per_token2: f(&prof, "b_ms_per_token2"),
        time_scale: p_stats.map_or(1.0, |v| {
            v.get("time_scale").and_then(Value::as_f64).unwrap_or(1.0)
        }),
    };
    let prefills: Vec<String> = (0..a.prefill_engines).map(|i| format!("p{i}")).collect();
    let mut rows = Vec::new();
    let mut text = String::new();
    for scenario in &a.scenarios {
        let sruns: Vec<&PolicyRun> = runs.iter().filter(|r| &r.scenario == scenario).collect();
        let windows: Vec<(f64, f64)> = sruns.iter().flat_map(|r| degraded_windows(r)).collect();
        let lines = path_lines(&sruns, &windows);
        let _ = writeln!(
            text,
            "\n## {scenario}{}",
            if scenario == "heterogeneous" {
                format!(
                    " ({} at {}; {} lowered to {} mid-run; replica 1 killed and restarted mid-run)",
                    topo.slow_path, topo.slow_rate, topo.degrade_path, topo.degrade_rate
                )
            } else {
                " (every path fast, no events)".into()
            }
        );
        let _ = writeln!(
            text,
            "\n| policy | requests | failed | TTFT p50 ms | p90 ms | p99 ms | p90 vs rr+fixed | pulled | recomputed | D→P MiB | P→D MiB | regret vs oracle | best choice |"
        );
        let _ = writeln!(
            text,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        let base = sruns.first().map(|r| row(r, &lines, &profile, &prefills));
        for r in &sruns {
            let x = row(r, &lines, &profile, &prefills);
            let ratio = base
                .as_ref()
                .map_or(f64::NAN, |b| x.ttft_p90_ms / b.ttft_p90_ms);
            let _ = writeln!(
                text,
                "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {} | {} | {:.0} | {:.0} | {:.1} % | {}/{} |",
                x.policy,
                x.requests,
                x.failed,
                x.ttft_p50_ms,
                x.ttft_p90_ms,
                x.ttft_p99_ms,
                ratio,
                x.pulled,
                x.recomputed,
                x.d2p_bytes as f64 / 1048576.0,
                x.p2d_bytes as f64 / 1048576.0,
                x.regret * 100.0,
                x.best_chosen,
                x.costed
            );
            rows.push(x);
        }
        let _ = writeln!(text, "\ndecisions (reason / reuse decision):");
        for r in rows.iter().filter(|r| &r.scenario == scenario) {
            let list: Vec<String> = r.reasons.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            let _ = writeln!(text, "- {}: {}", r.policy, list.join(", "));
        }
        let _ = writeln!(text, "\ncostliest turns against the oracle:");
        for r in rows.iter().filter(|r| &r.scenario == scenario) {
            if r.worst_turns.is_empty() {
                continue;
            }
            let _ = writeln!(text, "- {}: {}", r.policy, r.worst_turns.join("; "));
        }
        let mut lines_shown = false;
        for r in &sruns {
            for l in event_lines(r) {
                if !lines_shown {
                    let _ = writeln!(text, "\nevents:");
                    lines_shown = true;
                }
                let _ = writeln!(text, "- {}: {l}", r.policy);
            }
        }
        let mut ls: Vec<_> = lines.iter().filter(|(k, _)| !k.2).collect();
        ls.sort_by(|x, y| x.0.cmp(y.0));
        let paths: Vec<String> = ls
            .iter()
            .map(|((p, d, _), l)| {
                format!(
                    "{d}→{p} {:.1} ms + {:.4} ms/token",
                    l.fixed_ms, l.ms_per_token
                )
            })
            .collect();
        let _ = writeln!(
            text,
            "\nmeasured D→P READ paths (the oracle's): {}",
            paths.join("; ")
        );
    }
    let (verified, mismatched) = stats.iter().fold((0u64, 0u64), |acc, (_, v)| {
        (
            acc.0
                + v.get("verified_blocks")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
            acc.1
                + v.get("mismatched_blocks")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
        )
    });
    let _ = writeln!(
        text,
        "\nblocks verified byte-exact on arrival: {verified}, mismatched: {mismatched}"
    );
    let _ = writeln!(text, "total {:.0} s", t_start.elapsed().as_secs_f64());
    print!("{text}");
    std::fs::create_dir_all(&a.out_dir)?;
    let report = json!({
        "args": format!("{a:?}"),
        "topology": {"slow_path": topo.slow_path, "slow_rate": topo.slow_rate, "degrade_path": topo.degrade_path,
                     "degrade_rate": topo.degrade_rate, "router_addrs": topo.router_addrs},
        "rows": rows, "verified_blocks": verified, "mismatched_blocks": mismatched,
        "runs": runs,
    });
    let json_path = a.out_dir.join("report.json");
    std::fs::write(&json_path, serde_json::to_vec_pretty(&report)?)?;
    std::fs::write(a.out_dir.join("report.md"), &text)?;
    let png = a.out_dir.join("ttft.png");
    let groups: Vec<String> = rows
        .iter()
        .map(|r| format!("{} ({})", r.policy, &r.scenario[..5]))
        .collect();
    let values: Vec<Vec<f64>> = rows
        .iter()
        .map(|r| vec![r.ttft_p50_ms, r.ttft_p90_ms, r.ttft_p99_ms])
        .collect();
    kvloop_loadgen::bars::write_grouped_bars(
        &png,
        "kvloop demo cluster: TTFT by policy",
        "TTFT, ms",
        &groups,
        &["p50", "p90", "p99"],
        &values,
    )?;
    println!(
        "wrote {}, {} and {}",
        json_path.display(),
        a.out_dir.join("report.md").display(),
        png.display()
    );
    if mismatched > 0 {
        anyhow::bail!("{mismatched} KV blocks differed from the locally computed KV");
    }
    Ok(())
}
