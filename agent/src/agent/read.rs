//! The managed READ pipeline: connecting a hosted engine to a peer's side
//! channel, the checked READ (lease renewal at the owner, coverage, timing),
//! pull outcomes per pair, and the mapping of dataplane errors to the local
//! API's typed errors.
use super::*;
use kvloop_router_api::PullNotice;

/// Counts a READ in `kvloop_agent_reads_in_flight` until dropped (also
/// when the caller's future is cancelled mid-READ).
struct InFlight<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> InFlight<'a> {
    fn enter(g: &'a prometheus_client::metrics::gauge::Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A managed READ that may be cut on its progress ([`Agent::watch_read`]
/// with a watch): its completed bytes, its size and the predicted
/// recompute of its blocks, ms.
struct ProgressWatch {
    progress: Arc<kvloop_dataplane::backend::ReadProgress>,
    bytes: u64,
    recompute_ms: Option<f64>,
}

/// A READ cut on its progress.
struct Cut {
    after_ms: f64,
    done_fraction: f64,
}

/// How a managed READ failed.
enum ReadFailure {
    /// Abandoned after `after_ms` (cut on its progress, `done` of it
    /// completed, or timed out at its deadline): the engine recomputes.
    Abandoned { after_ms: u64, done: Option<f64> },
    /// Any other dataplane failure.
    Error(kvloop_dataplane::DataplaneError),
}

impl Agent {
    /// Connects a hosted engine to a remote engine.
    ///
    /// # Errors
    /// `unknown_engine`, `dataplane`.
    pub async fn connect(&self, engine_id: &str, remote: SocketAddr) -> Result<String, ApiError> {
        let e = self.engine(engine_id)?;
        let md = e.connect(remote).await.map_err(|e| dataplane_error(&e))?;
        Ok(md.engine_id)
    }

    /// A managed READ (see [`crate::proto::Request::Read`]).
    ///
    /// # Errors
    /// `unknown_engine`, `bad_request`, `lease`, `dataplane`.
    #[allow(clippy::too_many_arguments)]
    pub async fn read(
        &self,
        engine_id: &str,
        peer_engine_id: &str,
        blocks: Vec<kvloop_dataplane::BlockPair>,
        direction: ReadDirection,
        notify: Option<kvloop_dataplane::OwnerNotify>,
        check_lease: bool,
        timeout_ms: Option<u64>,
    ) -> Result<ReadOutcome, ApiError> {
        let e = self.engine(engine_id)?;
        let dir_label = match direction {
            ReadDirection::D2p => "d2p",
            ReadDirection::P2d => "p2d",
        };
        if check_lease {
            let req = notify.as_ref().ok_or_else(|| {
                ApiError::new(
                    ErrorKind::BadRequest,
                    "notify: check_lease needs notify.owner_request_id (the owner's request)",
                )
            })?;
            let lease_ms = self.cfg.lease.max_lease_ms;
            let checked = self
                .renew(peer_engine_id, &req.owner_request_id, lease_ms)
                .await
                .and_then(|lease| lease_covers(&lease, &blocks));
            if let Err(err) = checked {
                self.metrics
                    .reads
                    .get_or_create(&labels(&[("direction", dir_label), ("result", "declined")]))
                    .inc();
                self.record_pull(engine_id, peer_engine_id, PullOutcome::Declined(err.kind));
                self.notice_pull_ended(
                    (engine_id, peer_engine_id, &req.owner_request_id),
                    0,
                    "declined",
                );
                return Err(err);
            }
        }
        let in_flight = InFlight::enter(&self.metrics.reads_in_flight);
        let started = std::time::Instant::now();
        let peer = self.peer_of_engine(peer_engine_id);
        let n_blocks = blocks.len();
        let (bytes, descriptors) = read_size(e.layout(), n_blocks);
        let limit_ms = timeout_ms.unwrap_or(self.cfg.read_timeout_ms);
        let (predicted_ms, abandon_ms, recompute_ms) = match &peer {
            Some(p) => {
                let tokens = n_blocks as u64 * u64::from(e.layout().block_size_tokens);
                self.predict_managed_read(engine_id, p, bytes, descriptors, tokens)
            }
            None => (None, None, None),
        };
        let abandon_ms = abandon_ms.filter(|a| *a < limit_ms);
        let req = ReadRequest {
            peer_engine_id: peer_engine_id.to_string(),
            blocks,
            direction: direction.to_dataplane(),
            notify,
            timeout_ms: Some(abandon_ms.unwrap_or(limit_ms)),
        };
        // Watched only where it may be abandoned (a deadline below the
        // request's timeout).
        let watch = abandon_ms.map(|_| ProgressWatch {
            progress: Arc::default(),
            bytes,
            recompute_ms,
        });
        let progress = watch.as_ref().map(|w| w.progress.clone());
        let r = self
            .watch(
                peer.as_deref(),
                (bytes, descriptors),
                predicted_ms,
                SampleSource::Userspace,
                watch.as_ref(),
                e.read_with_progress(&req, progress),
            )
            .await;
        drop(in_flight);
        // Abandoned: cut on its progress, or timed out at its deadline
        // (ms, and the share done when cut).
        let r = match (r, abandon_ms) {
            (Ok(Ok(o)), _) => Ok(o),
            (Ok(Err(kvloop_dataplane::DataplaneError::Timeout { .. })), Some(after_ms)) => {
                Err(ReadFailure::Abandoned {
                    after_ms,
                    done: None,
                })
            }
            (Ok(Err(err)), _) => Err(ReadFailure::Error(err)),
            (Err(cut), _) => Err(ReadFailure::Abandoned {
                after_ms: cut.after_ms.ceil() as u64,
                done: Some(cut.done_fraction),
            }),
        };
        match r {
            Ok(o) => {
                self.metrics
                    .reads
                    .get_or_create(&labels(&[("direction", dir_label), ("result", "ok")]))
                    .inc();
                self.record_pull(engine_id, peer_engine_id, PullOutcome::Read);
                self.metrics
                    .read_bytes
                    .get_or_create(&labels(&[("direction", dir_label)]))
                    .inc_by(o.bytes);
                if !self.reads_timed_in_kernel {
                    self.observe_read_userspace(peer_engine_id, direction, &o);
                }
                if let Some(peer) = &peer {
                    self.record_own_read(peer, &o, SampleSource::Userspace);
                }
                if let (Some(n), ReadDirection::D2p) = (&req.notify, direction) {
                    self.notice_pull_ended(
                        (engine_id, peer_engine_id, &n.owner_request_id),
                        started.elapsed().as_millis() as u64,
                        PullNotice::READ,
                    );
                }
                Ok(o)
            }
            Err(failed) => {
                if let Some(n) = &req.notify {
                    let (after_ms, cause) = match &failed {
                        ReadFailure::Abandoned { after_ms, .. } => (*after_ms, "abandoned"),
                        ReadFailure::Error(_) => (started.elapsed().as_millis() as u64, "failed"),
                    };
                    self.notice_pull_ended(
                        (engine_id, peer_engine_id, &n.owner_request_id),
                        after_ms,
                        cause,
                    );
                }
                let (result, outcome, err) = match failed {
                    // The engine recomputes.
                    ReadFailure::Abandoned { after_ms: ms, done } => {
                        match done {
                            Some(f) => tracing::info!(
                                engine = engine_id,
                                peer = peer_engine_id,
                                blocks = n_blocks,
                                after_ms = ms,
                                done_percent = f * 100.0,
                                "READ abandoned early: at its rate so far, the rest would take longer than recomputing its blocks"
                            ),
                            None => tracing::info!(
                                engine = engine_id,
                                peer = peer_engine_id,
                                blocks = n_blocks,
                                after_ms = ms,
                                "READ abandoned: recomputing its blocks would have finished by now"
                            ),
                        }
                        let err = ApiError::new(
                            ErrorKind::Timeout,
                            format!(
                                "READ of {n_blocks} blocks from `{peer_engine_id}` abandoned after {ms} ms: \
                                 recomputing them is predicted to be faster (the engine recomputes)"
                            ),
                        )
                        .with_origin(ErrorOrigin::Local);
                        ("abandoned", PullOutcome::Abandoned, err)
                    }
                    ReadFailure::Error(err) => {
                        let err = dataplane_error(&err);
                        ("error", PullOutcome::Failed(err.kind), err)
                    }
                };
                self.metrics
                    .reads
                    .get_or_create(&labels(&[("direction", dir_label), ("result", result)]))
                    .inc();
                self.record_pull(engine_id, peer_engine_id, outcome);
                Err(err)
            }
        }
    }

    /// Queues for the routers ([`crate::tasks::notices`]) that the READ of
    /// `(reader engine, owner engine, owner's request id)` ended after
    /// `after_ms`: with the blocks (`cause` [`PullNotice::READ`]: the
    /// engine queues the turn's suffix now), or without them (`abandoned`,
    /// `failed`, `declined`: the engine recomputes the whole prompt). The
    /// router that sent the turn counts P's line from now instead of
    /// guessing until P answers. Not queued without routers; dropped when
    /// the queue is full.
    fn notice_pull_ended(
        &self,
        (reader, owner, request): (&str, &str, &str),
        after_ms: u64,
        cause: &str,
    ) {
        if self.cfg.routers.is_empty() {
            return;
        }
        let n = PullNotice {
            agent_id: self.cfg.agent_id.clone(),
            prefill_engine_id: reader.to_string(),
            decode_engine_id: owner.to_string(),
            decode_request_id: request.to_string(),
            after_ms,
            cause: cause.to_string(),
        };
        if self.pull_notices.try_send(n).is_err() {
            tracing::debug!("pull notice queue full; notice dropped");
        }
    }

    /// Counts a pull of `owner`'s blocks by `reader` and raises or clears
    /// the pair's alarm (`kvloop_agent_pull_alarm`, a warning when raised).
    pub(super) fn record_pull(&self, reader: &str, owner: &str, outcome: PullOutcome) {
        self.metrics
            .pulls
            .get_or_create(&labels(&[
                ("reader", reader),
                ("owner", owner),
                ("result", outcome.result_label()),
                ("reason", outcome.reason_label()),
            ]))
            .inc();
        let change = self.pulls.lock().record(reader, owner, outcome);
        let alarm = self
            .metrics
            .pull_alarm
            .get_or_create(&labels(&[("reader", reader), ("owner", owner)]));
        match change {
            AlarmChange::Raised(n) => {
                alarm.set(1);
                tracing::warn!(reader, owner, unread = n, last = ?outcome,
                               "pulls of this pair keep failing: every turn recomputes");
            }
            AlarmChange::Cleared => {
                alarm.set(0);
                tracing::info!(reader, owner, "pulls of this pair read again");
            }
            AlarmChange::Unchanged => {}
        }
    }

    /// Records a READ this agent made from `peer` in the cost model. Where
    /// the eBPF probes are loaded the kernel timing of the same READ is used
    /// instead ([`crate::tasks`] drains it), so user-space timing is only
    /// recorded in fallback mode; active probes are always recorded as such.
    pub fn record_own_read(&self, peer: &str, o: &ReadOutcome, source: SampleSource) {
        if source == SampleSource::Userspace && self.reads_timed_in_kernel {
            return;
        }
        let s = TransferSample {
            at: self.now(),
            bytes: o.bytes,
            descriptors: o.descriptors as u64,
            latency: Duration::from_micros(o.elapsed_us.max(1)),
            source,
        };
        if let Err(e) = self.model_transfer(peer, CmDirection::Inbound, s) {
            tracing::debug!(error = %e, "transfer sample rejected");
        }
    }

    /// Runs `read`, a READ of `bytes` in `descriptors` from `peer` that the
    /// path model predicts at `predicted_ms`, and while it is in flight past
    /// that prediction records it in the model as taking at least as long
    /// as it has so far, at each mark of [`crate::overdue::marks_ms`]
    /// (`kvloop_agent_reads_overdue_total`), with the READ's own `source`
    /// (a probe's lower bound is an active-probe sample). A READ that ends
    /// at a mark (an abandoned one's deadline may fall on the first) is
    /// recorded at it too: which of the two timers fires first is chance.
    /// Without a peer or a prediction it only runs `read`.
    pub async fn watch_read<T>(
        &self,
        peer: Option<&str>,
        size: (u64, u64),
        predicted_ms: Option<f64>,
        source: SampleSource,
        read: impl std::future::Future<Output = T>,
    ) -> T {
        match self
            .watch(peer, size, predicted_ms, source, None, read)
            .await
        {
            Ok(r) => r,
            Err(_) => unreachable!("a READ without a progress watch is never cut"),
        }
    }

    /// [`Agent::watch_read`], and with `cut` also checks the READ's
    /// progress from its first overdue mark on, every quarter of that mark
    /// (at least 10 ms): once, at its rate so far, the rest would outlast
    /// recomputing its blocks
    /// ([`kvloop_router_api::abandon::abandon_on_progress`]), it drops
    /// `read` (the dataplane abandons the READ, its blocks quarantined
    /// until the backend is done with them) and answers [`Cut`]. Bounded
    /// by the READ's own timeout (the ski-rental deadline).
    async fn watch<T>(
        &self,
        peer: Option<&str>,
        (bytes, descriptors): (u64, u64),
        predicted_ms: Option<f64>,
        source: SampleSource,
        cut: Option<&ProgressWatch>,
        read: impl std::future::Future<Output = T>,
    ) -> Result<T, Cut> {
        let marks = crate::overdue::marks_ms(predicted_ms);
        let Some(peer) = peer.filter(|_| !marks.is_empty()) else {
            return Ok(read.await);
        };
        tokio::pin!(read);
        let start = tokio::time::Instant::now();
        let step_ms = (marks[0] / 4.0).max(10.0);
        let (mut next_mark, mut next_check_ms) = (0, marks[0]);
        loop {
            let mark_ms = marks.get(next_mark).copied();
            let check_ms = cut.map(|_| next_check_ms);
            let Some(at_ms) = mark_ms.into_iter().chain(check_ms).reduce(f64::min) else {
                return Ok(read.await);
            };
            let at = start + Duration::from_secs_f64(at_ms / 1e3);
            tokio::select! {
                r = &mut read => {
                    // Ended (or was abandoned, whose deadline is never
                    // before the first mark) at the mark it raced: it was
                    // in flight that long.
                    if mark_ms == Some(at_ms) && tokio::time::Instant::now() >= at {
                        self.record_overdue(peer, bytes, descriptors, start.elapsed(), source);
                    }
                    return Ok(r);
                }
                _ = tokio::time::sleep_until(at) => {
                    let elapsed = start.elapsed();
                    if mark_ms == Some(at_ms) {
                        self.record_overdue(peer, bytes, descriptors, elapsed, source);
                        next_mark += 1;
                    }
                    if let Some(w) = cut.filter(|_| check_ms == Some(at_ms)) {
                        let elapsed_ms = elapsed.as_secs_f64() * 1e3;
                        let f = w.progress.done_bytes() as f64 / w.bytes.max(1) as f64;
                        tracing::debug!(elapsed_ms, done_fraction = f, "overdue READ's progress");
                        if kvloop_router_api::abandon::abandon_on_progress(
                            predicted_ms,
                            w.recompute_ms,
                            elapsed_ms,
                            f,
                        ) {
                            return Err(Cut { after_ms: elapsed_ms, done_fraction: f });
                        }
                        next_check_ms += step_ms;
                    }
                }
            }
        }
    }

    /// A READ from `peer` in flight for `elapsed`: a lower-bound sample of
    /// the inbound path (see [`crate::overdue`]).
    fn record_overdue(
        &self,
        peer: &str,
        bytes: u64,
        descriptors: u64,
        elapsed: Duration,
        source: SampleSource,
    ) {
        self.metrics
            .reads_overdue
            .get_or_create(&labels(&[("peer", peer)]))
            .inc();
        let s = TransferSample {
            at: self.now(),
            bytes,
            descriptors,
            latency: elapsed.max(Duration::from_micros(1)),
            source,
        };
        if let Err(e) = self.model_transfer(peer, CmDirection::Inbound, s) {
            tracing::debug!(error = %e, "overdue sample rejected");
        }
    }

    /// The inbound path model's prediction for a managed READ of `bytes` in
    /// `descriptors` holding `tokens` tokens, by hosted engine `engine_id`
    /// from `peer`, ms, and when to abandon it, ms after it begins
    /// ([`crate::overdue::abandon_after_ms`] of that prediction and the
    /// engine's recompute of those tokens; `None` when
    /// `abandon_slow_reads` is off or either model has no fit), and that
    /// recompute, ms (`None` without a prefill fit). One lock of the model.
    fn predict_managed_read(
        &self,
        engine_id: &str,
        peer: &str,
        bytes: u64,
        descriptors: u64,
        tokens: u64,
    ) -> (Option<f64>, Option<u64>, Option<f64>) {
        let model = self.model.lock();
        let predicted = model
            .transfer_coefficients(peer, CmDirection::Inbound)
            .map(|c| c.predict_ms(bytes, descriptors));
        let recompute = model
            .prefill_coefficients(engine_id)
            .map(|c| c.recompute_ms(tokens as f64));
        let abandon = self.cfg.abandon_slow_reads.then(|| {
            crate::overdue::abandon_after_ms(predicted, recompute).map(|ms| ms.ceil() as u64)
        });
        (predicted, abandon.flatten(), recompute)
    }

    /// The inbound path model's prediction for a READ of `bytes` in
    /// `descriptors` from `peer`, ms (`None` before a fit).
    pub fn predict_read_ms(&self, peer: &str, bytes: u64, descriptors: u64) -> Option<f64> {
        self.model
            .lock()
            .transfer_coefficients(peer, CmDirection::Inbound)
            .map(|c| c.predict_ms(bytes, descriptors))
    }

    /// Feeds a READ timed in user space to the probes' transfer histograms
    /// (`source="userspace"`), where the kernel does not time this agent's
    /// READs.
    pub(super) fn observe_read_userspace(
        &self,
        peer_engine_id: &str,
        direction: ReadDirection,
        o: &ReadOutcome,
    ) {
        let args = kvloop_common::ReadProbeArgs {
            xfer_id: o.xfer_id,
            bytes: o.bytes,
            descriptors: o.descriptors,
            direction: direction.to_dataplane() as u8,
            backend: match self.cfg.backend {
                kvloop_dataplane::BackendConfig::Libfabric(_) => {
                    kvloop_common::BackendKind::Libfabric as u8
                }
                kvloop_dataplane::BackendConfig::Nixl(_) => kvloop_common::BackendKind::Nixl as u8,
            },
            status: 0,
            peer: kvloop_common::ReadProbeArgs::peer_from_str(peer_engine_id),
            weight: 1,
            _pad: [0; 4],
        };
        self.probes
            .observe_read_userspace(&args, Duration::from_micros(o.elapsed_us.max(1)));
    }
}

/// Payload bytes and descriptors of a READ of `n_blocks` block ids of
/// `layout` (every region of each block id is one descriptor).
pub fn read_size(layout: &kvloop_dataplane::KvLayout, n_blocks: usize) -> (u64, u64) {
    let n = n_blocks as u64;
    (
        n * layout.bytes_per_block_id(),
        n * u64::from(layout.num_regions),
    )
}

/// A dataplane failure as the local API reports it: the finer kind, where
/// it came from ([`kvloop_dataplane::DataplaneError::source_kind`]) and
/// whether sending the request again is safe
/// ([`kvloop_dataplane::DataplaneError::retry_safe`]).
pub fn dataplane_error(e: &kvloop_dataplane::DataplaneError) -> ApiError {
    use kvloop_dataplane::DataplaneError as D;
    let kind = match e {
        D::BlockOutOfRange { .. } | D::DuplicateLocalBlock { .. } => ErrorKind::BlockRange,
        D::BlockQuarantined { .. } => ErrorKind::BlockQuarantined,
        D::UnknownPeer { .. } => ErrorKind::UnknownPeer,
        D::LayoutMismatch { .. } => ErrorKind::LayoutMismatch,
        D::Handshake { .. } => ErrorKind::Handshake,
        D::Timeout { .. } => ErrorKind::Timeout,
        D::PeerGone { .. } => ErrorKind::PeerGone,
        D::Backend { .. } | D::NixlUnavailable(_) => ErrorKind::Backend,
        D::Config { .. } => ErrorKind::BadRequest,
        D::Shutdown => ErrorKind::Internal,
        D::Protocol { .. } | D::Io { .. } => ErrorKind::Dataplane,
    };
    let origin = match e.source_kind() {
        kvloop_dataplane::ErrorSource::Local => ErrorOrigin::Local,
        kvloop_dataplane::ErrorSource::Peer => ErrorOrigin::Peer,
        kvloop_dataplane::ErrorSource::Backend => ErrorOrigin::Backend,
    };
    ApiError::new(kind, e.to_string())
        .with_origin(origin)
        .retry_safe(e.retry_safe())
}

/// A READ checked against the owner's lease may only name blocks the lease
/// retains: params that name other blocks (stale, or not this request's)
/// are declined rather than served from the wrong blocks.
///
/// # Errors
/// `lease`, naming the first block pair the lease does not cover.
pub(super) fn lease_covers(
    lease: &LeaseInfo,
    blocks: &[kvloop_dataplane::BlockPair],
) -> Result<(), ApiError> {
    match blocks
        .iter()
        .enumerate()
        .find(|(_, b)| !lease.block_ids.contains(&b.remote))
    {
        None => Ok(()),
        Some((i, b)) => Err(ApiError::new(
            ErrorKind::Lease,
            format!(
                "blocks[{i}].remote = {}: not retained under request `{}` of engine `{}` (it retains {} blocks)",
                b.remote,
                lease.request_id,
                lease.engine_id,
                lease.block_ids.len()
            ),
        )),
    }
}
