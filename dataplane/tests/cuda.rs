//! CUDA device-memory regions through both backends. Built with
//! `--features cuda`; the tests are `gpu_*` and `#[ignore]`d: `make test`
//! runs them where `nvidia-smi` lists a GPU and counts them as ignored
//! elsewhere (CI compiles this file with the feature). Without a GPU they fail.
#![cfg(feature = "cuda")]

use kvloop_dataplane::region::{CudaRegion, KvRegion, MemoryKind};

#[test]
#[ignore = "needs a GPU (CUDA driver)"]
fn gpu_cuda_region_registers_as_device_memory() {
    let r = CudaRegion::new(0, 1 << 20).expect("a CUDA device");
    let k = KvRegion::Cuda(r);
    assert_eq!(k.desc().kind, MemoryKind::Cuda { device: 0 });
    assert_eq!(k.len(), 1 << 20);
}
