//! Completion progress: who polls the completion queue.
//!
//! * The task awaiting a READ drives the CQ itself ([`Shared::drive`]) for up
//!   to `caller_spin_us`: its completion is read and resolved on its own
//!   thread, with no handoff to another thread and back. One caller holds the
//!   driver role at a time ([`Shared::drive_begin`]); the others stay parked
//!   and are completed by the driver, or by this thread once the driver
//!   leaves with work in flight ([`Shared::drive_end`]).
//! * The progress thread polls when no caller drives: READs that outlast the
//!   callers' spin, and the serving side of providers that need target
//!   progress (`tcp;ofi_rxm` moves nothing otherwise). While callers drive it
//!   stays off the CQ, waking every `idle_sleep_us` to check.
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::state::{OpCtx, Shared};

/// The progress thread leaves the CQ to callers that polled it this recently.
const DRIVE_DEFER: Duration = Duration::from_micros(100);

impl Shared {
    /// Polls every rail's completion queue once: resolves what completed and posts
    /// queued groups that now fit. Returns the completions read.
    pub(crate) fn reap(&self) -> usize {
        // Consecutive completions of one READ are accounted together (one
        // `pending` lock per run, not per operation); an error flushes.
        let mut run: Option<(u64, usize, u64)> = None;
        let mut n = 0;
        for rail in &self.rails {
            n += rail.ep.poll_cq_with(|(ctx, err)| {
                if ctx.is_null() {
                    return;
                }
                // SAFETY: every context we post is a Box<OpCtx> leaked at post
                // time, and its completion is read exactly once.
                let op = unsafe { Box::from_raw(ctx as *mut OpCtx) };
                rail.outstanding.fetch_sub(1, Ordering::AcqRel);
                self.outstanding.fetch_sub(1, Ordering::AcqRel);
                if err.is_none() {
                    rail.bytes.fetch_add(op.bytes, Ordering::Relaxed);
                }
                match run {
                    Some((id, ref mut ops, ref mut bytes)) if id == op.read_id && err.is_none() => {
                        *ops += 1;
                        *bytes += op.bytes;
                    }
                    _ => {
                        if let Some((id, ops, bytes)) = run.take() {
                            self.finish_ops(id, (ops, bytes), None);
                        }
                        if err.is_some() {
                            self.finish_ops(op.read_id, (1, 0), err);
                        } else {
                            run = Some((op.read_id, 1, op.bytes));
                        }
                    }
                }
            });
        }
        if let Some((id, ops, bytes)) = run {
            self.finish_ops(id, (ops, bytes), None);
        }
        self.pump();
        n
    }

    /// Takes the caller-driver role unless another caller holds it.
    pub(crate) fn drive_begin(&self) -> bool {
        if self.driving.swap(true, Ordering::SeqCst) {
            return false;
        }
        self.last_drive_ns
            .store(self.now_ns().max(1), Ordering::Release);
        true
    }

    /// One caller-driven poll of the CQ (the role's holder only).
    pub(crate) fn drive(&self) {
        self.last_drive_ns
            .store(self.now_ns().max(1), Ordering::Release);
        self.reap();
    }

    /// Gives the role up. With operations still outstanding or queued (the
    /// driver's own READ after its spin, or parked callers' READs) the
    /// progress thread takes the CQ at once instead of deferring.
    pub(crate) fn drive_end(&self) {
        self.driving.store(false, Ordering::SeqCst);
        if self.outstanding.load(Ordering::SeqCst) > 0 || self.queued.load(Ordering::SeqCst) > 0 {
            self.last_drive_ns.store(0, Ordering::Release);
            self.wake();
        }
    }

    /// ns since `epoch`.
    pub(crate) fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Whether a caller drove the CQ within [`DRIVE_DEFER`].
    fn callers_drive(&self) -> bool {
        let last = self.last_drive_ns.load(Ordering::Acquire);
        last != 0 && self.now_ns().saturating_sub(last) < DRIVE_DEFER.as_nanos() as u64
    }
}

