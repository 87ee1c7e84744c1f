//! A new router's warm-up (`warmup_ms` in the config): pure.
//!
//! `GET /health` ([`crate::admin::health`]) answers 503 with `status:
//! "warming"` while [`warmup_left_ms`] is `Some`.

/// Warm-up left after start, ms (`warmup_ms` in the config): `None` once
/// an agent's threshold push with at least one pair was applied
/// (`pushed`) or `warmup_ms` passed since `started_ms` (all on the
/// router's clock), and always with `warmup_ms` 0.
pub fn warmup_left_ms(now_ms: u64, started_ms: u64, warmup_ms: u64, pushed: bool) -> Option<u64> {
    let left = warmup_ms.saturating_sub(now_ms.saturating_sub(started_ms));
    (!pushed && left > 0).then_some(left)
}

#[cfg(test)]
mod tests {
    use super::warmup_left_ms;

    #[test]
    fn warmup_ends_at_the_first_push_or_its_deadline() {
        // 0: no warm-up.
        assert_eq!(warmup_left_ms(1_000, 1_000, 0, false), None);
        // Counting down from start.
        assert_eq!(warmup_left_ms(1_000, 1_000, 5_000, false), Some(5_000));
        assert_eq!(warmup_left_ms(4_500, 1_000, 5_000, false), Some(1_500));
        assert_eq!(warmup_left_ms(6_000, 1_000, 5_000, false), None);
        assert_eq!(warmup_left_ms(9_000, 1_000, 5_000, false), None);
        // A push ends it at once.
        assert_eq!(warmup_left_ms(1_200, 1_000, 5_000, true), None);
        // A clock behind the start (never negative).
        assert_eq!(warmup_left_ms(900, 1_000, 5_000, false), Some(5_000));
    }
}
