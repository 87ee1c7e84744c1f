"""Fixtures of the real-vLLM tests (make test-vllm; docs/vllm.md).

The suite needs root, the vLLM venv (scripts/vllm/install.sh) and kvloop's
binaries in target/debug; without them it FAILS naming what is missing,
it never skips.
"""

import os
import pathlib
import re
import signal
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts/vllm"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import cluster as cl  # noqa: E402

WORK = pathlib.Path(os.environ.get("KVLOOP_VLLM_WORK", ROOT / "target/vllm-test"))


def _sigterm(*_):
    # `timeout` stops the suite with SIGTERM: turn it into an exception so
    # the fixture's teardown stops every process and removes the namespaces.
    raise KeyboardInterrupt("SIGTERM")


signal.signal(signal.SIGTERM, _sigterm)


@pytest.fixture(scope="session")
def cluster():
    miss = cl.requirements()
    if miss:
        pytest.fail("real-vLLM tests need: " + "; ".join(miss), pytrace=False)
    c = cl.Cluster(WORK / time.strftime("run-%Y%m%d-%H%M%S"), plugin=True)
    try:
        c.start()
        yield c
    except Exception:
        for p in c.procs.values():
            sys.stderr.write(f"--- {p.name} ---\n{p.tail(30)}\n")
        raise
    finally:
        c.stop()


def _log_digest(c, lines_per_proc: int = 6) -> str:
    """Each process: alive or its exit status, and its last warning/error
    lines (what CI's short output tail must show of a failure)."""
    out = []
    pat = re.compile(r"WARN|ERROR|Error|Traceback|reset|refused|unhealthy")
    for p in c.procs.values():
        state = "alive" if p.alive() else f"exited {p.popen.returncode}"
        try:
            text = p.log_path.read_text(errors="replace").splitlines()
        except OSError:
            text = []
        ansi = re.compile(r"\x1b\[[0-9;]*m")
        hits = [ansi.sub("", ln)[:300] for ln in text if pat.search(ln)][-lines_per_proc:]
        out.append(f"--- {p.name} ({state}, {p.log_path.name}) ---")
        out.extend(hits or ["(no warning or error lines)"])
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    c = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
    if rep.when == "call" and rep.failed and c is not None:
        rep.sections.append(("kvloop processes at the failure", _log_digest(c)))


@pytest.fixture(scope="session")
def words():
    """Words of the frozen corpus the model's vocabulary is built from
    (tests/vllm/corpus.md), in order."""
    text = (ROOT / "tests/vllm/corpus.md").read_text()
    return [w for w in re.findall(r"\w+|[^\w\s]+", text) if w.isascii()]


@pytest.fixture(scope="session")
def report():
    """Rows and figures collected by the tests, written at the end."""
    r = {"rows": [], "figures": {}}
    yield r
    import json

    from client import RETRIES_503

    r["figures"]["requests retried after a router 503 (engine marked unhealthy)"] = len(RETRIES_503)
    try:
        resent = [cl.metric_sum(cl.metrics(f"http://{a}/metrics"), "kvloop_router_decode_retries_total")
                  for a in (cl.ROUTER_ON, cl.ROUTER_OFF)]
        r["figures"]["decode requests resent by the routers after a broken connection (on / off)"] = (
            " / ".join(f"{n:.0f}" for n in resent))
    except Exception as e:  # the routers are gone: the run failed earlier
        r["figures"]["decode requests resent by the routers after a broken connection"] = f"unknown ({e})"

    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "report.json").write_text(json.dumps(r, indent=1))
    lines = ["| conversation | turns | pulled at router | D->P READs (vLLM NIXL metrics) | "
             "NIXL events on P (kvloop trace) | P's READs recorded by P's agent | "
             "output diff vs no-reuse (max |dlogprob|) |",
             "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append("| {name} | {turns} | {pulled} | {nixl} | {probe} | {agent} | {diff} |".format(**row))
    lines.append("")
    for k, v in r["figures"].items():
        lines.append(f"- {k}: {v}")
    (WORK / "report.md").write_text("\n".join(lines) + "\n")
    sys.stderr.write("\n" + "\n".join(lines) + "\n")
