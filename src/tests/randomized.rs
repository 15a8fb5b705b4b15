//! Randomized runs of the whole dispatcher on the in-memory transport,
//! checked against the rules that hold whatever the interleaving: a
//! message is acked once, exactly when an attempt succeeded, and every
//! failed attempt is nacked (as is, once, a message the unsubscribed
//! subscription held and had not started); a run that is not closed early acks every
//! message of the subscriptions that stay; no more handlers run than the
//! concurrency limit and each subscription's own limit allow; a
//! key-ordered subscription never runs two messages of one key at once
//! and a subscription-ordered one never runs two at all; first attempts
//! start in publish order wherever ordering is promised; no handler of an
//! unsubscribed subscription starts after its unsubscribe returned. Each
//! run draws the concurrency limit, the scheduling policy, a reservation,
//! each subscription's priority, ordering and limit, a backlog at
//! subscribe, live arrivals, a priority change and an unsubscribe while
//! running, an early close or none, a processing deadline or none, and
//! each message's key, failures (errors, panics, or hangs that the
//! deadline cuts off) and yields. The clock is paused (it jumps only when
//! every task waits), so only hanging handlers meet their deadline, and a
//! run that waits for good fails at once instead of hanging.
//!
//! Handlers check the rules as they run and write what they see into a
//! shared record: a handler that panicked on a broken rule would only get
//! its message nacked.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use proptest::prelude::*;
use tokio::task::yield_now;

use super::{options, run_paused, settle_down, spawn_run};
use crate::transport::{MemoryTransport, OutgoingMessage};
use crate::{
    Aging, Dispatcher, Message, MessageId, Ordering, SchedulingPolicy, SubscriptionHandle, Weights,
};

/// What one message's handler does on each attempt.
#[derive(Clone, Debug)]
struct Script {
    /// Key from a small set, so that keys collide; `None` for no key.
    key: Option<u8>,
    /// Attempts that fail before one succeeds.
    failures: u32,
    /// How those attempts fail.
    failure: Failure,
    /// Yields inside the handler, so that handlers overlap.
    yields: u32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Failure {
    Error,
    Panic,
    /// Never returns: dropped at the subscription's processing deadline
    /// (only on subscriptions with one; an error elsewhere).
    Hang,
}

#[derive(Clone, Debug)]
struct Plan {
    priority: i64,
    ordering: Ordering,
    key_buffer: usize,
    max_in_flight: Option<usize>,
    /// Whether the subscription has a processing deadline.
    deadline: bool,
    /// Messages sent before the subscribe: a backlog at subscribe.
    backlog: usize,
    messages: Vec<Script>,
}

#[derive(Clone, Debug)]
struct Case {
    concurrency: usize,
    policy: SchedulingPolicy,
    /// Permits kept for priority 0 or better (fewer than the limit).
    reserved: usize,
    plans: Vec<Plan>,
    /// Which subscription the next live message goes to, and how many
    /// yields the sender makes before it.
    arrivals: Vec<(usize, u32)>,
    /// A subscription whose priority changes halfway through the arrivals.
    reprioritised: Option<(usize, i64)>,
    /// Closes the dispatcher before this arrival (the rest are not sent),
    /// with messages queued and handlers running; `None`: closes once
    /// every message is acked.
    close_after: Option<usize>,
    /// A subscription unsubscribed before this arrival; arrivals for it
    /// after that stay on the broker.
    unsubscribed: Option<(usize, usize)>,
}

fn script() -> impl Strategy<Value = Script> {
    (
        proptest::option::of(0u8..3),
        prop_oneof![3 => Just(0u32), 1 => 1u32..3],
        prop_oneof![
            2 => Just(Failure::Error),
            1 => Just(Failure::Panic),
            1 => Just(Failure::Hang)
        ],
        0u32..4,
    )
        .prop_map(|(key, failures, failure, yields)| Script {
            key,
            failures,
            failure,
            yields,
        })
}

fn plan() -> impl Strategy<Value = Plan> {
    (
        0i64..3,
        prop_oneof![
            Just(Ordering::Unordered),
            Just(Ordering::Key),
            Just(Ordering::Subscription)
        ],
        1usize..5,
        proptest::option::of(1usize..4),
        proptest::collection::vec(script(), 0..12),
        0usize..12,
        proptest::bool::weighted(0.3),
    )
        .prop_map(
            |(priority, ordering, key_buffer, max_in_flight, mut messages, backlog, deadline)| {
                if !deadline {
                    for script in messages.iter_mut().filter(|s| s.failure == Failure::Hang) {
                        script.failure = Failure::Error;
                    }
                }
                Plan {
                    priority,
                    ordering,
                    key_buffer,
                    max_in_flight,
                    deadline,
                    backlog: backlog.min(messages.len()),
                    messages,
                }
            },
        )
}

fn policy() -> impl Strategy<Value = SchedulingPolicy> {
    prop_oneof![
        Just(SchedulingPolicy::Strict),
        proptest::collection::vec(1u32..4, 3).prop_map(|weights| {
            let weights = (0..)
                .zip(weights)
                .fold(Weights::new(), |all, (level, weight)| {
                    all.level(level, weight)
                });
            SchedulingPolicy::Weighted(weights)
        }),
        Just(SchedulingPolicy::Aging(Aging::new(1_000.0, 2))),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..6, proptest::collection::vec(plan(), 1..5))
        .prop_flat_map(|(concurrency, plans)| {
            let live: usize = plans.iter().map(|p| p.messages.len() - p.backlog).sum();
            let subscriptions = plans.len();
            (
                Just(concurrency),
                policy(),
                0..concurrency,
                Just(plans),
                proptest::collection::vec((0..subscriptions, 0u32..3), live..=live),
                proptest::option::of((0..subscriptions, 0i64..3)),
                proptest::option::of(0..live.max(1)),
                proptest::option::of((0..subscriptions, 0..live.max(1))),
            )
        })
        .prop_map(
            |(
                concurrency,
                policy,
                reserved,
                plans,
                picks,
                reprioritised,
                close_after,
                unsubscribed,
            )| {
                // Each pick names a subscription; it sends that subscription's
                // next live message, or the first subscription's with any left.
                let mut left: Vec<usize> =
                    plans.iter().map(|p| p.messages.len() - p.backlog).collect();
                let arrivals = picks
                    .into_iter()
                    .map(|(pick, yields)| {
                        let to = if left[pick] > 0 {
                            pick
                        } else {
                            left.iter()
                                .position(|&n| n > 0)
                                .expect("one pick per live message")
                        };
                        left[to] -= 1;
                        (to, yields)
                    })
                    .collect();
                Case {
                    concurrency,
                    policy,
                    reserved,
                    plans,
                    arrivals,
                    reprioritised,
                    close_after,
                    unsubscribed,
                }
            },
        )
}

/// A handler's attempt, from its start until it is dropped.
struct Running<'a> {
    record: &'a Record,
    case: &'a Case,
    at: (usize, usize),
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.record.end(self.case, self.at.0, self.at.1);
    }
}

