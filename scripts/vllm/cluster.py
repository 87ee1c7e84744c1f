"""Brings up real vLLM P/D engines with kvloop around them, for `make test-vllm`
(tests/vllm) and for trying by hand (docs/vllm.md).

Topology (two network namespaces created here, removed in `Cluster.stop`):

    root ns: kvloop-router (reuse on)  10.86.76.1:18000 -> taps -> engines
             kvloop-router (reuse off) 127.0.0.1:18001  -> engines directly
             kvloop-router (pushes)    10.86.76.1:18002 -> engines directly, only
                                       receives P's agent's threshold pushes
             taps (scripts/vllm/tap.py) 127.0.0.1:18100 -> P, :18200 -> D
             kvloop trace (uprobes on the engines' libnixl), the test client
    vl-p:    vLLM P (engine_id vl-p0) 0.0.0.0:8100, NIXL side channel 10.86.77.1:5600
             kvloop-agent (observe mode: NIXL probes on the engines' libnixl,
             prefill probe on port 8100; pushes to the pushes router) 0.0.0.0:9470
    vl-d:    vLLM D (engine_id vl-d0) 0.0.0.0:8200, NIXL side channel 10.86.77.2:5601
             kvloop-agent (observe mode, NIXL probes) 0.0.0.0:9470
    links:   vl-pd0 10.86.77.1 <-> vl-pd1 10.86.77.2 (P<->D, the KV path)
             vl-hp0 10.86.76.1 (root) <-> vl-hp1 10.86.76.2 (vl-p)
             vl-hd0 10.86.78.1 (root) <-> vl-hd1 10.86.78.2 (vl-d)

Every process is started in its own session and stopped by its PID (SIGTERM
to its process group, SIGKILL after a grace period); every wait is bounded.

    python scripts/vllm/cluster.py up      # bring it up, print the addresses, wait for Ctrl-C
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = pathlib.Path(os.environ.get("KVLOOP_VLLM_VENV", pathlib.Path.home() / ".cache/kvloop/vllm-venv"))
BIN = pathlib.Path(os.environ.get("KVLOOP_BIN_DIR", ROOT / "target/debug"))

NS_P, NS_D = "vl-p", "vl-d"
P_KV, D_KV = "10.86.77.1", "10.86.77.2"
P_HOST, D_HOST = "10.86.76.2", "10.86.78.2"
ROUTER_ON = "10.86.76.1:18000"
ROUTER_OFF = "127.0.0.1:18001"
#: Receives P's agent's threshold pushes and serves no traffic: a pushed
#: threshold would change the reuse-on router's decisions under the tests.
ROUTER_OBS = "10.86.76.1:18002"
TAP_P, TAP_D = "127.0.0.1:18100", "127.0.0.1:18200"
P_PORT, D_PORT = 8100, 8200
P_SIDE, D_SIDE = 5600, 5601
P_ID, D_ID = "vl-p0", "vl-d0"
AGENT_PORT = 9470
#: The engines' dtype: bfloat16 as in production; KVLOOP_VLLM_DTYPE=float32
#: separates numerical noise from wrong KV when investigating a difference.
DTYPE = os.environ.get("KVLOOP_VLLM_DTYPE", "bfloat16")
MODEL_NAME = "tiny"
#: vLLM's CPU backend uses 128-token blocks unless told otherwise
#: (vllm/platforms/cpu.py); the router's registry must say the same.
BLOCK_TOKENS = 128
#: KV bytes per token of the tiny model: 2 layers x (K, V) x 2 KV heads x
#: head_dim 64 x 2 bytes (bf16) = 1024.
BYTES_PER_TOKEN = 1024

# (root side, ns side, ns, root addr, ns addr)
_LINKS = [
    ("vl-hp0", "vl-hp1", NS_P, "10.86.76.1", P_HOST),
    ("vl-hd0", "vl-hd1", NS_D, "10.86.78.1", D_HOST),
]


def log(msg: str) -> None:
    print(f"[vllm-cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def requirements() -> list[str]:
    """What is missing to run the real-vLLM tests (empty when all is there)."""
    miss = []
    if os.geteuid() != 0:
        miss.append("root (network namespaces, eBPF)")
    if not (VENV / ".kvloop-complete").exists():
        miss.append(f"the vLLM venv {VENV} (scripts/vllm/install.sh)")
    for b in ("kvloop", "kvloop-agent", "kvloop-router"):
        if not (BIN / b).exists():
            miss.append(f"{BIN / b} (cargo build -p kvloop -p kvloop-agent -p kvloop-router)")
    if subprocess.run(["which", "ip"], capture_output=True).returncode != 0:
        miss.append("iproute2 (ip)")
    return miss


def netns_up() -> None:
    netns_down()
    sh("ip", "netns", "add", NS_P)
    sh("ip", "netns", "add", NS_D)
    sh("ip", "link", "add", "vl-pd0", "type", "veth", "peer", "name", "vl-pd1")
    sh("ip", "link", "set", "vl-pd0", "netns", NS_P)
    sh("ip", "link", "set", "vl-pd1", "netns", NS_D)
    sh("ip", "-n", NS_P, "addr", "add", f"{P_KV}/24", "dev", "vl-pd0")
    sh("ip", "-n", NS_D, "addr", "add", f"{D_KV}/24", "dev", "vl-pd1")
    for root_dev, ns_dev, ns, root_addr, ns_addr in _LINKS:
        sh("ip", "link", "add", root_dev, "type", "veth", "peer", "name", ns_dev)
        sh("ip", "link", "set", ns_dev, "netns", ns)
        sh("ip", "addr", "add", f"{root_addr}/24", "dev", root_dev)
        sh("ip", "-n", ns, "addr", "add", f"{ns_addr}/24", "dev", ns_dev)
        sh("ip", "link", "set", root_dev, "up")
        sh("ip", "-n", ns, "link", "set", ns_dev, "up")
    for ns, dev in ((NS_P, "vl-pd0"), (NS_D, "vl-pd1")):
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def netns_down() -> None:
    for ns in (NS_P, NS_D):
        sh("ip", "netns", "del", ns, check=False)
    for root_dev, *_ in _LINKS:
        sh("ip", "link", "del", root_dev, check=False)


@dataclass
class Proc:
    """A process this harness started (own session: its PID is its PGID)."""

    name: str
    popen: subprocess.Popen
    log_path: pathlib.Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        if not self.alive():
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log(f"{self.name} (pid {self.pid}) ignored SIGTERM for {grace_s} s: SIGKILL")
            os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)
        # children left in the group (vLLM's engine core, workers)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def http(method: str, url: str, body=None, timeout: float = 120.0, headers=None):
    """One HTTP request; returns (status, bytes)."""
    data = None if body is None else json.dumps(body).encode()
    h = {"content-type": "application/json"} if body is not None else {}
    h.update(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_http(url: str, deadline: float, procs: list[Proc]) -> None:
    while time.time() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited ({p.popen.returncode}) before {url} answered:\n{p.tail()}")
        try:
            if http("GET", url, timeout=2)[0] == 200:
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer 200 in time:\n" + "\n".join(p.tail(15) for p in procs))


def metrics(url: str) -> dict[str, float]:
    """Prometheus text at `url` as {series (name{labels}): value}."""
    st, b = http("GET", url, timeout=10)
    if st != 200:
        raise RuntimeError(f"{url}: {st}")
    out: dict[str, float] = {}
    for line in b.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        k, _, v = line.rpartition(" ")
        try:
            out[k] = float(v)
        except ValueError:
            pass
    return out


def metric_sum(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series named `name` whose labels include `labels`."""
    tot = 0.0
    for k, v in m.items():
        n, _, rest = k.partition("{")
        if n != name:
            continue
        if all(f'{lk}="{lv}"' in rest for lk, lv in labels.items()):
            tot += v
    return tot


