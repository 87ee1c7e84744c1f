//! Unit tests of [`super`] (the load book), with a manual clock.
use super::*;
use crate::clock::ManualClock;

fn book(n: usize) -> (Arc<LoadBook>, Arc<ManualClock>) {
    let c = Arc::new(ManualClock::default());
    (LoadBook::new(n, c.clone()), c)
}

/// A pull whose READ's end the book guesses (its agent does not notice it).
fn guessed(digest: u64) -> Option<Pull> {
    Some(Pull {
        digest,
        read_noticed: false,
    })
}

/// A pull whose READ's end its agent notices.
fn read_noticed(digest: u64) -> Option<Pull> {
    Some(Pull {
        digest,
        read_noticed: true,
    })
}

#[test]
fn guards_count_while_alive() {
    let (b, _) = book(3);
    let g1 = b.begin_prefill(0, 100, None, None, None, 0);
    let g2 = b.begin_prefill(0, 50, None, None, None, 0);
    let d = b.begin_decode(2);
    assert_eq!(b.outstanding_prefill_tokens(0), 150);
    assert_eq!(b.inflight_decode_streams(2), 1);
    drop(g1);
    assert_eq!(b.outstanding_prefill_tokens(0), 50);
    drop((g2, d));
    assert_eq!(b.outstanding_prefill_tokens(0), 0);
    assert_eq!(b.inflight_decode_streams(2), 0);
    let _ = b.begin_prefill(9, 5, None, None, None, 0); // unknown index: ignored
    assert_eq!(b.kv_usage(2), None, "not reported");
    b.set_kv_usage(2, Some(0.42));
    assert_eq!(b.kv_usage(2), Some(0.42));
    b.set_kv_usage(2, Some(7.0));
    assert_eq!(b.kv_usage(2), Some(1.0), "clamped");
    b.set_kv_usage(2, None);
    assert_eq!(b.kv_usage(2), None);
}

#[test]
fn queue_ms_costs_known_prefills_by_prediction_and_the_rest_by_the_mean() {
    let (b, _) = book(2);
    assert_eq!(b.queue_ms(0, 0), None, "no prediction yet");
    let g = b.begin_prefill(0, 1000, Some(100.0), None, None, 0);
    let _h = b.begin_prefill(0, 1000, Some(200.0), None, None, 0); // mean 100 + 0.2 × 100 = 120
    assert_eq!(b.queue_ms(0, 0), Some(300.0));
    assert_eq!(b.queue_ms(1, 0), Some(0.0));
    // Two requests this replica does not know of: the mean each.
    b.set_reported_requests(1, Some(2));
    assert!((b.queue_ms(1, 0).unwrap() - 240.0).abs() < 1e-9);
    b.set_reported_requests(1, None);
    assert_eq!(b.queue_ms(1, 0), Some(0.0), "not reported: known work only");
    // P reports 3: the two known ones by prediction, one more at the mean.
    b.set_reported_requests(0, Some(3));
    assert!((b.queue_ms(0, 0).unwrap() - 420.0).abs() < 1e-9);
    // P reports fewer than are known (its report is older): known work.
    b.set_reported_requests(0, Some(1));
    assert_eq!(b.queue_ms(0, 0), Some(300.0));
    // Shared lines are known too.
    b.set_shared_line(
        0,
        SharedLine {
            items: vec![(0, 50_000, 0)],
            last_done_ms: None,
            reading: 0,
        },
    );
    b.set_reported_requests(0, Some(3));
    assert_eq!(b.queue_ms(0, 0), Some(350.0));
    drop(g);
    b.set_shared_line(0, SharedLine::default());
    b.set_reported_requests(0, None);
    assert_eq!(b.queue_ms(0, 0), Some(200.0));
}

