//! CUDA device-memory regions through both backends. Runs only with
//! `--features cuda` and `KVLOOP_GPU_TESTS=1` on a machine with a GPU (none
//! exists on the CI machines; CI compiles this file with the feature).
#![cfg(feature = "cuda")]

use kvloop_dataplane::region::{CudaRegion, KvRegion, MemoryKind};

#[test]
fn cuda_region_registers_as_device_memory() {
    if std::env::var("KVLOOP_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("KVLOOP_GPU_TESTS!=1: GPU test not requested (no GPU on this machine)");
        return;
    }
    let r = CudaRegion::new(0, 1 << 20).expect("a CUDA device");
    let k = KvRegion::Cuda(r);
    assert_eq!(k.desc().kind, MemoryKind::Cuda { device: 0 });
    assert_eq!(k.len(), 1 << 20);
}
