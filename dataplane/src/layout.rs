//! KV layouts, block pairs and coalescing into segments; defined in
//! `kvloop-kv-types` and re-exported here.
pub use kvloop_kv_types::layout::*;
