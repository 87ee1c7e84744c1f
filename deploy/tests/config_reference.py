"""Generates the configuration reference of docs/operator-guide.md from the
real config structs.

* Keys and defaults come from the binaries themselves:
  `kvloop-router --print-config` and `kvloop-agent --print-config` print the
  effective configuration (serde's view of the structs), once with no file
  and once with a minimal entry in each array of tables, so that the
  defaults of the entries' optional fields show.
* Meanings come from the `///` docstrings of the struct fields in the Rust
  sources (first sentence, default annotations removed: the default column
  is the binary's own).

    target/deploy-venv/bin/python deploy/tests/config_reference.py --write

rewrites the tables between the `<!-- BEGIN ... -->` / `<!-- END ... -->`
markers of the guide; test_docs.py fails when they are out of date.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operator-guide.md"

# TOML section -> (Rust file, struct name). "" is the top level.
ROUTER_STRUCTS = {
    "": ("router/src/config.rs", "RouterConfig"),
    "engines[]": ("router/src/registry.rs", "EngineConfig"),
    "retention": ("router/retention/src/policy.rs", "RetentionConfig"),
}
AGENT_STRUCTS = {
    "": ("agent/src/config.rs", "AgentConfig"),
    "backend": ("dataplane/src/fabric/config.rs", "FabricConfig"),
    "lease": ("agent/src/lease.rs", "LeaseConfig"),
    "probe": ("agent/src/config.rs", "ProbeConfig"),
    "network": ("agent/src/config.rs", "NetworkConfig"),
    "observe": ("agent/src/config.rs", "ObserveConfig"),
    "prefill_ports[]": ("agent/src/config.rs", "PrefillPort"),
    "peers[]": ("agent/src/config.rs", "PeerConfig"),
    "routers[]": ("agent/src/config.rs", "RouterTarget"),
    "pairs[]": ("agent/src/config.rs", "PairConfig"),
    "cost_model": ("agent/costmodel/src/config.rs", "CostModelConfig"),
    "cost_model.source_weights": ("agent/costmodel/src/config.rs", "SourceWeights"),
}
# Minimal entries of the arrays of tables (required fields only).
ROUTER_ENTRIES = """
[[engines]]
engine_id = "p0"
role = "prefill"
http_url = "http://127.0.0.1:1"
side_channel_host = "127.0.0.1"
side_channel_port = 1
"""
AGENT_ENTRIES = """
[[prefill_ports]]
engine_id = "p0"
port = 8100
[[peers]]
name = "b"
http = "127.0.0.1:1"
[[routers]]
url = "http://127.0.0.1:1"
token = "t"
[[pairs]]
prefill_engine_id = "p0"
decode_engine_id = "d0"
decode_peer = "b"
bytes_per_token = 1
"""
# Meanings not found as a struct field.
EXTRA_DOCS = {
    "backend.kind": "`libfabric` (the fields below) or `nixl` (fields `plugin`: `UCX` or "
                    "`LIBFABRIC`, and `lib_dir`)",
}
# Values that depend on the machine: shown as a description, not a literal.
MACHINE_DEFAULTS = {"agent_id": "(the host name)"}


def field_docs(rel: str, struct: str) -> dict[str, str]:
    """`field -> first sentence of its docstring` of `pub struct <struct>`."""
    src = (REPO / rel).read_text()
    m = re.search(r"pub struct " + re.escape(struct) + r"\b[^{]*\{", src)
    if not m:
        raise SystemExit(f"{rel}: no `pub struct {struct}`")
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    body = src[m.end():i - 1]
    docs: dict[str, str] = {}
    doc: list[str] = []
    for line in body.splitlines():
        s = line.strip()
        if s.startswith("///"):
            doc.append(s[3:].strip())
        elif s.startswith("#["):
            continue
        else:
            f = re.match(r"pub\s+(r#)?(\w+)\s*:", s)
            if f:
                docs[f.group(2)] = summarize(" ".join(doc))
            doc = []
    return docs


def summarize(text: str) -> str:
    """First sentence of a docstring, without default annotations."""
    text = re.sub(r"\s*\[[^\[\]]*\]\.?\s*$", "", text.strip())       # trailing "[default]"
    text = text.replace("e.g. ", "e.g.\0").replace("i.e. ", "i.e.\0")
    sentences = [x.replace("\0", " ") for x in re.split(r"(?<=\.)\s+", text) if x]
    sentences = [x for x in sentences if not re.match(r"Default\b", x)]
    first = sentences[0].rstrip(".") if sentences else "-"
    return first.replace("|", "\\|")


def run_print_config(binary: Path, toml_text: str | None) -> dict:
    args = [str(binary), "--print-config"]
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        if toml_text is not None:
            f.write(toml_text)
            f.flush()
            args += ["--config", f.name]
        r = subprocess.run(args, capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return tomllib.loads(r.stdout)


def toml_literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        r = repr(v)
        return r if ("." in r or "e" in r or "inf" in r or "nan" in r) else r + ".0"
    if isinstance(v, list):
        return "[" + ", ".join(toml_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_literal(x)}" for k, x in v.items()) + " }"
    return str(v)


def flatten(defaults: dict, entries: dict, structs: dict) -> list[tuple[str, str, str]]:
    """Rows (key, default, meaning) in struct order."""
    rows: list[tuple[str, str, str]] = []

    def walk(section: str, d: dict, prefix: str):
        docs = field_docs(*structs[section]) if section in structs else {}
        for k, v in d.items():
            path = f"{prefix}{k}"
            sub = f"{section}.{k}" if section else k
            if isinstance(v, dict) and sub in structs:
                walk(sub, v, path + ".")
            elif isinstance(v, list) and f"{sub}[]" in structs:
                rows.append((path, "[]", docs.get(k, "-")))
                entry = entries[k][0]
                walk(f"{sub}[]", entry, path + "[].")
            else:
                shown = MACHINE_DEFAULTS.get(path, toml_literal(v))
                rows.append((path, shown, EXTRA_DOCS.get(path, docs.get(k, "-"))))
        # Fields serde did not print are `Option`s that are unset by default.
        for k, doc in docs.items():
            if k not in d:
                rows.append((f"{prefix}{k}", "none", doc))

    walk("", defaults, "")
    return rows


def table(rows, required: set[str]) -> str:
    out = ["| key | default | meaning |", "|---|---|---|"]
    for k, d, m in rows:
        shown = "required" if k in required else ("none" if d == "none" else f"`{d}`")
        out.append(f"| `{k}` | {shown} | {m} |")
    return "\n".join(out)


def required_fields(entries_toml: str) -> dict[str, set[str]]:
    """Fields given in the minimal entries: the required ones."""
    req: dict[str, set[str]] = {}
    for name, items in tomllib.loads(entries_toml).items():
        req[name] = set(items[0])
    return req


def reference(binary: Path, structs: dict, entries_toml: str) -> str:
    defaults = run_print_config(binary, None)
    with_entries = run_print_config(binary, entries_toml)
    entries = {k: with_entries[k] for k in tomllib.loads(entries_toml)}
    rows = flatten(defaults, entries, structs)
    req = {f"{arr}[].{f}" for arr, fs in required_fields(entries_toml).items() for f in fs}
    return table(rows, req)


def sections(bin_dir: Path) -> dict[str, str]:
    return {
        "router-config": reference(bin_dir / "kvloop-router", ROUTER_STRUCTS, ROUTER_ENTRIES),
        "agent-config": reference(bin_dir / "kvloop-agent", AGENT_STRUCTS, AGENT_ENTRIES),
    }


def splice(text: str, name: str, body: str) -> str:
    b, e = f"<!-- BEGIN {name} (generated: deploy/tests/config_reference.py) -->", f"<!-- END {name} -->"
    if b not in text or e not in text:
        raise SystemExit(f"{GUIDE}: markers of {name} missing")
    head, rest = text.split(b, 1)
    _, tail = rest.split(e, 1)
    return f"{head}{b}\n{body}\n{e}{tail}"


def current(text: str, name: str) -> str:
    b = f"<!-- BEGIN {name} (generated: deploy/tests/config_reference.py) -->"
    e = f"<!-- END {name} -->"
    return text.split(b, 1)[1].split(e, 1)[0].strip("\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default=str(REPO / "target" / "debug"))
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--only", choices=["router-config", "agent-config"])
    a = ap.parse_args()
    text = GUIDE.read_text() if a.write else ""
    bins = Path(a.bin_dir)
    names = [a.only] if a.only else ["router-config", "agent-config"]
    for n in names:
        binary = bins / ("kvloop-router" if n == "router-config" else "kvloop-agent")
        structs, entries = ((ROUTER_STRUCTS, ROUTER_ENTRIES) if n == "router-config"
                            else (AGENT_STRUCTS, AGENT_ENTRIES))
        body = reference(binary, structs, entries)
        if a.write:
            text = splice(text, n, body)
        else:
            print(body)
    if a.write:
        GUIDE.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
