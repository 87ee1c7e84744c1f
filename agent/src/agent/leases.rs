//! Leases of the blocks hosted engines retain: retain, renew (local and for
//! remote readers), release and expiry.
use super::*;
use crate::lease::RetentionOutcome;
use kvloop_agent_api::peer::{RETENTION_PATH, RetentionAnswer, RetentionRequest};

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
        let body = kvloop_agent_api::peer::RenewRequest {
            version: API_VERSION,
            engine_id: owner_engine_id.into(),
            request_id: request_id.into(),
            lease_ms,
        };
        self.ask_owner(
            ("peer_engine_id", owner_engine_id),
            "/v1/leases/renew",
            &body,
            None,
        )
        .await
    }

    /// POSTs `body` to `path` of the peer agent hosting `engine_id` (with
    /// `bearer`), and reads its answer; `field` names the engine id in the
    /// caller's request for the error. A peer that registered the engine
    /// since the last periodic discovery is found by asking the peers now.
    ///
    /// # Errors
    /// `unknown_engine` when no known agent hosts it; `lease` (origin peer)
    /// when the peer cannot be reached or answers badly; the peer's own
    /// error otherwise.
    async fn ask_owner<B: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        (field, engine_id): (&str, &str),
        path: &str,
        body: &B,
        bearer: Option<&str>,
    ) -> Result<R, ApiError> {
        let peer = match self.peer_of_engine(engine_id) {
            Some(p) => p,
            None => {
                self.refresh_peers().await;
                self.peer_of_engine(engine_id).ok_or_else(|| {
                    ApiError::new(
                        ErrorKind::UnknownEngine,
                        format!(
                            "{field} `{engine_id}`: no known agent hosts it (peers[] of the config)"
                        ),
                    )
                })?
            }
        };
        let http = self.peer_http(&peer).ok_or_else(|| {
            ApiError::new(
                ErrorKind::Internal,
                format!("peer `{peer}` has no HTTP address"),
            )
        })?;
        let url = format!("http://{http}{path}");
        let mut req = self.http.post(&url).json(body);
        if let Some(b) = bearer {
            req = req.bearer_auth(b);
        }
        let resp = req.send().await.map_err(|e| {
            ApiError::new(ErrorKind::Lease, format!("{url}: {e}")).with_origin(ErrorOrigin::Peer)
        })?;
        let status = resp.status();
        if status.is_success() {
            resp.json::<R>()
                .await
                .map_err(|e| ApiError::new(ErrorKind::Lease, format!("{url}: bad answer: {e}")))
        } else {
            let mut e: ApiError = resp.json().await.unwrap_or_else(|_| {
                ApiError::new(ErrorKind::Lease, format!("{url}: HTTP {status}"))
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

    /// A router's retention decision ([`RetentionRequest`]): applied here
    /// when this agent hosts `engine_id`, else forwarded once to the peer
    /// agent that does (with the caller's `bearer`). A hold that is not
    /// there answers [`RetentionAnswer::Unknown`] (releases are sent at
    /// least once: a repeat finds nothing).
    ///
    /// # Errors
    /// `unknown_engine` when no known agent hosts it; `lease` when asked to
    /// keep a hold the router released; a forward that failed.
    pub async fn retention(
        &self,
        r: &RetentionRequest,
        bearer: Option<&str>,
    ) -> Result<RetentionAnswer, ApiError> {
        let action = if r.keep_ms == 0 { "release" } else { "keep" };
        let count = |outcome: &str| {
            self.metrics
                .retention
                .get_or_create(&labels(&[("action", action), ("outcome", outcome)]))
                .inc();
        };
        if self.engines.read().contains_key(&r.engine_id) {
            let now = self.now_ms();
            let out = self
                .leases
                .lock()
                .set_retention(&r.engine_id, &r.request_id, r.keep_ms, now);
            self.update_lease_gauge();
            let answer = match out {
                Ok(RetentionOutcome::Released(rel)) => {
                    let blocks = rel.block_ids.len() as u64;
                    tracing::debug!(engine_id = %r.engine_id, request_id = %r.request_id, blocks, "released by the router");
                    self.push_event(&r.engine_id, EngineEvent::Released(rel));
                    RetentionAnswer::Released { blocks }
                }
                Ok(RetentionOutcome::Deferred { reading_for_ms }) => {
                    RetentionAnswer::Deferred { reading_for_ms }
                }
                Ok(RetentionOutcome::Kept { expires_in_ms }) => {
                    self.lease_changed.notify_one();
                    RetentionAnswer::Kept { expires_in_ms }
                }
                Err(LeaseError::Unknown { .. }) => RetentionAnswer::Unknown,
                Err(e) => {
                    count("error");
                    return Err(lease_err(e));
                }
            };
            count(match &answer {
                RetentionAnswer::Released { .. } => "released",
                RetentionAnswer::Deferred { .. } => "deferred",
                RetentionAnswer::Kept { .. } => "kept",
                RetentionAnswer::Unknown => "unknown",
            });
            return Ok(answer);
        }
        if r.forwarded {
            count("error");
            return Err(ApiError::new(
                ErrorKind::UnknownEngine,
                format!(
                    "engine_id `{}`: not hosted here (a forwarded decision is not forwarded again)",
                    r.engine_id
                ),
            ));
        }
        let mut body = r.clone();
        body.forwarded = true;
        let answer = self
            .ask_owner(("engine_id", &r.engine_id), RETENTION_PATH, &body, bearer)
            .await;
        count(if answer.is_ok() { "forwarded" } else { "error" });
        answer
    }

    /// Whether `bearer` may send retention decisions: any token when no
    /// `routers[].token` is configured (an agent that pushes to no router:
    /// the node network is trusted, as for lease renewals), else one of
    /// them (the routers' `admin_token`; constant-time comparison).
    pub fn retention_authorized(&self, bearer: Option<&str>) -> bool {
        let tokens: Vec<&str> = self
            .cfg
            .routers
            .iter()
            .filter_map(|r| r.token.as_deref())
            .collect();
        tokens.is_empty()
            || bearer.is_some_and(|b| {
                tokens
                    .iter()
                    .any(|t| kvloop_router_api::bearer_matches(t, b))
            })
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
