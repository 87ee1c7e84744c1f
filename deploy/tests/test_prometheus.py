"""A real Prometheus scrapes a running router (two engine simulators behind
it, multi-turn traffic through it) and two running agents (peers of each
other, active probes between them, pushing thresholds to the router), then
every query of the Grafana dashboard must return data.

Everything listens on 127.0.0.1; every wait is bounded; every process started
here is stopped here by its pid. Needs: Debian's `prometheus`, the binaries
kvloop-router, kvloop-engine-sim and kvloop-agent (target/debug or
$KVLOOP_BIN_DIR). Run as root so that the agents load their eBPF probes
(otherwise their READs are timed in user space, labelled source="userspace").
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

from conftest import DASHBOARD, kvloop_bin, need, tool

SCRAPE_S = 1
# $__rate_interval: wide enough that the whole test (traffic first, queries
# after) stays inside one window.
RATE_WINDOW = "3m"
STARTUP_TIMEOUT_S = 60
QUERY_TIMEOUT_S = 20  # per query, after the stack is warm (bounded)
WARM_TIMEOUT_S = 90   # until the agents' fitted paths and READ histograms show up
# Dashboard series the running programs do not produce yet: the query is
# marked xfail (with this reason) when it has no data, and passes once the
# producer is fixed. Each is reported to the owner of the producer.
KNOWN_GAPS = {
    "kvloop_agent_path_valid": "kvloop-agent sets kvloop_agent_path_valid only on a link "
                               "change (netstate.rs), never at start: no series while all "
                               "links stay up",
}
# Queries whose data comes from the agents (the router's threshold pushes too:
# only agents push).
AGENT_QUERIES = ("kvloop_agent_", "vllm:nixl_", "kvloop_xfer_", "kvloop_probe_", "kvloop_prefill_",
                 "kvloop_router_threshold_pushes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Processes started by this test, stopped by pid at the end."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], env: dict | None = None,
              ready: str | None = None) -> tuple[subprocess.Popen, str]:
        log = open(self.logdir / f"{name}.log", "w")
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True,
                             env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append((name, p))
        line = ""
        if ready:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while time.monotonic() < deadline:
                line = p.stdout.readline()
                if line.startswith(ready) or (not line and p.poll() is not None):
                    break
            if not line.startswith(ready):
                p.kill()
                raise AssertionError(f"{name} did not print {ready!r}: "
                                     f"{(self.logdir / f'{name}.log').read_text()[-3000:]}")
        return p, line.strip()

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text()

    def stop_all(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def addr_of(line: str, key: str = "http") -> str:
    return re.search(rf"{key}=(\S+)", line).group(1)


def dashboard_queries() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    out = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            out.append((f"{p['title']} [{t['refId']}]", t["expr"]))
    return out


def promql(expr: str) -> str:
    """Grafana's variables as a dashboard with defaults would send them."""
    return (expr.replace("$__rate_interval", RATE_WINDOW).replace("$instance", ".*")
            .replace("${instance}", ".*"))


def traffic(router: str, conversations: int = 4, turns: int = 3, prefix: str = "conv") -> None:
    """Multi-turn chat through the router (bounded: conversations × turns)."""
    for c in range(conversations):
        messages = [{"role": "user", "content": f"conversation {c}: " + "tell me a story " * 40}]
        for t in range(turns):
            r = requests.post(f"http://{router}/v1/chat/completions", timeout=30, json={
                "model": "sim-model", "messages": messages, "max_tokens": 8,
                "conversation_id": f"{prefix}-{c}", "stream": t % 2 == 1})
            assert r.status_code == 200, r.text
            if t % 2 == 1:
                text = "".join(
                    json.loads(l[6:])["choices"][0].get("delta", {}).get("content") or ""
                    for l in r.text.splitlines()
                    if l.startswith("data: {") and json.loads(l[6:]).get("choices"))
            else:
                text = r.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"and then {t}? " * 20}]


