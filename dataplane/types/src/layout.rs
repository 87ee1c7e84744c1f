//! KV-cache layout: a set of memory regions, each holding `num_blocks` blocks
//! of `block_len_bytes`, as vLLM's NixlConnector registers them (one region
//! per layer, or per layer and K/V). Descriptor index of (region, block) is
//! `region × num_blocks + block_id` (NixlConnector's `_get_block_descs_ids`).
//! Block ids on the wire are logical ids into that layout.
use serde::{Deserialize, Serialize};

use crate::error::{DataplaneError, Result, Side};

/// Shape of an engine's registered KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayout {
    /// Number of memory regions (for example one per layer, or per layer and
    /// K/V). Must match between two engines that exchange blocks.
    pub num_regions: u32,
    /// Blocks per region. May differ between engines.
    pub num_blocks: u32,
    /// Bytes of one block in one region. Must match between engines.
    pub block_len_bytes: u64,
    /// Tokens per block (vLLM's `block_size`). Must match between engines.
    pub block_size_tokens: u32,
}

impl KvLayout {
    /// Bytes of one region (`num_blocks × block_len_bytes`).
    pub fn region_len_bytes(&self) -> u64 {
        self.num_blocks as u64 * self.block_len_bytes
    }

    /// Bytes one block id covers across all regions.
    pub fn bytes_per_block_id(&self) -> u64 {
        self.num_regions as u64 * self.block_len_bytes
    }

    /// Descriptor index of `(region, block_id)`: `region × num_blocks + block_id`.
    pub fn descriptor_index(&self, region: u32, block_id: u32) -> u64 {
        region as u64 * self.num_blocks as u64 + block_id as u64
    }

    /// Byte offset of `block_id` inside each region.
    pub fn block_offset(&self, block_id: u32) -> u64 {
        block_id as u64 * self.block_len_bytes
    }

    /// Checks the layout itself: every field non-zero.
    ///
    /// # Errors
    /// [`DataplaneError::Config`] naming the zero field.
    pub fn validate(&self) -> Result<()> {
        let zero = |field: &'static str| DataplaneError::Config {
            field,
            expected: "a value greater than 0".into(),
        };
        if self.num_regions == 0 {
            return Err(zero("layout.num_regions"));
        }
        if self.num_blocks == 0 {
            return Err(zero("layout.num_blocks"));
        }
        if self.block_len_bytes == 0 {
            return Err(zero("layout.block_len_bytes"));
        }
        if self.block_size_tokens == 0 {
            return Err(zero("layout.block_size_tokens"));
        }
        Ok(())
    }

    /// Checks that blocks can move between `self` (local) and `remote`:
    /// same `num_regions`, `block_len_bytes` and `block_size_tokens`.
    ///
    /// # Errors
    /// [`DataplaneError::LayoutMismatch`] naming the first differing field.
    pub fn check_compatible(&self, remote_engine_id: &str, remote: &KvLayout) -> Result<()> {
        let mismatch = |field: &'static str, l: u64, r: u64| DataplaneError::LayoutMismatch {
            engine_id: remote_engine_id.to_string(),
            field,
            local: l.to_string(),
            remote: r.to_string(),
        };
        if self.block_len_bytes != remote.block_len_bytes {
            return Err(mismatch(
                "block_len_bytes",
                self.block_len_bytes,
                remote.block_len_bytes,
            ));
        }
        if self.num_regions != remote.num_regions {
            return Err(mismatch(
                "num_regions",
                self.num_regions as u64,
                remote.num_regions as u64,
            ));
        }
        if self.block_size_tokens != remote.block_size_tokens {
            return Err(mismatch(
                "block_size_tokens",
                self.block_size_tokens as u64,
                remote.block_size_tokens as u64,
            ));
        }
        Ok(())
    }

    /// Checks one block id against this layout.
    ///
    /// # Errors
    /// [`DataplaneError::BlockOutOfRange`] naming `field`.
    pub fn check_block(
        &self,
        side: Side,
        field: impl FnOnce() -> String,
        block_id: u64,
    ) -> Result<()> {
        if block_id >= self.num_blocks as u64 {
            return Err(DataplaneError::BlockOutOfRange {
                field: field(),
                side,
                block_id,
                num_blocks: self.num_blocks as u64,
            });
        }
        Ok(())
    }
}

