//! Unit tests of the scheduler; `proptests.rs` checks it against a model.

use std::num::NonZeroUsize;
use std::time::Duration;

use super::*;

fn scheduler(concurrency: usize) -> Scheduler<&'static str> {
    Scheduler::new(NonZeroUsize::new(concurrency).unwrap())
}

/// Settles a re-dispatch as the engine does when the subscription's next
/// message, `next` (ordered by `key`), was received: it takes the place of
/// the message the permit goes to. Returns that message, and whether the
/// subscription's next one is next in line.
fn exchange_keyed<M>(redispatch: Redispatch<'_, M>, next: M, key: Option<u64>) -> (M, bool) {
    let mut next = Some(next);
    let mut taken = None;
    let next_in_line = redispatch.exchange(
        |waiting| taken = Some(std::mem::replace(waiting, next.take().expect("once"))),
        |_| key,
        || None::<M>,
    );
    (taken.expect("exchanged"), next_in_line)
}

/// [`exchange_keyed`] for a message without a key.
fn exchange<M>(redispatch: Redispatch<'_, M>, next: M) -> (M, bool) {
    exchange_keyed(redispatch, next, None)
}

/// Dispatches and keeps the permit for later release.
fn dispatch(s: &mut Scheduler<&'static str>, permits: &mut Vec<Permit>) -> Option<&'static str> {
    let (permit, message) = s.try_dispatch()?;
    permits.push(permit);
    Some(message)
}

fn release_first(s: &mut Scheduler<&'static str>, permits: &mut Vec<Permit>) {
    s.release(permits.remove(0));
}

/// Dispatches one message, ends it at once and puts the same message back
/// into its subscription, which so stays backlogged and joins the back of
/// its level's line. Returns the message.
fn serve_and_refill(s: &mut Scheduler<&'static str>) -> &'static str {
    let (permit, message) = s.try_dispatch().expect("a message is waiting");
    let key = permit.subscription();
    s.release(permit);
    s.try_insert(key, message).unwrap();
    message
}

#[test]
fn lower_priority_value_is_served_first_whatever_the_insertion_order() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    let low = s.add_subscription(20);
    let high = s.add_subscription(5);
    let mid = s.add_subscription(10);
    s.try_insert(low, "low").unwrap();
    s.try_insert(mid, "mid").unwrap();
    s.try_insert(high, "high").unwrap();
    assert_eq!(dispatch(&mut s, &mut permits), Some("high"));
    assert_eq!(dispatch(&mut s, &mut permits), Some("mid"));
    assert_eq!(dispatch(&mut s, &mut permits), Some("low"));
    assert_eq!(dispatch(&mut s, &mut permits), None);
    assert_eq!(s.in_flight(), 3);
}

#[test]
fn negative_and_sparse_priorities_are_ordered() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    for (priority, name) in [
        (1000, "1000"),
        (-5, "-5"),
        (0, "0"),
        (i64::MIN, "min"),
        (7, "7"),
    ] {
        let key = s.add_subscription(priority);
        s.try_insert(key, name).unwrap();
    }
    let order: Vec<_> = std::iter::from_fn(|| dispatch(&mut s, &mut permits)).collect();
    assert_eq!(order, ["min", "-5", "0", "7", "1000"]);
}

#[test]
fn equal_priorities_take_turns_while_all_stay_busy() {
    let mut s = scheduler(100);
    let names = ["a", "b", "c"];
    let keys: Vec<_> = names.iter().map(|_| s.add_subscription(10)).collect();
    for (key, name) in keys.iter().zip(names) {
        s.try_insert(*key, name).unwrap();
    }
    let order: Vec<_> = (0..6).map(|_| serve_and_refill(&mut s)).collect();
    assert_eq!(order, ["a", "b", "c", "a", "b", "c"]);
}

#[test]
fn a_full_slot_rejects_and_returns_the_message() {
    let mut s = scheduler(1);
    let a = s.add_subscription(1);
    s.try_insert(a, "first").unwrap();
    assert!(!s.has_vacancy(a));
    assert_eq!(s.try_insert(a, "second"), Err(Rejected::Full("second")));
}

#[test]
fn no_message_is_picked_without_a_permit() {
    let mut s = scheduler(1);
    let mut permits = Vec::new();
    let low = s.add_subscription(20);
    let high = s.add_subscription(10);
    s.try_insert(low, "low-1").unwrap();
    assert_eq!(dispatch(&mut s, &mut permits), Some("low-1"));
    s.try_insert(low, "low-2").unwrap();
    assert_eq!(
        dispatch(&mut s, &mut permits),
        None,
        "the only permit is taken"
    );
    // A high-priority message arriving while capacity is exhausted wins
    // once the permit comes back.
    s.try_insert(high, "high").unwrap();
    release_first(&mut s, &mut permits);
    assert_eq!(dispatch(&mut s, &mut permits), Some("high"));
    release_first(&mut s, &mut permits);
    assert_eq!(dispatch(&mut s, &mut permits), Some("low-2"));
}

