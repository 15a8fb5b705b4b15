//! The scheduling policies, measured (issue 11): what one pick costs on the
//! pure scheduler under each policy, how closely weighted shares follow
//! their weights at saturation (on the pure scheduler and through the
//! dispatcher), and how long the lowest level waits under aging while a
//! better level saturates the dispatcher.
//!
//! Priority levels are numbered by their priority value: level `i` is
//! priority `i`, so level 0 is served first under strict priority.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::rc::Rc;
use std::time::{Duration, Instant};

use pulsar_dispatcher::scheduler::Scheduler;
use pulsar_dispatcher::transport::{Event, MemoryTransport};
use pulsar_dispatcher::{Aging, Dispatcher, Message, SchedulingPolicy, SubscribeOptions, Weights};
use tokio::sync::Notify;

/// The weights `weights[i]` for levels `i = 0, 1, ...`.
pub fn weights(weights: &[u32]) -> Weights {
    weights
        .iter()
        .enumerate()
        .fold(Weights::new(), |all, (level, &weight)| {
            all.level(level as i64, weight)
        })
}

/// The largest absolute difference between a level's share of `dispatches`
/// and its weight's share of the total weight.
pub fn share_error(dispatches: &[u64], weights: &[u32]) -> f64 {
    let total: u64 = dispatches.iter().sum();
    let weight: u32 = weights.iter().sum();
    dispatches
        .iter()
        .zip(weights)
        .map(|(&count, &level_weight)| {
            (count as f64 / total.max(1) as f64 - f64::from(level_weight) / f64::from(weight)).abs()
        })
        .fold(0.0, f64::max)
}

/// A pure-scheduler workload: `subscriptions` spread round-robin over
/// `levels` levels, chosen among by `policy`, at concurrency `concurrency`.
#[derive(Clone, Debug)]
pub struct Picks {
    pub policy: SchedulingPolicy,
    pub levels: usize,
    pub subscriptions: usize,
    pub concurrency: usize,
}

/// What [`picks`] measured.
#[derive(Clone, Debug)]
pub struct PickRun {
    /// How far the counter advanced per pick.
    pub per_pick: f64,
    /// Picks per level.
    pub by_level: Vec<u64>,
}

/// Saturation on the pure scheduler, as the engine drives it: every
/// subscription's slot starts full; then, `picks` times, the oldest of the
/// `concurrency` permits in flight is released (once all are taken), the
/// best message is dispatched and its slot is refilled at once, in one
/// round (as a worker's dispatch is). Every level
/// always has a message waiting. Measures the counter `read` (a clock, or
/// the allocation count) per pick (release + dispatch + insert) and counts
/// the picks per level.
pub fn picks(setup: &Picks, picks: usize, read: fn() -> u64) -> PickRun {
    let concurrency = NonZeroUsize::new(setup.concurrency).expect("a concurrency of at least 1");
    let mut scheduler = Scheduler::with_policy(concurrency, setup.policy.clone());
    let mut in_flight = VecDeque::with_capacity(setup.concurrency);
    let mut by_level = vec![0u64; setup.levels];
    for index in 0..setup.subscriptions {
        let level = index % setup.levels;
        let key = scheduler.add_subscription(level as i64);
        // The message is its level, which is all the count needs.
        scheduler.try_insert(key, level).expect("an empty slot");
    }
    let before = read();
    for _ in 0..picks {
        if in_flight.len() == setup.concurrency {
            scheduler.release(in_flight.pop_front().expect("a permit in flight"));
        }
        scheduler.begin_round();
        let Some((permit, level)) = scheduler.try_dispatch() else {
            unreachable!("every slot is full and a permit is free");
        };
        by_level[level] += 1;
        scheduler
            .try_insert(permit.subscription(), level)
            .expect("its slot was just emptied");
        scheduler.end_round();
        in_flight.push_back(permit);
    }
    let per_pick = (read() - before) as f64 / picks.max(1) as f64;
    for permit in in_flight {
        scheduler.release(permit);
    }
    PickRun { per_pick, by_level }
}

/// Counts the handler starts per level among the first `window`, and
/// wakes the run when the window is full.
fn level_handler(
    level: usize,
    by_level: Rc<RefCell<Vec<u64>>>,
    handled: Rc<Cell<usize>>,
    window: usize,
    done: Rc<Notify>,
) -> impl AsyncFn(&Message) -> Result<(), Infallible> {
    async move |_message: &Message| {
        let count = handled.get() + 1;
        handled.set(count);
        if count <= window {
            by_level.borrow_mut()[level] += 1;
        }
        if count == window {
            done.notify_one();
        }
        Ok(())
    }
}

