//! The KV-cache block allocator and the record of blocks held for a reader.
use std::time::Instant;

/// Free-list block allocator over `0..num_blocks`.
#[derive(Debug)]
pub struct BlockAllocator {
    free: Vec<u32>,
    num_blocks: u32,
}

impl BlockAllocator {
    /// All blocks free; low ids are handed out first.
    pub fn new(num_blocks: u32) -> Self {
        Self {
            free: (0..num_blocks).rev().collect(),
            num_blocks,
        }
    }
    /// Allocate `n` blocks, or `None` when fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let at = self.free.len() - n;
        let mut v = self.free.split_off(at);
        v.reverse();
        Some(v)
    }
    /// Return blocks to the free list.
    pub fn release(&mut self, ids: &[u32]) {
        self.free.extend(ids.iter().rev());
    }
    /// Free blocks.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
    /// Blocks in use over all blocks, 0..1 (0 without blocks).
    pub fn usage(&self) -> f64 {
        if self.num_blocks == 0 {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / f64::from(self.num_blocks)
    }
}

/// Blocks held for a finished request until read or expired.
#[derive(Debug, Clone)]
pub(crate) struct Hold {
    pub(crate) block_ids: Vec<u32>,
    pub(crate) num_tokens: u64,
    pub(crate) expires_at: Instant,
    /// Managed mode: leased at the node agent, whose lease table decides
    /// when the blocks are free again (a reader may have renewed the lease
    /// past `expires_at`): freed on the agent's release event, or evicted
    /// once the agent has ended the lease; never by the sweep while the
    /// agent is reachable.
    pub(crate) agent_lease: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_hands_out_and_takes_back() {
        let mut a = BlockAllocator::new(4);
        assert_eq!(a.allocate(3), Some(vec![0, 1, 2]));
        assert_eq!(a.allocate(2), None);
        a.release(&[0, 1, 2]);
        assert_eq!(a.free_blocks(), 4);
        assert!(a.usage() >= 0.0 && a.usage() <= 1.0);
    }
}