#[test]
fn a_replica_that_has_not_predicted_yet_counts_what_others_share() {
    let (b, _) = book(2);
    assert_eq!(b.queue_ms(0, 0), None, "nothing predicted, nothing shared");
    // Another replica has two prefills on engine 0 (100 and 300 ms).
    b.set_shared_line(
        0,
        SharedLine {
            items: vec![(0, 100_000, 0), (0, 300_000, 0)],
            last_done_ms: None,
            reading: 0,
        },
    );
    assert_eq!(b.queue_ms(0, 0), Some(400.0));
    // Engine 1 reports one request nobody shares: costed at their mean.
    b.set_reported_requests(1, Some(1));
    assert_eq!(b.queue_ms(1, 0), Some(200.0));
    // Once this replica predicts, its own mean rules.
    let _g = b.begin_prefill(1, 1000, Some(50.0), None, None, 0);
    assert_eq!(b.queue_ms(1, 0), Some(50.0), "the one reported is its own");
    b.set_reported_requests(1, Some(2));
    assert_eq!(b.queue_ms(1, 0), Some(100.0));
}

#[test]
fn a_report_counts_what_was_unknown_when_it_came() {
    let (b, clock) = book(1);
    let g1 = b.begin_prefill(0, 10, Some(300.0), None, None, 0);
    let g2 = b.begin_prefill(0, 10, Some(300.0), None, None, 0);
    // P reports both, and one request of a router that does not share.
    b.set_reported_requests(0, Some(3));
    assert_eq!(b.queue_ms(0, 0), Some(900.0));
    // P finishes the first before it reports again: the report's place
    // for it is not turned into a request nobody knows.
    clock.advance(300);
    drop(g1);
    assert_eq!(b.queue_ms(0, 300), Some(600.0), "g2 and the unknown one");
    // A prefill sent after the report (known, not in the report) takes
    // the finished one's place: the unknown one still counts.
    let g3 = b.begin_prefill(0, 10, Some(300.0), None, None, 0);
    assert_eq!(b.queue_ms(0, 300), Some(900.0));
    // Another replica's prefill that P had when it reported, shared after
    // the report: not counted twice.
    b.set_reported_requests(0, Some(4));
    assert_eq!(b.queue_ms(0, 300), Some(1200.0), "one more unknown");
    b.set_shared_line(
        0,
        SharedLine {
            items: vec![(300, 300_000, 0)],
            last_done_ms: None,
            reading: 0,
        },
    );
    assert_eq!(b.queue_ms(0, 300), Some(1200.0), "now known, not twice");
    drop((g2, g3));
}

#[test]
fn remaining_work_counts_down_as_the_head_computes() {
    let (b, clock) = book(1);
    clock.advance(1000);
    let g1 = b.begin_prefill(0, 10, Some(600.0), None, None, 0);
    clock.advance(100);
    let g2 = b.begin_prefill(0, 10, Some(300.0), None, None, 0);
    assert_eq!(
        b.remaining_ms(0, 1100),
        800.0,
        "the head did 100 of its 600 ms"
    );
    assert_eq!(b.remaining_ms(0, 1500), 400.0);
    assert_eq!(
        b.remaining_ms(0, 5000),
        300.0,
        "a head late on its prediction still leaves the rest of the line"
    );
    clock.advance(400); // the head answers at 1500
    drop(g1);
    assert_eq!(
        b.remaining_ms(0, 1600),
        200.0,
        "the next began when the head answered"
    );
    assert_eq!(b.queue_ms(0, 1600), Some(200.0));
    // One that answers out of order leaves the head's start alone.
    let g3 = b.begin_prefill(0, 10, Some(50.0), None, None, 0);
    drop(g3);
    assert_eq!(b.remaining_ms(0, 1600), 200.0);
    drop(g2);
    assert_eq!(b.remaining_ms(0, 1600), 0.0);
    assert_eq!(b.remaining_ms(7, 0), 0.0, "unknown engine");
}