/// What [`weighted_shares`] measured.
#[derive(Clone, Debug)]
pub struct SharesRun {
    /// Handler starts per level among the first `window`.
    pub by_level: Vec<u64>,
    /// Whether every level still had a backlog when the window closed (so
    /// every level had work throughout).
    pub saturated: bool,
}

/// Weighted shares through the dispatcher on `MemoryTransport`: one
/// subscription per level (level `i` weighted `weights[i]`), no-op
/// handlers, at concurrency `concurrency`; each level's backlog is larger
/// than the window, so every level has work throughout. Counts the first
/// `window` handler starts per level; checks that every message handled was
/// acknowledged. Must be called inside a `LocalSet`.
pub async fn weighted_shares(weights: &[u32], concurrency: usize, window: usize) -> SharesRun {
    let transport = MemoryTransport::new();
    let dispatcher = Dispatcher::builder()
        .concurrency(concurrency)
        .scheduling(SchedulingPolicy::Weighted(self::weights(weights)))
        .build(transport.clone())
        .expect("a valid configuration");
    let by_level = Rc::new(RefCell::new(vec![0u64; weights.len()]));
    let handled = Rc::new(Cell::new(0));
    let done = Rc::new(Notify::new());
    let topics: Vec<String> = (0..weights.len())
        .map(|level| format!("weighted-{level}"))
        .collect();
    for (level, topic) in topics.iter().enumerate() {
        let handler = level_handler(
            level,
            by_level.clone(),
            handled.clone(),
            window,
            done.clone(),
        );
        let options = SubscribeOptions::new().priority(level as i64);
        dispatcher
            .subscribe(topic, handler, options)
            .await
            .expect("subscribing to the in-memory transport");
    }
    // A level's messages received so far are at most those handled, one in
    // its slot and `concurrency` in flight.
    for topic in &topics {
        for _ in 0..window + concurrency + 1 {
            transport.send(topic, Vec::new());
        }
    }
    let closer = dispatcher.close_handle();
    let mut saturated = false;
    let finish = async {
        done.notified().await;
        saturated = topics.iter().all(|topic| transport.backlog_len(topic) > 0);
        closer.close().await;
    };
    let (result, ()) = tokio::join!(dispatcher.run(), finish);
    result.expect("the dispatcher shuts down cleanly");
    assert_every_message_acked(&transport, handled.get());
    let by_level = by_level.borrow().clone();
    SharesRun {
        by_level,
        saturated,
    }
}

/// Every message handled was acknowledged, and none negatively.
fn assert_every_message_acked(transport: &MemoryTransport, handled: usize) {
    let events = transport.events();
    let acked = events
        .iter()
        .filter(|event| matches!(event, Event::Acked { .. }))
        .count();
    let nacked = events
        .iter()
        .filter(|event| matches!(event, Event::Nacked { .. }))
        .count();
    assert_eq!(
        (acked, nacked),
        (handled, 0),
        "every message handled is acknowledged"
    );
}

