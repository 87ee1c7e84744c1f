#!/usr/bin/env python3
"""Module import cycles between the top-level modules of crates (`make lint`).

For each `src/` directory given, builds the graph of `crate::<module>` (and,
from top-level files, `super::<module>`) references between its top-level
modules, ignoring comments (doc links are not imports) and `#[cfg(test)]`
code, and prints the strongly connected components of more than one module.
Exits 1 when any crate has a cycle.

    python3 scripts/modcycles.py agent/src router/src ...
"""
from __future__ import annotations

import os
import re
import sys


def top_modules(src: str) -> dict[str, list[str]]:
    """Top-level module name -> its files (`crate` for lib.rs/main.rs)."""
    mods: dict[str, list[str]] = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            parts = os.path.relpath(path, src)[:-3].split(os.sep)
            if parts[0] == "bin":
                continue
            top = "crate" if parts[0] in ("lib", "main") else parts[0]
            mods.setdefault(top, []).append(path)
    return mods


def code_of(path: str) -> str:
    text = open(path, encoding="utf-8").read()
    cut = text.find("#[cfg(test)]")
    if cut >= 0:
        text = text[:cut]
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def graph(src: str) -> dict[str, set[str]]:
    mods = top_modules(src)
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, files in mods.items():
        for path in files:
            text = code_of(path)
            refs = set(re.findall(r"crate::(\w+)", text))
            depth = os.path.relpath(path, src).count(os.sep)
            if depth == 0 and m != "crate":
                refs |= set(re.findall(r"\bsuper::(\w+)", text))
            if depth == 1 and os.path.basename(path) != "mod.rs":
                refs |= set(re.findall(r"super::super::(\w+)", text))
            g[m] |= {r for r in refs if r in mods and r not in (m, "crate")}
    g.pop("crate", None)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def main(srcs: list[str]) -> int:
    bad = 0
    for src in srcs:
        g = graph(src)
        for comp in cycles(g):
            bad += 1
            edges = "; ".join(f"{m} -> {', '.join(sorted(g[m] & set(comp)))}" for m in comp)
            print(f"{src}: module cycle {comp}: {edges}")
    if not bad:
        print(f"modcycles: no module cycle in {len(srcs)} crates")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