class BackgroundTraffic:
    """Keeps multi-turn traffic flowing while the queries run, so that every
    rate() window has increases (bounded in count and time)."""

    def __init__(self, router: str, max_requests: int = 3000, max_s: float = 900):
        import threading
        self.router, self.max_requests, self.max_s = router, max_requests, max_s
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        t0 = time.monotonic()
        c = 0
        while not self.stop.is_set() and self.sent < self.max_requests \
                and time.monotonic() - t0 < self.max_s:
            try:
                traffic(self.router, conversations=1, turns=2, prefix=f"bg-{c}")
                self.sent += 2
            except Exception:  # noqa: BLE001 - the queries report what is missing
                pass
            c += 1
            self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def stack():
    prometheus = tool("prometheus")
    router_bin = kvloop_bin("kvloop-router")
    sim_bin = kvloop_bin("kvloop-engine-sim")
    tmp = Path(tempfile.mkdtemp(prefix="kvloop-prom-"))
    procs = Procs(tmp)
    try:
        sims = {}
        for role, eid in (("prefill", "p0"), ("decode", "d0")):
            _, line = procs.start(f"sim-{eid}", [str(sim_bin), "--role", role, "--engine-id", eid,
                                                 "--prefill-us-per-token", "20"], ready="READY")
            sims[eid] = (role, addr_of(line), addr_of(line, "side_channel"))
        engines = "".join(
            f'[[engines]]\nengine_id = "{eid}"\nrole = "{role}"\nhttp_url = "http://{http}"\n'
            f'side_channel_host = "{sc.rsplit(":", 1)[0]}"\nside_channel_port = {sc.rsplit(":", 1)[1]}\n'
            for eid, (role, http, sc) in sims.items())
        (tmp / "router.toml").write_text(
            'listen = "127.0.0.1:0"\nadmin_token = "t0ken"\nhealth_interval_ms = 200\n' + engines)
        _, line = procs.start("router", [str(router_bin), "--config", str(tmp / "router.toml")],
                              ready="READY")
        router = addr_of(line)
        targets = {"router": [router]}

        agents_ok = (Path(os.environ.get("KVLOOP_BIN_DIR", "")) / "kvloop-agent").exists() or \
            (Path(__file__).resolve().parents[2] / "target/debug/kvloop-agent").exists()
        agent_error = None
        if agents_ok:
            agent_bin = kvloop_bin("kvloop-agent")
            ports = {"a": free_port(), "b": free_port()}
            for me, other in (("a", "b"), ("b", "a")):
                # Agent a is the prefill node: its pair's threshold, and the
                # prefill socket probe on the prefill engine-sim's port.
                p_port = sims["p0"][1].rsplit(":", 1)[1]
                pair = (f'[[pairs]]\nprefill_engine_id = "p0"\ndecode_engine_id = "d0"\n'
                        f'decode_peer = "{other}"\nbytes_per_token = 4096\n'
                        f'[[prefill_ports]]\nengine_id = "p0"\nport = {p_port}\n') if me == "a" else ""
                (tmp / f"agent-{me}.toml").write_text(
                    f'agent_id = "{me}"\nnode_addr = "127.0.0.1"\n'
                    f'http_listen = "127.0.0.1:{ports[me]}"\n'
                    f'socket_path = "{tmp}/agent-{me}.sock"\npush_period_ms = 500\n'
                    'backend = { kind = "libfabric", provider = "tcp;ofi_rxm", bind_node = "127.0.0.1" }\n'
                    '[probe]\nperiod_ms = 200\n'
                    f'[[peers]]\nname = "{other}"\nhttp = "127.0.0.1:{ports[other]}"\n'
                    f'[[routers]]\nurl = "http://{router}"\ntoken = "t0ken"\n' + pair)
            try:
                # Under exactly the DaemonSet's capabilities and read-only host
                # paths (as root: see test_capabilities.py); without root,
                # plain (user-space timing).
                from test_capabilities import as_in_the_daemonset, daemonset_caps
                for me in ("a", "b"):
                    argv = [str(agent_bin), "--config", str(tmp / f"agent-{me}.toml")]
                    if os.geteuid() == 0:
                        argv = as_in_the_daemonset(daemonset_caps(), argv)
                    procs.start(f"agent-{me}", argv,
                                env={"RUST_LOG": "info"}, ready="READY")
                targets["agent"] = [f"127.0.0.1:{ports['a']}", f"127.0.0.1:{ports['b']}"]
            except AssertionError as e:
                agent_error = str(e)
        else:
            agent_error = "kvloop-agent binary not built"

        prom_port = free_port()
        scrape = "\n".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: {json.dumps(t)}"
            for job, t in targets.items())
        (tmp / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {SCRAPE_S}s\n  scrape_timeout: {SCRAPE_S}s\n"
            f"scrape_configs:\n{scrape}\n")
        procs.start("prometheus", [prometheus, f"--config.file={tmp}/prometheus.yml",
                                   f"--storage.tsdb.path={tmp}/tsdb",
                                   f"--web.listen-address=127.0.0.1:{prom_port}",
                                   "--storage.tsdb.retention.time=1h"])
        prom = f"http://127.0.0.1:{prom_port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{prom}/-/ready", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("prometheus not ready: " + procs.log("prometheus")[-2000:])
        # Traffic only once the router is healthy and Prometheus has scraped
        # every target, so that the counters' increase falls between samples.
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if requests.get(f"http://{router}/health", timeout=5).status_code == 200:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"router not healthy: {procs.log('router')[-2000:]}")
        n_targets = sum(len(t) for t in targets.values())
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            up = query(prom, "up == 1")
            if len(up) == n_targets:
                break
            time.sleep(0.5)
        time.sleep(2 * SCRAPE_S)
        traffic(router)
        time.sleep(2 * SCRAPE_S)
        traffic(router, conversations=2, turns=2)
        bg = BackgroundTraffic(router)
        if "agent" in targets:
            deadline = time.monotonic() + WARM_TIMEOUT_S
            while time.monotonic() < deadline:
                if has_data(query(prom, "kvloop_agent_path_bandwidth_bytes_per_second")) and \
                        has_data(query(prom, "vllm:nixl_xfer_time_seconds_count")):
                    break
                time.sleep(1)
        time.sleep(3 * SCRAPE_S)
        try:
            yield {"prom": prom, "targets": targets, "agent_error": agent_error, "procs": procs,
                   "router": router}
        finally:
            bg.close()
    finally:
        procs.stop_all()