#[test]
fn closing_rejects_insertions_but_drains_slots() {
    let mut s = scheduler(5);
    let mut permits = Vec::new();
    let a = s.add_subscription(1);
    let b = s.add_subscription(2);
    s.try_insert(a, "a").unwrap();
    s.close();
    assert_eq!(s.try_insert(b, "b"), Err(Rejected::Closed("b")));
    assert_eq!(s.waiting(), 1);
    assert_eq!(dispatch(&mut s, &mut permits), Some("a"));
    assert_eq!(dispatch(&mut s, &mut permits), None);
    assert!(!s.is_idle(), "one message is in flight");
    release_first(&mut s, &mut permits);
    assert!(s.is_idle());
}

#[test]
fn more_than_64_priority_levels_are_ordered() {
    let mut s = scheduler(200);
    let mut permits = Vec::new();
    let keys: Vec<_> = (0..150).rev().map(|p| (p, s.add_subscription(p))).collect();
    let names: Vec<&'static str> = (0..150)
        .map(|p| &*Box::leak(p.to_string().into_boxed_str()))
        .collect();
    for (p, key) in &keys {
        s.try_insert(*key, names[*p as usize]).unwrap();
    }
    let order: Vec<_> = std::iter::from_fn(|| dispatch(&mut s, &mut permits)).collect();
    assert_eq!(order, names);
}

#[test]
fn ready_queues_hold_their_whole_level_without_growing() {
    let mut s = scheduler(1);
    let keys: Vec<_> = (0..10).map(|_| s.add_subscription(7)).collect();
    let capacity = s.levels[0].ready.capacity();
    assert!(capacity >= 10, "capacity {capacity} for 10 members");
    for key in keys {
        s.try_insert(key, "m").unwrap();
    }
    assert_eq!(s.levels[0].ready.capacity(), capacity);
    assert_eq!(s.waiting(), 10);
}

#[test]
fn a_subscription_at_its_limit_is_passed_over_without_blocking_others() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    let limited = s.add(SubscriptionConfig {
        max_in_flight: NonZeroUsize::new(1),
        ..SubscriptionConfig::new(1)
    });
    let other = s.add_subscription(5);
    s.try_insert(limited, "l1").unwrap();
    s.try_insert(other, "o1").unwrap();
    assert_eq!(dispatch(&mut s, &mut permits), Some("l1"));
    s.try_insert(limited, "l2").unwrap();
    assert_eq!(
        dispatch(&mut s, &mut permits),
        Some("o1"),
        "the better subscription is at its limit"
    );
    assert_eq!(dispatch(&mut s, &mut permits), None);
    assert_eq!(s.load(limited), (1, 1));
    release_first(&mut s, &mut permits);
    assert_eq!(dispatch(&mut s, &mut permits), Some("l2"));
}

#[test]
fn subscription_ordering_runs_one_message_at_a_time() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    let ordered = s.add(SubscriptionConfig {
        ordering: Ordering::Subscription,
        ..SubscriptionConfig::new(1)
    });
    s.try_insert(ordered, "1").unwrap();
    assert_eq!(dispatch(&mut s, &mut permits), Some("1"));
    s.try_insert(ordered, "2").unwrap();
    assert_eq!(dispatch(&mut s, &mut permits), None);
    release_first(&mut s, &mut permits);
    assert_eq!(dispatch(&mut s, &mut permits), Some("2"));
}

#[test]
fn key_ordering_runs_keys_concurrently_but_never_one_key_twice() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    let keyed = s.add(SubscriptionConfig {
        ordering: Ordering::Key,
        key_buffer: 3,
        ..SubscriptionConfig::new(1)
    });
    s.try_insert_keyed(keyed, "a1", Some(1)).unwrap();
    s.try_insert_keyed(keyed, "a2", Some(1)).unwrap();
    s.try_insert_keyed(keyed, "b1", Some(2)).unwrap();
    assert!(!s.has_vacancy(keyed), "the buffer is full");
    assert_eq!(dispatch(&mut s, &mut permits), Some("a1"));
    assert_eq!(
        dispatch(&mut s, &mut permits),
        Some("b1"),
        "a2 waits for a1 without holding up b1"
    );
    assert_eq!(dispatch(&mut s, &mut permits), None);
    assert!(s.has_vacancy(keyed));
    s.try_insert_keyed(keyed, "none", None).unwrap();
    assert_eq!(
        dispatch(&mut s, &mut permits),
        Some("none"),
        "no key, no wait"
    );
    let holds_key: Vec<bool> = permits.iter().map(Permit::holds_key).collect();
    assert_eq!(
        holds_key,
        [true, true, false],
        "a message without a key holds none"
    );
    release_first(&mut s, &mut permits);
    assert_eq!(dispatch(&mut s, &mut permits), Some("a2"));
    assert!(!s.is_idle() && s.waiting() == 0);
}

