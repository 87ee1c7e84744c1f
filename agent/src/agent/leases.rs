//! Leases of the blocks hosted engines retain: retain, renew (local and for
//! remote readers), release and expiry.
use super::*;

impl Agent {
    /// Retains blocks of a hosted engine.
    ///
    /// # Errors
    /// `unknown_engine`, `lease`.
    pub fn retain(
        &self,
        engine_id: &str,
        request_id: &str,
        block_ids: Vec<u64>,
        ttl_ms: Option<u64>,
    ) -> Result<LeaseInfo, ApiError> {
        let e = self.engine(engine_id)?;
        let nb = e.layout().num_blocks as u64;
        if let Some((i, b)) = block_ids.iter().enumerate().find(|(_, b)| **b >= nb) {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                format!("block_ids[{i}] = {b}: expected a block id below {nb} (layout.num_blocks)"),
            ));
        }
        let now = self.now_ms();
        let r = self
            .leases
            .lock()
            .retain(engine_id, request_id, block_ids, ttl_ms, now)
            .map_err(lease_err);
        self.update_lease_gauge();
        self.lease_changed.notify_one();
        r
    }

    /// Renews the lease of `request_id` of `owner_engine_id`: in the local
    /// table when the owner is hosted here, else through its agent
    /// (`POST /v1/leases/renew`). Fails when the blocks expire within the
    /// safety margin.
    ///
    /// # Errors
    /// `lease` (unknown, expiring), `unknown_engine` (no agent hosts it).
    pub async fn renew(
        &self,
        owner_engine_id: &str,
        request_id: &str,
        lease_ms: u64,
    ) -> Result<LeaseInfo, ApiError> {
        if self.engines.read().contains_key(owner_engine_id) {
            return self.renew_local(owner_engine_id, request_id, lease_ms);
        }
        let peer = match self.peer_of_engine(owner_engine_id) {
            Some(p) => p,
            None => {
                // Registered since the last periodic discovery: ask the peers now.
                self.refresh_peers().await;
                self.peer_of_engine(owner_engine_id).ok_or_else(|| {
                    ApiError::new(
                        ErrorKind::UnknownEngine,
                        format!("peer_engine_id `{owner_engine_id}`: no known agent hosts it (peers[] of the config)"),
                    )
                })?
            }
        };
        let http = self.peer_http(&peer);
        let http = http.ok_or_else(|| {
            ApiError::new(
                ErrorKind::Internal,
                format!("peer `{peer}` has no HTTP address"),
            )
        })?;
        let url = format!("http://{http}/v1/leases/renew");
        let body = kvloop_agent_api::peer::RenewRequest {
            version: API_VERSION,
            engine_id: owner_engine_id.into(),
            request_id: request_id.into(),
            lease_ms,
        };
        let resp = self.http.post(&url).json(&body).send().await.map_err(|e| {
            ApiError::new(ErrorKind::Lease, format!("renew at {url}: {e}"))
                .with_origin(ErrorOrigin::Peer)
        })?;
        let status = resp.status();
        if status.is_success() {
            resp.json::<LeaseInfo>().await.map_err(|e| {
                ApiError::new(ErrorKind::Lease, format!("renew at {url}: bad answer: {e}"))
            })
        } else {
            let mut e: ApiError = resp.json().await.unwrap_or_else(|_| {
                ApiError::new(ErrorKind::Lease, format!("renew at {url}: HTTP {status}"))
            });
            e.origin.get_or_insert(ErrorOrigin::Peer);
            Err(e)
        }
    }

    /// Renews a lease of a hosted engine and checks the safety margin.
    ///
    /// # Errors
    /// `lease`.
    pub fn renew_local(
        &self,
        engine_id: &str,
        request_id: &str,
        lease_ms: u64,
    ) -> Result<LeaseInfo, ApiError> {
        let now = self.now_ms();
        let mut t = self.leases.lock();
        t.check_read(engine_id, request_id, now)
            .map_err(lease_err)?;
        let r = t
            .renew(engine_id, request_id, lease_ms, now)
            .map_err(lease_err);
        self.lease_changed.notify_one();
        r
    }

    /// The owner releases blocks.
    ///
    /// # Errors
    /// `lease` when nothing is retained; `lease_in_use` while a reader's
    /// renewal holds them.
    pub fn release(&self, engine_id: &str, request_id: &str) -> Result<(), ApiError> {
        let now = self.now_ms();
        let r = self.leases.lock().release(engine_id, request_id, now);
        self.update_lease_gauge();
        let r = r.map_err(lease_err)?;
        self.push_event(engine_id, EngineEvent::Released(r));
        Ok(())
    }

    /// Expires lapsed leases and tells their owners (called by the lease
    /// task). Returns the next expiry, ms on the agent's clock
    /// ([`Agent::now_ms`]), or `None` when nothing is retained.
    pub fn expire_leases(&self) -> Option<u64> {
        let now = self.now_ms();
        let (gone, next): (Vec<Released>, Option<u64>) = {
            let mut t = self.leases.lock();
            let gone = t.expire(now);
            (gone, t.next_expiry_ms())
        };
        for r in gone {
            tracing::debug!(engine_id = %r.engine_id, request_id = %r.request_id, "lease expired");
            let id = r.engine_id.clone();
            self.push_event(&id, EngineEvent::Released(r));
        }
        self.update_lease_gauge();
        next
    }

    /// Waits until a lease is added or renewed.
    pub async fn lease_changed(&self) {
        self.lease_changed.notified().await;
    }

    pub(super) fn update_lease_gauge(&self) {
        self.metrics.leases.set(self.leases.lock().len() as i64);
    }
}

/// `lease`, or `lease_in_use` for an owner release refused while a reader
/// holds the blocks (the owner keeps them and evicts another request).
pub(super) fn lease_err(e: LeaseError) -> ApiError {
    let kind = if matches!(e, LeaseError::InUse { .. }) {
        ErrorKind::LeaseInUse
    } else {
        ErrorKind::Lease
    };
    ApiError::new(kind, e.to_string())
}