#[test]
fn a_pull_overtaken_by_a_later_prefill_holds_no_place_in_the_line() {
    let (b, clock) = book(1);
    clock.advance(1000);
    // A pull whose READ runs long (a degraded path), then two recomputes.
    let pull = b.begin_prefill(0, 10, Some(400.0), guessed(0), None, 0);
    clock.advance(10);
    let r1 = b.begin_prefill(0, 10, Some(100.0), None, None, 0);
    let r2 = b.begin_prefill(0, 10, Some(300.0), None, None, 0);
    // Before anything answers, the pull is assumed at the head.
    assert_eq!(b.remaining_ms(0, 1010), 790.0);
    clock.advance(100);
    drop(r1); // P answered r1 at 1110 while the pull was still READing
    assert_eq!(
        b.remaining_ms(0, 1110),
        300.0,
        "only r2 is in P's line, and it starts now"
    );
    assert_eq!(b.remaining_ms(0, 1210), 200.0);
    let line = b.own_line(0, 1210).unwrap();
    assert_eq!(line.items, vec![(200, 300_000)], "shared without the pull");
    // Still counted among P's requests: a report of 2 adds nothing.
    b.set_reported_requests(0, Some(2));
    assert_eq!(b.queue_ms(0, 1210), Some(200.0));
    drop(r2);
    drop(pull);
    assert_eq!(b.remaining_ms(0, 1210), 0.0);
    // A recompute is never overtaken: P computes in order.
    let slow = b.begin_prefill(0, 10, Some(400.0), None, None, 0);
    let quick = b.begin_prefill(0, 10, Some(100.0), None, None, 0);
    drop(quick);
    assert_eq!(b.remaining_ms(0, 1110), 400.0, "sent at 1110");
    drop(slow);
}

/// A pull's abandon foreseen at 600 ms, then 900 ms of whole-prompt
/// recompute; its READ due after 20 ms.
fn abandon_at_600(noticed: bool) -> Abandon {
    Abandon {
        after_ms: 600.0,
        compute_ms: 900.0,
        read_ms: 20.0,
        noticed,
    }
}

/// At 1000 ms, a pull (50 ms of suffix, [`abandon_at_600`], `digest`) on
/// engine 0; a recompute of 100 ms sent past the READ's predicted end
/// overtakes it, answered at 1130 ms (the clock's time on return).
fn overtaken_pull(
    b: &Arc<LoadBook>,
    clock: &ManualClock,
    noticed: bool,
    digest: u64,
) -> PrefillGuard {
    clock.advance(1000);
    let pull = b.begin_prefill(
        0,
        10,
        Some(50.0),
        guessed(digest),
        Some(abandon_at_600(noticed)),
        0,
    );
    clock.advance(30); // past the READ's predicted end
    let r1 = b.begin_prefill(0, 10, Some(100.0), None, None, 0);
    clock.advance(100);
    drop(r1);
    pull
}

#[test]
fn an_abandoned_pull_reenters_the_line_as_a_whole_recompute() {
    let (b, clock) = book(1);
    // A pull that P's agent abandons after 600 ms, then recomputes in
    // 900 ms; a recompute of 100 ms overtakes it.
    let pull = overtaken_pull(&b, &clock, false, 0);
    let abandon = abandon_at_600(false);
    assert_eq!(b.remaining_ms(0, 1130), 0.0, "READing: not in P's line");
    assert_eq!(b.remaining_ms(0, 1599), 0.0);
    // At the deadline P recomputes the whole prompt, from then on.
    assert_eq!(b.remaining_ms(0, 1600), 900.0);
    assert_eq!(b.remaining_ms(0, 1800), 700.0);
    assert_eq!(b.own_line(0, 1800).unwrap().items, vec![(200, 900_000)]);
    // No longer a pull: a later prefill answered first does not take
    // it out of the line again.
    let r2 = b.begin_prefill(0, 10, Some(100.0), None, None, 0);
    drop(r2);
    assert_eq!(b.remaining_ms(0, 1800), 700.0);
    drop(pull);
    assert_eq!(b.remaining_ms(0, 1800), 0.0);
    // A recompute carries no deadline; a pull not overtaken may hold
    // its KV and wait in P's line: neither changes at the deadline.
    let r = b.begin_prefill(0, 10, Some(100.0), None, Some(abandon), 0);
    assert_eq!(b.remaining_ms(0, 2400), 0.0, "done by then");
    drop(r);
    let _p = b.begin_prefill(0, 10, Some(50.0), guessed(0), Some(abandon), 0);
    assert_eq!(b.remaining_ms(0, 2400), 0.0, "done by then");
}