def query(prom: str, expr: str) -> list:
    r = requests.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body.get("status") == "success", f"{expr}: {body}"
    return body["data"]["result"]


def has_data(result: list) -> bool:
    for s in result:
        v = float(s["value"][1])
        if not math.isnan(v):
            return True
    return False


def test_prometheus_scrapes_every_target(stack):
    deadline = time.monotonic() + 30
    up: list = []
    while time.monotonic() < deadline:
        up = query(stack["prom"], "up")
        if len(up) == sum(len(t) for t in stack["targets"].values()) and all(
                s["value"][1] == "1" for s in up):
            break
        time.sleep(1)
    assert up and all(s["value"][1] == "1" for s in up), up
    need(stack["agent_error"] is None, f"agents running: {stack['agent_error']}")
    assert {s["metric"]["job"] for s in up} == {"router", "agent"}


@pytest.mark.parametrize("title,expr", dashboard_queries(), ids=[t for t, _ in dashboard_queries()])
def test_dashboard_query_returns_data(stack, title, expr):
    if any(p in expr for p in AGENT_QUERIES):
        need(stack["agent_error"] is None, f"agents running: {stack['agent_error']}")
    q = promql(expr)
    deadline = time.monotonic() + QUERY_TIMEOUT_S
    result: list = []
    while time.monotonic() < deadline:
        result = query(stack["prom"], q)
        if has_data(result):
            break
        time.sleep(2)
    if not has_data(result):
        for metric, why in KNOWN_GAPS.items():
            if metric in expr:
                pytest.xfail(f"{title}: {why}")
    names = sorted({m["metric"].get("__name__", "") for m in query(stack["prom"], '{__name__=~"kvloop.*|vllm:.*"}')})
    assert has_data(result), f"no data for {title}: {q}\nresult: {result}\nseries present: {names}"


def test_agents_time_reads_in_the_kernel(stack):
    """Under the DaemonSet's capabilities the agents' active-probe READs are
    timed by the eBPF uprobes (source="ebpf"), not by the user-space
    fallback."""
    need(stack["agent_error"] is None, f"agents running: {stack['agent_error']}")
    need(os.geteuid() == 0, "root (eBPF)")
    result = query(stack["prom"], 'sum by (instance) '
                   '(vllm:nixl_xfer_time_seconds_count{source="ebpf", direction="probe"}) > 0')
    assert len(result) == 2, result
    assert not has_data(query(stack["prom"], 'kvloop_probe_source_info{source="userspace"}'))
