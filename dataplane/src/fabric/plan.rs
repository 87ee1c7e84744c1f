//! The pure READ planner of the libfabric backend: coalesced segments (from
//! [`crate::layout::segments`]) become chunks of at most the provider's
//! message size, grouped into `fi_readmsg` calls of at most `iovs_per_read`
//! IOVs and at most one message size in total. No I/O: unit-tested here.
use crate::layout::Segment;

/// Smallest message size the planner assumes, whatever the provider reports
/// (a provider reporting less would make the plan needlessly long), bytes.
pub(crate) const MIN_MSG_BYTES: u64 = 4096;

/// One IOV of a READ: `len` bytes from `remote_offset` of remote region
/// `region` into `local_offset` of local region `region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Region index (same on both sides).
    pub(crate) region: u32,
    /// Byte offset in the remote region.
    pub(crate) remote_offset: u64,
    /// Byte offset in the local region.
    pub(crate) local_offset: u64,
    /// Bytes, at most the plan's message size.
    pub(crate) len: u64,
}

/// The `fi_readmsg` calls of one READ: [`ReadPlan::groups`] in posting order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReadPlan {
    chunks: Vec<Chunk>,
    /// End index (exclusive) in `chunks` of each group.
    ends: Vec<usize>,
}

impl ReadPlan {
    /// Plans `segments` for a provider with `max_msg_bytes` per message
    /// (raised to [`MIN_MSG_BYTES`]) and `iovs_per_read` IOVs per call
    /// (raised to 1). Segment order is kept; a segment longer than the
    /// message size is split into consecutive chunks; zero-length segments
    /// produce nothing.
    pub(crate) fn new(segments: &[Segment], max_msg_bytes: u64, iovs_per_read: usize) -> Self {
        let max = max_msg_bytes.max(MIN_MSG_BYTES);
        let per = iovs_per_read.max(1);
        let chunks = chunk(segments, max);
        let mut ends = Vec::new();
        let mut start = 0;
        while start < chunks.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < chunks.len() && end - start < per && bytes + chunks[end].len <= max {
                bytes += chunks[end].len;
                end += 1;
            }
            ends.push(end);
            start = end;
        }
        Self { chunks, ends }
    }

    /// Number of `fi_readmsg` calls.
    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there is nothing to read.
    pub(crate) fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Group `i` (`i < len()`): the IOVs of the `i`-th `fi_readmsg`.
    pub(crate) fn group(&self, i: usize) -> &[Chunk] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.chunks[start..self.ends[i]]
    }

    /// The groups, each the IOVs of one `fi_readmsg`, in posting order.
    #[cfg(test)]
    pub(crate) fn groups(&self) -> impl Iterator<Item = &[Chunk]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(self.ends.iter().copied())
            .map(|(s, e)| &self.chunks[s..e])
    }
}

