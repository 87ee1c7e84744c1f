"""Shared helpers of kvloop's deployment tests.

Real dependencies (kvloop binaries, the Debian `prometheus` package, root for
eBPF, capsh/setpriv) are looked up here. When one is missing a test is
skipped on a developer machine and FAILS when CI=true: a CI run never passes
without having exercised the real thing.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = DEPLOY / "kubernetes"
CHART = DEPLOY / "helm" / "kvloop"
DASHBOARD = CHART / "dashboards" / "kvloop.json"
GUIDE = REPO / "docs" / "operator-guide.md"


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def need(condition: bool, what: str) -> None:
    """Skip (developer machine) or fail (CI=true) when `condition` is false."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"missing real dependency (CI=true): {what}")
    pytest.skip(f"missing real dependency: {what}")


def bin_dir() -> Path:
    """Folder of the kvloop binaries: $KVLOOP_BIN_DIR, else target/debug."""
    return Path(os.environ.get("KVLOOP_BIN_DIR", REPO / "target" / "debug"))


def kvloop_bin(name: str) -> Path:
    p = bin_dir() / name
    need(p.is_file() and os.access(p, os.X_OK),
         f"{p} (build it: cargo build -p <crate>; or set KVLOOP_BIN_DIR)")
    return p


def tool(name: str) -> str:
    p = shutil.which(name)
    need(p is not None, f"`{name}` on PATH")
    return p  # type: ignore[return-value]


def load_docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def plain_objects() -> list[dict]:
    out: list[dict] = []
    for p in sorted(MANIFESTS.glob("*.yaml")):
        out.extend(load_docs(p))
    return out


def find(objs: list[dict], kind: str, name: str) -> dict:
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise AssertionError(f"no {kind}/{name}")
