//! Retention bench (issue 15): D's held block-seconds, the reuse hit rate
//! and TTFT for fixed 480 s (vLLM), early release only, and adaptive
//! retention, on one mixed multi-turn workload, in one run.
//!
//! `cargo bench -p kvloop-retention --bench retention_bench` prints the
//! table and writes `target/kvloop-bench/retention.png`.
//!
//! Injected time: an event-driven simulation of one D (capacity
//! `D_CAPACITY_BLOCKS`, a share taken by other requests' decodes) and the
//! router's policy ([`kvloop_retention`], the same code the router runs),
//! so hours of agentic and chat gaps take milliseconds. Workload
//! (seeded, the same for every mode):
//! - agentic tenant: 12-turn tool loops, gaps lognormal (median 2 s,
//!   σ 0.8), 10 % end silently after each turn;
//! - chat tenant: 6-turn conversations, gaps lognormal (median 45 s,
//!   σ 1.2, so some exceed 480 s), 25 % end silently after each turn;
//! - 30 % of endings are explicit (`DELETE /v1/conversations/{id}`);
//! - 5 % of next turns change the prefix (the stored turn is taken but
//!   recomputed).
//!
//! A hit is a next turn whose previous turn's blocks are still held: it
//! READs them (TTFT = transfer + suffix); a miss recomputes everything.
//! Costs (Qwen3-32B-like, P at TP 8): prefill 0.08 ms per token, READ
//! 3 ms + 0.004 ms per token. When D is full, the hold that expires first
//! is evicted (as vLLM's prefix cache and kvloop's engine-sim do).
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use kvloop_loadgen::report::percentile;
use kvloop_retention::{
    GapBook, HoldFacts, RetentionConfig, RetentionMode, RetentionPolicy, RetentionReason, Verdict,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal};

const BLOCK_TOKENS: u64 = 16;
const D_CAPACITY_BLOCKS: u64 = 60_000;
/// Share of D's blocks other requests' running decodes take.
const ACTIVE_SHARE: f64 = 0.35;
const PREFILL_MS_PER_TOKEN: f64 = 0.08;
const READ_FIXED_MS: f64 = 3.0;
const READ_MS_PER_TOKEN: f64 = 0.004;
const CONVERSATIONS: usize = 3_000;
const ARRIVAL_SPAN_MS: f64 = 3.0 * 3_600_000.0;
const TURN_MS: u64 = 1_500;

struct Conv {
    tenant: &'static str,
    turns_left: u32,
    tokens: u64,
    gap: LogNormal<f64>,
    end_p: f64,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Turn `turn` of conversation `c` starts.
    Start { c: usize, turn: u32 },
    /// Turn of `c` ends: D stores a hold.
    End { c: usize, turn: u32 },
    /// The hold of `c` (generation `g`) reaches its lease end.
    LeaseEnd { c: usize, g: u64 },
    /// The router's store forgets the turn of `c` (generation `g`).
    Forget { c: usize, g: u64 },
}

struct Hold {
    c: usize,
    blocks: u64,
    since_ms: u64,
    lease_end_ms: u64,
}

#[derive(Default, Clone)]
struct Out {
    block_ms: f64,
    next_turns: u64,
    hits: u64,
    ttft_ms: Vec<f64>,
    released_early: u64,
    not_renewed: u64,
    evicted: u64,
    peak_blocks: u64,
}

/// Per conversation: its next turns' plan, drawn once (same for every mode).
struct Plan {
    gaps_ms: Vec<u64>,
    mismatch: Vec<bool>,
    explicit_end: bool,
    start_ms: u64,
    tenant: &'static str,
    tokens0: u64,
}

fn plans() -> Vec<Plan> {
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    (0..CONVERSATIONS)
        .map(|_| {
            let agentic = rng.random_bool(0.5);
            let c = if agentic {
                Conv {
                    tenant: "agents",
                    turns_left: 12,
                    tokens: 3_000,
                    gap: LogNormal::new(2_000f64.ln(), 0.8).unwrap(),
                    end_p: 0.10,
                }
            } else {
                Conv {
                    tenant: "chat",
                    turns_left: 6,
                    tokens: 1_500,
                    gap: LogNormal::new(45_000f64.ln(), 1.2).unwrap(),
                    end_p: 0.25,
                }
            };
            let mut gaps = Vec::new();
            let mut turns = c.turns_left;
            while turns > 1 && !rng.random_bool(c.end_p) {
                gaps.push(c.gap.sample(&mut rng) as u64);
                turns -= 1;
            }
            Plan {
                mismatch: gaps.iter().map(|_| rng.random_bool(0.05)).collect(),
                gaps_ms: gaps,
                explicit_end: rng.random_bool(0.3),
                start_ms: (rng.random::<f64>() * ARRIVAL_SPAN_MS) as u64,
                tenant: c.tenant,
                tokens0: c.tokens,
            }
        })
        .collect()
}

