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

/// Set in the child that exports a CUDA IPC handle (a process cannot open
/// a handle it exported itself).
const CHILD_ENV: &str = "KVLOOP_CUDA_IPC_CHILD";
const IPC_LEN: usize = 1 << 20;

fn pattern() -> Vec<u8> {
    (0..IPC_LEN).map(|i| (i * 31 % 251) as u8).collect()
}

/// The child: 1 MiB of device memory filled with `pattern()`, its IPC
/// handle printed as `HANDLE <hex>`, kept alive until stdin closes.
fn export_child() {
    use cudarc::driver::{DevicePtr, sys};
    use std::io::Read;
    let ctx = cudarc::driver::CudaContext::new(0).expect("a CUDA device");
    let stream = ctx.default_stream();
    let buf = stream.memcpy_stod(&pattern()).expect("device copy");
    stream.synchronize().expect("synchronize");
    let (ptr, _sync) = buf.device_ptr(&stream);
    // SAFETY: all-zero bytes are a valid CUipcMemHandle, filled by the call.
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer and a live allocation of this context.
    let r = unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuIpcGetMemHandle");
    let hex: String = h
        .reserved
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect();
    println!("HANDLE {hex}");
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop(_sync);
    drop(buf);
}

#[test]
#[ignore = "needs a GPU (CUDA driver)"]
fn gpu_ipc_region_opens_another_process_memory() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    if std::env::var_os(CHILD_ENV).is_some() {
        return export_child();
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "gpu_ipc_region_opens_another_process_memory",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let hex = out
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("HANDLE ").map(str::to_string))
        .expect("the child prints its handle");
    let mut handle = [0u8; 64];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let r = CudaRegion::from_ipc(0, &handle, IPC_LEN).expect("the handle opens");
    assert!(r.is_ipc());
    let mut host = vec![0u8; IPC_LEN];
    // SAFETY: `host` is IPC_LEN writable bytes; the region maps IPC_LEN
    // device bytes in the current context (bound by from_ipc).
    let rc = unsafe {
        cudarc::driver::sys::cuMemcpyDtoH_v2(
            host.as_mut_ptr().cast(),
            r.device_ptr() as cudarc::driver::sys::CUdeviceptr,
            IPC_LEN,
        )
    };
    assert_eq!(rc, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    assert!(
        host == pattern(),
        "the other process's bytes, through the mapping"
    );
    let k = KvRegion::Cuda(r);
    assert_eq!(k.desc().kind, MemoryKind::Cuda { device: 0 });
    drop(k); // closes the mapping before the owner frees its memory
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}
