//! What to load: the user-facing configuration of [`crate::Probes::load`].

/// What to load and how. `Default`: every probe on, every transfer event
/// sampled, no prefill port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeConfig {
    /// Transfer probes (kvloop sites, NIXL library); attach with
    /// [`Probes::attach_transfer_sites`] / [`Probes::attach_nixl`].
    pub transfer: bool,
    /// Prefill socket probes (attached at load; ports via
    /// [`Probes::prefill_port`] or `prefill_ports`).
    pub prefill: bool,
    /// TCP retransmit probe (attached at load).
    pub retransmit: bool,
    /// Send one transfer event out of every `xfer_sample_every` to user space
    /// (1 = all). Histograms always count every READ.
    pub xfer_sample_every: u32,
    /// Prefill server ports to time from the start (at most 16).
    pub prefill_ports: Vec<u16>,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            transfer: true,
            prefill: true,
            retransmit: true,
            xfer_sample_every: 1,
            prefill_ports: Vec::new(),
        }
    }
}
