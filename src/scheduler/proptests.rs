//! The scheduler against a small reference model, on random sequences of
//! operations: limits are never exceeded, strict picks take the best
//! priority that may run, a key is never in flight twice and starts in
//! order, and nothing is lost or handed out twice across add, remove,
//! priority changes and messages taken back. Weighted shares converge to the weights.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;

use proptest::prelude::*;

use super::*;

#[derive(Clone, Debug)]
enum Op {
    Add {
        priority: i64,
        limit: Option<usize>,
        ordering: u8,
        key_buffer: usize,
    },
    Insert {
        subscription: usize,
        key: Option<u64>,
    },
    Dispatch,
    /// A dispatch that refills the subscription it picks from, with
    /// messages of these keys for as long as it asks; `tells_key`: the
    /// refill tells their keys (as the engine's does), so that a key buffer
    /// is refilled too.
    DispatchRefilling {
        keys: Vec<Option<u64>>,
        tells_key: bool,
    },
    Release(usize),
    SetPriority {
        subscription: usize,
        priority: i64,
    },
    Remove(usize),
    /// Take a held message back without dispatching it.
    TakeWaiting,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0i64..4, proptest::option::of(1usize..3), 0u8..3, 1usize..4).prop_map(
            |(priority, limit, ordering, key_buffer)| Op::Add { priority, limit, ordering, key_buffer }
        ),
        6 => (0usize..8, proptest::option::of(0u64..3))
            .prop_map(|(subscription, key)| Op::Insert { subscription, key }),
        5 => Just(Op::Dispatch),
        3 => (proptest::collection::vec(proptest::option::of(0u64..3), 0..4), any::<bool>())
            .prop_map(|(keys, tells_key)| Op::DispatchRefilling { keys, tells_key }),
        4 => (0usize..16).prop_map(Op::Release),
        1 => (0usize..8, 0i64..4)
            .prop_map(|(subscription, priority)| Op::SetPriority { subscription, priority }),
        1 => (0usize..8).prop_map(Op::Remove),
        1 => Just(Op::TakeWaiting),
    ]
}

/// What the model knows of one subscription.
struct Model {
    key: SubscriptionKey,
    priority: i64,
    limit: usize,
    ordering: Ordering,
    capacity: usize,
    /// Held messages: (id, key), in insertion order.
    held: Vec<(u64, Option<u64>)>,
    /// Keys of its messages in flight (key ordering).
    busy: Vec<u64>,
    in_flight: usize,
}

impl Model {
    /// Whether the held message at `index` may run now.
    fn may_run(&self, index: usize) -> bool {
        if self.in_flight >= self.limit {
            return false;
        }
        match (self.ordering, self.held[index].1) {
            (Ordering::Key, Some(key)) => {
                !self.busy.contains(&key)
                    && !self.held[..index].iter().any(|(_, k)| *k == Some(key))
            }
            (Ordering::Key, None) => true,
            // One slot: the held message is the next one.
            _ => index == 0,
        }
    }

    fn has_runnable(&self) -> bool {
        (0..self.held.len()).any(|index| self.may_run(index))
    }

    /// Whether a held message could run now, the in-flight limit aside.
    fn holds_free(&self) -> bool {
        match self.ordering {
            Ordering::Key => (0..self.held.len()).any(|index| match self.held[index].1 {
                Some(key) => {
                    !self.busy.contains(&key)
                        && !self.held[..index].iter().any(|(_, k)| *k == Some(key))
                }
                None => true,
            }),
            _ => !self.held.is_empty(),
        }
    }

    /// How many of `supply` a refill within a pick from this subscription
    /// stores: one in a slot; in a key buffer, with keys told, one and more
    /// while nothing held may run and there is room; none in a key buffer
    /// without keys told (its caller refills it).
    fn refill(&mut self, supply: &[(u64, Option<u64>)], tells_key: bool) -> usize {
        let keyed = self.ordering == Ordering::Key;
        if keyed && !tells_key {
            return 0;
        }
        let mut taken = 0;
        for &message in supply {
            self.held.push(message);
            taken += 1;
            if !keyed || self.holds_free() || self.held.len() == self.capacity {
                break;
            }
        }
        taken
    }
}

