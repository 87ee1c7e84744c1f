# kvloop — top-level commands. `make demo` and `make test` work on a fresh
# machine of this kind: both run scripts/bootstrap.sh first, which installs
# what is missing and skips what is there.
SHELL := /bin/bash
.DEFAULT_GOAL := help

NIXL_DIR ?= $(or $(KVLOOP_NIXL_DIR),$(HOME)/.cache/kvloop/nixl-cu12-1.5.1)
NIXL_LIBS := $(NIXL_DIR)/.nixl_cu12.mesonpy.libs
# Environment of every process that loads NIXL (shared/RECIPES.md):
# UCX_MODULES='^ib*' keeps UCX from loading a bundled InfiniBand module that
# segfaults at exit on machines without IB.
export KVLOOP_NIXL_DIR := $(NIXL_DIR)
export NIXL_PLUGIN_DIR := $(NIXL_LIBS)/plugins
export UCX_MODULES := ^ib*
export LD_LIBRARY_PATH := $(NIXL_LIBS):$(LD_LIBRARY_PATH)
export CARGO_TERM_COLOR ?= never

.PHONY: help bootstrap build test demo demo-hold demo-slow-link demo-cluster demo-cluster-hold bench lint fmt

help:
	@echo "make demo   - run the main job (installs what it needs first)"
	@echo "make demo-hold - make demo, then keep it running for kvloop doctor/ping/top (Ctrl-C ends)"
	@echo "make demo-cluster - the emulated xPyD cluster: three policies side by side"
	@echo "make demo-cluster-hold - make demo-cluster, then keep it running for the tools"
	@echo "make test   - run every test (installs what it needs first)"
	@echo "make bench  - run the benchmarks (tables on stdout)"
	@echo "make lint   - cargo fmt --check and clippy -D warnings"
	@echo "make test-vllm - kvloop in front of real vLLM engines (docs/vllm.md)"
	@echo "make fuzz   - run each fuzz target for FUZZ_SECONDS (default 60)"

bootstrap:
	@scripts/bootstrap.sh

build: bootstrap
	cargo build --release -p kvloop -p kvloop-agent -p kvloop-router -p kvloop-engine-sim

# Tests need root (network namespaces, eBPF, tc) and the NIXL runtime: those
# that do are #[ignore]d in a plain `cargo test`; tests/run.sh runs them with
# --include-ignored (each fails naming what it lacks), the GPU tests where a GPU
# exists (counted as ignored elsewhere), then deploy/tests, and prints the
# counts of passed, failed and ignored tests. Binaries are built first:
# end-to-end tests start them as processes.
test: bootstrap
	cargo build --workspace --all-targets
	CARGO_TARGET_DIR=target/cuda-check cargo check -p kvloop-dataplane -p kvloop-agent --features kvloop-dataplane/cuda,kvloop-agent/cuda --tests
	tests/run.sh

demo: build
	target/release/kvloop demo

# make demo, then the nodes, agents, engines and router stay up for
# `kvloop doctor` / `ping` / `top` (commands printed, and in
# target/kvloop-demo/hold.json) until Ctrl-C.
demo-hold: build
	target/release/kvloop demo --hold

# The same loop with the D→P link slowed (tc tbf) mid-run.
demo-slow-link: build
	target/release/kvloop demo slow-link

# The emulated xPyD cluster: 2 P + 3 D, two router replicas on Redis, one
# slow path; rr + fixed 64 / rr + adaptive / kvloop's selection side by side.
demo-cluster: build
	target/release/kvloop demo cluster

demo-cluster-hold: build
	target/release/kvloop demo cluster --hold

bench: build
	target/release/kvloop bench read --nixl UCX
	target/release/kvloop bench read --netns --provider 'tcp;ofi_rxm' --block-sizes 64K,1M,16M
	target/release/kvloop bench read --provider 'tcp;ofi_rxm',shm --layout qwen3-32b-tp8,qwen3-32b-tp1 --outstanding 1
	cargo bench -p kvloop-probes --bench probe_cost
	cargo bench -p kvloop-router --bench router_bench
	cargo run --release -p kvloop-costmodel --example sim_report

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	python3 scripts/modcycles.py $(sort $(dir $(wildcard */src/lib.rs */*/src/lib.rs */src/main.rs */*/src/main.rs)))

# kvloop in front of real vLLM engines (1 P + 1 D vLLM 0.32 CPU engines with
# NixlConnector in two network namespaces; docs/vllm.md). The first run
# installs vLLM's CPU build into ~/.cache/kvloop/vllm-venv (about 6 GB).
.PHONY: test-vllm
test-vllm: bootstrap
	cargo build -p kvloop -p kvloop-agent -p kvloop-router
	scripts/vllm/test.sh

# Fuzz targets (fuzz/, cargo-fuzz on the nightly toolchain) for the
# kv_transfer_params parser, the SSE parser, the agent's frame decoder and the
# side channel's decoder, one after the other for FUZZ_SECONDS each (default
# 60); prints target | executions | seconds | crashes and fails on a crash.
# scripts/fuzz.sh installs cargo-fuzz when missing. Not part of `make test`.
.PHONY: fuzz
fuzz:
	scripts/fuzz.sh
