//! Hosted engines: registration of an engine's KV memory (one transfer
//! engine each), unregistration, owner notifications and the per-engine
//! event queues the engines poll.
use super::*;
use kvloop_dataplane::region::KvRegion;

impl Agent {
    /// Registers an engine: maps its memfds and starts its transfer engine.
    /// Returns its side channel, backend name and registration generation
    /// (for [`Agent::unregister_generation`]).
    ///
    /// # Errors
    /// `bad_request` naming the field (fd count, lengths, layout); `dataplane`.
    pub async fn register(
        self: &Arc<Self>,
        engine_id: String,
        layout: KvLayout,
        regions: RegionSource,
        side_channel_port: Option<u16>,
        fds: Vec<OwnedFd>,
    ) -> Result<(SocketAddr, String, u64), ApiError> {
        if engine_id.starts_with(PROBE_ENGINE_PREFIX) {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                format!(
                    "engine_id: `{PROBE_ENGINE_PREFIX}*` is reserved for the agent's probe engine"
                ),
            ));
        }
        layout
            .validate()
            .map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
        // Params naming a side channel peers cannot reach would make every
        // reader decline and recompute, silently: refuse instead.
        self.cfg
            .check_side_channel_reachable()
            .map_err(|e| ApiError::new(ErrorKind::BadRequest, format!("side channel: {e}")))?;
        let kv_regions: Vec<KvRegion> = match regions {
            RegionSource::Memfd { len_bytes } => {
                if fds.len() != layout.num_regions as usize || len_bytes.len() != fds.len() {
                    return Err(ApiError::new(
                        ErrorKind::BadRequest,
                        format!(
                            "regions.len_bytes / fds: expected {} of each (layout.num_regions), got {} lengths and {} fds",
                            layout.num_regions,
                            len_bytes.len(),
                            fds.len()
                        ),
                    ));
                }
                let mut v = Vec::with_capacity(fds.len());
                for (i, (fd, len)) in fds.into_iter().zip(len_bytes).enumerate() {
                    let r = HostRegion::from_fd(fd, len as usize).map_err(|e| {
                        ApiError::new(
                            ErrorKind::BadRequest,
                            format!("regions.len_bytes[{i}]: {e}"),
                        )
                    })?;
                    v.push(KvRegion::from(r));
                }
                v
            }
            RegionSource::CudaIpc { regions } => {
                crate::cuda::open_regions(&regions, layout.num_regions)
                    .map_err(|e| ApiError::new(ErrorKind::BadRequest, e))?
            }
        };
        let ecfg = EngineConfig {
            engine_id: engine_id.clone(),
            side_channel_addr: SocketAddr::new(self.cfg.node_addr, side_channel_port.unwrap_or(0)),
            backend: self.cfg.backend.clone(),
            layout,
            read_timeout_ms: self.cfg.read_timeout_ms,
            handshake_timeout_ms: 5000,
        };
        // Replace an earlier registration first (it may hold the port).
        self.unregister(&engine_id);
        let engine = TransferEngine::start_with_regions(ecfg, kv_regions)
            .await
            .map_err(|e| dataplane_error(&e))?;
        let addr = engine.side_channel_addr();
        let backend = engine.backend_name();
        let mut rx = engine.subscribe_notifications();
        let weak = Arc::downgrade(self);
        let id = engine_id.clone();
        let task = tokio::spawn(async move {
            loop {
                let n = match rx.recv().await {
                    Ok(n) => n,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(k)) => {
                        tracing::warn!(engine_id = %id, lost = k, "owner notifications lost (queue overflow)");
                        continue;
                    }
                    Err(_) => return,
                };
                let Some(agent) = weak.upgrade() else { return };
                let released =
                    agent
                        .leases
                        .lock()
                        .on_notification(&id, &n.owner_request_id, n.count);
                agent.push_event(
                    &id,
                    EngineEvent::Notification {
                        from_engine_id: n.from_engine_id,
                        owner_request_id: n.owner_request_id,
                        count: n.count,
                    },
                );
                if let Some(r) = released {
                    agent.push_event(&id, EngineEvent::Released(r));
                }
                agent.update_lease_gauge();
            }
        });
        let generation = self
            .next_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.engines.write().insert(
            engine_id.clone(),
            Hosted {
                engine,
                generation,
                _notif: AbortOnDrop(task),
            },
        );
        // A fresh queue: events of an earlier registration of the same id
        // (an engine that restarted) must not reach the new one.
        self.events
            .lock()
            .insert(engine_id.clone(), Default::default());
        self.metrics.engines.set(self.engines.read().len() as i64);
        tracing::info!(%engine_id, side_channel = %addr, %backend, "engine registered");
        self.adopt_registered_shape(&engine_id, &layout);
        // Off the registration's path: opening a probe engine allocates and
        // registers memory and binds a side channel (with NIXL, starts an
        // agent); the engine need not wait for it.
        let me = self.clone();
        tokio::spawn(async move { me.follow_engine_layout(&layout).await });
        Ok((addr, backend, generation))
    }

    /// Unregisters an engine; `true` if it was registered.
    pub fn unregister(&self, engine_id: &str) -> bool {
        // What its rails carried since the last scrape still counts.
        self.account_rail_bytes();
        let gone = self.engines.write().remove(engine_id).is_some();
        if gone {
            self.leases.lock().drop_engine(engine_id);
            // Waiters in `events` see `unknown_engine` from now on.
            if let Some(q) = self.events.lock().remove(engine_id) {
                q.notify.notify_waiters();
            }
            self.metrics.engines.set(self.engines.read().len() as i64);
            tracing::info!(%engine_id, "engine unregistered");
        }
        gone
    }

    /// Unregisters `engine_id` only if it is still the registration of
    /// `generation` (the registering connection closed; a newer registration
    /// of the same id stays).
    pub fn unregister_generation(&self, engine_id: &str, generation: u64) -> bool {
        let same = self
            .engines
            .read()
            .get(engine_id)
            .is_some_and(|h| h.generation == generation);
        same && self.unregister(engine_id)
    }

    /// Sends an owner notification without a READ.
    ///
    /// # Errors
    /// `unknown_engine`, `dataplane`.
    pub fn notify(
        &self,
        engine_id: &str,
        peer_engine_id: &str,
        owner_request_id: &str,
        count: u32,
    ) -> Result<(), ApiError> {
        self.engine(engine_id)?
            .notify(peer_engine_id, owner_request_id, count)
            .map_err(|e| dataplane_error(&e))
    }

    pub(super) fn push_event(&self, engine_id: &str, ev: EngineEvent) {
        let mut m = self.events.lock();
        let q = m.entry(engine_id.to_string()).or_default();
        if q.q.len() >= MAX_QUEUED_EVENTS {
            q.q.pop_front();
        }
        q.q.push_back(ev);
        q.notify.notify_waiters();
        q.notify.notify_one();
    }

    /// Waits up to `timeout` for events of `engine_id`.
    ///
    /// # Errors
    /// `unknown_engine`.
    pub async fn events(
        &self,
        engine_id: &str,
        timeout: Duration,
        max: usize,
    ) -> Result<Vec<EngineEvent>, ApiError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notify = {
                let mut m = self.events.lock();
                let Some(q) = m.get_mut(engine_id) else {
                    return Err(ApiError::new(
                        ErrorKind::UnknownEngine,
                        format!("engine_id `{engine_id}` is not registered with this agent"),
                    ));
                };
                if !q.q.is_empty() {
                    let n = q.q.len().min(max.max(1));
                    return Ok(q.q.drain(..n).collect());
                }
                q.notify.clone()
            };
            if tokio::time::timeout_at(deadline, notify.notified())
                .await
                .is_err()
            {
                return Ok(Vec::new());
            }
        }
    }
}
