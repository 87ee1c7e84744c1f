//! One error type for the dataplane, recording where a failure came from and
//! whether retrying the same READ is safe (in the style of pingora's errors).
//! Defined in `kvloop-kv-types` (so that light crates can name it) and
//! re-exported here.
pub use kvloop_kv_types::error::*;
