//! Prints what `kvloop explain --pair P,D` would show after a bandwidth step
//! (40 → 10 Gbit/s, Qwen3-32B KV, TP=1 prefill profile), as text and JSON.
//!
//! `cargo run --release -p kvloop-costmodel --example explain_demo`

#[path = "../tests/common/mod.rs"]
mod common;
use common::*;
use kvloop_costmodel::*;
use std::time::Duration;

fn main() {
    let s = Duration::from_secs(1);
    let r = step_convergence(
        SimParams::default(),
        PREFILL_TP1,
        40.0,
        4.0,
        60 * s,
        20 * s,
        CostModelConfig::default(),
    );
    let ex = r.sim.explain();
    println!("{ex}");
    println!("{}", serde_json::to_string_pretty(&ex).expect("serializes"));
}
