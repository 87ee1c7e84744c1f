//! Generates kvloop's own libfabric bindings with bindgen against the
//! installed libfabric (1.17 on Debian 12, 2.x from the AWS EFA installer),
//! with C wrappers for the `static inline` data-path calls (`fi_read`,
//! `fi_cq_read`, ...), and compiles the small C helpers in `csrc/`.
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc");
    println!("cargo:rerun-if-changed=build.rs");
    let lib = pkg_config::Config::new()
        .atleast_version("1.17")
        .probe("libfabric")
        .expect(
            "libfabric >= 1.17 not found by pkg-config: install libfabric-dev (Debian) or the \
             AWS EFA installer's libfabric, or run scripts/bootstrap.sh apt",
        );
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let wrap_src = out.join("fabric_static_wrappers");

    let mut builder = bindgen::Builder::default()
        .header("csrc/wrapper.h")
        .clang_arg("-Icsrc")
        .allowlist_function("fi_.*")
        .allowlist_function("kvl_.*")
        .allowlist_type("fi_.*")
        .allowlist_type("fid_.*")
        .allowlist_var("FI_.*")
        .allowlist_var("FI_E.*")
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrap_src)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for p in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", p.display()));
    }
    let bindings = builder
        .generate()
        .expect("bindgen failed on libfabric headers");
    bindings
        .write_to_file(out.join("fabric_bindings.rs"))
        .unwrap();

    let mut cc = cc::Build::new();
    cc.file(wrap_src.with_extension("c"))
        .file("csrc/kvl_helpers.c")
        .include("csrc")
        .include(env::current_dir().unwrap())
        .warnings(false);
    for p in &lib.include_paths {
        cc.include(p);
    }
    cc.compile("kvl_fabric_wrappers");
    for l in &lib.libs {
        println!("cargo:rustc-link-lib={l}");
    }
    for p in &lib.link_paths {
        println!("cargo:rustc-link-search=native={}", p.display());
    }
}
