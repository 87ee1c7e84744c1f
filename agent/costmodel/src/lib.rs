//! Sans-IO transfer/prefill cost model and adaptive recompute threshold
