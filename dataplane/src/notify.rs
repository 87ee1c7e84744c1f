//! Owner notifications (`"<owner request id>:<count>"`) and their tracker;
//! defined in `kvloop-kv-types` and re-exported here.
pub use kvloop_kv_types::notify::*;