/// A refilled message that tells its key, as the engine's does.
struct TellingKey(u64, Option<u64>);

impl Refilled<u64> for TellingKey {
    const TELLS_KEY: bool = true;

    fn refill_key(&self) -> Option<u64> {
        self.1
    }

    fn into_refilled(self) -> u64 {
        self.0
    }
}

/// Checks a pick of message `id` against the models and records it in
/// the model it came from; returns that model's index and the message's
/// key (`u64::MAX` for none).
fn record_pick(
    models: &mut [Model],
    runnable: &[usize],
    permit: &Permit,
    id: u64,
) -> Result<(usize, u64), TestCaseError> {
    let m = models
        .iter()
        .position(|model| model.key == permit.subscription())
        .unwrap();
    let best = runnable.iter().map(|&m| models[m].priority).min().unwrap();
    prop_assert_eq!(
        models[m].priority,
        best,
        "strict: the best priority that may run"
    );
    let model = &mut models[m];
    let index = model.held.iter().position(|(held, _)| *held == id).unwrap();
    prop_assert!(model.may_run(index), "{} may not run yet", id);
    let (_, key) = model.held.remove(index);
    if model.ordering == Ordering::Key {
        if let Some(key) = key {
            prop_assert!(!model.busy.contains(&key), "key {} twice in flight", key);
            model.busy.push(key);
        }
    }
    model.in_flight += 1;
    prop_assert!(model.in_flight <= model.limit);
    Ok((m, key.unwrap_or(u64::MAX)))
}

