"""The agent under exactly the DaemonSet's capabilities.

A container running as uid 0 with `capabilities: {drop: [ALL], add: [...]}`
holds exactly the added capabilities in its bounding, permitted and effective
sets. `setpriv --bounding-set=-all,+cap...` reproduces that for a process
started by root here (exec recomputes root's permitted and effective sets
from the bounding set); the test reads the agent's /proc/<pid>/status to
prove it.

* With the DaemonSet's set, and the DaemonSet's read-only host paths
  (tracefs, debugfs, BTF, bpffs) read-only in a private mount namespace, the
  agent loads its eBPF programs, attaches its uprobes (READ sites) and
  tracepoints, and serves /healthz and /metrics with `source="ebpf"`.
* Without CAP_SYS_ADMIN it cannot load its probes and, with
  `require_ebpf = true` (as deployed), refuses to start.
* CAP_SYS_PTRACE and CAP_IPC_LOCK guard operations this single-node test has
  no engine or EFA device for (uprobes into another container's process,
  EFA memory registration): the test shows the kernel rule each one is
  granted for, under the same capability set, with and without it.

Needs root (to load eBPF and to set the bounding set) and util-linux's
setpriv; fails when CI=true and either is missing.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

from conftest import find, kvloop_bin, need, plain_objects, tool
from test_prometheus import free_port

# Linux capability numbers (include/uapi/linux/capability.h).
CAP_NUMBERS = {"IPC_LOCK": 14, "SYS_PTRACE": 19, "SYS_ADMIN": 21, "PERFMON": 38, "BPF": 39}
START_TIMEOUT_S = 60


def daemonset_caps() -> list[str]:
    ds = find(plain_objects(), "DaemonSet", "kvloop-agent")
    return ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]


def readonly_host_paths() -> list[str]:
    """Host paths the DaemonSet mounts read-only (that exist on this machine)."""
    pod = find(plain_objects(), "DaemonSet", "kvloop-agent")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    out = []
    for m in pod["containers"][0]["volumeMounts"]:
        if m["name"] in host and m.get("readOnly") and Path(host[m["name"]]).is_dir():
            assert m["mountPath"] == host[m["name"]]
            out.append(m["mountPath"])
    return out


def as_in_the_daemonset(caps: list[str], argv: list[str]) -> list[str]:
    """argv in a private mount namespace where the DaemonSet's read-only host
    paths are read-only, under exactly `caps`."""
    mounts = " && ".join(f"mount -o bind,ro {p} {p}" for p in readonly_host_paths())
    inner = " ".join(["exec"] + [f"'{a}'" for a in setpriv_args(caps) + argv])
    return [tool("unshare"), "--mount", "--propagation", "private", "--", "sh", "-c",
            f"{mounts} && {inner}" if mounts else inner]


def setpriv_args(caps: list[str]) -> list[str]:
    spec = ",".join(["-all"] + [f"+{c.lower()}" for c in caps])
    return [tool("setpriv"), f"--bounding-set={spec}", "--"]


def cap_mask(caps: list[str]) -> int:
    return sum(1 << CAP_NUMBERS[c] for c in caps)


def need_root():
    need(os.geteuid() == 0, "root (loading eBPF programs, setting the capability bounding set)")


class Agent:
    """One kvloop-agent under a capability set, stopped by its pid."""

    def __init__(self, caps: list[str], tmp: Path, name: str = "agent"):
        self.tmp = tmp
        self.port = free_port()
        cfg = tmp / f"{name}.toml"
        cfg.write_text(
            f'agent_id = "{name}"\nnode_addr = "127.0.0.1"\n'
            f'http_listen = "127.0.0.1:{self.port}"\nsocket_path = "{tmp}/{name}.sock"\n'
            "require_ebpf = true\n"
            'backend = { kind = "libfabric", provider = "tcp;ofi_rxm", bind_node = "127.0.0.1" }\n')
        self.err_path = tmp / f"{name}.err"
        self.proc = subprocess.Popen(
            as_in_the_daemonset(caps, [str(kvloop_bin("kvloop-agent")), "--config", str(cfg)]),
            stdout=subprocess.PIPE, stderr=open(self.err_path, "w"), text=True,
            env={**os.environ, "RUST_LOG": "info", "NO_COLOR": "1"},
            start_new_session=True)
        self.ready = ""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY") or (not line and self.proc.poll() is not None):
                self.ready = line.strip()
                break

    def stderr(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.err_path.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def tmp():
    with tempfile.TemporaryDirectory(prefix="kvloop-caps-") as d:
        yield Path(d)


def test_daemonset_set_loads_probes_and_serves_healthz(tmp):
    need_root()
    caps = daemonset_caps()
    a = Agent(caps, tmp)
    try:
        assert a.ready.startswith("READY"), f"agent did not start under {caps}:\n{a.stderr()[-3000:]}"
        status = Path(f"/proc/{a.proc.pid}/status").read_text()  # sh exec'd setpriv exec'd the agent
        eff = int(re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
        bnd = int(re.search(r"^CapBnd:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
        assert eff == cap_mask(caps) and bnd == cap_mask(caps), (hex(eff), hex(bnd), caps)
        mountinfo = Path(f"/proc/{a.proc.pid}/mountinfo").read_text().splitlines()
        for path in readonly_host_paths():
            opts = [l.split()[5] for l in mountinfo if l.split()[4] == path]
            assert opts and opts[-1].split(",")[0] == "ro", (path, opts)
        r = requests.get(f"http://127.0.0.1:{a.port}/healthz", timeout=5)
        assert r.status_code == 200, r.text
        m = requests.get(f"http://127.0.0.1:{a.port}/metrics", timeout=5).text
        assert 'kvloop_probe_source_info{source="ebpf"} 1' in m, m[-2000:]
        err = a.stderr()
        assert "eBPF probes loaded (source=ebpf)" in err, err[-3000:]
        assert "attaching READ probes to this process failed" not in err, err[-3000:]
    finally:
        a.stop()


@pytest.mark.parametrize("removed", ["SYS_ADMIN"])
def test_without_the_probe_capability_the_agent_refuses_to_start(tmp, removed):
    need_root()
    caps = [c for c in daemonset_caps() if c != removed]
    a = Agent(caps, tmp)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while a.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        err = a.stderr()
        assert a.proc.returncode not in (None, 0), (
            f"agent without CAP_{removed} kept running:\n{err[-3000:]}")
        assert "eBPF probes do not load" in err and "Operation not permitted" in err, err[-3000:]
        assert f"missing capability CAP_{removed}" in err, err[-3000:]
    finally:
        a.stop()


def test_sys_ptrace_is_what_lets_the_agent_reach_another_users_process(tmp):
    """The agent attaches to libnixl inside engine containers through
    /proc/<pid>/root and reads /proc/<pid>/maps: the kernel's ptrace access
    check passes for a process of another uid only with CAP_SYS_PTRACE."""
    need_root()
    engine = subprocess.Popen([tool("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups",
                               "--", "sleep", "60"], start_new_session=True)
    try:
        time.sleep(0.3)
        probe = ("import sys; p=sys.argv[1]; open(f'/proc/{p}/maps').read(); "
                 "import os; os.stat(f'/proc/{p}/root/bin/sh'); print('ok')")
        caps = daemonset_caps()
        ok = subprocess.run(setpriv_args(caps) + ["python3", "-c", probe, str(engine.pid)],
                            capture_output=True, text=True, timeout=30)
        assert ok.returncode == 0 and "ok" in ok.stdout, ok.stderr
        without = [c for c in caps if c != "SYS_PTRACE"]
        denied = subprocess.run(setpriv_args(without) + ["python3", "-c", probe, str(engine.pid)],
                                capture_output=True, text=True, timeout=30)
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    finally:
        engine.kill()
        engine.wait(timeout=10)


def test_ipc_lock_is_what_lets_the_agent_pin_memory_beyond_the_memlock_limit(tmp):
    """EFA memory registration pins pages and is charged to RLIMIT_MEMLOCK
    unless the process holds CAP_IPC_LOCK, like mlock(2). Containers get a
    small limit (8 MiB by default with containerd); the agent's probe buffers
    alone are 8 MiB (2 regions × 64 blocks × 64 KiB)."""
    need_root()
    pin = ("import ctypes, mmap; n=64<<20; m=mmap.mmap(-1, n); "
           "a=ctypes.addressof(ctypes.c_char.from_buffer(m)); "
           "libc=ctypes.CDLL(None, use_errno=True); "
           "r=libc.mlock(ctypes.c_void_p(a), ctypes.c_size_t(n)); "
           "print('pinned' if r == 0 else 'errno %d' % ctypes.get_errno())")
    prlimit = [tool("prlimit"), "--memlock=8388608:8388608", "--"]
    caps = daemonset_caps()
    ok = subprocess.run(setpriv_args(caps) + prlimit + ["python3", "-c", pin],
                        capture_output=True, text=True, timeout=30)
    assert ok.stdout.strip() == "pinned", (ok.stdout, ok.stderr)
    without = [c for c in caps if c != "IPC_LOCK"]
    denied = subprocess.run(setpriv_args(without) + prlimit + ["python3", "-c", pin],
                            capture_output=True, text=True, timeout=30)
    assert denied.stdout.strip().startswith("errno"), (denied.stdout, denied.stderr)


def test_without_sys_admin_but_with_bpf_and_perfmon_no_read_is_timed_in_the_kernel(tmp):
    """BPF + PERFMON load the programs and attach the tracepoints, but not the
    READ-site uprobes (Linux >= 6.16). With `require_ebpf = true` the agent
    then refuses to start, naming CAP_SYS_ADMIN."""
    need_root()
    caps = [c for c in daemonset_caps() if c != "SYS_ADMIN"] + ["BPF", "PERFMON"]
    a = Agent(caps, tmp)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while a.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        err = a.stderr()
        assert not a.ready.startswith("READY"), f"agent started without CAP_SYS_ADMIN:\n{err[-3000:]}"
        assert a.proc.returncode not in (None, 0), err[-3000:]
        assert "attaching READ probes to this process failed" in err, err[-3000:]
        assert "Permission denied" in err, err[-3000:]
        assert "missing capability CAP_SYS_ADMIN (uprobes need it on Linux" in err, err[-3000:]
    finally:
        a.stop()