/// The processing deadline of the subscriptions that have one. Time is
/// paused and moves only while every task waits, so only a hanging
/// handler reaches it.
const DEADLINE: Duration = Duration::from_millis(50);

/// What the handlers saw.
#[derive(Default)]
struct Record {
    running: Cell<usize>,
    running_per_subscription: RefCell<HashMap<usize, usize>>,
    running_per_key: RefCell<HashMap<(usize, u8), usize>>,
    attempts: RefCell<HashMap<(usize, usize), usize>>,
    /// First attempts, in the order they started: (subscription, message).
    first_starts: RefCell<Vec<(usize, usize)>>,
    /// The subscription whose unsubscribe has returned.
    gone: Cell<Option<usize>>,
    broken: RefCell<Vec<String>>,
}

impl Record {
    fn start(&self, case: &Case, subscription: usize, message: usize) -> u32 {
        let plan = &case.plans[subscription];
        let script = &plan.messages[message];
        if self.gone.get() == Some(subscription) {
            self.broke(format!(
                "subscription {subscription}: a handler started after its unsubscribe returned"
            ));
        }
        self.running.set(self.running.get() + 1);
        if self.running.get() > case.concurrency {
            self.broke(format!(
                "{} handlers ran at once, limit {}",
                self.running.get(),
                case.concurrency
            ));
        }
        let limit = match plan.ordering {
            Ordering::Subscription => Some(1),
            _ => plan.max_in_flight,
        };
        let mine = bump(
            &mut self.running_per_subscription.borrow_mut(),
            subscription,
        );
        if let Some(limit) = limit.filter(|&limit| mine > limit) {
            self.broke(format!(
                "subscription {subscription}: {mine} at once, limit {limit}"
            ));
        }
        if let (Ordering::Key, Some(key)) = (plan.ordering, script.key) {
            let same_key = bump(&mut self.running_per_key.borrow_mut(), (subscription, key));
            if same_key > 1 {
                self.broke(format!(
                    "subscription {subscription}: key {key} ran {same_key} at once"
                ));
            }
        }
        let attempt = bump(&mut self.attempts.borrow_mut(), (subscription, message)) as u32 - 1;
        if attempt == 0 {
            self.first_starts.borrow_mut().push((subscription, message));
        }
        attempt
    }

