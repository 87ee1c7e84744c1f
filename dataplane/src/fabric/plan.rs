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
        Self::from_chunks(
            chunk(segments, max_msg_bytes.max(MIN_MSG_BYTES)),
            max_msg_bytes,
            iovs_per_read,
        )
    }

    /// Groups `chunks` (each at most `max_msg_bytes`, raised to
    /// [`MIN_MSG_BYTES`]) into calls of at most `iovs_per_read` IOVs and one
    /// message size in total, in order.
    pub(crate) fn from_chunks(
        chunks: Vec<Chunk>,
        max_msg_bytes: u64,
        iovs_per_read: usize,
    ) -> Self {
        let max = max_msg_bytes.max(MIN_MSG_BYTES);
        let per = iovs_per_read.max(1);
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

/// Rail cuts fall on multiples of this many bytes from a chunk's start
/// (so page-aligned blocks stay page-aligned on every rail), bytes.
pub(crate) const SPLIT_ALIGN: u64 = 4096;

/// Plans a READ over `rails` rails: the segments are chunked to
/// `max_msg_bytes`, the chunks split into per-rail parts by
/// [`split_rails`], and each part grouped into `fi_readmsg` calls. Returns
/// (rail, plan) for every rail that carries bytes.
pub(crate) fn plan_rails(
    segments: &[Segment],
    max_msg_bytes: u64,
    iovs_per_read: usize,
    (rails, min_part_bytes, first): (usize, u64, usize),
) -> Vec<(usize, ReadPlan)> {
    if rails <= 1 {
        let p = ReadPlan::new(segments, max_msg_bytes, iovs_per_read);
        return if p.is_empty() {
            Vec::new()
        } else {
            vec![(0, p)]
        };
    }
    let chunks = chunk(segments, max_msg_bytes.max(MIN_MSG_BYTES));
    split_rails(&chunks, rails, min_part_bytes, first)
        .into_iter()
        .map(|(rail, part)| {
            (
                rail,
                ReadPlan::from_chunks(part, max_msg_bytes, iovs_per_read),
            )
        })
        .collect()
}

/// Splits a READ's chunks across `rails` rails by bytes: into `parts =
/// clamp(total / min_part_bytes, 1, rails)` contiguous runs of the chunk
/// sequence, part `i` ending at about `(i + 1) × total / parts` bytes (the
/// cut inside a chunk falls on the nearest multiple of [`SPLIT_ALIGN`] from
/// the chunk's start, or its end), so every part is within [`SPLIT_ALIGN`]
/// bytes of `total / parts`. Part `i` goes to rail `(first + i) % rails`;
/// rails that would carry nothing are left out. Every byte of every chunk
/// is in exactly one part, each part keeps the chunks' order, and the parts
/// in rail-turn order are the chunks again. Pure.
pub(crate) fn split_rails(
    chunks: &[Chunk],
    rails: usize,
    min_part_bytes: u64,
    first: usize,
) -> Vec<(usize, Vec<Chunk>)> {
    let rails = rails.max(1);
    let total: u64 = chunks.iter().map(|c| c.len).sum();
    if total == 0 {
        return Vec::new();
    }
    let parts = (total / min_part_bytes.max(1)).clamp(1, rails as u64) as usize;
    // End of part `p` in the READ's byte stream (u128: no overflow).
    let end = |p: usize| ((total as u128 * (p as u128 + 1)) / parts as u128) as u64;
    let mut out: Vec<Vec<Chunk>> = vec![Vec::new(); parts];
    let mut p = 0;
    let mut pos = 0;
    for &c in chunks {
        let mut c = c;
        while p + 1 < parts && pos + c.len > end(p) {
            let cut = nearest_cut(end(p).saturating_sub(pos), c.len);
            if cut > 0 {
                out[p].push(Chunk { len: cut, ..c });
                c = Chunk {
                    region: c.region,
                    remote_offset: c.remote_offset + cut,
                    local_offset: c.local_offset + cut,
                    len: c.len - cut,
                };
                pos += cut;
            }
            p += 1;
        }
        if c.len > 0 {
            out[p].push(c);
            pos += c.len;
        }
    }
    out.into_iter()
        .enumerate()
        .filter(|(_, part)| !part.is_empty())
        .map(|(i, part)| ((first + i) % rails, part))
        .collect()
}

/// The cut nearest `want` bytes into a chunk of `len` bytes (`want <
/// len`): a multiple of [`SPLIT_ALIGN`], or `len`; the lower one on a tie.
fn nearest_cut(want: u64, len: u64) -> u64 {
    let lower = want / SPLIT_ALIGN * SPLIT_ALIGN;
    let upper = (lower + SPLIT_ALIGN).min(len);
    if want - lower <= upper.saturating_sub(want) {
        lower
    } else {
        upper
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

    fn c(remote_offset: u64, len: u64) -> Chunk {
        Chunk {
            region: 0,
            remote_offset,
            local_offset: remote_offset + 7,
            len,
        }
    }

    fn rail_bytes(parts: &[(usize, Vec<Chunk>)]) -> Vec<(usize, u64)> {
        parts
            .iter()
            .map(|(r, p)| (*r, p.iter().map(|c| c.len).sum()))
            .collect()
    }

    #[test]
    fn one_rail_or_a_small_read_stays_whole() {
        let chunks = [c(0, 4096), c(8192, 4096)];
        // One rail: everything on it.
        assert_eq!(split_rails(&chunks, 1, 1, 5), [(0, chunks.to_vec())]);
        // Below the minimum per rail: whole, on the rail whose turn it is.
        assert_eq!(split_rails(&chunks, 4, 64 << 10, 6), [(2, chunks.to_vec())]);
        // Nothing to read: no parts.
        assert!(split_rails(&[], 2, 1, 0).is_empty());
        assert!(split_rails(&[c(0, 0)], 2, 1, 0).is_empty());
    }

    #[test]
    fn whole_descriptors_are_dealt_in_contiguous_runs() {
        // 16 blocks of 16 KiB over 2 rails: 8 each, in order.
        let chunks: Vec<Chunk> = (0..16).map(|i| c(i * 32_768, 16_384)).collect();
        let parts = split_rails(&chunks, 2, 4096, 0);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], (0, chunks[..8].to_vec()));
        assert_eq!(parts[1], (1, chunks[8..].to_vec()));
        // The turn rotates which rail gets which part.
        let parts = split_rails(&chunks, 2, 4096, 1);
        assert_eq!(parts.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 0]);
    }

    #[test]
    fn one_big_descriptor_is_cut_on_aligned_offsets() {
        // One 16 MiB chunk over 4 rails: four 4 MiB pieces.
        let parts = split_rails(&[c(1 << 20, 16 << 20)], 4, 64 << 10, 0);
        assert_eq!(
            rail_bytes(&parts),
            [(0, 4 << 20), (1, 4 << 20), (2, 4 << 20), (3, 4 << 20)]
        );
        assert_eq!(parts[1].1, [c((1 << 20) + (4 << 20), 4 << 20)]);
        // 3 rails of 1 MiB + 5 bytes: cuts at multiples of 4 KiB, within
        // 4 KiB of a third each.
        let total = (1 << 20) + 5;
        let parts = split_rails(&[c(0, total)], 3, 1, 0);
        let b = rail_bytes(&parts);
        assert_eq!(b.iter().map(|x| x.1).sum::<u64>(), total);
        for (_, bytes) in &b {
            assert!(bytes.abs_diff(total / 3) <= SPLIT_ALIGN, "{b:?}");
        }
        assert_eq!(parts[0].1[0].len % SPLIT_ALIGN, 0);
        assert_eq!(parts[1].1[0].remote_offset % SPLIT_ALIGN, 0);
    }

    #[test]
    fn plans_over_rails_group_each_part() {
        let segs: Vec<Segment> = (0..8)
            .map(|i| seg(1, i * 100_000, i * 100_000, 65_536))
            .collect();
        let p = plan_rails(&segs, 1 << 20, 2, (2, 64 << 10, 0));
        assert_eq!(p.len(), 2);
        for (rail, plan) in &p {
            // 4 chunks per rail, 2 per call.
            assert_eq!(plan.len(), 2, "rail {rail}");
            assert!(plan.groups().all(|g| g.len() == 2 && g[0].region == 1));
        }
        // One rail: the plan of today.
        assert_eq!(
            plan_rails(&segs, 1 << 20, 2, (1, 64 << 10, 3)),
            [(0, ReadPlan::new(&segs, 1 << 20, 2))]
        );
        assert!(plan_rails(&[], 1 << 20, 2, (2, 1, 0)).is_empty());
    }

    proptest::proptest! {
        #[test]
        fn rail_parts_cover_every_byte_once_in_order_and_balanced(
            lens in proptest::collection::vec(1u64..300_000, 1..40),
            rails in 1usize..6,
            min_part in 1u64..200_000,
            first in 0usize..10,
        ) {
            let mut chunks = Vec::new();
            let mut off = 0;
            for len in &lens {
                chunks.push(c(off, *len));
                off += len + 4096;
            }
            let total: u64 = lens.iter().sum();
            let parts = split_rails(&chunks, rails, min_part, first);
            let n = (total / min_part).clamp(1, rails as u64) as usize;
            proptest::prop_assert!(parts.len() <= n);
            // Distinct rails, taken in turn from `first`.
            for (i, (r, _)) in parts.iter().enumerate() {
                proptest::prop_assert!(*r < rails);
                proptest::prop_assert!(parts[..i].iter().all(|(q, _)| q != r));
            }
            // Balanced: every part within SPLIT_ALIGN of total / n (each
            // cut is within half of it of its ideal place).
            if total / n as u64 > SPLIT_ALIGN + 1 {
                proptest::prop_assert_eq!(parts.len(), n);
            }
            for (_, p) in &parts {
                let b: u64 = p.iter().map(|c| c.len).sum();
                proptest::prop_assert!(
                    b.abs_diff(total / n as u64) <= SPLIT_ALIGN + 1,
                    "part of {} bytes, {} parts, total {}", b, n, total
                );
            }
            // In order, every byte exactly once: the parts' pieces, merged
            // where one chunk was cut, are the chunks again.
            let mut merged: Vec<Chunk> = Vec::new();
            for (_, p) in &parts {
                for piece in p {
                    proptest::prop_assert!(piece.len > 0);
                    proptest::prop_assert_eq!(piece.local_offset, piece.remote_offset + 7);
                    match merged.last_mut() {
                        Some(m) if m.remote_offset + m.len == piece.remote_offset => m.len += piece.len,
                        _ => merged.push(*piece),
                    }
                }
            }
            proptest::prop_assert_eq!(merged, chunks);
        }
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