fn check(concurrency: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut s: Scheduler<u64> = Scheduler::new(NonZeroUsize::new(concurrency).unwrap());
    let mut models: Vec<Model> = Vec::new();
    let mut in_flight: Vec<(Permit, usize, u64)> = Vec::new();
    let mut next_id = 0u64;
    let mut inserted = BTreeSet::new();
    let mut dispatched = BTreeSet::new();
    for op in ops {
        match op {
            Op::Add {
                priority,
                limit,
                ordering,
                key_buffer,
            } => {
                let ordering =
                    [Ordering::Unordered, Ordering::Key, Ordering::Subscription][ordering as usize];
                let key = s.add(SubscriptionConfig {
                    priority,
                    max_in_flight: limit.and_then(NonZeroUsize::new),
                    ordering,
                    key_buffer,
                });
                let limit = match ordering {
                    Ordering::Subscription => 1,
                    _ => limit.unwrap_or(usize::MAX),
                };
                let capacity = if ordering == Ordering::Key {
                    key_buffer
                } else {
                    1
                };
                models.push(Model {
                    key,
                    priority,
                    limit,
                    ordering,
                    capacity,
                    held: Vec::new(),
                    busy: Vec::new(),
                    in_flight: 0,
                });
            }
            Op::Insert { subscription, key } => {
                let Some(model) = models.get_mut(subscription) else {
                    continue;
                };
                let room = model.held.len() < model.capacity;
                prop_assert_eq!(s.has_vacancy(model.key), room);
                let id = next_id;
                next_id += 1;
                let result = s.try_insert_keyed(model.key, id, key);
                if room {
                    prop_assert!(result.is_ok());
                    model.held.push((id, key));
                    inserted.insert(id);
                } else {
                    prop_assert_eq!(result, Err(Rejected::Full(id)));
                }
            }
            Op::Dispatch => {
                let runnable: Vec<usize> = (0..models.len())
                    .filter(|&m| models[m].has_runnable())
                    .collect();
                match s.try_dispatch() {
                    None => prop_assert!(
                        in_flight.len() == concurrency || runnable.is_empty(),
                        "nothing dispatched though {:?} could run",
                        runnable
                    ),
                    Some((permit, id)) => {
                        prop_assert!(in_flight.len() < concurrency);
                        let (m, key) = record_pick(&mut models, &runnable, &permit, id)?;
                        prop_assert!(dispatched.insert(id), "{} dispatched twice", id);
                        in_flight.push((permit, m, key));
                    }
                }
            }
            Op::DispatchRefilling { keys, tells_key } => {
                let runnable: Vec<usize> = (0..models.len())
                    .filter(|&m| models[m].has_runnable())
                    .collect();
                let supply: Vec<(u64, Option<u64>)> = keys
                    .into_iter()
                    .map(|key| {
                        next_id += 1;
                        (next_id - 1, key)
                    })
                    .collect();
                let mut left = supply.iter().copied();
                let pick = if tells_key {
                    s.try_dispatch_refilling(|_| left.next().map(|(id, key)| TellingKey(id, key)))
                } else {
                    s.try_dispatch_refilling(|_| left.next().map(|(id, _)| id))
                };
                let taken = supply.len() - left.len();
                let Some(pick) = pick else {
                    prop_assert!(
                        in_flight.len() == concurrency || runnable.is_empty(),
                        "nothing dispatched though {:?} could run",
                        runnable
                    );
                    prop_assert_eq!(taken, 0, "no pick, no refill");
                    continue;
                };
                prop_assert!(in_flight.len() < concurrency);
                let (m, key) = record_pick(&mut models, &runnable, &pick.permit, pick.message)?;
                prop_assert!(
                    dispatched.insert(pick.message),
                    "{} dispatched twice",
                    pick.message
                );
                let model = &mut models[m];
                let keyed_untold = model.ordering == Ordering::Key && !tells_key;
                prop_assert_eq!(pick.refill_called, !keyed_untold);
                prop_assert_eq!(model.refill(&supply, tells_key), taken, "refills taken");
                inserted.extend(supply[..taken].iter().map(|(id, _)| *id));
                in_flight.push((pick.permit, m, key));
            }
            Op::Release(which) => {
                if in_flight.is_empty() {
                    continue;
                }
                let (permit, m, key) = in_flight.remove(which % in_flight.len());
                s.release(permit);
                let model = &mut models[m];
                model.in_flight -= 1;
                model.busy.retain(|busy| *busy != key);
            }
            Op::SetPriority {
                subscription,
                priority,
            } => {
                let Some(model) = models.get_mut(subscription) else {
                    continue;
                };
                s.set_priority(model.key, priority);
                model.priority = priority;
                prop_assert_eq!(s.priority(model.key), priority);
            }
            Op::TakeWaiting => match s.take_waiting() {
                None => prop_assert!(models.iter().all(|m| m.held.is_empty())),
                Some((key, id)) => {
                    let model = models.iter_mut().find(|m| m.key == key).unwrap();
                    let index = model.held.iter().position(|(held, _)| *held == id);
                    prop_assert!(index.is_some(), "{} was not held there", id);
                    model.held.remove(index.unwrap());
                    inserted.remove(&id);
                }
            },
            Op::Remove(subscription) => {
                let Some(model) = models.get(subscription) else {
                    continue;
                };
                let empty = model.held.is_empty() && model.in_flight == 0;
                prop_assert_eq!(s.remove_subscription(model.key), empty);
                if empty {
                    models.remove(subscription);
                    // Keys of later models stay valid; in-flight entries
                    // refer to models by index.
                    for entry in &mut in_flight {
                        if entry.1 > subscription {
                            entry.1 -= 1;
                        }
                    }
                }
            }
        }
        prop_assert_eq!(s.in_flight(), in_flight.len());
        prop_assert_eq!(
            s.waiting(),
            models.iter().map(|m| m.held.len()).sum::<usize>()
        );
    }
    // Drain: everything inserted is dispatched exactly once.
    loop {
        while let Some((permit, id)) = s.try_dispatch() {
            prop_assert!(dispatched.insert(id), "{} dispatched twice", id);
            in_flight.push((permit, 0, 0));
        }
        let Some((permit, _, _)) = in_flight.pop() else {
            break;
        };
        s.release(permit);
    }
    prop_assert_eq!(dispatched, inserted);
    prop_assert!(s.is_idle());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_scheduler_agrees_with_the_model(
        concurrency in 1usize..4,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        check(concurrency, ops)?;
    }

    /// As above, with a key buffer added first, so that refills within
    /// picks often meet busy keys.
    #[test]
    fn key_buffers_refilled_within_picks_agree_with_the_model(
        concurrency in 1usize..4,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let first = Op::Add { priority: 0, limit: None, ordering: 1, key_buffer: 3 };
        check(concurrency, std::iter::once(first).chain(ops).collect())?;
    }

    #[test]
    fn weighted_shares_converge_to_the_weights(
        weights in proptest::collection::vec(1u32..10, 2..5),
    ) {
        let policy = SchedulingPolicy::Weighted(
            weights.iter().enumerate().fold(Weights::new(), |w, (level, weight)| w.level(level as i64, *weight)),
        );
        let mut s: Scheduler<usize> = Scheduler::with_policy(NonZeroUsize::new(1).unwrap(), policy);
        let keys: Vec<_> = (0..weights.len()).map(|level| s.add_subscription(level as i64)).collect();
        for (level, key) in keys.iter().enumerate() {
            s.try_insert(*key, level).unwrap();
        }
        let mut served: BTreeMap<usize, u32> = BTreeMap::new();
        let rounds = 10_000;
        for _ in 0..rounds {
            let (permit, level) = s.try_dispatch().unwrap();
            *served.entry(level).or_default() += 1;
            let key = permit.subscription();
            s.release(permit);
            s.try_insert(key, level).unwrap();
        }
        let total: u32 = weights.iter().sum();
        for (level, weight) in weights.iter().enumerate() {
            let share = f64::from(served[&level]) / f64::from(rounds);
            let expected = f64::from(*weight) / f64::from(total);
            prop_assert!((share - expected).abs() <= 0.02, "level {}: {} against {}", level, share, expected);
        }
    }
}