    fn end(&self, case: &Case, subscription: usize, message: usize) {
        self.running.set(self.running.get() - 1);
        *self
            .running_per_subscription
            .borrow_mut()
            .get_mut(&subscription)
            .unwrap() -= 1;
        let plan = &case.plans[subscription];
        if let (Ordering::Key, Some(key)) = (plan.ordering, plan.messages[message].key) {
            *self
                .running_per_key
                .borrow_mut()
                .get_mut(&(subscription, key))
                .unwrap() -= 1;
        }
    }

    fn broke(&self, rule: String) {
        self.broken.borrow_mut().push(rule);
    }
}

fn bump<K: std::hash::Hash + Eq>(counts: &mut HashMap<K, usize>, key: K) -> usize {
    let count = counts.entry(key).or_default();
    *count += 1;
    *count
}

fn topic(subscription: usize) -> String {
    format!("random-{subscription}")
}

fn send(
    transport: &MemoryTransport,
    case: &Case,
    subscription: usize,
    message: usize,
) -> MessageId {
    let payload = format!("{subscription}/{message}");
    let mut outgoing = OutgoingMessage::new(payload);
    if let Some(key) = case.plans[subscription].messages[message].key {
        outgoing = outgoing.with_partition_key(format!("k{key}"));
    }
    transport.send_message(&topic(subscription), outgoing)
}

/// The (subscription, message) a payload names.
fn parse(message: &Message) -> (usize, usize) {
    let text = std::str::from_utf8(message.payload()).expect("payloads are ASCII");
    let (subscription, index) = text.split_once('/').expect("subscription/message");
    (subscription.parse().unwrap(), index.parse().unwrap())
}

async fn run_case(case: Rc<Case>) -> Result<(), TestCaseError> {
    let transport = MemoryTransport::new();
    let record = Rc::new(Record::default());
    let mut sent: Vec<Vec<MessageId>> = vec![Vec::new(); case.plans.len()];
    let (dispatcher, handles) = start(&case, &transport, &record, &mut sent).await;
    let run = spawn_run(&dispatcher);
    // Running before any close: a run that starts after one is refused.
    settle_down().await;
    for (at, &(subscription, yields)) in case.arrivals.iter().enumerate() {
        if Some(at) == case.close_after {
            break;
        }
        if let Some((which, _)) = case.unsubscribed.filter(|&(_, before)| before == at) {
            dispatcher
                .unsubscribe(handles[which].clone())
                .await
                .unwrap();
            record.gone.set(Some(which));
        }
        if at == case.arrivals.len() / 2 {
            if let Some((which, priority)) = case.reprioritised {
                let changed = handles[which].set_priority(priority);
                let gone = record.gone.get() == Some(which);
                prop_assert_eq!(changed.is_ok(), !gone, "set_priority: {:?}", changed);
            }
        }
        for _ in 0..yields {
            yield_now().await;
        }
        let message = sent[subscription].len();
        sent[subscription].push(send(&transport, &case, subscription, message));
    }
    if case.close_after.is_none() {
        for (subscription, ids) in sent.iter().enumerate() {
            if record.gone.get() == Some(subscription) {
                continue;
            }
            let all = tokio::time::timeout(
                Duration::from_secs(30),
                transport.wait_acked(&topic(subscription), ids.len()),
            )
            .await;
            prop_assert!(
                all.is_ok(),
                "subscription {} never acked all {} messages",
                subscription,
                ids.len()
            );
        }
    }
    dispatcher.close().await;
    let ran = run.await.unwrap();
    prop_assert!(ran.is_ok(), "run: {:?}", ran);

    let broken = record.broken.borrow();
    prop_assert!(broken.is_empty(), "rules broken: {:?}", broken);
    check_settlements(&case, &transport, &record, &sent)?;
    let starts = record.first_starts.borrow();
    check_first_start_order(&case, &starts)
}

/// A dispatcher with the case's subscriptions, each over its backlog.
async fn start(
    case: &Rc<Case>,
    transport: &MemoryTransport,
    record: &Rc<Record>,
    sent: &mut [Vec<MessageId>],
) -> (Rc<Dispatcher<MemoryTransport>>, Vec<SubscriptionHandle>) {
    let mut builder = Dispatcher::builder()
        .concurrency(case.concurrency)
        .scheduling(case.policy.clone());
    if case.reserved > 0 {
        builder = builder.reserve(0, case.reserved);
    }
    let dispatcher = builder.build(transport.clone()).unwrap();
    let mut handles = Vec::new();
    for (subscription, plan) in case.plans.iter().enumerate() {
        for message in 0..plan.backlog {
            sent[subscription].push(send(transport, case, subscription, message));
        }
        let mut options = options(plan.priority).ordering(plan.ordering);
        if plan.ordering == Ordering::Key {
            options = options.key_buffer(plan.key_buffer);
        }
        if let (Some(limit), false) = (plan.max_in_flight, plan.ordering == Ordering::Subscription)
        {
            options = options.max_in_flight(limit);
        }
        let (case, record) = (case.clone(), record.clone());
        if plan.deadline {
            options = options.processing_timeout(DEADLINE);
        }
        let handler = async move |message: &Message| {
            let (subscription, index) = parse(message);
            let attempt = record.start(&case, subscription, index);
            // Ends the attempt however the handler stops: returning,
            // panicking, or dropped at its deadline.
            let _running = Running {
                record: &record,
                case: &case,
                at: (subscription, index),
            };
            let script = &case.plans[subscription].messages[index];
            for _ in 0..script.yields {
                yield_now().await;
            }
            if attempt < script.failures {
                match script.failure {
                    Failure::Error => return Err("scripted failure"),
                    Failure::Panic => panic!("scripted panic, attempt {attempt}"),
                    Failure::Hang => std::future::pending::<()>().await,
                }
            }
            Ok(())
        };
        let topic = topic(subscription);
        handles.push(
            dispatcher
                .subscribe(&topic, handler, options)
                .await
                .unwrap(),
        );
    }
    (Rc::new(dispatcher), handles)
}

