//! Deterministic block contents for verification: the byte at offset `i` of
//! block `block` in region `region` of an engine filled with `tag` is a
//! function of the four, so a reader can check every byte it READ without
//! another copy.

/// Fills `buf` with the pattern of `(tag, region, block)`.
pub fn fill(tag: u64, region: u64, block: u64, buf: &mut [u8]) {
    let seed = tag
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(region.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(block.wrapping_mul(0x94D0_49BB_1331_11EB));
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let v = splitmix(seed.wrapping_add(i as u64)).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// Whether `buf` holds the pattern of `(tag, region, block)`.
pub fn matches(tag: u64, region: u64, block: u64, buf: &[u8]) -> bool {
    let mut want = vec![0u8; buf.len()];
    fill(tag, region, block, &mut want);
    want == buf
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    #[test]
    fn differs_by_every_coordinate() {
        let mut a = [0u8; 64];
        let mut b = [0u8; 64];
        super::fill(1, 0, 0, &mut a);
        for (t, r, k) in [(2, 0, 0), (1, 1, 0), (1, 0, 1)] {
            super::fill(t, r, k, &mut b);
            assert_ne!(a, b);
        }
        assert!(super::matches(1, 0, 0, &a));
    }
}
