"""The operator guide's configuration reference against the real config
structs, and the shipped TOML files against the real config parsers."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import tomllib

import pytest

import config_reference as ref
from conftest import GUIDE, find, kvloop_bin, plain_objects


def configmap_file(name: str, key: str) -> str:
    return find(plain_objects(), "ConfigMap", name)["data"][key]


@pytest.mark.parametrize("section,binary,structs,entries", [
    ("router-config", "kvloop-router", ref.ROUTER_STRUCTS, ref.ROUTER_ENTRIES),
    ("agent-config", "kvloop-agent", ref.AGENT_STRUCTS, ref.AGENT_ENTRIES),
])
def test_config_reference_matches_the_structs(section, binary, structs, entries):
    """Every key and default of the binary's effective config is in the guide,
    and nothing else. Meanings come from the docstrings when generated; a
    reworded docstring does not fail this test (regenerate to pick it up)."""
    exe = kvloop_bin(binary)
    want = rows(ref.reference(exe, structs, entries))
    have = rows(ref.current(GUIDE.read_text(), section))
    regen = ("regenerate with\n  target/deploy-venv/bin/python "
             "deploy/tests/config_reference.py --write")
    assert [k for k, _, _ in have] == [k for k, _, _ in want], (
        f"docs/operator-guide.md's {section} keys differ from the structs; {regen}")
    for (k, d, m), (_, wd, _) in zip(have, want):
        assert d == wd, f"{section}: `{k}` default {d} in the guide, {wd} in the binary; {regen}"
        assert m and m != "-", f"{section}: `{k}` has no meaning (docstring missing)"


def rows(table: str) -> list[tuple[str, str, str]]:
    out = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        out.append((cells[0], cells[1], cells[2]))
    return out


def print_config(exe, text: str, env: dict[str, str] | None = None) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        r = subprocess.run([str(exe), "--config", f.name, "--print-config"], capture_output=True,
                           text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", **(env or {})})
    assert r.returncode == 0, f"{exe.name} rejects the shipped config: {r.stderr}"
    return tomllib.loads(r.stdout)


def test_shipped_router_config_parses():
    exe = kvloop_bin("kvloop-router")
    cfg = print_config(exe, configmap_file("kvloop-router-config", "router.toml"))
    assert cfg["listen"] == "0.0.0.0:8000"
    assert cfg["admin_token"] == "", "the token belongs in the Secret, not the ConfigMap"
    dep = find(plain_objects(), "Deployment", "kvloop-router")
    port = dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert cfg["listen"].endswith(f":{port}")


def test_shipped_agent_config_parses():
    exe = kvloop_bin("kvloop-agent")
    text = configmap_file("kvloop-agent-config", "agent.toml")
    env = {"KVLOOP_AGENT_ID": "node-a", "KVLOOP_AGENT_NODE_ADDR": "10.0.0.1"}
    ds = find(plain_objects(), "DaemonSet", "kvloop-agent")
    c = ds["spec"]["template"]["spec"]["containers"][0]
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
    env["KVLOOP_AGENT_ROUTER_TOKEN"] = "t0ken"
    cfg = print_config(exe, text, env)
    assert cfg["agent_id"] == "node-a" and cfg["node_addr"] == "10.0.0.1"
    assert cfg["require_ebpf"] is True
    assert cfg["backend"]["kind"] == "nixl" and cfg["backend"]["plugin"] == "LIBFABRIC"
    assert [r["token"] for r in cfg["routers"]] == ["t0ken"]
    port = c["ports"][0]["containerPort"]
    assert cfg["http_listen"] == f"0.0.0.0:{port}"