#[test]
fn set_priority_takes_effect_at_the_next_pick_and_moves_a_waiting_message() {
    let mut s = scheduler(1);
    let mut permits = Vec::new();
    let a = s.add_subscription(10);
    let b = s.add_subscription(20);
    s.try_insert(a, "a").unwrap();
    s.try_insert(b, "b").unwrap();
    s.set_priority(b, 5);
    assert_eq!(s.priority(b), 5);
    assert_eq!(dispatch(&mut s, &mut permits), Some("b"));
    s.set_priority(a, 30);
    assert_eq!(s.levels.len(), 2, "the emptied level 20 is gone, 30 is new");
    release_first(&mut s, &mut permits);
    assert_eq!(dispatch(&mut s, &mut permits), Some("a"));
}

#[test]
fn a_removed_subscription_frees_its_key_and_level() {
    let mut s = scheduler(2);
    let mut permits = Vec::new();
    let a = s.add_subscription(10);
    let b = s.add_subscription(20);
    s.try_insert(a, "a").unwrap();
    assert!(!s.remove_subscription(a), "it holds a message");
    assert_eq!(dispatch(&mut s, &mut permits), Some("a"));
    assert!(!s.remove_subscription(a), "its message is in flight");
    release_first(&mut s, &mut permits);
    assert!(s.remove_subscription(a));
    assert_eq!(s.levels.len(), 1);
    let c = s.add_subscription(5);
    assert_eq!(c, a, "the key is reused");
    s.try_insert(b, "b").unwrap();
    s.try_insert(c, "c").unwrap();
    assert_eq!(dispatch(&mut s, &mut permits), Some("c"));
    assert_eq!(dispatch(&mut s, &mut permits), Some("b"));
}

/// A scheduler of one permit weighted by `weights`, with two backlogged
/// subscriptions: "h" at priority 1, "l" at priority 2.
fn two_weighted_levels(weights: Weights) -> Scheduler<&'static str> {
    let policy = SchedulingPolicy::Weighted(weights);
    let mut s = Scheduler::with_policy(NonZeroUsize::new(1).unwrap(), policy);
    let high = s.add_subscription(1);
    let low = s.add_subscription(2);
    s.try_insert(high, "h").unwrap();
    s.try_insert(low, "l").unwrap();
    s
}

/// The order in which [`two_weighted_levels`] serves `dispatches`
/// messages, one at a time.
fn weighted_order(weights: Weights, dispatches: usize) -> String {
    let mut s = two_weighted_levels(weights);
    (0..dispatches).map(|_| serve_and_refill(&mut s)).collect()
}

#[test]
fn weighted_levels_share_dispatches_by_weight() {
    let weights = Weights::new().level(1, 3).level(2, 1);
    assert_eq!(weighted_order(weights, 12), "hhhlhhhlhhhl");
}

/// Levels not named take the `others` weight, which leaves the named
/// levels' weights as they were.
#[test]
fn levels_not_named_take_the_others_weight() {
    let weights = Weights::new().level(2, 1).others(3);
    assert_eq!(weighted_order(weights, 8), "hhhlhhhl");
}

/// A level removed in the middle of another level's turn (here the best
/// one, so the levels after it are renumbered) leaves that turn as it was.
#[test]
fn removing_a_level_mid_turn_keeps_the_turn() {
    let mut s = two_weighted_levels(Weights::new().level(1, 3).level(2, 1));
    let idle = s.add_subscription(0);
    let mut order: String = (0..2).map(|_| serve_and_refill(&mut s)).collect();
    assert!(s.remove_subscription(idle));
    order.extend((2..8).map(|_| serve_and_refill(&mut s)));
    assert_eq!(order, "hhhlhhhl");
}

#[test]
fn a_weighted_level_without_work_gives_its_turn_away() {
    let policy = SchedulingPolicy::Weighted(Weights::new().level(1, 5));
    let mut s = Scheduler::with_policy(NonZeroUsize::new(10).unwrap(), policy);
    let mut permits = Vec::new();
    let high = s.add_subscription(1);
    let low = s.add_subscription(2);
    s.try_insert(high, "h").unwrap();
    s.try_insert(low, "l").unwrap();
    assert_eq!(dispatch(&mut s, &mut permits), Some("h"));
    assert_eq!(dispatch(&mut s, &mut permits), Some("l"));
}

