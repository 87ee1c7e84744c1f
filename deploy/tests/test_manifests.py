"""The plain manifests and the Helm chart.

* Every object of deploy/kubernetes/ and of the chart (default and
  non-default values) validates against the Kubernetes OpenAPI schemas
  (kubernetes-validate, strict: unknown fields rejected) of the oldest and
  newest Kubernetes version the chart supports; ServiceMonitors against the
  Prometheus Operator CRD models.
* The chart, rendered by Helm's own Go SDK (helm-python-sdk) with its default
  values as release "kvloop" in namespace "kvloop", produces exactly the
  objects of deploy/kubernetes/ (Namespace aside): both are kept by hand and
  this test holds them together.
* `helm lint --strict` finds nothing; every value in values.yaml is
  documented with its default.
"""
from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor
from helm_python import chart as helm

from conftest import CHART, DASHBOARD, MANIFESTS, find, plain_objects

K8S_VERSIONS = ["1.25.0", "1.37.0"]  # Chart.yaml kubeVersion ">=1.25.0-0" .. newest bundled


def _walk_dropped(given, dumped, path=""):
    """Keys present in `given` but not in the model's dump: unknown fields."""
    out = []
    if isinstance(given, dict):
        for k, v in given.items():
            if not isinstance(dumped, dict) or k not in dumped:
                out.append(f"{path}.{k}")
            else:
                out.extend(_walk_dropped(v, dumped[k], f"{path}.{k}"))
    elif isinstance(given, list):
        for i, v in enumerate(given):
            out.extend(_walk_dropped(v, dumped[i] if i < len(dumped) else None, f"{path}[{i}]"))
    return out


def validate(obj: dict) -> None:
    """Validate one object; raises with the object's kind/name on failure."""
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("apiVersion") == "monitoring.coreos.com/v1" and obj.get("kind") == "ServiceMonitor":
        model = ServiceMonitor.model_validate(obj)
        dumped = model.model_dump(by_alias=True, exclude_none=True, mode="json")
        unknown = _walk_dropped(obj, dumped)
        assert not unknown, f"{where}: fields unknown to the ServiceMonitor CRD: {unknown}"
        return
    for v in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{where} (Kubernetes {v}): {e.message} at "
                                 f"/{'/'.join(str(p) for p in e.path)}") from e
        except kubernetes_validate.SchemaNotFoundError as e:
            raise AssertionError(f"{where}: no Kubernetes {v} schema for it: {e}") from e


def render(values: dict | None = None, name: str = "kvloop", namespace: str = "kvloop") -> list[dict]:
    with helm.Chart.load(CHART) as c:
        files = c.render(values or {}, name=name, namespace=namespace)
    out: list[dict] = []
    for path in sorted(files):
        if not path.endswith((".yaml", ".yml")):
            continue
        out.extend(d for d in yaml.safe_load_all(files[path]) if d)
    return out


def key(o: dict) -> tuple[str, str, str]:
    return (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])


