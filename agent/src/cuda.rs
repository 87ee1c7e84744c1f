//! CUDA IPC handle registration (GPU KV memory of an engine, managed mode).
//!
//! An engine registers its GPU KV regions as CUDA IPC handles
//! ([`kvloop_agent_api::proto::RegionSource::CudaIpc`]); with feature
//! `cuda`, [`open_regions`] opens each with cudarc
//! (`kvloop_dataplane::region::CudaRegion::from_ipc`, driver loaded at run
//! time) and the transfer engine registers them as device memory
//! (libfabric `FI_HMEM_CUDA` with the device ordinal, NIXL `VRAM`); READs go
//! into and out of them like host regions. Without the feature the
//! registration is refused with [`unsupported_message`]. Exercised only
//! where a GPU exists (`agent/tests/cuda.rs`, `gpu_*`).
use kvloop_agent_api::proto::CudaIpcRegion;
use kvloop_dataplane::region::KvRegion;

/// Why a CUDA IPC registration is refused in a build without feature `cuda`.
pub fn unsupported_message() -> String {
    "regions: cuda_ipc needs kvloop-agent built with feature `cuda` (and a GPU); register \
     host memory with kind = \"memfd\""
        .into()
}

/// Opens an engine's GPU regions from their IPC handles, one per layout
/// region (`num_regions`), in layout order.
///
/// # Errors
/// A message naming the bad field: `regions.regions` (count),
/// `regions.regions[i].handle_hex`, or the driver's refusal of region `i`;
/// without feature `cuda`, [`unsupported_message`].
pub fn open_regions(regions: &[CudaIpcRegion], num_regions: u32) -> Result<Vec<KvRegion>, String> {
    if regions.len() != num_regions as usize {
        return Err(format!(
            "regions.regions: expected {num_regions} (layout.num_regions), got {}",
            regions.len()
        ));
    }
    let mut handles = Vec::with_capacity(regions.len());
    for (i, r) in regions.iter().enumerate() {
        handles
            .push(decode_handle(&r.handle_hex).map_err(|e| format!("regions.regions[{i}].{e}"))?);
    }
    open(regions, &handles)
}

#[cfg(feature = "cuda")]
fn open(regions: &[CudaIpcRegion], handles: &[[u8; 64]]) -> Result<Vec<KvRegion>, String> {
    use kvloop_dataplane::region::CudaRegion;
    regions
        .iter()
        .zip(handles)
        .enumerate()
        .map(|(i, (r, h))| {
            let len = usize::try_from(r.len_bytes)
                .map_err(|_| format!("regions.regions[{i}].len_bytes: too large"))?;
            CudaRegion::from_ipc(r.device, h, len)
                .map(KvRegion::Cuda)
                .map_err(|e| format!("regions.regions[{i}]: {e}"))
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn open(_: &[CudaIpcRegion], _: &[[u8; 64]]) -> Result<Vec<KvRegion>, String> {
    Err(unsupported_message())
}

/// Decodes a hex `cudaIpcMemHandle_t` (64 bytes).
///
/// # Errors
/// A message naming `handle_hex` when it is not 128 hex digits.
pub fn decode_handle(hex: &str) -> Result<[u8; 64], String> {
    if hex.len() != 128 {
        return Err(format!(
            "handle_hex: expected 128 hex digits (64 bytes), got {} characters",
            hex.len()
        ));
    }
    let mut out = [0u8; 64];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|_| format!("handle_hex: non-hex digits at byte {i}"))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn region_count_and_handles_are_checked_first() {
        let r = |hex: &str| kvloop_agent_api::proto::CudaIpcRegion {
            device: 0,
            handle_hex: hex.into(),
            len_bytes: 4096,
        };
        let e = super::open_regions(&[r(&"ab".repeat(64))], 2)
            .err()
            .unwrap();
        assert!(e.starts_with("regions.regions: expected 2"), "{e}");
        let e = super::open_regions(&[r("zz")], 1).err().unwrap();
        assert!(e.starts_with("regions.regions[0].handle_hex"), "{e}");
    }

    #[test]
    fn handle_hex_is_checked() {
        let ok = "ab".repeat(64);
        assert_eq!(super::decode_handle(&ok).unwrap()[63], 0xab);
        assert!(
            super::decode_handle("ab")
                .unwrap_err()
                .contains("handle_hex")
        );
        assert!(super::decode_handle(&"zz".repeat(64)).is_err());
    }
}