thread_local! {
    static NOW: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

fn fake_now() -> Instant {
    NOW.with(|now| *now.get().get_or_insert_with(Instant::now))
}

fn advance(by: Duration) {
    NOW.with(|now| now.set(Some(fake_now() + by)));
}

#[test]
fn an_aged_message_overtakes_fresher_better_ones_up_to_the_bound() {
    let policy = SchedulingPolicy::Aging(Aging::new(10.0, 15));
    let mut s = Scheduler::with_policy(NonZeroUsize::new(1).unwrap(), policy).with_clock(fake_now);
    let high = s.add_subscription(10);
    let low = s.add_subscription(20);
    s.try_insert(low, "low").unwrap();
    advance(Duration::from_millis(500));
    s.try_insert(high, "high").unwrap();
    // low has waited 0.5 s: 20 - 5 = 15, still worse than 10.
    let (permit, first) = s.try_dispatch().unwrap();
    assert_eq!(first, "high");
    s.release(permit);
    advance(Duration::from_millis(600));
    s.try_insert(high, "high").unwrap();
    // low has waited 1.1 s: 20 - 11 = 9, better than a fresh 10.
    let (permit, second) = s.try_dispatch().unwrap();
    assert_eq!(second, "low");
    s.release(permit);
    let (permit, _) = s.try_dispatch().unwrap();
    s.release(permit);
    let far = s.add_subscription(100);
    s.try_insert(far, "far").unwrap();
    advance(Duration::from_secs(60));
    s.try_insert(high, "high").unwrap();
    // far can improve by 15 at most: 85 never beats a fresh 10.
    let (_, third) = s.try_dispatch().unwrap();
    assert_eq!(third, "high");
}

/// A better level that stays backlogged (its slot refilled as soon as it
/// is picked, as the engine does) does not hold a worse level back for
/// good: its messages age too, and the worse one goes once it has waited
/// the priority difference longer than the better level's next message.
/// With waits counted only up to `max_boost`, both capped, the better
/// level won every pick.
#[test]
fn an_aged_message_is_served_while_a_better_level_stays_backlogged() {
    // At its fourth pick low has waited 9 s against 3 s for high's head:
    // 40 - 90 beats 10 - 30 (at the third, 40 - 60 ties 10 - 30, and the
    // tie goes to the better level).
    let expected = ["high", "high", "high", "low", "high", "high"];
    assert_eq!(aged_picks(0), expected);
    // The same far from zero, where a priority as an `f64` loses the
    // gap (steps of 1,024 or more beyond 2^62).
    assert_eq!(aged_picks(i64::MIN), expected);
    assert_eq!(aged_picks(i64::MAX - 40), expected);
}

/// The picks of a level at `base + 10`, backlogged, and one message at
/// `base + 40`, under aging of 10 points a second up to 50.
fn aged_picks(base: i64) -> Vec<&'static str> {
    let policy = SchedulingPolicy::Aging(Aging::new(10.0, 50));
    let mut s = Scheduler::with_policy(NonZeroUsize::new(1).unwrap(), policy).with_clock(fake_now);
    let high = s.add_subscription(base + 10);
    let low = s.add_subscription(base + 40);
    // The fake clock stands still from here: both arrive at one instant.
    advance(Duration::ZERO);
    s.try_insert(low, "low").unwrap();
    s.try_insert(high, "high").unwrap();
    let mut picked = Vec::new();
    for _ in 0..6 {
        let (permit, message) = s.try_dispatch().unwrap();
        picked.push(message);
        if message == "high" {
            s.try_insert(high, "high").unwrap();
        }
        // Each handler runs 3 s, longer than the 3-point gap takes to age
        // away (0.3 s) and than the 5 s bound allows twice over.
        advance(Duration::from_secs(3));
        s.release(permit);
    }
    picked
}

#[test]
fn an_aging_bound_too_long_for_a_duration_is_the_longest_one() {
    assert_eq!(Aging::new(0.1, i64::MAX).bound(), Some(Duration::MAX));
    assert_eq!(Aging::new(1e-310, 1).bound(), Some(Duration::MAX));
    assert_eq!(Aging::new(10.0, 50).bound(), Some(Duration::from_secs(5)));
}

#[test]
fn without_a_rate_nothing_ages_so_there_is_no_bound() {
    for per_second in [0.0, -1.0, f64::NAN] {
        assert_eq!(Aging::new(per_second, 50).bound(), None, "{per_second}");
    }
}