@dataclass
class Cluster:
    """The running system. `start()` brings it up; `stop()` tears it down."""

    work: pathlib.Path
    plugin: bool = True
    procs: dict[str, Proc] = field(default_factory=dict)
    model_dir: pathlib.Path | None = None
    trace_path: pathlib.Path | None = None
    core_pids: dict[str, list[int]] = field(default_factory=dict)
    nixl_libs: list[str] = field(default_factory=list)
    startup_s: float = 0.0

    # ---- processes -------------------------------------------------------
    def spawn(self, name: str, argv: list[str], env: dict[str, str | None] | None = None,
              ns: str | None = None) -> Proc:
        """Starts `argv` (in namespace `ns`) with `env` over this process's
        environment (None removes a variable); output to `<work>/<name>.log`
        (`<name>.2.log`, ... for a restart)."""
        logp, k = self.work / f"{name}.log", 1
        while logp.exists():  # a restarted process gets a log of its own
            k += 1
            logp = self.work / f"{name}.{k}.log"
        full = (["ip", "netns", "exec", ns] if ns else []) + argv
        e = dict(os.environ)
        for k, v in (env or {}).items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = v
        f = open(logp, "ab")
        p = subprocess.Popen(full, stdout=f, stderr=subprocess.STDOUT, env=e, start_new_session=True,
                             cwd=str(self.work))
        proc = Proc(name, p, logp)
        self.procs[name] = proc
        log(f"started {name} pid {p.pid}")
        return proc

    def vllm_env(self, kv_host: str, side_port: int, cpu: str) -> dict[str, str | None]:
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "UCX_MODULES": "^ib*",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": kv_host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            "VLLM_CPU_OMP_THREADS_BIND": cpu,
            "PYTHONUNBUFFERED": "1",
            # kvloop's own NIXL runtime (cu12, from scripts/bootstrap.sh) must
            # not shadow the one vLLM's nixl wheel loads (an empty
            # NIXL_PLUGIN_DIR is not "unset": NIXL then finds no plugin).
            "LD_LIBRARY_PATH": None,
            "NIXL_PLUGIN_DIR": None,
        }
        return env

    def vllm_argv(self, engine_id: str, port: int) -> list[str]:
        kv = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "engine_id": engine_id,
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": True,
                # the router decides; vLLM's own threshold must not veto a pull
                "kv_recompute_threshold": 1,
                "decoder_kv_blocks_ttl": 120,
                # P keeps a prefill's blocks for D's READ this long (D's
                # heartbeats extend it; vLLM's default is 30 s). On this
                # 2-core CPU machine one engine step can stall for tens of
                # seconds: seen, P took 21 s for a 300-token prefill and D
                # began its READ 29-30 s after P answered, after P had
                # released the blocks (D then answered 500).
                "kv_lease_duration": 120,
            },
        }
        return [str(VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", MODEL_NAME,
                "--host", "0.0.0.0", "--port", str(port), "--dtype", DTYPE,
                "--max-model-len", "4096", "--no-enable-prefix-caching", "--seed", "0",
                "--kv-transfer-config", json.dumps(kv)]

    def start_engine(self, role: str, plugin: bool) -> Proc:
        if role == "p":
            env = self.vllm_env(P_KV, P_SIDE, "0")
            argv, ns, name = self.vllm_argv(P_ID, P_PORT), NS_P, "vllm-p"
        else:
            env = self.vllm_env(D_KV, D_SIDE, "1")
            argv, ns, name = self.vllm_argv(D_ID, D_PORT), NS_D, "vllm-d"
        # VLLM_PLUGINS: comma-separated names of general plugins to load; empty loads none.
        env["VLLM_PLUGINS"] = "kvloop_stream_kv_params" if plugin else ""
        return self.spawn(name, argv, env, ns)

    def write_model(self) -> None:
        self.model_dir = self.work / "model"
        r = subprocess.run([str(VENV / "bin/python"), str(ROOT / "scripts/vllm/make_model.py"), str(self.model_dir)],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"make_model.py: {r.stderr[-2000:]}")
        log(f"model: {r.stdout.strip()}")

    def router_config(self, listen: str, threshold: int, p_url: str, d_url: str) -> pathlib.Path:
        cfg = f"""listen = "{listen}"
admin_token = "vl-admin"
kv_recompute_threshold = {threshold}
prefix_check = "tokens"
decoder_kv_blocks_ttl_ms = 120000
ttl_safety_margin_ms = 20000
# vLLM answers /health slowly while it computes on a loaded 2-core machine:
# a 1 s timeout (the default) marks busy engines unhealthy.
health_interval_ms = 2000
health_timeout_ms = 10000

[[engines]]
engine_id = "{P_ID}"
role = "prefill"
http_url = "{p_url}"
side_channel_host = "{P_KV}"
side_channel_port = {P_SIDE}
block_size_tokens = {BLOCK_TOKENS}

[[engines]]
engine_id = "{D_ID}"
role = "decode"
http_url = "{d_url}"
side_channel_host = "{D_KV}"
side_channel_port = {D_SIDE}
block_size_tokens = {BLOCK_TOKENS}
"""
        path = self.work / f"router-{listen.replace(':', '_')}.toml"
        path.write_text(cfg)
        return path

    def venv_nixl_libs(self) -> list[str]:
        """The libnixl.so files of the vLLM venv's NIXL wheels (what the
        engines will map), for the agents' `observe.nixl_libs`."""
        site = sorted(VENV.glob("lib/python*/site-packages"))
        libs = sorted({str(p.resolve()) for d in site for p in d.glob("*nixl*/**/libnixl.so")})
        if not libs:
            raise RuntimeError(f"no libnixl.so under {site} (is nixl installed in the vLLM venv?)")
        return libs

    def agent_config(self, me: str) -> pathlib.Path:
        mine, other = (("vl-node-p", P_KV), ("vl-node-d", D_KV)) if me == "p" else (("vl-node-d", D_KV), ("vl-node-p", P_KV))
        prefill = f"""
[[prefill_ports]]
engine_id = "{P_ID}"
port = {P_PORT}
""" if me == "p" else ""
        cfg = f"""agent_id = "{mine[0]}"
node_addr = "{mine[1]}"
http_listen = "0.0.0.0:{AGENT_PORT}"
socket_path = "{self.work}/agent-{me}.sock"
require_ebpf = true
backend = {{ kind = "libfabric", provider = "tcp;ofi_rxm", bind_node = "{mine[1]}" }}
{prefill}
[probe]
period_ms = 1000

# Both "nodes" are network namespaces of one kernel: count only the engine
# processes in this agent's namespace.
[observe]
nixl_libs = {json.dumps(self.venv_nixl_libs())}
scope = "netns"

[[peers]]
name = "{other[0]}"
http = "{other[1]}:{AGENT_PORT}"

"""
        if me == "p":
            cfg += f"""
[[routers]]
url = "http://{ROUTER_OBS}"
token = "vl-admin"

[[pairs]]
prefill_engine_id = "{P_ID}"
decode_engine_id = "{D_ID}"
decode_peer = "vl-node-d"
bytes_per_token = {BYTES_PER_TOKEN}
block_size_tokens = {BLOCK_TOKENS}
regions_per_block = 2
"""
        path = self.work / f"agent-{me}.toml"
        path.write_text(cfg)
        return path

    def start(self, engine_timeout_s: float = 420.0) -> None:
        t0 = time.time()
        self.work.mkdir(parents=True, exist_ok=True)
        netns_up()
        self.write_model()
        # both engines at once: start-up is 40-60 s each on a quiet machine
        p = self.start_engine("p", self.plugin)
        d = self.start_engine("d", self.plugin)
        kvenv = {"RUST_LOG": "info"}
        self.spawn("agent-p", [str(BIN / "kvloop-agent"), "--config", str(self.agent_config("p"))], kvenv, NS_P)
        self.spawn("agent-d", [str(BIN / "kvloop-agent"), "--config", str(self.agent_config("d"))], kvenv, NS_D)
        self.spawn("tap-p", [str(VENV / "bin/python"), str(ROOT / "scripts/vllm/tap.py"), "--listen", TAP_P,
                             "--upstream", f"http://{P_HOST}:{P_PORT}", "--log", str(self.work / "tap-p.jsonl")])
        self.spawn("tap-d", [str(VENV / "bin/python"), str(ROOT / "scripts/vllm/tap.py"), "--listen", TAP_D,
                             "--upstream", f"http://{D_HOST}:{D_PORT}", "--log", str(self.work / "tap-d.jsonl")])
        rlog = {"RUST_LOG": "info,kvloop_router=debug"}
        self.spawn("router-on", [str(BIN / "kvloop-router"), "--config",
                                 str(self.router_config(ROUTER_ON, 1, f"http://{TAP_P}", f"http://{TAP_D}"))], rlog)
        self.spawn("router-off", [str(BIN / "kvloop-router"), "--config",
                                  str(self.router_config(ROUTER_OFF, 1 << 30, f"http://{P_HOST}:{P_PORT}",
                                                         f"http://{D_HOST}:{D_PORT}"))], rlog)
        self.spawn("router-obs", [str(BIN / "kvloop-router"), "--config",
                                  str(self.router_config(ROUTER_OBS, 1, f"http://{P_HOST}:{P_PORT}",
                                                         f"http://{D_HOST}:{D_PORT}"))], rlog)
        deadline = time.time() + engine_timeout_s
        wait_http(f"http://{P_HOST}:{P_PORT}/health", deadline, [p, d])
        wait_http(f"http://{D_HOST}:{D_PORT}/health", deadline, [p, d])
        for a, host in (("agent-p", P_HOST), ("agent-d", D_HOST)):
            wait_http(f"http://{host}:{AGENT_PORT}/healthz", time.time() + 60, [self.procs[a]])
        wait_http(f"http://{ROUTER_ON}/health", time.time() + 60, [self.procs["router-on"]])
        wait_http(f"http://{ROUTER_OFF}/health", time.time() + 60, [self.procs["router-off"]])
        wait_http(f"http://{ROUTER_OBS}/health", time.time() + 60, [self.procs["router-obs"]])
        self.find_engine_cores()
        self.start_trace()
        self.warm_up()
        self.startup_s = time.time() - t0
        log(f"up in {self.startup_s:.0f} s")

    def warm_up(self, attempts: int = 3) -> None:
        """Two-turn conversations through the reuse-on router until P has
        done one D->P READ: the first transfer in each direction does the
        NIXL handshake, whose reply vLLM waits for only 5 s (hard-coded in
        nixl/base_worker.py), which a loaded 2-core machine can miss (P's
        answer is then a 500 and the router retries without D's params)."""
        body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0}
        text = " ".join(["the router keeps the params of the decode engine"] * 30)
        def failures() -> int:
            return self.procs["vllm-p"].log_path.read_text(errors="replace").count("handshake_failed")

        def turn(k: int, which: str, msgs: list) -> tuple[int, bytes]:
            # A stalled engine (its /health late: seen, D's first READ took
            # 90 s) is marked unhealthy and the router answers 503 until it
            # is healthy again: wait for that rather than burn the attempts.
            self.wait_router_healthy(300)
            st, b = http("POST", f"http://{ROUTER_ON}/v1/chat/completions",
                         dict(body, messages=msgs, conversation_id=f"warm-{k}"), timeout=300)
            if st != 200:
                log(f"warm-up {k + 1}: {which} turn answered {st}: {b[:200]!r}")
            return st, b

        for k in range(attempts):
            before = failures()
            msgs = [{"role": "user", "content": text}]
            st, b = turn(k, "first", msgs)
            if st != 200:
                continue
            msgs += [{"role": "assistant", "content": json.loads(b)["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "and then"}]
            turn(k, "second", msgs)
            m = metrics(f"http://{ROUTER_ON}/metrics")
            if metric_sum(m, "kvloop_router_decisions_total", reason="pulled") >= 1 and failures() == before:
                log(f"warm-up: D->P READ done after {k + 1} conversation(s)")
                self._settle_p_stats()
                return
            log(f"warm-up {k + 1}: no clean D->P READ yet")
        raise RuntimeError("warm-up: P never READ D's blocks:\n" + self.procs["vllm-p"].tail(30))

    def _settle_p_stats(self, timeout_s: float = 60.0) -> None:
        """Waits until vLLM has published P's transfer stats (its /metrics and
        its periodic "Num successful transfers" log line lag the READ), so
        that the warm-up's READs do not land in a test's counts."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            m = metrics(f"http://{P_HOST}:{P_PORT}/metrics")
            text = self.procs["vllm-p"].log_path.read_text(errors="replace")
            logged = sum(int(x) for x in re.findall(r"Num successful transfers=(\d+)", text)) >= 1
            if metric_sum(m, "vllm:nixl_xfer_time_seconds_count") >= 1 and logged:
                return
            time.sleep(1)
        raise RuntimeError("warm-up: P's NIXL stats never showed its READ")

    def wait_router_healthy(self, timeout_s: float) -> bool:
        """Waits until the reuse-on router reports no unhealthy engine (it
        marks one healthy again within its health interval); false if it
        still does after `timeout_s`."""
        deadline = time.time() + timeout_s
        while True:
            try:
                st, b = http("GET", f"http://{ROUTER_ON}/health", timeout=5)
            except OSError as e:  # refused or timed out: not known healthy
                st, b = 0, str(e).encode()
            if st == 200 and all(e.get("healthy") for e in json.loads(b).get("engines", [])):
                return True
            if time.time() >= deadline:
                log(f"router still reports an unhealthy engine after {timeout_s:.0f} s: {b[:300]!r}")
                return False
            time.sleep(1)

    def restart_decode(self, plugin: bool, timeout_s: float = 300.0) -> None:
        """Stops D and starts it again with or without the kvloop-vllm plugin."""
        self.procs["vllm-d"].stop()
        d = self.start_engine("d", plugin)
        wait_http(f"http://{D_HOST}:{D_PORT}/health", time.time() + timeout_s, [d])
        self.wait_router_healthy(30)
        self.find_engine_cores()

    def find_engine_cores(self) -> None:
        """PIDs of the processes under each engine that map libnixl.so (the API
        server, the engine core and the worker that posts the transfers), and
        the libnixl.so files they map."""
        libs: set[str] = set()
        for name in ("vllm-p", "vllm-d"):
            root = self.procs[name].pid
            pids = []
            for pid in [root] + descendants(root):
                try:
                    maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
                except OSError:
                    continue
                found = set(re.findall(r"(/\S*/libnixl\.so)\s*$", maps, re.M))
                if found:
                    pids.append(pid)
                    libs |= found
            if not pids:
                raise RuntimeError(f"{name}: no process maps libnixl.so (is NixlConnector on?)")
            self.core_pids[name] = pids
        self.nixl_libs = sorted(libs)
        log(f"processes mapping libnixl {self.core_pids}, libraries {self.nixl_libs}")

    def start_trace(self) -> None:
        """`kvloop trace` with uprobes on the engines' own libnixl.so (observe
        mode: no pid filter, lines carry the pid)."""
        if "trace" in self.procs and self.procs["trace"].alive():
            return
        self.trace_path = self.work / "trace.log"
        if len(self.nixl_libs) != 1:
            raise RuntimeError(f"the engines map {len(self.nixl_libs)} libnixl.so files: {self.nixl_libs}")
        proc = self.spawn("trace", [str(BIN / "kvloop"), "trace", "--nixl-lib", self.nixl_libs[0],
                                    "--seconds", "3600"], {"RUST_LOG": "warn"})
        deadline = time.time() + 60
        while time.time() < deadline:
            if "NIXL" in proc.tail(20):
                return
            if not proc.alive():
                raise RuntimeError(f"kvloop trace exited:\n{proc.tail()}")
            time.sleep(0.5)
        raise RuntimeError(f"kvloop trace did not attach:\n{proc.tail()}")

    def trace_xfers(self, name: str) -> list[str]:
        """NIXL transfer events (`kvloop trace` lines) of engine `name`'s processes so far."""
        if not self.trace_path or not self.trace_path.exists():
            return []
        pids = {f" pid={p} " for p in self.core_pids.get(name, [])}
        return [line for line in self.trace_path.read_text(errors="replace").splitlines()
                if line.startswith("xfer") and "site=kvloop" not in line
                and any(p in line for p in pids)]

    def stop(self) -> None:
        for name in ["trace", "router-on", "router-off", "router-obs", "tap-p", "tap-d", "agent-p", "agent-d", "vllm-p", "vllm-d"]:
            p = self.procs.get(name)
            if p:
                try:
                    p.stop()
                except Exception as e:  # keep tearing down
                    log(f"stopping {name}: {e}")
        netns_down()


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = pathlib.Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in kids:
            out.append(int(k))
            todo.append(int(k))
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "up":
        print(__doc__)
        sys.exit(2)
    miss = requirements()
    if miss:
        sys.exit("missing: " + "; ".join(miss))
    c = Cluster(pathlib.Path(os.environ.get("KVLOOP_VLLM_WORK", "/tmp/kvloop-vllm")))
    try:
        c.start()
        print(json.dumps({"router": f"http://{ROUTER_ON}", "router_no_reuse": f"http://{ROUTER_OFF}",
                          "p": f"http://{P_HOST}:{P_PORT}", "d": f"http://{D_HOST}:{D_PORT}",
                          "agent_p": f"http://{P_HOST}:{AGENT_PORT}", "agent_d": f"http://{D_HOST}:{AGENT_PORT}",
                          "logs": str(c.work)}, indent=1), flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
