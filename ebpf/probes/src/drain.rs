//! The thread that drains the programs' ring buffer: decodes each record
//! into an [`Event`] and hands every batch to a sink (the loader's, which
//! buffers them for snapshots and broadcasts them to trace streams).

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use aya::maps::{MapData, RingBuf};

use crate::ProbeError;
use crate::trace::Event;

/// Starts the drain thread: it polls `ring` (woken by the programs once
/// enough bytes are pending, else every [`crate::DRAIN_INTERVAL`]), passes
/// each non-empty batch of decoded events to `sink`, and exits once `stop`
/// is set (within one interval).
///
/// # Errors
/// [`ProbeError::Load`] when the thread cannot be spawned.
pub(crate) fn spawn_drain(
    mut ring: RingBuf<MapData>,
    stop: Arc<AtomicBool>,
    mut sink: impl FnMut(Vec<Event>) + Send + 'static,
) -> Result<JoinHandle<()>, ProbeError> {
    std::thread::Builder::new()
        .name("kvloop-probes-drain".into())
        .spawn(move || {
            let fd = ring.as_raw_fd();
            while !stop.load(Ordering::Relaxed) {
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd. The programs wake us only when
                // WAKEUP_BYTES are pending; the timeout drains the rest.
                unsafe { libc::poll(&mut pfd, 1, crate::DRAIN_INTERVAL.as_millis() as i32) };
                let mut batch = Vec::new();
                while let Some(item) = ring.next() {
                    if let Some(ev) = Event::decode(&item) {
                        batch.push(ev);
                    }
                }
                if !batch.is_empty() {
                    sink(batch);
                }
            }
        })
        .map_err(|e| ProbeError::Load {
            program: "<drain thread>".into(),
            message: e.to_string(),
        })
}
