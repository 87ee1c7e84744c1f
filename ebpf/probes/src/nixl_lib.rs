//! The NIXL library's probed symbols: `nixlAgent::createXferReq`,
//! `postXferReq` and `getXferStatus`, found by prefix in `libnixl.so`.

use std::path::Path;

use crate::ProbeError;

/// Symbol prefixes (Itanium mangling of `nixlAgent::<method>` const member
/// functions) of the NIXL calls probed, with (entry program, return program).
/// Prefixes, not full names, so that argument-type changes between NIXL
/// versions still match; the argument registers used are documented in
/// `ebpf/README.md`.
pub(crate) const NIXL_SYMBOLS: [(&str, &str, &str); 3] = [
    (
        "_ZNK9nixlAgent13createXferReqE",
        "nixl_create_enter",
        "nixl_create_exit",
    ),
    (
        "_ZNK9nixlAgent11postXferReqE",
        "nixl_post_enter",
        "nixl_post_exit",
    ),
    (
        "_ZNK9nixlAgent13getXferStatusE",
        "nixl_status_enter",
        "nixl_status_exit",
    ),
];

/// Finds the full names of the probed NIXL symbols in `lib`'s dynamic symbol
/// table, in [`NIXL_SYMBOLS`] order.
pub(crate) fn nixl_symbols(lib: &Path) -> Result<Vec<String>, ProbeError> {
    use object::{Object, ObjectSymbol};
    let data = std::fs::read(lib).map_err(|e| ProbeError::Invalid {
        field: "lib",
        message: format!("{}: {e}", lib.display()),
    })?;
    let obj = object::File::parse(&*data).map_err(|e| ProbeError::Invalid {
        field: "lib",
        message: format!("{}: not an ELF object: {e}", lib.display()),
    })?;
    let names: Vec<String> = obj
        .dynamic_symbols()
        .chain(obj.symbols())
        .filter(|s| s.is_definition())
        .filter_map(|s| s.name().ok().map(str::to_string))
        .collect();
    NIXL_SYMBOLS
        .iter()
        .map(|(prefix, _, _)| {
            names
                .iter()
                .find(|n| n.starts_with(prefix))
                .cloned()
                .ok_or_else(|| ProbeError::Invalid {
                    field: "lib",
                    message: format!(
                        "{} defines no symbol starting with {prefix} (is it libnixl.so?)",
                        lib.display()
                    ),
                })
        })
        .collect()
}