#[test]
fn a_pull_overtaken_before_its_read_was_due_keeps_its_place() {
    let (b, clock) = book(1);
    clock.advance(1000);
    // A pull whose READ should take 120 ms; a recompute sent 10 ms later
    // reaches P's line first (the pull joins it once its READ ends) and
    // is answered first: the pull is not late, it waits in P's line.
    let abandon = Abandon {
        read_ms: 120.0,
        ..abandon_at_600(false)
    };
    let pull = b.begin_prefill(0, 10, Some(50.0), guessed(0), Some(abandon), 0);
    clock.advance(10);
    let r1 = b.begin_prefill(0, 10, Some(100.0), None, None, 0);
    clock.advance(100);
    drop(r1);
    assert_eq!(b.remaining_ms(0, 1110), 50.0, "in P's line, starting now");
    // Past its abandon deadline it is still booked as its own suffix.
    assert_eq!(b.remaining_ms(0, 1150), 10.0);
    assert_eq!(b.remaining_ms(0, 1700), 0.0);
    drop(pull);
}

#[test]
fn a_pull_its_agent_says_ended_without_the_blocks_is_a_whole_recompute_from_then() {
    let (b, clock) = book(2);
    clock.advance(1000);
    let digest = pull_digest("d0", "cmpl-7");
    let pull = b.begin_prefill(
        1,
        10,
        Some(50.0),
        guessed(digest),
        Some(abandon_at_600(false)),
        0,
    );
    assert_eq!(b.remaining_ms(1, 1000), 50.0, "booked as its suffix");
    // Cut at 127 ms, not overtaken: without the notice the book keeps the
    // suffix (the pull may be waiting in P's line with its KV).
    clock.advance(127);
    assert!(
        !b.pull_abandoned(pull_digest("d0", "cmpl-8")),
        "another pull"
    );
    assert!(!b.pull_abandoned(pull_digest("d1", "cmpl-7")), "another D");
    assert_eq!(b.remaining_ms(1, 1127), 0.0);
    assert!(b.pull_abandoned(digest));
    assert_eq!(b.remaining_ms(1, 1127), 900.0, "the whole prompt, from now");
    assert_eq!(b.remaining_ms(1, 1327), 700.0);
    assert_eq!(b.own_line(1, 1327).unwrap().items, vec![(200, 900_000)]);
    // A second notice (both routers' addresses, a retry) changes nothing.
    assert!(b.pull_abandoned(digest));
    assert_eq!(b.remaining_ms(1, 1327), 700.0);
    drop(pull);
    assert!(!b.pull_abandoned(digest), "answered: gone from the book");
    assert_eq!(b.remaining_ms(1, 1327), 0.0);
    // Untracked prefills never match.
    let _r = b.begin_prefill(0, 10, Some(100.0), None, None, 0);
    assert!(!b.pull_abandoned(0));
}

#[test]
fn shared_lines_merge_with_the_own_one_in_sending_order() {
    let (b, clock) = book(2);
    clock.advance(1000);
    let _own = b.begin_prefill(0, 10, Some(300.0), None, None, 0); // sent at 1000
    // Another replica sent 500 ms of work at 900 (ahead of ours) and
    // 200 ms at 1050.
    b.set_shared_line(
        0,
        SharedLine {
            items: vec![(1050, 200_000, 0), (900, 500_000, 0)],
            last_done_ms: None,
            reading: 0,
        },
    );
    // The head is theirs, computing since 900: at 1000 it has 400 left.
    assert_eq!(b.remaining_ms(0, 1000), 400.0 + 300.0 + 200.0);
    // P finished their head at 1400 (they said so): ours computes since.
    b.set_shared_line(
        0,
        SharedLine {
            items: vec![(1050, 200_000, 0)],
            last_done_ms: Some(1400),
            reading: 0,
        },
    );
    assert_eq!(b.remaining_ms(0, 1500), 200.0 + 200.0);
    // Only shared work on an engine this replica sent nothing to.
    b.set_shared_line(
        1,
        SharedLine {
            items: vec![(1000, 100_000, 0)],
            last_done_ms: None,
            reading: 0,
        },
    );
    assert_eq!(b.remaining_ms(1, 1030), 70.0);
    let own = b.own_line(0, 1500).unwrap();
    assert_eq!(
        own.items,
        vec![(500, 300_000)],
        "only this replica's own line is shared"
    );
    assert_eq!(own.done_age_ms, None);
    b.set_shared_line(1, SharedLine::default());
    assert_eq!(b.remaining_ms(1, 1030), 0.0);
}