/// An operation on two schedulers kept in step, for
/// [`Scheduler::try_redispatch`].
#[derive(Clone, Debug)]
enum TwinOp {
    Add {
        priority: i64,
        limit: Option<usize>,
        ordering: u8,
    },
    Insert {
        subscription: usize,
        key: Option<u64>,
    },
    Dispatch,
    /// Ends the in-flight message at this index (modulo), and dispatches
    /// with a refill of this many messages.
    EndAndDispatch {
        which: usize,
        refills: usize,
    },
    SetPriority {
        subscription: usize,
        priority: i64,
    },
}

fn twin_op() -> impl Strategy<Value = TwinOp> {
    prop_oneof![
        1 => (0i64..3, proptest::option::of(1usize..3), 0u8..3)
            .prop_map(|(priority, limit, ordering)| TwinOp::Add { priority, limit, ordering }),
        5 => (0usize..6, proptest::option::of(0u64..3))
            .prop_map(|(subscription, key)| TwinOp::Insert { subscription, key }),
        3 => Just(TwinOp::Dispatch),
        6 => (0usize..8, 0usize..3)
            .prop_map(|(which, refills)| TwinOp::EndAndDispatch { which, refills }),
        1 => (0usize..6, 0i64..3)
            .prop_map(|(subscription, priority)| TwinOp::SetPriority { subscription, priority }),
    ]
}

/// A message refilled in the twin tests, which tells its ordering key
/// ([`key_of`]) as the engine's refill does.
struct RefilledWithKey(u64);

impl Refilled<u64> for RefilledWithKey {
    const TELLS_KEY: bool = true;

    fn refill_key(&self) -> Option<u64> {
        key_of(self.0)
    }

    fn into_refilled(self) -> u64 {
        self.0
    }
}

/// The ordering key of a refilled message: one of three, or none for one
/// message in four (a key buffer's slots ignore it).
fn key_of(message: u64) -> Option<u64> {
    (message % 4 != 3).then_some(message % 3)
}