fn simulate(plans: &[Plan], cfg: RetentionConfig) -> Out {
    let policy = RetentionPolicy::new(cfg);
    let mut gaps = GapBook::default();
    let mut q: BinaryHeap<Reverse<(u64, Ev)>> = BinaryHeap::new();
    for (c, p) in plans.iter().enumerate() {
        q.push(Reverse((p.start_ms, Ev::Start { c, turn: 0 })));
    }
    // Every hold by generation; `current[c]`: the readable hold of `c`.
    let mut holds: BTreeMap<u64, Hold> = BTreeMap::new();
    let mut current: Vec<Option<u64>> = vec![None; plans.len()];
    // The latest stored turn of `c`: (generation, stored at, followed).
    let mut latest: Vec<(u64, u64, bool)> = vec![(0, 0, true); plans.len()];
    let mut held_blocks = 0u64;
    let mut last_gap: Vec<Option<u64>> = vec![None; plans.len()];
    let mut tokens: Vec<u64> = plans.iter().map(|p| p.tokens0).collect();
    let mut next_gen = 0u64;
    let mut out = Out::default();
    let budget = (D_CAPACITY_BLOCKS as f64 * (1.0 - ACTIVE_SHARE)) as u64;

    let free = |h: Hold, now: u64, held: &mut u64, out: &mut Out| {
        out.block_ms += (h.blocks * now.saturating_sub(h.since_ms)) as f64;
        *held -= h.blocks;
    };

    while let Some(Reverse((now, ev))) = q.pop() {
        match ev {
            Ev::Start { c, turn } => {
                let p = &plans[c];
                let n = tokens[c];
                if turn > 0 {
                    out.next_turns += 1;
                    let mismatch = p.mismatch[(turn - 1) as usize];
                    // The router sees the gap while its store still has the
                    // turn (up to the cap).
                    let (_, stored_ms, followed) = &mut latest[c];
                    let gap = now - *stored_ms;
                    if gap <= cfg.max_hold_ms {
                        *followed = true;
                        gaps.record_gap(p.tenant, gap);
                        last_gap[c] = Some(gap);
                    }
                    let hold = current[c].take();
                    let hit = hold.is_some() && !mismatch;
                    if let Some(g) = hold {
                        // Pulled (released by the READ's notification) or,
                        // on a mismatch, recomputed: early release frees it
                        // now; fixed keeps it, unread, to its TTL.
                        if hit || policy.releases_early() {
                            if !hit {
                                out.released_early += 1;
                            }
                            let h = holds.remove(&g).unwrap();
                            free(h, now, &mut held_blocks, &mut out);
                        }
                    }
                    let prev = n - 400;
                    let ttft = if hit {
                        READ_FIXED_MS
                            + READ_MS_PER_TOKEN * prev as f64
                            + 400.0 * PREFILL_MS_PER_TOKEN
                    } else {
                        n as f64 * PREFILL_MS_PER_TOKEN
                    };
                    if hit {
                        out.hits += 1;
                    }
                    out.ttft_ms.push(ttft);
                }
                q.push(Reverse((now + TURN_MS, Ev::End { c, turn })));
            }
            Ev::End { c, turn } => {
                let p = &plans[c];
                let blocks = tokens[c].div_ceil(BLOCK_TOKENS);
                // Make room: evict the holds that expire first.
                while held_blocks + blocks > budget {
                    let Some((&g, h)) = holds.iter().min_by_key(|(_, h)| h.lease_end_ms) else {
                        break;
                    };
                    if current[h.c] == Some(g) {
                        current[h.c] = None;
                    }
                    let h = holds.remove(&g).unwrap();
                    out.evicted += 1;
                    free(h, now, &mut held_blocks, &mut out);
                }
                next_gen += 1;
                let g = next_gen;
                let facts = HoldFacts {
                    elapsed_ms: 0,
                    blocks,
                    saved_ms: tokens[c] as f64 * PREFILL_MS_PER_TOKEN,
                    kv_usage: Some(usage(held_blocks)),
                    conversation_gap_ms: last_gap[c],
                };
                let v = policy.first_lease(gaps.get(p.tenant), &facts);
                holds.insert(
                    g,
                    Hold {
                        c,
                        blocks,
                        since_ms: now,
                        lease_end_ms: now + v.keep_ms,
                    },
                );
                current[c] = Some(g);
                latest[c] = (g, now, false);
                held_blocks += blocks;
                out.peak_blocks = out.peak_blocks.max(held_blocks);
                q.push(Reverse((now + v.keep_ms, Ev::LeaseEnd { c, g })));
                q.push(Reverse((now + cfg.max_hold_ms, Ev::Forget { c, g })));
                let next = turn as usize;
                if next < p.gaps_ms.len() {
                    tokens[c] += 400 + 300;
                    q.push(Reverse((
                        now + p.gaps_ms[next],
                        Ev::Start { c, turn: turn + 1 },
                    )));
                } else if p.explicit_end && policy.releases_early() {
                    // DELETE /v1/conversations/{id}: released at once.
                    if let Some(g) = current[c].take() {
                        out.released_early += 1;
                        let h = holds.remove(&g).unwrap();
                        free(h, now, &mut held_blocks, &mut out);
                    }
                }
            }
            Ev::LeaseEnd { c, g } => {
                let Some(h) = holds.get(&g) else { continue };
                if h.lease_end_ms != now {
                    continue;
                }
                let readable = current[c] == Some(g);
                let v = if readable {
                    let facts = HoldFacts {
                        elapsed_ms: now - h.since_ms,
                        blocks: h.blocks,
                        saved_ms: tokens[c] as f64 * PREFILL_MS_PER_TOKEN,
                        kv_usage: Some(usage(held_blocks)),
                        conversation_gap_ms: last_gap[c],
                    };
                    policy.renew(gaps.get(plans[c].tenant), &facts)
                } else {
                    Verdict {
                        keep_ms: 0,
                        reason: RetentionReason::Cap,
                        value_ms: 0.0,
                        cost_ms: 0.0,
                    }
                };
                if v.releases() {
                    if v.reason == RetentionReason::NotWorth {
                        out.not_renewed += 1;
                    }
                    if readable {
                        current[c] = None;
                    }
                    let h = holds.remove(&g).unwrap();
                    free(h, now, &mut held_blocks, &mut out);
                } else {
                    holds.get_mut(&g).unwrap().lease_end_ms = now + v.keep_ms;
                    q.push(Reverse((now + v.keep_ms, Ev::LeaseEnd { c, g })));
                }
            }
            Ev::Forget { c, g } => {
                // The store's TTL: the conversation did not come back.
                let (lg, _, followed) = latest[c];
                if lg == g && !followed {
                    gaps.record_abandoned(plans[c].tenant);
                }
            }
        }
    }
    out
}

