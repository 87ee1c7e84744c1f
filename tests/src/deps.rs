//! What a test with a real dependency does without it: it fails, naming the
//! dependency. Such tests are `#[ignore = "needs ..."]` so that a plain
//! `cargo test` lists them as ignored; `make test` runs them with
//! `--include-ignored` (GPU tests apart, see the Makefile).
//!
//! "In CI" has one definition for the whole workspace: `CI=true`.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Whether tests run in CI: the environment variable `CI` is exactly `true`
/// (what `.ci/run` and common CI services set).
pub fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// Whether this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    (unsafe { libc::geteuid() }) == 0
}

/// Asserts that the test runs as root (network namespaces, tc, eBPF, uid
/// switching).
///
/// # Panics
/// When not root, naming `test`.
pub fn require_root(test: &str) {
    assert!(
        is_root(),
        "{test}: needs root (network namespaces, tc, eBPF or switching uid); \
         run it as root: `cargo test -- --include-ignored` (or `make test`)"
    );
}

/// Kept for tests that were written as `if !have_root(name) { return; }`:
/// asserts root ([`require_root`]) and returns true, so the early return is
/// never taken.
///
/// # Panics
/// When not root.
pub fn have_root(test: &str) -> bool {
    require_root(test);
    true
}

/// Path of `tool` on `PATH`.
///
/// # Panics
/// When `tool` is not on `PATH`, naming `test` and `package` (the Debian
/// package that has it).
pub fn require_tool(test: &str, tool: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{test}: needs `{tool}` on PATH (Debian package {package})"))
}

/// The folder holding `libnixl.so` of the NIXL runtime that
/// `scripts/bootstrap.sh nixl` installs: `$KVLOOP_NIXL_DIR/.nixl_cu12.mesonpy.libs`,
/// `KVLOOP_NIXL_DIR` defaulting to `~/.cache/kvloop/nixl-cu12-1.5.1`.
///
/// # Panics
/// When `libnixl.so` is not there, naming `test`.
pub fn nixl_libs(test: &str) -> PathBuf {
    let dir = std::env::var_os("KVLOOP_NIXL_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvloop/nixl-cu12-1.5.1"))
        })
        .unwrap_or_else(|| panic!("{test}: needs KVLOOP_NIXL_DIR or HOME to find NIXL"));
    let libs = dir.join(".nixl_cu12.mesonpy.libs");
    assert!(
        libs.join("libnixl.so").is_file(),
        "{test}: needs the NIXL runtime at {} (scripts/bootstrap.sh nixl, or set KVLOOP_NIXL_DIR)",
        libs.display()
    );
    libs
}

/// Environment of a child process that loads NIXL from `libs` (the folder
/// [`nixl_libs`] returns): the library path, the plugin folder,
/// `UCX_MODULES='^ib*'` (UCX's bundled InfiniBand module crashes at exit on
/// machines without IB) and `KVLOOP_NIXL_DIR`.
pub fn nixl_env(libs: &Path) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("LD_LIBRARY_PATH", libs.display().to_string()),
        (
            "NIXL_PLUGIN_DIR",
            libs.join("plugins").display().to_string(),
        ),
        ("UCX_MODULES", "^ib*".to_string()),
    ];
    if let Some(dir) = libs.parent() {
        env.push(("KVLOOP_NIXL_DIR", dir.display().to_string()));
    }
    env
}

/// Asserts that an NVIDIA GPU is visible (`nvidia-smi -L` lists one).
///
/// # Panics
/// When none is, naming `test`.
pub fn require_gpu(test: &str) {
    let ok = Command::new("nvidia-smi")
        .arg("-L")
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("GPU"));
    assert!(
        ok,
        "{test}: needs an NVIDIA GPU (`nvidia-smi -L` lists none)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ci_is_exactly_true() {
        // Read-only check of the one definition against the current value.
        let v = std::env::var("CI").ok();
        assert_eq!(in_ci(), v.as_deref() == Some("true"));
    }

    #[test]
    #[should_panic(expected = "needs `kvloop-no-such-tool` on PATH")]
    fn a_missing_tool_fails_the_test() {
        require_tool("t", "kvloop-no-such-tool", "none");
    }

    #[test]
    fn nixl_env_points_at_the_plugins() {
        let env = nixl_env(Path::new("/x/nixl/.libs"));
        assert!(env.contains(&("NIXL_PLUGIN_DIR", "/x/nixl/.libs/plugins".into())));
        assert!(env.contains(&("KVLOOP_NIXL_DIR", "/x/nixl".into())));
    }
}