/// What a pick showed: the subscription, the priority and the message.
fn shown(permit: &Permit, message: u64) -> (SubscriptionKey, i64, u64) {
    (permit.subscription(), permit.priority(), message)
}

/// Ends a message on `redispatching` with a re-dispatch, whose refill
/// exchanges the slot's message as the engine's does, and on `plain` with
/// a release and a dispatch: both must pick the same message, refill the
/// same, and be left alike. `refills` messages numbered from `next_id` are
/// offered to each refill.
fn end_both(
    redispatching: &mut Scheduler<u64>,
    plain: &mut Scheduler<u64>,
    (mut permit, plain_permit): (Permit, Permit),
    refills: usize,
    next_id: u64,
) -> Result<Option<(Permit, Permit)>, TestCaseError> {
    let supply = || (0..refills).map(move |i| RefilledWithKey(next_id + i as u64));
    let mut left = supply();
    let redispatched = redispatching.try_redispatch(&mut permit).map(|redispatch| {
        // As the engine does: the next message, if there is one, takes
        // the place of the one the permit now runs.
        match left.next() {
            Some(RefilledWithKey(next)) => {
                let mut message = next;
                let next_in_line = redispatch.exchange(
                    |waiting| std::mem::swap(waiting, &mut message),
                    |&stored| key_of(stored),
                    || left.next(),
                );
                (message, Some(next_in_line))
            }
            None => (redispatch.take(), None),
        }
    });
    let taken = refills - left.len();
    plain.release(plain_permit);
    let mut plain_left = supply();
    let plain_pick = plain.try_dispatch_refilling(|_| plain_left.next());
    let plain_taken = refills - plain_left.len();
    let Some((message, next_in_line)) = redispatched else {
        prop_assert_eq!(taken, 0, "no re-dispatch, no refill");
        // Then the caller ends the message as usual.
        redispatching.release(permit);
        let mut left = supply();
        let pick = redispatching.try_dispatch_refilling(|_| left.next());
        prop_assert_eq!(refills - left.len(), plain_taken, "refills taken");
        prop_assert_eq!(
            pick.as_ref().map(|p| shown(&p.permit, p.message)),
            plain_pick.as_ref().map(|p| shown(&p.permit, p.message))
        );
        return Ok(pick.zip(plain_pick).map(|(a, b)| (a.permit, b.permit)));
    };
    prop_assert_eq!(taken, plain_taken, "refills taken");
    let Some(plain_pick) = plain_pick else {
        return Err(TestCaseError::fail(
            "re-dispatched where a dispatch picks nothing",
        ));
    };
    prop_assert_eq!(
        shown(&permit, message),
        shown(&plain_pick.permit, plain_pick.message)
    );
    if let Some(next_in_line) = next_in_line {
        prop_assert_eq!(next_in_line, plain_pick.next_in_line, "next in line");
    }
    if plain_pick.permits_left {
        // A dispatch round would pick on: it must find nothing, so that
        // the re-dispatch, which picks one, is the whole round.
        let (more, plain_more) = (redispatching.try_dispatch(), plain.try_dispatch());
        prop_assert!(
            more.is_none() && plain_more.is_none(),
            "re-dispatched with a permit free and more to pick"
        );
    }
    Ok(Some((permit, plain_pick.permit)))
}

