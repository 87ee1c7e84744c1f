//! Empty on purpose: kvloop's eBPF programs are the `kvloop-ebpf` binary
//! (`src/main.rs`), built for `bpfel-unknown-none` by aya-build from
//! `ebpf/probes/build.rs`.
#![no_std]
