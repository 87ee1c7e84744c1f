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