thread_local! {
    static READS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn counted_now() -> Instant {
    READS.with(|reads| reads.set(reads.get() + 1));
    fake_now()
}

#[test]
fn within_a_round_aging_reads_the_clock_once() {
    let policy = SchedulingPolicy::Aging(Aging::new(10.0, 15));
    let mut s =
        Scheduler::with_policy(NonZeroUsize::new(2).unwrap(), policy).with_clock(counted_now);
    let high = s.add_subscription(10);
    let low = s.add_subscription(20);
    s.try_insert(low, "low").unwrap();
    advance(Duration::from_secs(2));
    let reads = || READS.with(|reads| reads.get());
    let before = reads();
    s.begin_round();
    s.try_insert(high, "high").unwrap();
    // low waited 2 s by the round's time: 20 - 15 (the bound) beats 10.
    let (first, _) = s.try_dispatch().unwrap();
    let (second, _) = s.try_dispatch().unwrap();
    s.end_round();
    assert_eq!(
        reads() - before,
        1,
        "one read for an insertion and two picks"
    );
    assert_eq!((first.subscription(), second.subscription()), (low, high));
    s.release(first);
    s.release(second);
    s.try_insert(low, "low").unwrap();
    assert_eq!(reads() - before, 2, "outside a round every use reads it");
}

/// The builder refuses such reservations first; the scheduler's own check
/// counts every reservation, not the last one alone.
#[test]
#[should_panic(expected = "reservations must leave a permit")]
fn reservations_that_add_up_to_the_limit_panic() {
    let mut s = scheduler(3);
    s.reserve(10, 2);
    s.reserve(20, 1);
}

#[test]
fn reserved_permits_are_left_for_better_levels() {
    let mut s = scheduler(3);
    let mut permits = Vec::new();
    s.reserve(10, 1);
    let urgent = s.add_subscription(10);
    let bulk = s.add_subscription(50);
    for _ in 0..3 {
        s.try_insert(bulk, "bulk").unwrap();
        let _ = dispatch(&mut s, &mut permits);
    }
    assert_eq!(s.in_flight(), 2, "one permit stays free for level 10");
    assert_eq!(s.waiting(), 1);
    s.try_insert(urgent, "urgent").unwrap();
    assert_eq!(dispatch(&mut s, &mut permits), Some("urgent"));
}

#[test]
fn take_waiting_hands_back_every_held_message() {
    let mut s = scheduler(1);
    let keyed = s.add(SubscriptionConfig {
        ordering: Ordering::Key,
        key_buffer: 4,
        ..SubscriptionConfig::new(1)
    });
    s.try_insert_keyed(keyed, "a1", Some(1)).unwrap();
    s.try_insert_keyed(keyed, "a2", Some(1)).unwrap();
    let mut taken = Vec::new();
    while let Some((_, message)) = s.take_waiting() {
        taken.push(message);
    }
    assert_eq!(taken, ["a1", "a2"]);
    assert!(s.is_idle());
    assert!(s.try_dispatch().is_none());
}

#[test]
fn a_held_permit_is_no_one_elses_until_given_back() {
    let mut s = scheduler(1);
    let a = s.add(SubscriptionConfig::new(1));
    let held = s.hold().expect("a free permit");
    assert!(s.hold().is_none(), "the only permit is held");
    s.try_insert(a, "a").unwrap();
    assert!(
        s.try_dispatch().is_none(),
        "a held permit is not dispatched"
    );
    assert_eq!(
        (s.in_flight(), s.running()),
        (1, 0),
        "a held permit is taken but runs nothing"
    );
    assert!(!s.is_idle(), "shutdown waits for a held permit too");
    s.unhold(held);
    let (permit, message) = s.try_dispatch().expect("the permit is back");
    assert_eq!(message, "a");
    assert_eq!((s.in_flight(), s.running()), (1, 1));
    s.release(permit);
    assert!(s.is_idle());
}

/// Picks with [`Scheduler::try_dispatch_refilling`], refilling each slot
/// with the next name from `next` (if any), and keeps the permit.
fn dispatch_refilling(
    s: &mut Scheduler<&'static str>,
    permits: &mut Vec<Permit>,
    next: &mut Vec<&'static str>,
) -> Option<(&'static str, bool, bool)> {
    let pick = s.try_dispatch_refilling(|_| next.pop())?;
    permits.push(pick.permit);
    Some((pick.message, pick.refill_called, pick.permits_left))
}

#[test]
fn a_slot_refilled_within_the_pick_takes_its_turn_after_the_others() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    let a = s.add_subscription(1);
    let b = s.add_subscription(1);
    s.try_insert(a, "a1").unwrap();
    s.try_insert(b, "b1").unwrap();
    // Refills are popped from the back: a gets a2, then b gets b2.
    let mut next = vec!["b2", "a2"];
    let order: Vec<_> = std::iter::from_fn(|| dispatch_refilling(&mut s, &mut permits, &mut next))
        .map(|(message, refill_called, _)| {
            assert!(refill_called, "a slot is refilled within the pick");
            message
        })
        .collect();
    assert_eq!(order, ["a1", "b1", "a2", "b2"]);
    assert_eq!(s.waiting(), 0);
    assert_eq!(s.in_flight(), 4);
}

#[test]
fn a_lone_refilled_slot_stays_ready_until_the_permits_run_out() {
    let mut s = scheduler(3);
    let mut permits = Vec::new();
    let only = s.add_subscription(0);
    s.try_insert(only, "1").unwrap();
    let mut next = vec!["4", "3", "2"];
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("1", true, true))
    );
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("2", true, true))
    );
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("3", true, false)),
        "the last permit is taken"
    );
    assert_eq!(dispatch_refilling(&mut s, &mut permits, &mut next), None);
    assert_eq!(s.load(only), (1, 3), "4 waits in the slot");
    release_first(&mut s, &mut permits);
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("4", true, false))
    );
    assert_eq!(s.load(only), (0, 3));
    release_first(&mut s, &mut permits);
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        None,
        "an empty slot left the ready queue"
    );
}

#[test]
fn a_slot_at_its_in_flight_limit_leaves_the_ready_queue_though_refilled() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    let limited = s.add(SubscriptionConfig {
        max_in_flight: NonZeroUsize::new(1),
        ..SubscriptionConfig::new(0)
    });
    let other = s.add_subscription(5);
    s.try_insert(limited, "l1").unwrap();
    s.try_insert(other, "o1").unwrap();
    let mut next = vec!["o2", "l2"];
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("l1", true, true))
    );
    assert_eq!(s.load(limited), (1, 1), "refilled, and at its limit");
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("o1", true, true)),
        "the limited subscription waits"
    );
    release_first(&mut s, &mut permits);
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("l2", true, true)),
        "ready again once its message is released"
    );
}

