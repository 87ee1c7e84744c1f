"""Least privilege, as written in the manifests (the capability test starts
the agent under exactly this set: test_capabilities.py)."""
from __future__ import annotations

import re

from conftest import GUIDE, MANIFESTS, find, plain_objects

# The agent's capabilities, with the reason in deploy/kubernetes/agent-daemonset.yaml
# and docs/operator-guide.md ("Privileges of the agent").
AGENT_CAPS = ["SYS_ADMIN", "SYS_PTRACE", "IPC_LOCK"]
AGENT_HOST_PATHS = {
    "/sys/fs/bpf": True, "/sys/kernel/tracing": True, "/sys/kernel/debug": True,
    "/sys/kernel/btf": True, "/sys/class/infiniband": True, "/run/kvloop": False,
}  # path -> mounted read-only


def agent_pod() -> dict:
    return find(plain_objects(), "DaemonSet", "kvloop-agent")["spec"]["template"]["spec"]


def test_agent_capabilities_are_exactly_the_documented_set():
    c = agent_pod()["containers"][0]
    sc = c["securityContext"]
    assert sc["privileged"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["capabilities"]["add"] == AGENT_CAPS
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsUser"] == 0
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"


def test_each_granted_capability_has_its_reason_next_to_it():
    lines = (MANIFESTS / "agent-daemonset.yaml").read_text().splitlines()
    for cap in AGENT_CAPS:
        i = next(n for n, l in enumerate(lines) if l.strip() == f"- {cap}")
        assert lines[i - 1].strip().startswith("#"), f"{cap}: no comment above it"
    text = (MANIFESTS / "agent-daemonset.yaml").read_text()
    for field in ("hostPID", "hostNetwork"):
        assert re.search(rf"#\s*{field}:", text), f"{field} without an explanation"


def test_operator_guide_lists_the_same_privileges():
    guide = GUIDE.read_text()
    section = guide.split("## Privileges of the agent", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `CAP_([A-Z_]+)` \|", section, re.M)
    assert rows == AGENT_CAPS, rows
    for field in ("hostPID: true", "hostNetwork: true", "vpc.amazonaws.com/efa: 1"):
        assert f"| `{field}` |" in section, field


def test_agent_host_access_is_limited_to_what_is_explained():
    pod = agent_pod()
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert "hostIPC" not in pod
    assert pod["automountServiceAccountToken"] is False
    vols = {v["name"]: v for v in pod["volumes"]}
    host = {v["hostPath"]["path"]: n for n, v in vols.items() if "hostPath" in v}
    assert set(host) == set(AGENT_HOST_PATHS), host
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    for path, ro in AGENT_HOST_PATHS.items():
        m = mounts[host[path]]
        assert m["mountPath"] == path
        assert m.get("readOnly", False) is ro, path


def test_agent_node_placement_health_and_resources():
    pod = agent_pod()
    c = pod["containers"][0]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    env = {e["name"]: e for e in c["env"]}
    assert env["KVLOOP_AGENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["KVLOOP_AGENT_NODE_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["resources"]["requests"]["vpc.amazonaws.com/efa"] == 1
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 1
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    ds = find(plain_objects(), "DaemonSet", "kvloop-agent")
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def test_router_runs_unprivileged():
    dep = find(plain_objects(), "Deployment", "kvloop-router")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    sc = pod["containers"][0]["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}
    assert "hostPath" not in str(pod["volumes"])
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["KVLOOP_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "kvloop-router-admin", "key": "token"}
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
