//! vLLM-protocol engine simulator (P or D role) for tests and the demo
