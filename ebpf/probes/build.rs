//! Builds the eBPF programs (`ebpf/kvloop-ebpf`) for bpfel with aya-build
//! (nightly + `-Z build-std=core`, linked by `bpf-linker`); the object lands in
//! `$OUT_DIR/kvloop-ebpf` and is embedded by `src/loader.rs`.
//!
//! `AYA_BUILD_SKIP=1` skips the eBPF build (the crate then compiles without
//! programs and `Probes::load` reports `ProbeError::NotBuilt`).
fn main() {
    println!("cargo:rerun-if-changed=../common/src");
    println!("cargo:rustc-check-cfg=cfg(kvloop_ebpf_skipped)");
    let skip = std::env::var("AYA_BUILD_SKIP")
        .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
        .unwrap_or(false);
    if skip {
        println!("cargo:rustc-cfg=kvloop_ebpf_skipped");
    }
    let root_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../kvloop-ebpf");
    // aya-build runs `cargo build --package kvloop-ebpf` in the current
    // directory. kvloop-ebpf is excluded from the host workspace (it is a
    // bpfel-only crate with its own Cargo.lock), so run that cargo from inside
    // it; from the host workspace cargo does not know the package.
    std::env::set_current_dir(root_dir).expect("ebpf/kvloop-ebpf exists");
    let package = aya_build::Package {
        name: "kvloop-ebpf",
        root_dir,
        ..Default::default()
    };
    if let Err(e) = aya_build::build_ebpf([package], aya_build::Toolchain::default()) {
        panic!(
            "building the eBPF programs failed: {e:#}\n\
             needs: nightly rust with rust-src and bpf-linker 0.13 on PATH \
             (scripts/bootstrap.sh ebpf); AYA_BUILD_SKIP=1 builds without them"
        );
    }
}