#[test]
fn a_closed_scheduler_does_not_refill_and_key_buffers_are_left_to_the_caller() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    let keyed = s.add(SubscriptionConfig {
        ordering: Ordering::Key,
        key_buffer: 2,
        ..SubscriptionConfig::new(0)
    });
    let slot = s.add_subscription(1);
    s.try_insert_keyed(keyed, "k1", Some(1)).unwrap();
    s.try_insert(slot, "s1").unwrap();
    let mut next = vec!["never"];
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("k1", false, true)),
        "a key buffer is not refilled here"
    );
    s.close();
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("s1", false, true)),
        "nothing is refilled once closed"
    );
    assert_eq!(next, ["never"]);
    assert_eq!(s.waiting(), 0);
    assert_eq!(dispatch_refilling(&mut s, &mut permits, &mut next), None);
}

/// A refilled message that tells its key, as the engine's does.
struct Told(&'static str, Option<u64>);

impl Refilled<&'static str> for Told {
    const TELLS_KEY: bool = true;

    fn refill_key(&self) -> Option<u64> {
        self.1
    }

    fn into_refilled(self) -> &'static str {
        self.0
    }
}

#[test]
fn a_key_buffer_refilled_within_the_pick_takes_more_while_every_key_is_busy() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    let keyed = s.add(SubscriptionConfig {
        ordering: Ordering::Key,
        key_buffer: 3,
        ..SubscriptionConfig::new(0)
    });
    let other = s.add_subscription(0);
    s.try_insert_keyed(keyed, "a1", Some(1)).unwrap();
    s.try_insert(other, "o1").unwrap();
    // Refills of the key buffer are popped from the back; the other
    // subscription has nothing more.
    let mut next = vec![
        Told("c1", Some(3)),
        Told("b1", Some(2)),
        Told("a2", Some(1)),
    ];
    let mut pick = |s: &mut Scheduler<&'static str>, next: &mut Vec<Told>| {
        let pick = s.try_dispatch_refilling(|picked| match *picked {
            "o1" => None,
            _ => next.pop(),
        })?;
        permits.push(pick.permit);
        Some((pick.message, pick.refill_called))
    };
    assert_eq!(pick(&mut s, &mut next), Some(("a1", true)));
    assert_eq!(next.len(), 1, "a2 waits for a1, so b1 is taken too");
    assert_eq!(s.load(keyed), (2, 1));
    assert_eq!(
        pick(&mut s, &mut next),
        Some(("o1", true)),
        "the refilled buffer took its turn after the other subscription"
    );
    assert_eq!(pick(&mut s, &mut next), Some(("b1", true)));
    assert!(next.is_empty(), "c1 taken: it may run, so the refill stops");
    assert_eq!(pick(&mut s, &mut next), Some(("c1", true)));
    assert_eq!(pick(&mut s, &mut next), None, "a2 waits for a1");
    assert_eq!(s.load(keyed), (1, 3));
    s.release(permits.remove(0));
    let (permit, message) = s.try_dispatch().expect("a1 released");
    assert_eq!(message, "a2");
    s.release(permit);
}

#[test]
fn a_refill_that_panics_leaves_the_queue_sound() {
    let mut s = scheduler(10);
    let mut permits = Vec::new();
    let a = s.add_subscription(1);
    let b = s.add_subscription(1);
    s.try_insert(a, "a1").unwrap();
    s.try_insert(b, "b1").unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        s.try_dispatch_refilling(|_| -> Option<&str> { panic!("a broken transport") })
    }));
    assert!(panicked.is_err());
    assert_eq!(s.load(a), (0, 1), "a1 is lost with its pick, as its permit");
    let mut next = vec![];
    assert_eq!(
        dispatch_refilling(&mut s, &mut permits, &mut next),
        Some(("b1", true, true)),
        "the emptied slot left the ready queue"
    );
    assert_eq!(dispatch_refilling(&mut s, &mut permits, &mut next), None);
    assert!(
        s.try_insert(a, "a2").is_ok(),
        "its slot takes the next message"
    );
}

#[test]
fn a_subscription_fits_in_one_cache_line() {
    // The engine's message is two pointers: its subscription and its box.
    type Message = (std::rc::Rc<()>, Box<u64>);
    let mut s: Scheduler<Message> = Scheduler::new(NonZeroUsize::new(1).unwrap());
    let (first, second) = (s.add_subscription(0), s.add_subscription(0));
    let at = |key: SubscriptionKey| &s.subscriptions[key.0] as *const _ as usize;
    assert_eq!(at(first) % 64, 0);
    assert_eq!(
        at(second) - at(first),
        64,
        "the slab adds nothing around it"
    );
}