fn check_twins(
    concurrency: usize,
    reserved: Option<i64>,
    ops: Vec<TwinOp>,
) -> Result<(), TestCaseError> {
    let permits = NonZeroUsize::new(concurrency).unwrap();
    let (mut a, mut b) = (Scheduler::new(permits), Scheduler::new(permits));
    // A permit kept for a priority or better, where there is one to keep.
    if let Some(priority) = reserved.filter(|_| concurrency > 1) {
        a.reserve(priority, 1);
        b.reserve(priority, 1);
    }
    let mut keys = Vec::new();
    let mut in_flight: Vec<(Permit, Permit)> = Vec::new();
    let mut next_id = 0u64;
    for op in ops {
        match op {
            TwinOp::Add {
                priority,
                limit,
                ordering,
            } => {
                let config = SubscriptionConfig {
                    priority,
                    max_in_flight: limit.and_then(NonZeroUsize::new),
                    ordering: [Ordering::Unordered, Ordering::Key, Ordering::Subscription]
                        [ordering as usize],
                    key_buffer: 2,
                };
                let key = a.add(config);
                prop_assert_eq!(key, b.add(config));
                keys.push(key);
            }
            TwinOp::Insert { subscription, key } => {
                let Some(&subscription) = keys.get(subscription) else {
                    continue;
                };
                let inserted = a.try_insert_keyed(subscription, next_id, key).is_ok();
                let twin_inserted = b.try_insert_keyed(subscription, next_id, key).is_ok();
                prop_assert_eq!(inserted, twin_inserted);
                next_id += 1;
            }
            TwinOp::Dispatch => match (a.try_dispatch(), b.try_dispatch()) {
                (None, None) => {}
                (Some((pa, ma)), Some((pb, mb))) => {
                    prop_assert_eq!(shown(&pa, ma), shown(&pb, mb));
                    in_flight.push((pa, pb));
                }
                _ => return Err(TestCaseError::fail("one dispatched, the other not")),
            },
            TwinOp::EndAndDispatch { which, refills } => {
                if in_flight.is_empty() {
                    continue;
                }
                let permits = in_flight.remove(which % in_flight.len());
                if let Some(picked) = end_both(&mut a, &mut b, permits, refills, next_id)? {
                    in_flight.push(picked);
                }
                next_id += refills as u64;
            }
            TwinOp::SetPriority {
                subscription,
                priority,
            } => {
                let Some(&key) = keys.get(subscription) else {
                    continue;
                };
                a.set_priority(key, priority);
                b.set_priority(key, priority);
            }
        }
        prop_assert_eq!(a.in_flight(), b.in_flight());
        prop_assert_eq!(a.waiting(), b.waiting());
    }
    // Both drain in the same order.
    loop {
        match (a.try_dispatch(), b.try_dispatch()) {
            (None, None) => {}
            (Some((pa, ma)), Some((pb, mb))) => {
                prop_assert_eq!(shown(&pa, ma), shown(&pb, mb));
                in_flight.push((pa, pb));
                continue;
            }
            _ => return Err(TestCaseError::fail("one dispatched, the other not")),
        }
        let Some((pa, pb)) = in_flight.pop() else {
            break;
        };
        a.release(pa);
        b.release(pb);
    }
    prop_assert!(a.is_idle() && b.is_idle());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// A job's end re-dispatched in place picks what a release and a
    /// dispatch pick, refills the same, and leaves the scheduler alike.
    #[test]
    fn a_redispatch_is_a_release_and_a_dispatch(
        concurrency in 1usize..4,
        reserved in proptest::option::of(0i64..3),
        ops in proptest::collection::vec(twin_op(), 1..150),
    ) {
        check_twins(concurrency, reserved, ops)?;
    }

    /// As above, with a key buffer added first and fed most messages, so
    /// that its keys are often busy while it and the slots around it
    /// re-dispatch.
    #[test]
    fn a_redispatch_beside_a_busy_key_buffer_is_a_release_and_a_dispatch(
        concurrency in 1usize..4,
        ops in proptest::collection::vec(twin_op(), 1..150),
        keys in proptest::collection::vec(0u64..3, 40),
    ) {
        let first = TwinOp::Add { priority: 0, limit: None, ordering: 1 };
        let fed = keys
            .into_iter()
            .map(|key| Some(TwinOp::Insert { subscription: 0, key: Some(key) }))
            .chain(std::iter::repeat_with(|| None));
        // The key buffer's messages among the other operations, every
        // operation kept (the later ones without a feed between them).
        let mixed = ops.into_iter().zip(fed).flat_map(|(op, insert)| insert.into_iter().chain([op]));
        check_twins(concurrency, None, std::iter::once(first).chain(mixed).collect())?;
    }
}
