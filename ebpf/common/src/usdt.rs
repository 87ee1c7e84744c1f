//! USDT-style probe sites of the kvloop dataplane (user space only).
//!
//! The dataplane calls [`read_post`] when it posts a READ and [`read_done`]
//! when the READ completes (successfully or not). Each calls an exported,
//! never-inlined function whose first instruction on x86-64 is a 5-byte NOP
//! (`nopl 0x0(%rax,%rax,1)`, bytes `0f 1f 44 00 00`):
//!
//! | symbol | arg0 (`rdi` / `x0`) | arg1 (`rsi` / `x1`) |
//! |---|---|---|
//! | `kvloop_probe_read_post` | `*const ReadProbeArgs`, `status` = 0 | `xfer_id` (u64) |
//! | `kvloop_probe_read_done` | `*const ReadProbeArgs`, `status` set | `xfer_id` (u64) |
//!
//! `xfer_id` is passed in a register as well so that the post probe reads no
//! user memory (a `bpf_probe_read_user` costs ~150 ns on this VM).
//!
//! A uprobe placed on a 5-byte NOP is turned by the kernel into a trampoline
//! call instead of a single-step trap: about 0.7 µs per hit on this VM instead
//! of about 10 µs for an ordinary function entry (measured, see
//! `docs/recipes.md`). With no probe attached a call costs a few ns.
//!
//! Contract: one READ is one `read_post` and one `read_done` with the same
//! `xfer_id`, in the same process. The eBPF side pairs them by
//! `(tgid, xfer_id)`.
//!
//! `bpftrace` users:
//! `bpftrace -e 'uprobe:/path/to/bin:kvloop_probe_read_done { printf("%d\n", *(uint64*)(arg0+8)); }'`
//! (offsets in [`ReadProbeArgs`]).

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::ReadProbeArgs;

/// The agent's default of [`set_site_sampling`]'s `every` (its
/// `read_site_sample_every`): one small READ in 32 is probed. At 1 in 16 the
/// sites accounted 1.3 % of a 64 KiB `shm` READ's CPU (two traps and the
/// programs, ≈ 2 µs per probed READ: `probe_cost`, 2026-12-05, issue 14's
/// target is 1 %); 1 in 32 halves it. A process that never calls
/// [`set_site_sampling`] probes every READ.
pub const DEFAULT_SITE_SAMPLE_EVERY: u32 = 32;
/// The agent's default of [`set_site_sampling`]'s `full_bytes`: READs of 1 MiB or more
/// are always probed. A probed READ costs about 1.5 µs of CPU (two uprobe
/// hits, `cargo bench -p kvloop-probes --bench probe_cost`): under 1 % of a
/// 1 MiB READ's CPU on every backend measured here, but 10–35 % of a 64 KiB
/// READ's on `shm`, hence the sampling below it.
pub const DEFAULT_SITE_FULL_BYTES: u64 = 1 << 20;

static SAMPLE_EVERY: AtomicU32 = AtomicU32::new(1);
static FULL_BYTES: AtomicU64 = AtomicU64::new(DEFAULT_SITE_FULL_BYTES);
static SMALL_READS: AtomicU64 = AtomicU64::new(0);

/// Sets which READs this process probes at its sites: every READ of at
/// least `full_bytes`, and one in `every` of the smaller ones (that one
/// carrying weight `every`, so the histograms still count every READ).
/// `every` 1 (or 0) probes every READ.
pub fn set_site_sampling(every: u32, full_bytes: u64) {
    SAMPLE_EVERY.store(every.max(1), Ordering::Relaxed);
    FULL_BYTES.store(full_bytes, Ordering::Relaxed);
}

/// The weight to probe a READ of `bytes` with, under this process's
/// sampling ([`set_site_sampling`]); `None`: do not call the sites for it.
pub fn site_weight(bytes: u64) -> Option<u32> {
    let every = SAMPLE_EVERY.load(Ordering::Relaxed);
    let full = FULL_BYTES.load(Ordering::Relaxed);
    if bytes >= full || every <= 1 {
        return Some(1);
    }
    let n = SMALL_READS.fetch_add(1, Ordering::Relaxed);
    sample_weight(n, bytes, every, full)
}

/// The sampling rule, pure: the `n`-th small READ (counting from 0) of
/// `bytes` is probed with weight `every` when `n` is a multiple of `every`;
/// READs of at least `full_bytes`, or every READ when `every` ≤ 1, with
/// weight 1.
pub fn sample_weight(n: u64, bytes: u64, every: u32, full_bytes: u64) -> Option<u32> {
    if bytes >= full_bytes || every <= 1 {
        Some(1)
    } else if n.is_multiple_of(every as u64) {
        Some(every)
    } else {
        None
    }
}