def test_validator_rejects_a_bad_manifest():
    """The validator is live: a misspelt field and a wrong type are caught."""
    ds = find(plain_objects(), "DaemonSet", "kvloop-agent")
    bad = json.loads(json.dumps(ds))
    bad["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(AssertionError, match="hostPid"):
        validate(bad)
    bad = json.loads(json.dumps(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(AssertionError):
        validate(bad)
    sm = find(plain_objects(), "ServiceMonitor", "kvloop-router")
    bad = json.loads(json.dumps(sm))
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="intervall"):
        validate(bad)


def test_plain_manifests_validate():
    objs = plain_objects()
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == ["ConfigMap", "DaemonSet", "Deployment", "Namespace", "Secret", "Service",
                     "ServiceAccount", "ServiceMonitor"], kinds
    for o in objs:
        validate(o)
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "kvloop", key(o)


def test_chart_defaults_render_the_plain_manifests():
    plain = {key(o): o for o in plain_objects() if o["kind"] != "Namespace"}
    rendered = {key(o): o for o in render()}
    assert sorted(rendered) == sorted(plain)
    for k, o in plain.items():
        assert rendered[k] == o, f"{k} differs between deploy/kubernetes and the chart"


def test_chart_with_other_values_renders_valid_objects():
    values = {
        "adminToken": {"existingSecret": "my-router-token"},
        "agent": {"efa": {"devices": 0}, "capabilities": ["BPF", "PERFMON", "IPC_LOCK"],
                  "priorityClassName": "system-node-critical"},
        "router": {"replicas": 2, "extraEnv": [{"name": "X", "value": "1"}]},
        "serviceMonitor": {"labels": {"release": "prometheus"}},
        "grafanaDashboard": {"enabled": True},
        "image": {"registry": "registry.example.com/ml", "pullSecrets": [{"name": "regcred"}]},
    }
    objs = render(values, name="prod", namespace="ml")
    for o in objs:
        validate(o)
        assert o["metadata"]["namespace"] == "ml"
    assert not [o for o in objs if o["kind"] == "Secret"], "existingSecret: no Secret created"
    ds = find(objs, "DaemonSet", "prod-kvloop-agent")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "registry.example.com/ml/kvloop/kvloop-agent:0.1.0"
    assert c["securityContext"]["capabilities"]["add"] == ["BPF", "PERFMON", "IPC_LOCK"]
    assert "vpc.amazonaws.com/efa" not in c["resources"]["requests"]
    assert not [v for v in pod["volumes"] if v["name"] == "infiniband"]
    token_env = [e for e in c["env"] if e["name"] == "KVLOOP_AGENT_ROUTER_TOKEN"][0]
    assert token_env["valueFrom"]["secretKeyRef"]["name"] == "my-router-token"
    cm = find(objs, "ConfigMap", "prod-kvloop-agent-config")
    # Agents push to every replica, through the headless Service.
    assert 'url = "http://prod-kvloop-router-headless.ml.svc.cluster.local:8000"' in cm["data"]["agent.toml"]
    headless = find(objs, "Service", "prod-kvloop-router-headless")
    assert headless["spec"]["clusterIP"] == "None"
    dep = find(objs, "Deployment", "prod-kvloop-router")
    assert dep["spec"]["replicas"] == 2
    dash = find(objs, "ConfigMap", "prod-kvloop-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["kvloop.json"]) == json.loads(DASHBOARD.read_text())
    for sm in [o for o in objs if o["kind"] == "ServiceMonitor"]:
        assert sm["metadata"]["labels"]["release"] == "prometheus"


def test_helm_lint_strict_is_clean():
    report = helm.lint(CHART, strict=True, kube_version="v1.30.0")
    problems = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    assert not problems and not report.get("errors"), report


def test_every_value_is_documented_with_its_default():
    """Each leaf value of values.yaml, or a parent map of it, carries a `# --`
    comment that states the default."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented)
    comment: list[str] = []
    in_block = None
    missing = []
    for ln, line in enumerate(lines, 1):
        if in_block is not None:
            if line.strip() == "" or len(line) - len(line.lstrip()) > in_block:
                continue
            in_block = None
        s = line.strip()
        if not s:
            comment = []
            continue
        if s.startswith("#"):
            comment.append(s)
            continue
        indent = len(line) - len(line.lstrip())
        m = re.match(r"^(-\s+)?([A-Za-z0-9_.\-/\"]+):(\s+(.*))?$", s)
        if not m or m.group(1):
            comment = []
            continue  # list items belong to the documented value above them
        while stack and stack[-1][0] >= indent:
            stack.pop()
        text = " ".join(comment)
        documented = ("# --" in text and "Default" in text) or any(d for _, d in stack)
        value = (m.group(4) or "").strip()
        if value in ("|", "|-", ">"):
            in_block = indent
        is_leaf = value != ""
        nxt = next((x for x in lines[ln:] if x.strip() and not x.strip().startswith("#")), "")
        if not is_leaf and nxt.lstrip().startswith("- "):
            is_leaf = True  # a list value
        if is_leaf and not documented:
            missing.append(f"values.yaml:{ln}: {m.group(2)}")
        stack.append((indent, documented))
        comment = []
    assert not missing, "values without a `# --` comment giving the default:\n" + "\n".join(missing)


def test_dashboard_is_valid_grafana_json():
    d = json.loads(DASHBOARD.read_text())
    assert d["title"] and d["uid"] and d["panels"]
    for p in d["panels"]:
        if p.get("type") == "row":
            continue
        assert p.get("targets"), p.get("title")
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"]
            assert t["datasource"]["uid"] == "${datasource}"