#[test]
fn a_pick_tells_whether_its_subscription_is_next_in_line_at_its_level() {
    let mut s = scheduler(4);
    let (a, b) = (s.add_subscription(0), s.add_subscription(0));
    s.try_insert(a, "a1").unwrap();
    s.try_insert(b, "b1").unwrap();
    let pick = s.try_dispatch_refilling(|_| Some("a2")).unwrap();
    assert_eq!(pick.message, "a1");
    assert!(!pick.next_in_line, "b takes the next turn at that level");
    let pick = s.try_dispatch_refilling(|_| None::<&str>).unwrap();
    assert_eq!(pick.message, "b1");
    assert!(!pick.next_in_line, "not refilled, so not ready");
    let pick = s.try_dispatch_refilling(|_| Some("a3")).unwrap();
    assert_eq!(pick.message, "a2");
    assert!(pick.next_in_line, "refilled, and alone at its level");
}

#[test]
fn a_redispatch_takes_the_lone_subscriptions_next_message_under_the_same_permit() {
    let mut s = scheduler(1);
    let only = s.add_subscription(0);
    s.try_insert(only, "1").unwrap();
    let mut permit = s.try_dispatch_refilling(|_| Some("2")).unwrap().permit;
    let (taken, next_in_line) = exchange(s.try_redispatch(&mut permit).expect("2 is next"), "3");
    assert_eq!(taken, "2");
    assert!(next_in_line, "still alone at its level");
    assert_eq!((s.in_flight(), s.waiting()), (1, 1));
    // Dropped unsettled: nothing changes.
    drop(s.try_redispatch(&mut permit).expect("3 is next"));
    assert_eq!((s.in_flight(), s.waiting()), (1, 1));
    // No next message: the slot's is taken out, and the slot left empty.
    let redispatch = s.try_redispatch(&mut permit).expect("3 is next");
    assert_eq!(redispatch.take(), "3");
    assert_eq!((s.in_flight(), s.waiting()), (1, 0));
    assert!(s.try_redispatch(&mut permit).is_none(), "nothing waits");
    s.release(permit);
    assert!(s.is_idle());
}

#[test]
fn a_redispatch_is_refused_when_a_release_and_a_pick_would_choose_otherwise() {
    let mut s = scheduler(2);
    let (a, b) = (s.add_subscription(1), s.add_subscription(1));
    s.try_insert(a, "a1").unwrap();
    s.try_insert(b, "b1").unwrap();
    let mut first = s.try_dispatch_refilling(|_| Some("a2")).unwrap().permit;
    assert!(
        s.try_redispatch(&mut first).is_none(),
        "a permit is still free"
    );
    let second = s.try_dispatch_refilling(|_| None::<&str>).unwrap().permit;
    // a2 is the only ready message: a takes it under its own permit.
    let (taken, next_in_line) = exchange(s.try_redispatch(&mut first).expect("a2 is next"), "a3");
    assert_eq!(taken, "a2");
    assert!(next_in_line);
    // A better subscription's message waits: it goes first.
    let better = s.add_subscription(0);
    s.try_insert(better, "better").unwrap();
    assert!(s.try_redispatch(&mut first).is_none());
    s.release(first);
    let pick = s.try_dispatch_refilling(|_| None::<&str>).unwrap();
    assert_eq!(pick.message, "better");
    for permit in [second, pick.permit] {
        s.release(permit);
    }
}

#[test]
fn a_subscription_at_its_in_flight_limit_redispatches_when_its_next_message_would_be_picked() {
    let one_at_a_time = |priority| SubscriptionConfig {
        ordering: Ordering::Subscription,
        ..SubscriptionConfig::new(priority)
    };
    let mut s = scheduler(2);
    s.reserve(0, 1);
    let ordered = s.add(one_at_a_time(5));
    let high = s.add_subscription(0);
    s.try_insert(ordered, "o1").unwrap();
    let mut first = s.try_dispatch_refilling(|_| Some("o2")).unwrap();
    assert_eq!(first.message, "o1");
    assert!(
        first.next_in_line,
        "o2 waits, at the limit, with no other at its level"
    );
    // With the other permit free and nothing else ready, o2 follows o1.
    let (taken, next_in_line) = exchange(
        s.try_redispatch(&mut first.permit).expect("o2 is next"),
        "o3",
    );
    assert_eq!(taken, "o2");
    assert!(next_in_line);
    assert_eq!((s.in_flight(), s.waiting()), (1, 1));
    // The last free permit is kept for priority 0: a release would leave
    // o3 waiting, so it is not re-dispatched either.
    s.try_insert(high, "h1").unwrap();
    let second = s.try_dispatch().unwrap();
    assert_eq!(second.1, "h1");
    assert!(s.try_redispatch(&mut first.permit).is_none());
    s.release(first.permit);
    assert!(
        s.try_dispatch().is_none(),
        "o3 waits for the reserved permit"
    );
    s.release(second.0);
    let (last, message) = s.try_dispatch().unwrap();
    assert_eq!(message, "o3");
    s.release(last);
    assert!(s.is_idle());
}

