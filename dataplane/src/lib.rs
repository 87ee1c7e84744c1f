//! KV-cache block transfer engine: memory regions, layouts, READs over libfabric and NIXL
