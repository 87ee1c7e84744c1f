//! Helpers of kvloop's end-to-end tests: locating the workspace's binaries
//! (built by `cargo build --workspace` before the tests, as `make test` does)
//! and deciding what a missing real dependency means (a failure in CI).
use std::path::PathBuf;
use std::process::Command;

pub use kvloop_cli::child::{NodeChild, ReadyChild};
pub use kvloop_cli::netns::NodePair;

/// Path of a workspace binary next to the running test (`target/<profile>/<name>`).
///
/// # Panics
/// When the binary has not been built, with the command that builds it.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not found: build the workspace binaries first (`cargo build --workspace --bins`, as `make test` does)",
        p.display()
    );
    p
}

/// Whether tests run in CI (`CI=true`): there, a missing real dependency is a failure.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Whether the test may use root-only facilities (network namespaces, tc).
/// Outside CI and without root the test says so on stderr and returns false
/// (the caller returns early); in CI without root it panics.
pub fn have_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        !in_ci(),
        "{test}: needs root (network namespaces) and CI=true: failing instead of skipping"
    );
    eprintln!("SKIPPED {test}: needs root (network namespaces); run as root or in CI");
    false
}

/// `kvloop node <args>` as a command, optionally inside a namespace.
pub fn node_cmd(ns: Option<&str>, args: &[String]) -> Command {
    let kvloop = bin("kvloop");
    let mut c = match ns {
        Some(ns) => NodePair::command_in(ns, &kvloop),
        None => Command::new(kvloop),
    };
    c.arg("node").args(args);
    c
}

/// Engine flags for a test node.
pub fn node_args(
    engine_id: &str,
    listen: &str,
    backend: &str,
    provider: &str,
    blocks: u32,
    block_bytes: u64,
    tag: u64,
) -> Vec<String> {
    [
        "--engine-id",
        engine_id,
        "--listen",
        listen,
        "--backend",
        backend,
        "--provider",
        provider,
        "--num-regions",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--num-blocks".into(),
        blocks.to_string(),
        "--block-bytes".into(),
        block_bytes.to_string(),
        "--fill-tag".into(),
        tag.to_string(),
    ])
    .collect()
}