/// The progress thread's loop: polls the CQ and resolves READs when no
/// caller does; spins while operations are outstanding or queued, for
/// `spin_us` after activity and while a reader's hint is in force;
/// otherwise parks with a backoff.
pub(crate) fn progress_loop(s: &Shared) {
    let spin = Duration::from_micros(s.cfg.spin_us);
    let min_sleep = Duration::from_micros(s.cfg.idle_sleep_us.max(1));
    let max_sleep = Duration::from_micros(s.cfg.idle_sleep_max_us.max(s.cfg.idle_sleep_us).max(1));
    let mut sleep = min_sleep;
    let mut last_activity = Instant::now();
    while !s.stop.load(Ordering::Acquire) {
        // Stay off the CQ while a caller drives it, and shortly after (the
        // next READ's caller usually takes it again), unless a remote reader
        // hinted: then only while a caller holds it (its polls serve too).
        let serving = s.now_ns() < s.serve_until_ns.load(Ordering::Acquire);
        let defer = s.driving.load(Ordering::Acquire) || (!serving && s.callers_drive());
        if !s.cfg.busy_poll && defer {
            last_activity = Instant::now();
            sleep = min_sleep;
            idle_wait(s.waker, min_sleep);
            continue;
        }
        if s.reap() > 0 {
            last_activity = Instant::now();
            sleep = min_sleep;
            continue;
        }
        if s.outstanding.load(Ordering::Acquire) > 0 || s.queued.load(Ordering::Acquire) > 0 {
            last_activity = Instant::now();
            sleep = min_sleep;
            std::hint::spin_loop();
            continue;
        }
        if s.retired_any.load(Ordering::Acquire) {
            s.reap_retired();
        }
        if s.cfg.busy_poll
            || last_activity.elapsed() < spin
            || s.now_ns() < s.serve_until_ns.load(Ordering::Acquire)
        {
            std::hint::spin_loop();
            continue;
        }
        // Idle. With a CQ wait fd: block in poll(2) on it and on the waker
        // eventfd (posting writes it), so remote READs served from our
        // memory are progressed as soon as they arrive. Without one: wait on
        // the waker (posting writes it), backing off from idle_sleep_us to
        // idle_sleep_max_us; serving-side progress happens on each wake-up.
        // (One rail only: several rails would need every CQ's fd.)
        if let Some(fd) = s.ep().wait_fd.filter(|_| s.rails.len() == 1) {
            if s.ep().try_wait() {
                let mut fds = [
                    libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: s.waker,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                ];
                // SAFETY: polling two open fds through a live array of two
                // pollfds; bounded timeout so `stop` is seen.
                unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
                if fds[1].revents != 0 {
                    let mut v: u64 = 0;
                    // SAFETY: `waker` is our open eventfd; reading 8 bytes into a live u64.
                    unsafe { libc::read(s.waker, &mut v as *mut u64 as *mut c_void, 8) };
                }
                last_activity = Instant::now();
            }
            continue;
        }
        idle_wait(s.waker, sleep);
        if last_activity.elapsed() > Duration::from_millis(10) {
            sleep = (sleep * 2).min(max_sleep);
        }
    }
}

/// Waits up to `timeout` for the waker eventfd, then drains it.
///
/// A relative `ppoll(2)` timeout, not `std::thread::park_timeout`: std's timed
/// waits hand the kernel an absolute `CLOCK_MONOTONIC` deadline computed in
/// user space, so a process whose user-space monotonic clock is offset (under
/// libfaketime, which fakes `clock_gettime(CLOCK_MONOTONIC)` but not the
/// kernel's clock) would sleep for the offset instead of `timeout`, and serve
/// remote READs only when a hint wakes it (test: `reads_do_not_depend_on_the_owners_monotonic_clock`
/// in `tests/tests/dataplane_e2e.rs`).
fn idle_wait(waker: i32, timeout: Duration) {
    let mut fds = [libc::pollfd {
        fd: waker,
        events: libc::POLLIN,
        revents: 0,
    }];
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one open fd in a live array of one pollfd; `ts` lives for the
    // call; a null signal mask leaves the mask unchanged.
    let n = unsafe { libc::ppoll(fds.as_mut_ptr(), 1, &ts, std::ptr::null()) };
    if n > 0 && fds[0].revents != 0 {
        let mut v: u64 = 0;
        // SAFETY: `waker` is our open non-blocking eventfd; reading 8 bytes
        // into a live u64.
        unsafe { libc::read(waker, &mut v as *mut u64 as *mut c_void, 8) };
    }
}