/// One (remote block, local block) pair of a READ: copy remote block
/// `remote` of every region into local block `local` of the same region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockPair {
    /// Block id in the remote engine's layout (source).
    pub remote: u64,
    /// Block id in the local layout (destination).
    pub local: u64,
}

/// One contiguous copy, after coalescing: `len_bytes` from `remote_offset` of
/// remote region `region` to `local_offset` of local region `region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Region index (same on both sides).
    pub region: u32,
    /// Byte offset in the remote region.
    pub remote_offset: u64,
    /// Byte offset in the local region.
    pub local_offset: u64,
    /// Bytes to copy.
    pub len_bytes: u64,
}

/// Turns validated block pairs into per-region segments, merging runs of
/// pairs that are contiguous on both sides (`remote+1`, `local+1`) into one
/// segment, as NIXL does for adjacent descriptors. Order: region-major, then
/// request order.
pub fn segments(layout: &KvLayout, pairs: &[BlockPair]) -> Vec<Segment> {
    let mut out = Vec::with_capacity(pairs.len() * layout.num_regions as usize);
    for region in 0..layout.num_regions {
        let mut cur: Option<Segment> = None;
        for p in pairs {
            let r = p.remote * layout.block_len_bytes;
            let l = p.local * layout.block_len_bytes;
            match cur.as_mut() {
                Some(s)
                    if s.remote_offset + s.len_bytes == r && s.local_offset + s.len_bytes == l =>
                {
                    s.len_bytes += layout.block_len_bytes;
                }
                _ => {
                    if let Some(s) = cur.take() {
                        out.push(s);
                    }
                    cur = Some(Segment {
                        region,
                        remote_offset: r,
                        local_offset: l,
                        len_bytes: layout.block_len_bytes,
                    });
                }
            }
        }
        out.extend(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_regions: 2,
            num_blocks: 8,
            block_len_bytes: 4096,
            block_size_tokens: 16,
        }
    }

    #[test]
    fn descriptor_index_matches_nixl_connector() {
        let l = layout();
        assert_eq!(l.descriptor_index(0, 3), 3);
        assert_eq!(l.descriptor_index(1, 3), 11);
    }

    #[test]
    fn coalesces_contiguous_runs_per_region() {
        let l = layout();
        let pairs = [
            BlockPair {
                remote: 1,
                local: 4,
            },
            BlockPair {
                remote: 2,
                local: 5,
            },
            BlockPair {
                remote: 6,
                local: 0,
            },
        ];
        let s = segments(&l, &pairs);
        assert_eq!(s.len(), 4);
        assert_eq!(
            s[0],
            Segment {
                region: 0,
                remote_offset: 4096,
                local_offset: 16384,
                len_bytes: 8192
            }
        );
        assert_eq!(s[1].remote_offset, 6 * 4096);
        assert_eq!(s[2].region, 1);
        let total: u64 = s.iter().map(|s| s.len_bytes).sum();
        assert_eq!(total, 3 * 2 * 4096);
    }

    #[test]
    fn mismatched_layouts_name_the_field() {
        let a = layout();
        let mut b = a;
        b.block_len_bytes = 8192;
        let e = a.check_compatible("d0", &b).unwrap_err().to_string();
        assert!(e.contains("block_len_bytes"), "{e}");
        let mut c = a;
        c.num_blocks = 100; // capacity may differ
        a.check_compatible("d0", &c).unwrap();
        c.num_regions = 3;
        let e = a.check_compatible("d0", &c).unwrap_err().to_string();
        assert!(e.contains("num_regions"), "{e}");
    }

    #[test]
    fn out_of_range_block_names_field() {
        let e = layout()
            .check_block(Side::Remote, || "blocks[2].remote".into(), 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("blocks[2].remote") && e.contains("0..8"), "{e}");
    }
}