#[test]
fn measured_cost_is_an_ewma() {
    let (b, _) = book(1);
    assert_eq!(b.measured_ms_per_token(0), None);
    b.record_prefill(0, 100, 10.0);
    assert_eq!(b.measured_ms_per_token(0), Some(0.1));
    b.record_prefill(0, 100, 20.0);
    let m = b.measured_ms_per_token(0).unwrap();
    assert!((m - 0.12).abs() < 1e-12, "{m}");
    b.record_prefill(0, 0, 5.0);
    b.record_prefill(0, 10, f64::NAN);
    assert_eq!(b.measured_ms_per_token(0), Some(m));
}

#[test]
fn a_conversation_routed_here_drops_its_prefill_from_the_shared_lines() {
    let (b, clock) = book(2);
    clock.advance(1000);
    // Another replica shares prefills of conversations 7 and 8 on engine
    // 0, and one with no conversation; then it dies and the client
    // retries conversation 7 here.
    let line = || SharedLine {
        items: vec![(900, 300_000, 7), (950, 200_000, 8), (960, 100_000, 0)],
        last_done_ms: None,
        reading: 0,
    };
    b.set_shared_line(0, line());
    assert_eq!(b.remaining_ms(0, 1000), 500.0);
    b.supersede(7);
    assert_eq!(
        b.remaining_ms(0, 1000),
        250.0,
        "8's 200 ms and 0's 100 ms, head since 950"
    );
    // Its share, read again before it ages out, still lists 7: dropped.
    clock.advance(100);
    b.set_shared_line(0, line());
    assert_eq!(b.shared_items(0), vec![(950, 200_000), (960, 100_000)]);
    // The conversation's next turn, routed by the other replica after
    // this one's, counts.
    b.set_shared_line(
        0,
        SharedLine {
            items: vec![(1050, 400_000, 7)],
            last_done_ms: None,
            reading: 0,
        },
    );
    assert_eq!(b.shared_items(0), vec![(1050, 400_000)]);
    // Remembered for SUPERSEDED_KEEP_MS, then forgotten.
    clock.advance(SUPERSEDED_KEEP_MS + 1);
    b.set_shared_line(0, line());
    assert_eq!(b.shared_items(0).len(), 3);
    b.supersede(0);
    assert_eq!(b.shared_items(0).len(), 3, "0 names no conversation");
}

#[test]
fn own_lines_name_their_conversations() {
    let (b, _) = book(2);
    let g = b.begin_prefill(0, 10, Some(100.0), None, None, 42);
    let h = b.begin_prefill(0, 10, Some(100.0), None, None, 0);
    let i = b.begin_prefill(1, 10, Some(100.0), None, None, 0);
    assert!(
        b.own_line(1, 0).unwrap().conversations.is_empty(),
        "none named"
    );
    assert_eq!(b.own_line(0, 0).unwrap().conversations, vec![42, 0]);
    drop((g, h, i));
}

#[test]
fn a_pull_whose_agent_notices_its_cuts_is_not_assumed_cut_at_the_deadline() {
    let (b, clock) = book(1);
    // As in an_abandoned_pull_reenters_the_line_as_a_whole_recompute, but
    // P's agent sends notices: overtaken and past its deadline, the pull
    // is still READing (its agent cuts only on its progress), not in line.
    let pull = overtaken_pull(&b, &clock, true, pull_digest("d0", "r"));
    assert_eq!(b.remaining_ms(0, 1600), 0.0, "no assumed cut");
    assert_eq!(b.remaining_ms(0, 2500), 0.0);
    // The notice comes at 2.5 s: the whole prompt from then.
    clock.advance(1370);
    assert!(b.pull_abandoned(pull_digest("d0", "r")));
    assert_eq!(b.remaining_ms(0, 2500), 900.0);
    drop(pull);
}