/// Splits every segment into chunks of at most `max` bytes.
fn chunk(segments: &[Segment], max: u64) -> Vec<Chunk> {
    let mut chunks = Vec::with_capacity(segments.len());
    for seg in segments {
        let mut off = 0;
        while off < seg.len_bytes {
            let len = (seg.len_bytes - off).min(max);
            chunks.push(Chunk {
                region: seg.region,
                remote_offset: seg.remote_offset + off,
                local_offset: seg.local_offset + off,
                len,
            });
            off += len;
        }
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{BlockPair, KvLayout, segments};

    fn seg(region: u32, remote_offset: u64, local_offset: u64, len_bytes: u64) -> Segment {
        Segment {
            region,
            remote_offset,
            local_offset,
            len_bytes,
        }
    }

    /// The groups by iteration, checked against [`ReadPlan::group`] (the
    /// posting path's indexed access).
    fn groups(p: &ReadPlan) -> Vec<Vec<Chunk>> {
        let g: Vec<Vec<Chunk>> = p.groups().map(<[Chunk]>::to_vec).collect();
        for (i, gi) in g.iter().enumerate() {
            assert_eq!(p.group(i), gi.as_slice(), "group {i}");
        }
        g
    }

    #[test]
    fn segments_are_chunked_to_the_message_size() {
        let p = ReadPlan::new(&[seg(1, 100, 200, 20_000)], 8192, 1);
        let g = groups(&p);
        assert_eq!(g.len(), 3);
        assert_eq!(
            g[0][0],
            Chunk {
                region: 1,
                remote_offset: 100,
                local_offset: 200,
                len: 8192
            }
        );
        assert_eq!((g[1][0].remote_offset, g[1][0].local_offset), (8292, 8392));
        assert_eq!(g[2][0].len, 20_000 - 2 * 8192);
    }

    #[test]
    fn groups_respect_the_iov_limit_and_the_message_size() {
        let segs: Vec<Segment> = (0..5)
            .map(|i| seg(0, i * 10_000, i * 10_000, 4096))
            .collect();
        // 2 IOVs per call: 2 + 2 + 1.
        let p = ReadPlan::new(&segs, 1 << 20, 2);
        assert_eq!(
            groups(&p).iter().map(Vec::len).collect::<Vec<_>>(),
            [2, 2, 1]
        );
        // 4 IOVs allowed but only 8 KiB per message: 2 per call.
        let p = ReadPlan::new(&segs, 8192, 4);
        assert_eq!(
            groups(&p).iter().map(Vec::len).collect::<Vec<_>>(),
            [2, 2, 1]
        );
    }

    #[test]
    fn contiguous_blocks_coalesce_into_one_iov() {
        let l = KvLayout {
            num_regions: 2,
            num_blocks: 8,
            block_len_bytes: 4096,
            block_size_tokens: 16,
        };
        let pairs: Vec<BlockPair> = (0..4)
            .map(|i| BlockPair {
                remote: i,
                local: i + 2,
            })
            .collect();
        let p = ReadPlan::new(&segments(&l, &pairs), 1 << 20, 4);
        // One 16 KiB segment per region, both in one call.
        assert_eq!(
            groups(&p),
            [vec![
                Chunk {
                    region: 0,
                    remote_offset: 0,
                    local_offset: 8192,
                    len: 16_384
                },
                Chunk {
                    region: 1,
                    remote_offset: 0,
                    local_offset: 8192,
                    len: 16_384
                }
            ]]
        );
    }

    #[test]
    fn edge_cases() {
        // Nothing to read.
        assert!(ReadPlan::new(&[], 8192, 4).is_empty());
        assert!(ReadPlan::new(&[seg(0, 0, 0, 0)], 8192, 4).is_empty());
        // Limits below the floors are raised: no zero-length or empty groups.
        let p = ReadPlan::new(&[seg(0, 0, 0, 10_000)], 0, 0);
        assert_eq!(
            groups(&p).iter().map(|g| g[0].len).collect::<Vec<_>>(),
            [4096, 4096, 1808]
        );
        assert_eq!(p.len(), 3);
        // A segment of exactly the message size is one chunk.
        assert_eq!(ReadPlan::new(&[seg(0, 0, 0, 8192)], 8192, 1).len(), 1);
    }

    proptest::proptest! {
        #[test]
        fn plans_cover_every_byte_once_within_limits(
            lens in proptest::collection::vec(0u64..50_000, 0..20),
            max in 0u64..40_000,
            per in 0usize..6,
        ) {
            let mut segs = Vec::new();
            let mut off = 0;
            for (i, len) in lens.iter().enumerate() {
                segs.push(seg(i as u32 % 3, off, off + 7, *len));
                off += len + 1;
            }
            let p = ReadPlan::new(&segs, max, per);
            let cap = max.max(MIN_MSG_BYTES);
            let mut next = 0;
            let mut covered: Vec<(u32, u64, u64)> = Vec::new();
            for g in p.groups() {
                proptest::prop_assert!(!g.is_empty() && g.len() <= per.max(1));
                proptest::prop_assert!(g.iter().map(|c| c.len).sum::<u64>() <= cap);
                for c in g {
                    proptest::prop_assert!(c.len > 0);
                    proptest::prop_assert_eq!(c.local_offset, c.remote_offset + 7);
                    covered.push((c.region, c.remote_offset, c.len));
                }
                next += 1;
            }
            proptest::prop_assert_eq!(next, p.len());
            // Chunks tile the segments in order.
            let mut it = covered.into_iter();
            for s in &segs {
                let mut at = s.remote_offset;
                while at < s.remote_offset + s.len_bytes {
                    let (r, o, l) = it.next().expect("a chunk for every byte");
                    proptest::prop_assert_eq!((r, o), (s.region, at));
                    at += l;
                }
                proptest::prop_assert_eq!(at, s.remote_offset + s.len_bytes);
            }
            proptest::prop_assert!(it.next().is_none());
        }
    }
}