/// Keeps the thread busy for `time` (a CPU-bound handler: it never yields).
fn spin_for(time: Duration) {
    let until = Instant::now() + time;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// How the aging run is set up.
#[derive(Clone, Copy, Debug)]
pub struct AgingSetup {
    pub aging: Aging,
    /// The priority of the low level; the high level is 0.
    pub low_priority: i64,
    /// High-priority subscriptions (each saturating on its own).
    pub high_subscriptions: usize,
    pub concurrency: usize,
    /// How long each handler keeps the thread busy.
    pub handler_time: Duration,
    /// How long the dispatcher runs.
    pub run_for: Duration,
}

/// What [`aging_wait`] measured.
#[derive(Clone, Debug)]
pub struct AgingRun {
    /// The longest slot wait of a low-priority message (the dispatcher's
    /// own measure: from its arrival in its slot to its handler's start).
    pub max_wait: Duration,
    /// The median of the same.
    pub p50_wait: Duration,
    /// The same wait seen from outside: the longest gap between two
    /// low-priority handler starts. The low slot is refilled as its message
    /// is dispatched, so each gap is about one message's wait.
    pub max_gap: Duration,
    /// Low-priority and high-priority messages dispatched while running.
    pub low_dispatched: u64,
    pub high_dispatched: u64,
    /// Whether both levels still had a backlog when the run ended.
    pub saturated: bool,
}

/// The handler of the aging run: it notes the start of each low-priority
/// message, then keeps the thread busy for `time`.
fn busy_handler(
    low: bool,
    low_starts: Rc<RefCell<Vec<Instant>>>,
    handled: Rc<Cell<u64>>,
    time: Duration,
) -> impl AsyncFn(&Message) -> Result<(), Infallible> {
    async move |_message: &Message| {
        if low {
            low_starts.borrow_mut().push(Instant::now());
        }
        handled.set(handled.get() + 1);
        spin_for(time);
        Ok(())
    }
}

/// The lowest level's longest wait under aging: `high_subscriptions`
/// subscriptions at priority 0 with backlogs that last the whole run keep
/// every permit busy, one subscription at `low_priority` has a backlog
/// too, and handlers keep the thread busy for `handler_time`; the
/// dispatcher (with timings on, for the slot wait) runs for `run_for` in
/// real time and is then closed. Checks that every message handled was
/// acknowledged. Must be called inside a `LocalSet`.
pub async fn aging_wait(setup: AgingSetup) -> AgingRun {
    let transport = MemoryTransport::new();
    let dispatcher = Dispatcher::builder()
        .concurrency(setup.concurrency)
        .scheduling(SchedulingPolicy::Aging(setup.aging))
        .timings(true)
        .build(transport.clone())
        .expect("a valid configuration");
    let low_starts = Rc::new(RefCell::new(Vec::new()));
    let handled = Rc::new(Cell::new(0));
    const LOW: &str = "aging-low";
    let highs: Vec<String> = (0..setup.high_subscriptions)
        .map(|index| format!("aging-high-{index}"))
        .collect();
    for topic in &highs {
        let handler = busy_handler(
            false,
            low_starts.clone(),
            handled.clone(),
            setup.handler_time,
        );
        dispatcher
            .subscribe(topic, handler, SubscribeOptions::new().priority(0))
            .await
            .expect("subscribing to the in-memory transport");
    }
    let handler = busy_handler(
        true,
        low_starts.clone(),
        handled.clone(),
        setup.handler_time,
    );
    let options = SubscribeOptions::new().priority(setup.low_priority);
    dispatcher
        .subscribe(LOW, handler, options)
        .await
        .expect("subscribing to the in-memory transport");
    // Handlers run one after another on this thread, so at most
    // `run_for / handler_time` messages are handled: each high topic gets
    // that many, the low one twice what the aging bound lets through.
    let most = (setup.run_for.as_secs_f64() / setup.handler_time.as_secs_f64()) as usize + 16;
    for topic in &highs {
        for _ in 0..most {
            transport.send(topic, Vec::new());
        }
    }
    let bound = setup.aging.bound().unwrap_or(setup.run_for);
    let lows = 2 * (setup.run_for.as_secs_f64() / bound.as_secs_f64()) as usize + 16;
    for _ in 0..lows {
        transport.send(LOW, Vec::new());
    }
    let closer = dispatcher.close_handle();
    let mut saturated = false;
    let mut stats = None;
    let finish = async {
        tokio::time::sleep(setup.run_for).await;
        saturated = highs
            .iter()
            .map(String::as_str)
            .chain([LOW])
            .all(|topic| transport.backlog_len(topic) > 0);
        stats = Some(dispatcher.stats());
        closer.close().await;
    };
    let (result, ()) = tokio::join!(dispatcher.run(), finish);
    result.expect("the dispatcher shuts down cleanly");
    assert_every_message_acked(&transport, handled.get() as usize);
    let stats = stats.expect("taken before closing");
    let (low, high) = stats
        .subscriptions
        .split_last()
        .expect("the low subscription is the last one registered");
    let wait = low.slot_wait.unwrap_or_default();
    let max_gap = low_starts
        .borrow()
        .windows(2)
        .map(|pair| pair[1] - pair[0])
        .max()
        .unwrap_or_default();
    AgingRun {
        max_wait: wait.max,
        p50_wait: wait.p50,
        max_gap,
        low_dispatched: low.dispatched,
        high_dispatched: high.iter().map(|stats| stats.dispatched).sum(),
        saturated,
    }
}
