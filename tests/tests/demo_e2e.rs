//! A short `kvloop demo` for real: the router, a node agent per node, a P and
//! a D `kvloop-engine-sim` with real KV memory registered with their agents
//! (managed mode: the agents READ every block over libfabric, the engines
//! verify it), in two
//! network namespaces joined by a veth (needs root); agentic conversations from `kvloop-loadgen`. Checks the
//! report's fields, the OFF → fixed speed-up at the longest prompt, and that
//! no KV block mismatched. No timing thresholds beyond "reuse is faster than
//! recomputing 8k tokens", which the cost profile makes a ~5× effect.
use std::process::Command;

use kvloop_tests::*;
use serde_json::Value;

#[test]
#[ignore = "needs root (network namespaces)"]
fn short_demo_reports_speed_up_and_zero_mismatches() {
    require_root("short_demo_reports_speed_up_and_zero_mismatches");
    let kvloop = bin("kvloop");
    // The demo starts these from the same directory.
    bin("kvloop-engine-sim");
    bin("kvloop-router");
    bin("kvloop-agent");
    let out = std::env::temp_dir().join(format!("kvloop-demo-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut cmd = Command::new(&kvloop);
    cmd.args(["demo", "loop"])
        .args(["--prefix-tokens", "1024,8192"])
        .args(["--conversations-per-prefix", "1", "--turns", "3"])
        .args(["--answer-tokens", "16", "--max-mode-s", "120"])
        .arg("--out-dir")
        .arg(&out);
    let o = cmd.output().expect("running kvloop demo");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "kvloop demo failed:\n{stdout}\n{stderr}"
    );
    eprintln!("{stdout}");
    assert!(stdout.contains("TTFT OFF"), "{stdout}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert!(out.join("ttft.png").exists());
    let rows = report["rows"].as_array().expect("rows");
    for r in rows {
        for field in [
            "mode",
            "prompt_tokens",
            "ttft_ms_p50",
            "transfer_ms_p50",
            "threshold_tokens",
        ] {
            assert!(r.get(field).is_some(), "row without {field}: {r}");
        }
        assert_eq!(r["errors"], 0, "{r}");
    }
    let longest = |mode: &str| {
        rows.iter()
            .filter(|r| r["mode"] == mode)
            .max_by_key(|r| r["prompt_tokens"].as_u64().unwrap())
            .unwrap_or_else(|| panic!("no {mode} rows: {report}"))
            .clone()
    };
    let off = longest("OFF");
    let fixed = longest("fixed");
    assert_eq!(off["threshold_tokens"], 1_000_000_000u64);
    assert_eq!(fixed["threshold_tokens"], 64);
    assert!(
        fixed["transfer_ms_p50"].as_f64().is_some(),
        "fixed reused KV: {fixed}"
    );
    assert!(
        off["transfer_ms_p50"].is_null(),
        "OFF never reads D's KV: {off}"
    );
    let speed_up = off["ttft_ms_p50"].as_f64().unwrap() / fixed["ttft_ms_p50"].as_f64().unwrap();
    assert!(
        speed_up > 1.0,
        "speed-up {speed_up} at the longest prompt\n{stdout}"
    );
    // The adaptive rows carry the agent-pushed threshold.
    assert_eq!(report["modes_skipped"], serde_json::json!([]));
    let adaptive = longest("adaptive");
    assert!(
        adaptive["threshold_tokens"].as_u64().is_some(),
        "agent pushed a threshold: {adaptive}"
    );
    assert!(adaptive["ttft_ms_p50"].as_f64().is_some(), "{adaptive}");
    // Both engines' KV was managed by their node agents.
    for e in ["p0", "d0"] {
        assert_eq!(report["engines"][e]["kv_mode"], "agent", "{e}: {report}");
    }
    assert!(report["verified_blocks"].as_u64().unwrap() > 0, "{stdout}");
    assert_eq!(report["mismatched_blocks"], 0, "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}