#[test]
fn a_pull_whose_read_end_is_noticed_joins_the_line_at_the_notice() {
    let (b, clock) = book(1);
    clock.advance(1000);
    let digest = pull_digest("d0", "cmpl-9");
    let pull = b.begin_prefill(0, 10, Some(50.0), read_noticed(digest), None, 0);
    assert_eq!(b.remaining_ms(0, 1000), 0.0, "READing: not in P's line");
    assert_eq!(b.own_line(0, 1000).unwrap().reading, 1, "shared as a count");
    assert!(b.own_line(0, 1000).unwrap().items.is_empty(), "nor shared");
    // P computes a turn sent after it while the READ runs.
    clock.advance(10);
    let r1 = b.begin_prefill(0, 10, Some(100.0), None, None, 0);
    assert_eq!(b.remaining_ms(0, 1060), 50.0, "r1 heads the line");
    // P answers a short one: nothing in line was overtaken.
    let r2 = b.begin_prefill(0, 10, Some(5.0), None, None, 0);
    clock.advance(60);
    drop(r2);
    // The READ ends at 1080: the pull joins the tail, behind r1.
    clock.advance(10);
    assert!(!b.pull_read(pull_digest("d0", "cmpl-8")), "another pull");
    assert!(b.pull_read(digest));
    assert_eq!(b.remaining_ms(0, 1080), 80.0, "r1's last 30 ms, then 50");
    assert_eq!(b.own_line(0, 1080).unwrap().reading, 0);
    assert_eq!(
        b.own_line(0, 1080).unwrap().items,
        vec![(70, 100_000), (0, 50_000)]
    );
    assert!(b.pull_read(digest), "a repeat changes nothing");
    assert_eq!(b.remaining_ms(0, 1080), 80.0);
    clock.advance(30);
    drop(r1);
    assert_eq!(b.remaining_ms(0, 1110), 50.0, "P starts the pull now");
    drop(pull);
    assert!(!b.pull_read(digest), "answered: gone from the book");
    assert!(!b.pull_read(0));
    // Without a digest no notice can match: the book guesses as before.
    let _blind = b.begin_prefill(0, 10, Some(50.0), read_noticed(0), None, 0);
    assert_eq!(b.remaining_ms(0, 1110), 50.0, "in line from the start");
}

#[test]
fn a_noticed_pull_cut_joins_the_line_as_a_whole_recompute_at_its_tail() {
    let (b, clock) = book(1);
    clock.advance(1000);
    let r1 = b.begin_prefill(0, 10, Some(100.0), None, None, 0);
    let digest = pull_digest("d0", "cmpl-10");
    let pull = b.begin_prefill(
        0,
        10,
        Some(50.0),
        read_noticed(digest),
        Some(abandon_at_600(true)),
        0,
    );
    clock.advance(50);
    assert_eq!(b.remaining_ms(0, 1050), 50.0, "r1 only");
    assert!(b.pull_abandoned(digest));
    assert_eq!(b.remaining_ms(0, 1050), 950.0, "r1's rest, then 900");
    // A read notice after the cut (out of order) changes nothing.
    assert!(b.pull_read(digest));
    assert_eq!(b.remaining_ms(0, 1050), 950.0);
    drop((r1, pull));
}

#[test]
fn other_replicas_pulls_still_reading_are_known_requests() {
    let (b, _) = book(1);
    let _g = b.begin_prefill(0, 10, Some(300.0), None, None, 0);
    b.set_shared_line(
        0,
        SharedLine {
            items: Vec::new(),
            last_done_ms: None,
            reading: 2,
        },
    );
    // P reports its own one and the two READing: none unknown, and the
    // READing ones are not work in its line.
    b.set_reported_requests(0, Some(3));
    assert_eq!(b.queue_ms(0, 0), Some(300.0));
}