/// A key-ordered subscription holding up to `key_buffer` messages, one of
/// them in flight at a time.
fn add_keyed_one_at_a_time(s: &mut Scheduler<&'static str>, key_buffer: usize) -> SubscriptionKey {
    s.add(SubscriptionConfig {
        ordering: Ordering::Key,
        key_buffer,
        max_in_flight: NonZeroUsize::new(1),
        ..SubscriptionConfig::new(0)
    })
}

/// At its in-flight limit, a key buffer that a re-dispatch leaves holding
/// only a parked message has nothing next in line: nothing it holds may
/// run when the permit comes back.
#[test]
fn a_key_buffer_at_its_limit_left_with_a_parked_message_has_nothing_next_in_line() {
    let mut s = scheduler(2);
    let keyed = add_keyed_one_at_a_time(&mut s, 2);
    for (message, key) in [("a1", 1), ("b1", 2)] {
        s.try_insert_keyed(keyed, message, Some(key)).unwrap();
    }
    let (mut permit, first) = s.try_dispatch().unwrap();
    assert_eq!(first, "a1");
    // At its limit, b1 waits out of the ready queues; a1's end hands it
    // the permit, and b2, received in its place, waits behind it.
    let (taken, next_in_line) = exchange_keyed(
        s.try_redispatch(&mut permit)
            .expect("b1 is next at its limit"),
        "b2",
        Some(2),
    );
    assert_eq!(taken, "b1");
    assert!(!next_in_line, "b2 waits for b1's key: nothing held may run");
    assert!(s.try_redispatch(&mut permit).is_none(), "b2 is parked");
    s.release(permit);
    let (permit, last) = s.try_dispatch().expect("b1's end freed b2");
    assert_eq!(last, "b2");
    s.release(permit);
    assert!(s.is_idle());
}

/// The same for a pick whose refill leaves the key buffer, at its limit,
/// holding only a parked message.
#[test]
fn a_key_buffer_at_its_limit_refilled_with_a_parked_message_has_nothing_next_in_line() {
    let mut s = scheduler(2);
    let keyed = add_keyed_one_at_a_time(&mut s, 1);
    s.try_insert_keyed(keyed, "a1", Some(1)).unwrap();
    let mut refills = vec![Told("a2", Some(1))];
    let pick = s.try_dispatch_refilling(|_| refills.pop()).unwrap();
    assert_eq!(pick.message, "a1");
    assert!(pick.refill_called && refills.is_empty());
    assert!(
        !pick.next_in_line,
        "a2 waits for a1's key: nothing held may run"
    );
    s.release(pick.permit);
    let (permit, next) = s.try_dispatch().expect("a1's end freed a2");
    assert_eq!(next, "a2");
    s.release(permit);
    assert!(s.is_idle());
}

#[test]
fn a_key_buffer_redispatches_as_a_release_and_a_pick_would() {
    let mut s = scheduler(1);
    let keyed = s.add(SubscriptionConfig {
        ordering: Ordering::Key,
        key_buffer: 3,
        ..SubscriptionConfig::new(0)
    });
    for (message, key) in [("a1", 1), ("a2", 1), ("b1", 2)] {
        s.try_insert_keyed(keyed, message, Some(key)).unwrap();
    }
    let (mut permit, first) = s.try_dispatch().unwrap();
    assert_eq!(first, "a1");
    // a2 is parked behind a1; b1 is free, so it goes next.
    let (taken, next_in_line) = exchange_keyed(
        s.try_redispatch(&mut permit).expect("b1 is free"),
        "b2",
        Some(2),
    );
    assert_eq!(taken, "b1");
    assert!(next_in_line, "a2, freed by a1's end, may run next");
    assert!(permit.holds_key());
    assert_eq!((s.in_flight(), s.waiting()), (1, 2));
    // a1's end freed a2; b2 is parked behind b1, in flight now. Nothing
    // more comes: a2 is taken out, and b1's end frees b2.
    let redispatch = s.try_redispatch(&mut permit).expect("a2 is free");
    assert_eq!(redispatch.take(), "a2");
    assert_eq!((s.in_flight(), s.waiting()), (1, 1));
    let redispatch = s.try_redispatch(&mut permit).expect("b2 is free");
    assert_eq!(redispatch.take(), "b2");
    assert!(s.try_redispatch(&mut permit).is_none(), "nothing is held");
    s.release(permit);
    assert!(s.is_idle());
}

#[test]
fn debug_shows_the_counts_not_the_messages() {
    let mut s = scheduler(2);
    let a = s.add_subscription(1);
    s.add_subscription(2);
    s.try_insert(a, "secret").unwrap();
    let shown = format!("{s:?}");
    assert!(
        shown.contains("subscriptions: 2, levels: 2, waiting: 1, in_flight: 0, concurrency: 2"),
        "{shown}"
    );
    let (permit, _) = s.try_dispatch().unwrap();
    let shown = format!("{s:?}");
    assert!(shown.contains("waiting: 0, in_flight: 1"), "{shown}");
    assert!(!shown.contains("secret"), "{shown}");
    s.release(permit);
}
