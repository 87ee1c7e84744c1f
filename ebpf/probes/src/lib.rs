//! Loader and map readers for kvloop's eBPF probes (user space)
