//! KV-cache-aware P/D router, drop-in for vLLM's multi-turn disaggregated proxy