/// Probe site called when a READ is posted. `args.status` is 0.
///
/// Cost without a probe attached: one call + NOP + return.
#[inline(always)]
pub fn read_post(args: &ReadProbeArgs) {
    let p: *const ReadProbeArgs = core::hint::black_box(args);
    // SAFETY: the site reads nothing; a probe attached to it reads the
    // pointed-to struct (valid for the duration of the call).
    unsafe { kvloop_probe_read_post(p, args.xfer_id) }
}

/// Probe site called when a READ completes; `args.status` carries the result
/// (see [`crate::status`]) and `xfer_id` is the one passed to [`read_post`].
#[inline(always)]
pub fn read_done(args: &ReadProbeArgs) {
    let p: *const ReadProbeArgs = core::hint::black_box(args);
    // SAFETY: as in `read_post`.
    unsafe { kvloop_probe_read_done(p, args.xfer_id) }
}

/// Bytes of the 5-byte NOP that starts each probe site on x86-64.
pub const NOP5: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];

/// Names of the probe-site symbols, in the order (post, done).
pub const SYMBOLS: [&str; 2] = ["kvloop_probe_read_post", "kvloop_probe_read_done"];

#[cfg(target_arch = "x86_64")]
mod site {
    use crate::ReadProbeArgs;

    /// READ-post probe site: `nopl 0x0(%rax,%rax,1); ret`.
    ///
    /// # Safety
    /// Always safe to call; it does nothing. Marked unsafe only because it is
    /// a naked `extern "C"` symbol.
    #[unsafe(naked)]
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn kvloop_probe_read_post(_args: *const ReadProbeArgs, _xfer_id: u64) {
        core::arch::naked_asm!(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00", "ret")
    }

    /// READ-done probe site: `nopl 0x0(%rax,%rax,1); ret`.
    ///
    /// # Safety
    /// Always safe to call; it does nothing.
    #[unsafe(naked)]
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn kvloop_probe_read_done(_args: *const ReadProbeArgs, _xfer_id: u64) {
        core::arch::naked_asm!(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00", "ret")
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod site {
    use crate::ReadProbeArgs;

    /// READ-post probe site (plain never-inlined function on this arch).
    ///
    /// # Safety
    /// Always safe to call; it does nothing.
    #[inline(never)]
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn kvloop_probe_read_post(args: *const ReadProbeArgs, xfer_id: u64) {
        core::hint::black_box((args, xfer_id));
    }

    /// READ-done probe site (plain never-inlined function on this arch).
    ///
    /// # Safety
    /// Always safe to call; it does nothing.
    #[inline(never)]
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn kvloop_probe_read_done(args: *const ReadProbeArgs, xfer_id: u64) {
        core::hint::black_box((args, xfer_id));
    }
}

pub use site::{kvloop_probe_read_done, kvloop_probe_read_post};

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    #[test]
    fn small_reads_are_sampled_with_their_weight() {
        let probed: std::vec::Vec<_> = (0..48)
            .filter_map(|n| sample_weight(n, 65536, 16, 1 << 20))
            .collect();
        assert_eq!(probed, [16, 16, 16]);
        // large READs, and every = 1, are always probed with weight 1
        assert!((0..5).all(|n| sample_weight(n, 1 << 20, 16, 1 << 20) == Some(1)));
        assert!((0..5).all(|n| sample_weight(n, 4096, 1, 1 << 20) == Some(1)));
        assert!((0..5).all(|n| sample_weight(n, 4096, 0, 1 << 20) == Some(1)));
    }

    #[test]
    fn sites_are_callable() {
        let mut a = ReadProbeArgs {
            xfer_id: 7,
            bytes: 4096,
            descriptors: 1,
            direction: crate::Direction::PrefillToDecode as u8,
            backend: crate::BackendKind::Nixl as u8,
            status: 0,
            peer: ReadProbeArgs::peer_from_str("decode-0"),
            weight: 1,
            _pad: [0; 4],
        };
        read_post(&a);
        a.status = crate::status::OK;
        read_done(&a);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn sites_start_with_nop5() {
        let f = kvloop_probe_read_post as *const u8;
        let g = kvloop_probe_read_done as *const u8;
        // SAFETY: reading the first 5 bytes of our own function's code.
        unsafe {
            assert_eq!(core::slice::from_raw_parts(f, 5), &NOP5);
            assert_eq!(core::slice::from_raw_parts(g, 5), &NOP5);
        }
    }
}
