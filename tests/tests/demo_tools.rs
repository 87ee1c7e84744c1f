//! The operator tools against a running demo (issue 16): `kvloop demo
//! --hold` keeps its two namespace nodes, agents, engines and router up
//! after a short run; `kvloop doctor`, `kvloop ping` and `kvloop top` then
//! run inside node A's namespace as `hold.json` lists them. Each is checked
//! healthy, then with a failure injected (a wrong router token in a copy of
//! agent A's configuration, a peer address where no agent listens). Then
//! decode-side retention (issue 15): `DELETE /v1/conversations/{id}` on the
//! held router releases D's hold through both agents. SIGTERM ends the
//! hold: the demo exits 0 and removes its namespaces. No timing assertions.
use std::time::Duration;

use kvloop_tests::held::*;
use kvloop_tests::*;

#[test]
#[ignore = "needs root (network namespaces)"]
fn doctor_ping_and_top_against_a_held_demo() {
    let name = "doctor_ping_and_top_against_a_held_demo";
    require_root(name);
    require_tool(name, "timeout", "coreutils");
    require_tool(name, "curl", "curl");
    require_tool(name, "nsenter", "util-linux");
    bin("kvloop-engine-sim");
    bin("kvloop-router");
    bin("kvloop-agent");
    let out = std::env::temp_dir().join(format!("kvloop-demo-tools-{}", std::process::id()));
    let mut demo = HeldDemo::start(
        &[
            "demo",
            "loop",
            "--modes",
            "adaptive",
            "--prefix-tokens",
            "2048",
            "--conversations-per-prefix",
            "1",
            "--turns",
            "2",
            "--answer-tokens",
            "8",
            "--max-mode-s",
            "120",
        ],
        &out,
    );
    let held = demo.wait_held(Duration::from_secs(240));
    let nodes = held["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), 2, "{held}");
    let s = |v: &serde_json::Value| v.as_str().unwrap_or_else(|| panic!("{held}")).to_string();
    let (ns_a, ns_b) = (s(&nodes[0]["netns"]), s(&nodes[1]["netns"]));
    let cfg_a = s(&nodes[0]["agent_config"]);
    let (agent_a, agent_b) = (s(&nodes[0]["agent_http"]), s(&nodes[1]["agent_http"]));
    let router = s(&held["routers"][0]);
    let commands = held["commands"].as_array().unwrap();
    assert_eq!(commands.len(), 4, "{held}");
    assert!(s(&commands[3]).contains("explain --router"), "{held}");

    // doctor, healthy: node A's side channel is routable from B, the router
    // takes agent A's token, B's clock answers.
    let v = json_of(&tool_on(
        &nodes[0],
        &["doctor", "--json", "--config", &cfg_a],
    ));
    for c in ["side_channel", "routers", "clock"] {
        assert_eq!(doctor_check(&v, c)["level"], "pass", "{c}: {v}");
    }
    // doctor, injected: a wrong router token (a copy of agent A's config).
    let bad = out.join("agent-a-wrong-token.toml");
    let text = std::fs::read_to_string(&cfg_a).unwrap();
    assert!(text.contains("token = \"kvloop-demo\""), "{text}");
    std::fs::write(
        &bad,
        text.replace("token = \"kvloop-demo\"", "token = \"not-the-token\""),
    )
    .unwrap();
    let o = tool_on(
        &nodes[0],
        &["doctor", "--json", "--config", bad.to_str().unwrap()],
    );
    let v = json_of(&o);
    assert_eq!(doctor_check(&v, "routers")["level"], "fail", "{v}");
    assert_eq!(o.status.code(), Some(2), "{v}");

    // ping A → B's probe engine: every READ completes.
    let o = tool_on(&nodes[0], &["ping", &agent_b, "-c", "20", "--json"]);
    assert!(o.status.success(), "ping failed");
    let rows = ping_summaries(&o);
    assert_eq!(rows.len(), 3, "one summary per --blocks row (1, 8, 32)");
    for r in &rows {
        assert_eq!(r["reads"], 20, "{r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert!(r["bw_gbps"].as_f64().unwrap() > 0.0, "{r}");
    }
    // ping, injected: an address in node A where no agent listens.
    let o = tool_on(&nodes[0], &["ping", "127.0.0.1:9", "-c", "2", "--json"]);
    assert!(!o.status.success(), "ping of nothing must fail");

    // explain of the router's last turns, with the printed token.
    let host_port = router.trim_start_matches("http://");
    let o = tool_on(
        &nodes[0],
        &[
            "explain",
            "--router",
            host_port,
            "--token",
            "kvloop-demo",
            "--last",
            "5",
        ],
    );
    assert!(
        o.status.success(),
        "explain --router: {}",
        String::from_utf8_lossy(&o.stderr)
    );

    // top --once --json over both agents and the router.
    let v = json_of(&tool_on(
        &nodes[0],
        &[
            "top", "--once", "--json", "--router", &router, &agent_a, &agent_b,
        ],
    ));
    assert!(v["errors"].as_array().unwrap().is_empty(), "{v}");
    let path = v["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["agent"] == "node-a" && p["peer"] == "node-b")
        .unwrap_or_else(|| panic!("no node-a → node-b path: {v}"))
        .clone();
    assert_eq!(path["path_valid"], true, "{path}");
    assert!(path["probe_reads"].as_u64().unwrap() > 0, "{path}");
    // The fit's bandwidth, once identified (a run this short may end
    // before: null).
    assert!(
        path["bandwidth_gbps"].is_null() || path["bandwidth_gbps"].as_f64().unwrap() > 0.0,
        "{path}"
    );
    let th = &v["thresholds"][0];
    assert_eq!(th["prefill"], "p0", "{v}");
    assert!(th["threshold_tokens"].as_u64().is_some(), "{v}");
    // Confidence of the fit behind it; null while the pair has none yet
    // (a run this short may end before the first fit).
    let conf = th.get("confidence").expect("a confidence field");
    assert!(
        conf.is_null() || (0.0..=1.0).contains(&conf.as_f64().unwrap()),
        "{v}"
    );
    assert!(
        !v["decisions"].as_array().unwrap().is_empty(),
        "the held router served the adaptive mode: {v}"
    );
    // top, injected: an agent that is not there is listed, exit status 1.
    let o = tool_on(
        &nodes[0],
        &["top", "--once", "--json", &agent_a, "127.0.0.1:9"],
    );
    assert_eq!(o.status.code(), Some(1));

    // Decode-side retention (issue 15): the conversation's last turn is
    // stored and D holds its blocks; DELETE ends the conversation, the
    // router tells agent A, which forwards to agent B (D's node), which
    // releases the hold. Once: a second DELETE finds nothing.
    let conv = format!("{router}/v1/conversations/agentic-p2048-c0@adaptive");
    let delete = || {
        let o = std::process::Command::new("timeout")
            .args([
                "20",
                "ip",
                "netns",
                "exec",
                &ns_a,
                "curl",
                "-s",
                "-o",
                "/dev/null",
            ])
            .args(["-w", "%{http_code}", "-X", "DELETE"])
            .args(["-H", "Authorization: Bearer kvloop-demo", &conv])
            .output()
            .expect("curl");
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert_eq!(delete(), "204", "the last turn was stored");
    assert_eq!(delete(), "404", "nothing stored any more");
    let metric = |addr: &str, needle: &str| -> f64 {
        let o = std::process::Command::new("timeout")
            .args(["20", "ip", "netns", "exec", &ns_a, "curl", "-s"])
            .arg(format!("{}/metrics", addr))
            .output()
            .expect("curl");
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.contains(needle))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    // Both sides count once the agent's answer is back (bounded wait).
    let end = std::time::Instant::now() + Duration::from_secs(20);
    let (released, routed) = loop {
        let released = metric(
            &format!("http://{agent_b}"),
            r#"kvloop_agent_retention_total{action="release",outcome="released"}"#,
        );
        let routed = metric(
            &router,
            r#"kvloop_router_retention_total{action="release",cause="ended",result="released"}"#,
        );
        if (released >= 1.0 && routed >= 1.0) || std::time::Instant::now() > end {
            break (released, routed);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(released >= 1.0, "agent B released no hold");
    assert_eq!(routed, 1.0, "the router counted the release it sent");
    // Every stored turn got a first lease, applied by D's agent.
    let kept = metric(
        &router,
        r#"kvloop_router_retention_total{action="keep",cause="first_lease",result="kept"}"#,
    );
    assert!(kept >= 1.0, "no first lease applied");

    // kvloop explain shows those decisions and the agents' answers.
    let o = tool_on(
        &nodes[0],
        &[
            "explain",
            "--router",
            &router,
            "--retention",
            "--token",
            "kvloop-demo",
        ],
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("retention adaptive"), "{text}");
    assert!(text.contains("decisions about d0 go to http://"), "{text}");
    assert!(
        text.contains("KV usage of d0: "),
        "D reports its KV usage: {text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("release: D d0") && l.contains("ended (ended) → released")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("keep 480000 ms") && l.contains("first_lease (no_history) → kept")),
        "{text}"
    );

    // SIGTERM ends the hold cleanly.
    let status = demo.stop();
    let stdout = demo.stdout();
    assert!(status.success(), "{status}:\n{stdout}");
    assert!(stdout.contains("hold ended"), "{stdout}");
    assert!(
        !netns_exists(&ns_a) && !netns_exists(&ns_b),
        "namespaces left"
    );
    assert!(!out.join("hold.json").exists());
    let _ = std::fs::remove_dir_all(&out);
}