fn usage(held_blocks: u64) -> f64 {
    ACTIVE_SHARE + held_blocks as f64 / D_CAPACITY_BLOCKS as f64
}

fn main() {
    let plans = plans();
    let d = RetentionConfig::default();
    let modes = [
        (
            "fixed 480 s (vLLM)".to_string(),
            RetentionMode::Fixed,
            d.block_second_cost_ms,
        ),
        (
            "early release".to_string(),
            RetentionMode::EarlyRelease,
            d.block_second_cost_ms,
        ),
        (
            format!("adaptive (default, {} ms/block-s)", d.block_second_cost_ms),
            RetentionMode::Adaptive,
            d.block_second_cost_ms,
        ),
        (
            "adaptive, cost ×4".to_string(),
            RetentionMode::Adaptive,
            d.block_second_cost_ms * 4.0,
        ),
        (
            "adaptive, cost ÷4".to_string(),
            RetentionMode::Adaptive,
            d.block_second_cost_ms / 4.0,
        ),
    ];
    let mut rows = Vec::new();
    for (name, mode, cost) in modes {
        let cfg = RetentionConfig {
            mode,
            block_second_cost_ms: cost,
            ..Default::default()
        };
        rows.push((name, simulate(&plans, cfg)));
    }
    let base = rows[0].1.block_ms;
    println!(
        "retention bench: {CONVERSATIONS} conversations (agentic + chat) over {:.0} h of injected time, D {D_CAPACITY_BLOCKS} blocks",
        ARRIVAL_SPAN_MS / 3_600_000.0
    );
    println!(
        "| mode | held block-s | vs fixed | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT mean ms | released early | not renewed | evicted | peak held blocks |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut png = Vec::new();
    for (name, o) in &rows {
        let mean = o.ttft_ms.iter().sum::<f64>() / o.ttft_ms.len().max(1) as f64;
        let hit = o.hits as f64 / o.next_turns.max(1) as f64;
        let p50 = percentile(&o.ttft_ms, 0.5).unwrap_or(f64::NAN);
        let p90 = percentile(&o.ttft_ms, 0.9).unwrap_or(f64::NAN);
        println!(
            "| {name} | {:.0} | {:.2} | {:.1} % | {p50:.0} | {p90:.0} | {mean:.0} | {} | {} | {} | {} |",
            o.block_ms / 1000.0,
            o.block_ms / base,
            100.0 * hit,
            o.released_early,
            o.not_renewed,
            o.evicted,
            o.peak_blocks
        );
        png.push(vec![100.0 * o.block_ms / base, 100.0 * hit, mean / 10.0]);
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/kvloop-bench/retention.png");
    let groups: Vec<String> = rows.iter().map(|(n, _)| n.to_string()).collect();
    match kvloop_loadgen::bars::write_grouped_bars(
        &path,
        "D retention: held block-seconds, hit rate, TTFT",
        "percent / ms÷10",
        &groups,
        &[
            "held block-s (% of fixed)",
            "hit rate (%)",
            "TTFT mean (ms ÷ 10)",
        ],
        &png,
    ) {
        Ok(()) => println!("chart: {}", path.display()),
        Err(e) => eprintln!("chart not written: {e}"),
    }
}