/// Each message was acked at most once, and exactly when an attempt
/// succeeded; every failed attempt was nacked; no message ran more often
/// than its script allows. Without a close before the end, every message
/// of a subscription that stayed was acked.
fn check_settlements(
    case: &Case,
    transport: &MemoryTransport,
    record: &Record,
    sent: &[Vec<MessageId>],
) -> Result<(), TestCaseError> {
    let attempts = record.attempts.borrow();
    for (subscription, ids) in sent.iter().enumerate() {
        let name = topic(subscription);
        let (acked, nacked) = (transport.acked(&name), transport.nacked(&name));
        let unsubscribed = record.gone.get() == Some(subscription);
        // Messages the unsubscribed subscription held, handed back unstarted.
        let mut given_back = 0;
        for (index, id) in ids.iter().enumerate() {
            let failures = case.plans[subscription].messages[index].failures as usize;
            let tried = attempts.get(&(subscription, index)).copied().unwrap_or(0);
            let acks = acked.iter().filter(|acked| *acked == id).count();
            let nacks = nacked.iter().filter(|nacked| *nacked == id).count();
            let succeeded = tried == failures + 1;
            prop_assert!(
                tried <= failures + 1,
                "{}/{} ran {} times",
                subscription,
                index,
                tried
            );
            prop_assert_eq!(
                acks,
                usize::from(succeeded),
                "acks of {}/{}, run {} times",
                subscription,
                index,
                tried
            );
            let handed_back = nacks.saturating_sub(tried - acks);
            prop_assert!(
                handed_back == 0 || (unsubscribed && handed_back == 1 && acks == 0),
                "nacks of {}/{}: {} for {} runs and {} acks",
                subscription,
                index,
                nacks,
                tried,
                acks
            );
            prop_assert_eq!(
                nacks - handed_back,
                tried - acks,
                "nacks of {}/{}",
                subscription,
                index
            );
            given_back += handed_back;
            if case.close_after.is_none() && record.gone.get() != Some(subscription) {
                prop_assert!(succeeded, "{}/{} never succeeded", subscription, index);
            }
        }
        prop_assert_eq!(
            acked.len() + nacked.len(),
            attempts_of(&attempts, subscription) + given_back,
            "settlements of subscription {}",
            subscription
        );
    }
    Ok(())
}

fn attempts_of(attempts: &HashMap<(usize, usize), usize>, subscription: usize) -> usize {
    attempts
        .iter()
        .filter(|((of, _), _)| *of == subscription)
        .map(|(_, tried)| tried)
        .sum()
}

/// First attempts start in publish order: all of a subscription-ordered
/// subscription's, and those of each key on a key-ordered one.
fn check_first_start_order(case: &Case, starts: &[(usize, usize)]) -> Result<(), TestCaseError> {
    let mut last: HashMap<(usize, Option<u8>), usize> = HashMap::new();
    for &(subscription, message) in starts {
        let plan = &case.plans[subscription];
        let lane = match plan.ordering {
            Ordering::Subscription => (subscription, None),
            Ordering::Key => match plan.messages[message].key {
                Some(key) => (subscription, Some(key)),
                None => continue,
            },
            Ordering::Unordered => continue,
        };
        if let Some(&before) = last.get(&lane) {
            prop_assert!(
                before < message,
                "{:?}: message {} started after {}",
                lane,
                message,
                before
            );
        }
        last.insert(lane, message);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_runs_settle_everything_once_within_every_limit(case in case()) {
        run_paused(async {
            // Virtual time: reached at once if everything waits for good.
            let limit = Duration::from_secs(3_600);
            match tokio::time::timeout(limit, run_case(Rc::new(case))).await {
                Ok(result) => result,
                Err(_) => Err(TestCaseError::fail("the run hung")),
            }
        })?;
    }
}
