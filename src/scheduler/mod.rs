//! The pure scheduler: priority levels, the messages each subscription
//! holds, per-subscription limits, key ordering, the permit count, and the
//! policy that chooses among levels.
//!
//! This module owns the decision of *which* waiting message runs next and
//! *whether* anything may run at all. It knows nothing of Pulsar, tasks,
//! wakers or I/O: it is generic over the message type and driven through
//! plain method calls, so it can be tested exhaustively and benchmarked
//! alone. Whoever inserts a message or returns a permit asks it for work
//! right away; nothing in it waits.
//!
//! Invariants:
//! - a subscription holds at most one message (its slot), or, ordered by
//!   key, at most its key buffer; it is offered more only while it has room,
//!   which is how backpressure reaches the consumer;
//! - a subscription is in its level's ready queue exactly when it holds a
//!   message that may run now (its key free) and is below its own
//!   in-flight limit; so a ready queue never holds more entries than its
//!   level has members, and a pick never looks at a subscription that
//!   cannot run;
//! - `ready_levels` has bit `b` set exactly when level `b`'s ready queue is
//!   non-empty, so finding the best level with work is a bit scan;
//! - `available`, the permits held without a message and the
//!   subscriptions' in-flight counts add up to `concurrency`, and a message
//!   at priority `p`
//!   takes a permit only if more are free than are reserved for levels
//!   better than `p`;
//! - two messages of a key-ordered subscription with the same key are never
//!   in flight at once, and start in the order they were inserted.
//!
//! Picks allocate nothing and do not look at every subscription: one bit
//! scan and one pop, plus, for [`SchedulingPolicy::Aging`], one look per
//! level within the aging's `max_boost` of the best.

mod claims;
mod held;
mod policy;

use std::collections::VecDeque;
use std::num::NonZeroUsize;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use slab::Slab;

use self::held::{Held, Keyed, Slotted, Waiting};
use self::policy::Reservations;
pub use self::policy::{Aging, SchedulingPolicy, Weights};

/// Identifies one subscription inside a [`Scheduler`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SubscriptionKey(usize);

/// How the messages of one subscription may overlap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ordering {
    /// Messages are picked in the order they are received and run
    /// concurrently (the default); with several running at once, one may
    /// start a little ahead of one picked just before it.
    #[default]
    Unordered,
    /// Messages with the same key never run at once and start in the order
    /// they were received; messages with different keys, or without one,
    /// run concurrently. A message whose key is busy waits without holding
    /// up other keys.
    Key,
    /// One message at a time, in the order they are received.
    Subscription,
}

/// A subscription's place in the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubscriptionConfig {
    /// Lower values are served first.
    pub priority: i64,
    /// The most of its messages in flight at once (none beyond the global
    /// limit when `None`).
    pub max_in_flight: Option<NonZeroUsize>,
    /// How its messages may overlap.
    pub ordering: Ordering,
    /// For [`Ordering::Key`], how many messages it may hold while their keys
    /// are busy (at least 1).
    pub key_buffer: usize,
}

impl SubscriptionConfig {
    /// Unordered, no limit of its own, at `priority`.
    pub fn new(priority: i64) -> Self {
        SubscriptionConfig {
            priority,
            max_in_flight: None,
            ordering: Ordering::Unordered,
            key_buffer: 1,
        }
    }
}

/// Why a message could not be put into its subscription's slot or key
/// buffer. The message
/// is handed back so that the caller can settle it.
#[derive(Debug, PartialEq, Eq)]
pub enum Rejected<M> {
    /// The subscription holds as many messages as it may.
    Full(M),
    /// The scheduler has been closed to new insertions.
    Closed(M),
}

/// A dispatched message's permit. Give it back with
/// [`Scheduler::release`] when the message's processing has ended.
#[derive(Debug)]
#[must_use = "a permit not released is lost"]
pub struct Permit {
    subscription: SubscriptionKey,
    key: Option<u64>,
    priority: i64,
}

impl Permit {
    /// The subscription the message came from.
    pub fn subscription(&self) -> SubscriptionKey {
        self.subscription
    }

    /// The priority its message was picked at.
    pub fn priority(&self) -> i64 {
        self.priority
    }

    /// Whether its message holds an ordering key, busy until the permit
    /// is released (key ordering).
    pub fn holds_key(&self) -> bool {
        self.key.is_some()
    }
}

/// What [`Scheduler::try_dispatch_refilling`] picked.
#[derive(Debug)]
#[non_exhaustive]
pub struct Pick<M> {
    /// The message's permit.
    pub permit: Permit,
    /// The message.
    pub message: M,
    /// Whether the refill was called (it is, while the scheduler is open,
    /// for a one-message slot, and for a key buffer when the refill tells
    /// keys).
    pub refill_called: bool,
    /// Whether a permit is still free after this pick.
    pub permits_left: bool,
    /// Whether the subscription's next message is next in line at its
    /// level after this pick: it is ready and alone in its level's ready
    /// queue, or it holds a message that may run and is at its in-flight
    /// limit (one at a time, say) with no other ready at its level. A hint
    /// that [`Scheduler::try_redispatch`] may hand this permit to that
    /// message when this one ends (it checks everything again).
    pub next_in_line: bool,
}

/// A re-dispatch under way ([`Scheduler::try_redispatch`]): the permit of
/// a message that has ended, offered to its subscription's next message,
/// which waits in the slot or at the front of the key buffer's free
/// messages. Settle it with [`exchange`](Self::exchange) or
/// [`take`](Self::take); until then nothing has changed.
#[must_use = "a re-dispatch dropped unsettled leaves the permit to release"]
pub struct Redispatch<'a, M> {
    scheduler: &'a mut Scheduler<M>,
    permit: &'a mut Permit,
    level: usize,
}

impl<M> std::fmt::Debug for Redispatch<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redispatch")
            .field("permit", &self.permit)
            .field("level", &self.level)
            .finish_non_exhaustive()
    }
}

impl<M> Redispatch<'_, M> {
    /// The priority the permit's next message would run at: its
    /// subscription's, now.
    #[inline(always)]
    pub fn priority(&self) -> i64 {
        self.scheduler.levels[self.level].priority
    }

    /// The subscription's next message was received: `exchange` is given
    /// the message the permit goes to, takes it out and puts the next one
    /// in its place (the engine swaps their boxes), which the slot or key
    /// buffer then holds as a message received, its ordering key told by
    /// `key_of`. The permit is the message taken out's now, and the
    /// subscription takes its turn as after a pick. Returns
    /// [`Pick::next_in_line`] for this re-dispatch.
    ///
    /// A key buffer left with everything it holds waiting for busy keys
    /// takes more from `more` while it has room, as after a pick (see
    /// [`Scheduler::try_dispatch_refilling`]). A slot asks neither
    /// `key_of` nor `more`. `more` runs once the exchange is made, so it
    /// must not unwind: the subscription's place in the ready queues is
    /// set after it (the engine's receive catches a consumer's panic and
    /// fails the dispatcher instead).
    #[inline(always)]
    pub fn exchange<R: Refilled<M>>(
        self,
        exchange: impl FnOnce(&mut M),
        key_of: impl FnOnce(&M) -> Option<u64>,
        more: impl FnMut() -> Option<R>,
    ) -> bool {
        let subscription = &mut self.scheduler.subscriptions[self.permit.subscription.0];
        let Held::Slot(Some(slotted)) = &mut subscription.held else {
            return self.exchange_keyed(exchange, key_of, more);
        };
        exchange(&mut slotted.message);
        let Level {
            ready, priority, ..
        } = &mut self.scheduler.levels[self.level];
        // The subscription may have moved level since the permit's pick.
        self.permit.priority = *priority;
        // Queued, it is at the front and takes its turn. At its in-flight
        // limit, it stays out of the queues, and its level's is empty.
        take_turn(ready)
    }

    /// [`exchange`](Self::exchange) for a key buffer, as a release and a
    /// pick do it: the ended message's key is released first (which may
    /// free a message parked behind it, after the one taken out), and the
    /// message put in is stored as a received one is, parked if its key is
    /// busy. Out of line, so that a slot's re-dispatch carries none of it.
    #[inline(never)]
    fn exchange_keyed<R: Refilled<M>>(
        self,
        exchange: impl FnOnce(&mut M),
        key_of: impl FnOnce(&M) -> Option<u64>,
        mut more: impl FnMut() -> Option<R>,
    ) -> bool {
        let Scheduler {
            subscriptions,
            waiting,
            ..
        } = &mut *self.scheduler;
        let Held::Keyed(keyed) = &mut subscriptions[self.permit.subscription.0].held else {
            unreachable!("a re-dispatch is offered for a full slot or a key buffer")
        };
        self.permit.key = keyed.exchange(self.permit.key, exchange, key_of);
        while keyed.waits_for_busy_keys() {
            let Some(refilled) = more() else {
                break;
            };
            debug_assert!(R::TELLS_KEY, "a key buffer's refill tells keys");
            *waiting += 1;
            if Scheduler::store_in_key_buffer(keyed, refilled, None) {
                break;
            }
        }
        self.after_redispatch()
    }

    /// The subscription had no next message: the message the permit goes
    /// to is taken out, and the permit is its own now.
    pub fn take(self) -> M {
        let scheduler = &mut *self.scheduler;
        let subscription = &mut scheduler.subscriptions[self.permit.subscription.0];
        subscription.held.release(self.permit.key);
        let Some(waiting) = subscription.held.take_next() else {
            unreachable!("a re-dispatch is offered for a message that may run")
        };
        scheduler.waiting -= 1;
        self.permit.key = waiting.key;
        self.after_redispatch();
        waiting.message
    }

    /// The subscription's place after a re-dispatch that took a message
    /// out, as after a pick: queued, it takes its turn if it is still
    /// ready, and leaves the queue otherwise; at its in-flight limit, it
    /// stays out of the queues. Returns [`Pick::next_in_line`].
    fn after_redispatch(self) -> bool {
        let scheduler = self.scheduler;
        self.permit.priority = scheduler.levels[self.level].priority;
        let subscription = &scheduler.subscriptions[self.permit.subscription.0];
        let still_ready = subscription.is_ready();
        let full_at_limit =
            subscription.held.has_dispatchable() && subscription.in_flight == subscription.limit;
        let alone = if subscription.queued {
            scheduler.after_pick_at_front(self.level, still_ready)
        } else {
            false
        };
        alone || !still_ready && full_at_limit && scheduler.levels[self.level].ready.is_empty()
    }
}

/// What a refill within a pick ([`Scheduler::try_dispatch_refilling`])
/// hands back: the next message and, for a key buffer, its ordering key.
/// A plain message tells no key, so a pick from a key buffer leaves the
/// refill to its caller; a type that tells keys is asked for one only when
/// a key buffer is refilled, so a slot's refill never hashes a key.
pub trait Refilled<M> {
    /// Whether [`refill_key`](Self::refill_key) tells the message's key.
    const TELLS_KEY: bool;

    /// The hash of the message's ordering key, if it has one.
    fn refill_key(&self) -> Option<u64>;

    /// The message itself.
    fn into_refilled(self) -> M;
}

// Every type is a `Refilled` of itself, so the methods' names are chosen
// not to shadow any other type's.
impl<M> Refilled<M> for M {
    const TELLS_KEY: bool = false;

    fn refill_key(&self) -> Option<u64> {
        None
    }

    fn into_refilled(self) -> M {
        self
    }
}

/// A permit taken without a message, by a worker that steps aside for a
/// moment and dispatches right after: meanwhile no one else takes it, and
/// it holds no message and no key. Give it back with
/// [`Scheduler::unhold`].
#[derive(Debug)]
#[must_use = "a held permit not given back is lost"]
pub struct HeldPermit(());

// Aligned to a cache line, and small enough to fit in one (with a message
// of two pointers, as the engine's is): with many subscriptions a pick finds
// its subscription out of the cache, and then reads one line, where an
// unaligned layout would span two or three.
#[repr(align(64))]
struct Subscription<M> {
    level: usize,
    held: Held<M>,
    in_flight: usize,
    limit: usize,
    /// In its level's ready queue.
    queued: bool,
}

impl<M> Subscription<M> {
    #[inline]
    fn is_ready(&self) -> bool {
        self.held.has_dispatchable() && self.in_flight < self.limit
    }
}

struct Level {
    priority: i64,
    members: usize,
    /// Subscriptions that may run, in the order they became ready. Popping
    /// the front and pushing back a subscription that is ready again is
    /// what makes equal priorities take turns.
    ready: VecDeque<SubscriptionKey>,
    /// Its weight, and the dispatches left in its turn (weighted policy).
    weight: u32,
    deficit: u32,
    /// Free permits its messages must leave for better levels.
    to_leave: usize,
}

/// Chooses the next message to run among subscriptions grouped by priority
/// level, under a global concurrency limit.
pub struct Scheduler<M> {
    subscriptions: Slab<Subscription<M>>,
    /// Sorted by ascending priority value: index 0 is served first.
    levels: Vec<Level>,
    /// Bit `b % 64` of word `b / 64` is set when level `b` has a ready
    /// subscription.
    ready_levels: Vec<u64>,
    concurrency: usize,
    available: usize,
    /// Permits taken by [`Scheduler::hold`], without a message.
    held: usize,
    /// Messages held, across all subscriptions.
    waiting: usize,
    closed: bool,
    policy: SchedulingPolicy,
    reservations: Reservations,
    /// The level whose turn it is (weighted policy).
    turn: Option<usize>,
    clock: fn() -> Instant,
    /// Inside a round, the time the aging policy read first in it.
    round: Option<Option<Instant>>,
}

/// The time for the aging policy: the round's (read from `clock` at its
/// first use), or the clock's outside a round. On the fields alone, so that
/// a pick can read it while it holds its subscription.
fn round_time(round: &mut Option<Option<Instant>>, clock: fn() -> Instant) -> Instant {
    match round {
        None => clock(),
        Some(round) => *round.get_or_insert_with(clock),
    }
}

impl<M> std::fmt::Debug for Scheduler<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("subscriptions", &self.subscriptions.len())
            .field("levels", &self.levels.len())
            .field("waiting", &self.waiting)
            .field("in_flight", &self.in_flight())
            .field("concurrency", &self.concurrency)
            .field("policy", &self.policy)
            .field("closed", &self.closed)
            .finish()
    }
}

impl<M> Scheduler<M> {
    /// A strict-priority scheduler that lets at most `concurrency` messages
    /// be in flight.
    pub fn new(concurrency: NonZeroUsize) -> Self {
        Self::with_policy(concurrency, SchedulingPolicy::Strict)
    }

    /// A scheduler that chooses among levels by `policy`.
    pub fn with_policy(concurrency: NonZeroUsize, policy: SchedulingPolicy) -> Self {
        Scheduler {
            subscriptions: Slab::new(),
            levels: Vec::new(),
            ready_levels: Vec::new(),
            concurrency: concurrency.get(),
            available: concurrency.get(),
            held: 0,
            waiting: 0,
            closed: false,
            policy,
            reservations: Reservations::default(),
            turn: None,
            clock: Instant::now,
            round: None,
        }
    }

    /// Replaces the clock the aging policy reads (the system's by default):
    /// the engine gives it the runtime's, tests one of their own.
    pub fn with_clock(mut self, clock: fn() -> Instant) -> Self {
        self.clock = clock;
        self
    }

    /// Starts a dispatch round: until [`Scheduler::end_round`], the aging
    /// policy reads the clock once, at its first insertion or pick, and
    /// takes that time for all of them. A round is a burst of picks and
    /// refills with no waiting in between, so the waits it measures are
    /// off by at most the round's own length.
    pub fn begin_round(&mut self) {
        self.round = Some(None);
    }

    /// Ends the round begun by [`Scheduler::begin_round`].
    pub fn end_round(&mut self) {
        self.round = None;
    }

    /// The time for the aging policy: the round's, or the clock's.
    fn now(&mut self) -> Instant {
        round_time(&mut self.round, self.clock)
    }

    /// Keeps `permits` permits for messages at `priority` or better: a
    /// message at a worse level takes a permit only while more than those
    /// are free. Reservations add up.
    ///
    /// # Panics
    ///
    /// If the reservations would leave no permit unreserved: a level worse
    /// than every reservation could then never take one.
    pub fn reserve(&mut self, priority: i64, permits: usize) {
        let total = self.reservations.total().checked_add(permits);
        assert!(
            total.is_some_and(|total| total < self.concurrency),
            "reservations must leave a permit of the concurrency limit unreserved"
        );
        self.reservations.reserve(priority, permits);
        for level in &mut self.levels {
            level.to_leave = self.reservations.to_leave(level.priority);
        }
    }

    /// Registers an unordered subscription at `priority` (lower values are
    /// served first) with no limit of its own.
    pub fn add_subscription(&mut self, priority: i64) -> SubscriptionKey {
        self.add(SubscriptionConfig::new(priority))
    }

    /// Registers a subscription.
    pub fn add(&mut self, config: SubscriptionConfig) -> SubscriptionKey {
        let mut limit = config.max_in_flight.map_or(usize::MAX, NonZeroUsize::get);
        let keyed = config.ordering == Ordering::Key;
        if config.ordering == Ordering::Subscription {
            limit = 1;
        }
        let held = Held::new(keyed, config.key_buffer.max(1), limit.min(self.concurrency));
        let level = self.level_for(config.priority);
        self.join(level);
        SubscriptionKey(self.subscriptions.insert(Subscription {
            level,
            held,
            in_flight: 0,
            limit,
            queued: false,
        }))
    }

    /// Unregisters a subscription that holds nothing and has nothing in
    /// flight, and frees its key for reuse; returns false (and changes
    /// nothing) otherwise.
    pub fn remove_subscription(&mut self, key: SubscriptionKey) -> bool {
        let subscription = &self.subscriptions[key.0];
        if subscription.held.len() > 0 || subscription.in_flight > 0 {
            return false;
        }
        let level = subscription.level;
        self.subscriptions.remove(key.0);
        self.leave(level);
        true
    }

    /// Moves a subscription to another priority level, effective at the
    /// next pick. A message it holds moves with it, to the back of its new
    /// level's turns.
    pub fn set_priority(&mut self, key: SubscriptionKey, priority: i64) {
        if self.priority(key) == priority {
            return;
        }
        self.unqueue(key);
        // Join the new level before leaving the old one: creating the new
        // level, and removing the old one if it empties, both renumber the
        // levels, and each renumbering must see where this subscription is.
        let new = self.level_for(priority);
        self.join(new);
        let old = std::mem::replace(&mut self.subscriptions[key.0].level, new);
        self.leave(old);
        self.requeue(key);
    }

    /// The priority of a subscription.
    pub fn priority(&self, key: SubscriptionKey) -> i64 {
        self.levels[self.subscriptions[key.0].level].priority
    }

    /// Whether the subscription may be offered another message.
    pub fn has_vacancy(&self, key: SubscriptionKey) -> bool {
        self.subscriptions[key.0].held.has_room()
    }

    /// Whether the subscription holds a message it could dispatch now,
    /// limits aside: false when it holds nothing, or, under key ordering,
    /// only messages whose keys are busy.
    pub fn holds_dispatchable(&self, key: SubscriptionKey) -> bool {
        self.subscriptions[key.0].held.has_dispatchable()
    }

    /// Puts `message` into the subscription's slot or key buffer.
    pub fn try_insert(&mut self, key: SubscriptionKey, message: M) -> Result<(), Rejected<M>> {
        self.try_insert_keyed(key, message, None)
    }

    /// Puts `message` into the subscription's slot or key buffer;
    /// `order_key` is the hash of its ordering key (used by
    /// [`Ordering::Key`] subscriptions only).
    pub fn try_insert_keyed(
        &mut self,
        key: SubscriptionKey,
        message: M,
        order_key: Option<u64>,
    ) -> Result<(), Rejected<M>> {
        if self.closed {
            return Err(Rejected::Closed(message));
        }
        let since = matches!(self.policy, SchedulingPolicy::Aging(_)).then(|| self.now());
        let subscription = &mut self.subscriptions[key.0];
        if !subscription.held.has_room() {
            return Err(Rejected::Full(message));
        }
        subscription.held.insert(Waiting {
            message,
            key: order_key,
            since,
        });
        self.waiting += 1;
        self.requeue(key);
        Ok(())
    }

    /// Takes a permit and then the best waiting message, if there is both.
    ///
    /// The permit comes first: while none is free, messages stay where they
    /// are, so the choice is made when capacity frees up.
    pub fn try_dispatch(&mut self) -> Option<(Permit, M)> {
        if self.available == 0 {
            return None;
        }
        let level = self.choose_level()?;
        self.dispatch_at(level)
    }

    /// Takes a permit and the next message of the subscription at the
    /// front of `level`'s ready queue (a permit is free for that level).
    #[inline(always)]
    fn dispatch_at(&mut self, level: usize) -> Option<(Permit, M)> {
        let key = self.pop_ready_inline(level);
        let subscription = &mut self.subscriptions[key.0];
        let waiting = subscription
            .held
            .take_next()
            .expect("a ready subscription holds a message that may run");
        subscription.in_flight += 1;
        self.available -= 1;
        self.waiting -= 1;
        self.charge_turn(level);
        self.requeue(key);
        let permit = Permit {
            subscription: key,
            key: waiting.key,
            priority: self.levels[level].priority,
        };
        Some((permit, waiting.message))
    }

    /// Like [`try_dispatch`](Self::try_dispatch), and refills the emptied
    /// slot or key buffer in the same step: `refill` is called with the
    /// message picked and returns the subscription's next message, if
    /// there is one (the scheduler still accepting messages). A slot is
    /// refilled once; a key buffer, when the refill tells keys (see
    /// [`Refilled`]), as the engine refills one after a pick: once, and
    /// again while everything it holds waits for a busy key and it has
    /// room. The flag returned tells whether `refill` was called; it is
    /// not for a key buffer whose refill tells no key, which the caller
    /// refills as after `try_dispatch`. A pick also tells whether a permit
    /// is left, so that a caller picking until none is need not ask again.
    ///
    /// A subscription refilled here keeps its place in its level's ready
    /// queue: moved to the back when others wait there (as a pop and a
    /// push would), left where it is when it is the only one, so that the
    /// common case touches neither the queue nor the ready bits. `refill`
    /// runs while the subscription is still at the front of the queue,
    /// with its message taken; it cannot reach the scheduler (the caller
    /// holds it).
    #[inline(always)]
    pub fn try_dispatch_refilling<R: Refilled<M>>(
        &mut self,
        mut refill: impl FnMut(&M) -> Option<R>,
    ) -> Option<Pick<M>> {
        if self.available == 0 {
            return None;
        }
        let level = self.choose_level()?;
        let Level {
            ready, priority, ..
        } = &self.levels[level];
        let Some(&key) = ready.front() else {
            empty_ready_level()
        };
        let priority = *priority;
        if !R::TELLS_KEY && matches!(self.subscriptions[key.0].held, Held::Keyed(_)) {
            let (permit, message) = self.dispatch_at(level)?;
            return Some(self.pick(permit, message, false, false));
        }
        // Charged before the subscription is borrowed for the rest of the
        // pick; nothing in the pick reads the turn.
        self.charge_turn(level);
        let aging = matches!(self.policy, SchedulingPolicy::Aging(_));
        // The subscription is looked up once: the refill is stored, and its
        // readiness read, through this borrow (`refill` cannot reach the
        // scheduler); the rest of the pick touches other fields only, but
        // for `pop_ready` clearing `queued` when it is no longer ready.
        let subscription = &mut self.subscriptions[key.0];
        let Some(waiting) = subscription.held.take_next() else {
            nothing_to_run()
        };
        subscription.in_flight += 1;
        self.available -= 1;
        self.waiting -= 1;
        let permit = Permit {
            subscription: key,
            key: waiting.key,
            priority,
        };
        if self.closed {
            let still_ready = subscription.is_ready();
            self.after_pick_at_front(level, still_ready);
            return Some(self.pick(permit, waiting.message, false, false));
        }
        // A refill that panics must not leave the subscription at the
        // front of its queue with an empty slot, which every later pick
        // would trip on: the queue is put right first (what was stored
        // before the panic kept), and the pick is lost, its permit with it
        // (the unwind drops the `Permit`). (The engine's refill does not panic: it catches
        // a consumer's panic, a transport's bug, and fails the dispatcher,
        // since a lost pick would hold a permit shutdown waits for.) One
        // call of `refill` in the code, for a slot and a key
        // buffer alike: a second one kept the optimizer from inlining it.
        let refilled = std::panic::catch_unwind(AssertUnwindSafe(|| {
            while let Some(refilled) = refill(&waiting.message) {
                let since = aging.then(|| round_time(&mut self.round, self.clock));
                self.waiting += 1;
                if Self::store_refilled(&mut subscription.held, refilled, since) {
                    break;
                }
            }
        }));
        let still_ready = subscription.is_ready();
        // The next message can be re-dispatched when it is alone at its
        // level, or at its in-flight limit with no other at its level (see
        // `try_redispatch`).
        let full_at_limit =
            subscription.held.has_dispatchable() && subscription.in_flight == subscription.limit;
        let alone = self.after_pick_at_front(level, still_ready);
        let next_in_line =
            alone || !still_ready && full_at_limit && self.levels[level].ready.is_empty();
        if let Err(panic) = refilled {
            std::panic::resume_unwind(panic);
        }
        Some(self.pick(permit, waiting.message, true, next_in_line))
    }

    /// Offers `permit`, whose message's processing has just ended, to its
    /// own subscription's next message, when that is the message
    /// [`release`](Self::release) followed by
    /// [`try_dispatch_refilling`](Self::try_dispatch_refilling) would pick
    /// under it, and nothing more: the policy is strict, the subscription
    /// holds a message that may run (its slot's, or a free one in its key
    /// buffer), and either it is at the front of the best
    /// ready level, which leaves no permit to better levels, with no other
    /// permit free, or it is at its in-flight limit with nothing ready at
    /// its level or a better one (see `next_at_its_limit`). `None`
    /// otherwise (then release the permit and dispatch as usual).
    ///
    /// Nothing changes until the [`Redispatch`] returned is settled: the
    /// message it goes to is exchanged in place for the subscription's next
    /// one ([`Redispatch::exchange`]), or taken out when there is none
    /// ([`Redispatch::take`]). Dropped unsettled (a refill that panicked),
    /// it leaves the scheduler as it was and the permit the caller's to
    /// release.
    ///
    /// The common end of a job in a busy dispatcher, done without the
    /// permit's round trip through the ready queue and the level bits, and
    /// without moving a message in or out of a slot.
    #[inline(always)]
    pub fn try_redispatch<'a>(&'a mut self, permit: &'a mut Permit) -> Option<Redispatch<'a, M>> {
        let key = permit.subscription;
        let subscription = &self.subscriptions[key.0];
        let level = subscription.level;
        let Level {
            ready, to_leave, ..
        } = &self.levels[level];
        let queued = subscription.queued;
        // A full slot first: the common re-dispatch tests one tag (4
        // instructions per message fewer than asking the holder).
        let open = (matches!(subscription.held, Held::Slot(Some(_)))
            || subscription.held.has_dispatchable())
            && !self.closed
            && matches!(self.policy, SchedulingPolicy::Strict);
        // Queued, the pick after the release is the front of the best ready
        // level, with the only permit free.
        let same_pick = if queued {
            open && self.available == 0
                && *to_leave == 0
                && ready.front() == Some(&key)
                && first_set_bit(&self.ready_levels, 0) == Some(level)
        } else {
            open && self.next_at_its_limit(key)
        };
        if !same_pick {
            return None;
        }
        Some(Redispatch {
            scheduler: self,
            permit,
            level,
        })
    }

    /// [`try_redispatch`](Self::try_redispatch) for a subscription that
    /// holds a message that may run (a full slot, or a free message in its
    /// key buffer) and is out of the ready queues: whether it is at its
    /// in-flight limit (one at a time, say), so that the release puts it at
    /// the back of its level's queue, and the pick that follows takes it
    /// and no other: nothing is ready at its level or a better one, and
    /// either no other permit is free or nothing is ready anywhere (a round
    /// with permits left picks on). Out of line: the common re-dispatch is
    /// a queued subscription's.
    #[cold]
    #[inline(never)]
    fn next_at_its_limit(&self, key: SubscriptionKey) -> bool {
        let subscription = &self.subscriptions[key.0];
        let level = subscription.level;
        // After the release, `available + 1` permits are free, which must
        // be more than its level leaves to better ones.
        if subscription.in_flight != subscription.limit
            || self.available < self.levels[level].to_leave
        {
            return false;
        }
        match first_set_bit(&self.ready_levels, 0) {
            None => true,
            Some(best) => self.available == 0 && best > level,
        }
    }

    /// Stores a message refilled within a pick into `held`, which has room
    /// for it (the pick took one); returns whether the refill is done. A
    /// slot is then full. A key buffer takes more while everything it
    /// holds waits for a busy key (the keys behind them must not wait too,
    /// and nothing else would take them) and it has room.
    #[inline(always)]
    fn store_refilled<R: Refilled<M>>(
        held: &mut Held<M>,
        refilled: R,
        since: Option<Instant>,
    ) -> bool {
        match held {
            Held::Slot(slot) => {
                *slot = Some(Slotted {
                    message: refilled.into_refilled(),
                    since,
                });
                true
            }
            Held::Keyed(keyed) => Self::store_in_key_buffer(keyed, refilled, since),
        }
    }

    /// [`store_refilled`](Self::store_refilled) for a key buffer: hashes
    /// the message's key and stores it. Out of line, as one call: inlined,
    /// it made the slot's path around it 8 instructions per message dearer
    /// (callgrind), though it never runs there.
    #[inline(never)]
    fn store_in_key_buffer<R: Refilled<M>>(
        keyed: &mut Keyed<M>,
        refilled: R,
        since: Option<Instant>,
    ) -> bool {
        let order_key = refilled.refill_key();
        keyed.store_refilled(Waiting {
            message: refilled.into_refilled(),
            key: order_key,
            since,
        })
    }

    #[inline(always)]
    fn pick(&self, permit: Permit, message: M, refill_called: bool, next_in_line: bool) -> Pick<M> {
        Pick {
            permit,
            message,
            refill_called,
            permits_left: self.available > 0,
            next_in_line,
        }
    }

    /// After a pick from the subscription at the front of `level`'s ready
    /// queue: to the back of the queue if it is `still_ready` (where a pop
    /// and a push would put it), out of it otherwise. Returns whether it is
    /// ready and alone there (see [`Pick::next_in_line`]).
    #[inline(always)]
    fn after_pick_at_front(&mut self, level: usize, still_ready: bool) -> bool {
        if !still_ready {
            self.pop_ready(level);
            return false;
        }
        take_turn(&mut self.levels[level].ready)
    }

    /// A pick at `level` costs its turn one dispatch (weighted policy).
    #[inline(always)]
    fn charge_turn(&mut self, level: usize) {
        if matches!(self.policy, SchedulingPolicy::Weighted(_)) {
            let level = &mut self.levels[level];
            level.deficit = level.deficit.saturating_sub(1);
        }
    }

    /// Takes any waiting message without a permit (to give it back when the
    /// dispatcher gives up on it).
    pub fn take_waiting(&mut self) -> Option<(SubscriptionKey, M)> {
        let (index, _) = self
            .subscriptions
            .iter()
            .find(|(_, subscription)| subscription.held.len() > 0)?;
        let key = SubscriptionKey(index);
        self.take_held(key).map(|message| (key, message))
    }

    /// Takes a message the subscription holds, dispatchable or not,
    /// without a permit (to give it back).
    pub fn take_held(&mut self, key: SubscriptionKey) -> Option<M> {
        let waiting = self.subscriptions[key.0].held.take_any()?;
        self.waiting -= 1;
        if !self.subscriptions[key.0].is_ready() {
            self.unqueue(key);
        }
        Some(waiting.message)
    }

    /// Returns the permit of a message whose processing has ended.
    pub fn release(&mut self, permit: Permit) {
        assert!(self.available < self.concurrency, "permit released twice");
        self.available += 1;
        let subscription = &mut self.subscriptions[permit.subscription.0];
        subscription.in_flight -= 1;
        subscription.held.release(permit.key);
        self.requeue(permit.subscription);
    }

    /// Takes a free permit without a message, if one is free.
    pub fn hold(&mut self) -> Option<HeldPermit> {
        if self.available == 0 {
            return None;
        }
        self.available -= 1;
        self.held += 1;
        Some(HeldPermit(()))
    }

    /// Gives back a permit taken by [`Scheduler::hold`].
    pub fn unhold(&mut self, held: HeldPermit) {
        let HeldPermit(()) = held;
        assert!(self.available < self.concurrency, "permit given back twice");
        self.available += 1;
        self.held -= 1;
    }

    /// Number of permits taken: by dispatched messages whose processing has
    /// not ended, and held ones.
    pub fn in_flight(&self) -> usize {
        self.concurrency - self.available
    }

    /// Number of dispatched messages whose processing has not ended: the
    /// permits taken, less the held ones.
    pub fn running(&self) -> usize {
        self.in_flight() - self.held
    }

    /// Number of permits free.
    pub fn available(&self) -> usize {
        self.available
    }

    /// Number of messages held, not yet dispatched.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Messages of one subscription held and in flight.
    pub fn load(&self, key: SubscriptionKey) -> (usize, usize) {
        let subscription = &self.subscriptions[key.0];
        (subscription.held.len(), subscription.in_flight)
    }

    /// Whether nothing waits and nothing is in flight.
    pub fn is_idle(&self) -> bool {
        self.waiting == 0 && self.in_flight() == 0
    }

    /// Refuses further insertions; messages already held stay to be
    /// dispatched.
    pub fn close(&mut self) {
        self.closed = true;
    }

    // ----- choosing a level -----

    fn choose_level(&mut self) -> Option<usize> {
        let best = first_set_bit(&self.ready_levels, 0)?;
        let chosen = match &self.policy {
            SchedulingPolicy::Strict => best,
            SchedulingPolicy::Weighted(_) => self.weighted_turn(best),
            SchedulingPolicy::Aging(aging) => {
                let aging = *aging;
                let now = self.now();
                self.most_aged(best, &aging, now)
            }
        };
        // Reservations grow with the priority value, so if the chosen level
        // must leave its permits, the best level with work is the one left
        // to try.
        [chosen, best]
            .into_iter()
            .find(|&level| self.available > self.levels[level].to_leave)
    }

    /// Deficit round robin across levels: the level whose turn it is keeps
    /// it for as many dispatches as its weight, while it has work when a
    /// pick comes; a level without work then loses the rest of its turn.
    fn weighted_turn(&mut self, best: usize) -> usize {
        if let Some(turn) = self.turn {
            if self.level_is_ready(turn) && self.levels[turn].deficit > 0 {
                return turn;
            }
        }
        let next = self
            .turn
            .and_then(|turn| first_set_bit(&self.ready_levels, turn + 1))
            .unwrap_or(best);
        let level = &mut self.levels[next];
        level.deficit = level.weight;
        self.turn = Some(next);
        next
    }

    /// Among the levels within `max_boost` of the best ready one, the level
    /// whose next message has the best priority once lowered by its wait,
    /// without limit (ties go to the better level). Priority so works as a
    /// delay: a message goes before the better levels' messages that came
    /// more than the priority difference (in seconds of aging) after it.
    /// The wait is not capped at `max_boost`: a cap would let a better
    /// level's backlog, whose messages age too, hold a worse level back for
    /// good.
    ///
    /// Priorities are compared as their distance from the best level's,
    /// at most `max_boost`: a priority itself as an `f64` loses small gaps
    /// far from zero (in steps of 1,024 beyond 2^62), and aging with it.
    fn most_aged(&self, best: usize, aging: &Aging, now: Instant) -> usize {
        let base = self.levels[best].priority;
        let reach = base.saturating_add(aging.max_boost());
        let mut chosen = (best, f64::INFINITY);
        let mut next = Some(best);
        while let Some(index) = next {
            let level = &self.levels[index];
            if level.priority > reach {
                break;
            }
            let head = level.ready.front().expect("a ready level has a head");
            let waited = self.subscriptions[head.0]
                .held
                .next_since()
                .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
            let effective = level.priority.abs_diff(base) as f64 - aging.points(waited);
            if effective < chosen.1 {
                chosen = (index, effective);
            }
            next = first_set_bit(&self.ready_levels, index + 1);
        }
        chosen.0
    }

    // ----- ready queues and levels -----

    /// Puts a subscription in its level's ready queue if it may run and is
    /// not there yet. Inlined by force: it is on the path of every insert,
    /// `try_dispatch` pick and release, and out of line it cost about 65
    /// instructions per message more (callgrind).
    #[inline(always)]
    fn requeue(&mut self, key: SubscriptionKey) {
        let subscription = &mut self.subscriptions[key.0];
        if subscription.queued || !subscription.is_ready() {
            return;
        }
        subscription.queued = true;
        let level = subscription.level;
        self.levels[level].ready.push_back(key);
        self.ready_levels[level / 64] |= 1 << (level % 64);
    }

    fn unqueue(&mut self, key: SubscriptionKey) {
        let subscription = &mut self.subscriptions[key.0];
        if !std::mem::replace(&mut subscription.queued, false) {
            return;
        }
        let level = subscription.level;
        let ready = &mut self.levels[level].ready;
        let at = ready.iter().position(|&k| k == key).expect("queued");
        ready.remove(at);
        self.clear_bit_if_idle(level);
    }

    /// [`pop_ready`](Self::pop_ready) inlined by force, for
    /// `dispatch_at` (a `try_dispatch` pick, and a key buffer's pick whose
    /// refill tells no key), which pops every time (a pick that refills
    /// pops only when it leaves the subscription not ready, and takes the
    /// call).
    #[inline(always)]
    fn pop_ready_inline(&mut self, level: usize) -> SubscriptionKey {
        let key = self.levels[level]
            .ready
            .pop_front()
            .expect("ready bit set for an empty level");
        self.subscriptions[key.0].queued = false;
        self.clear_bit_if_idle(level);
        key
    }

    /// Out of line: a subscription that its refilling pick left not ready
    /// is the rare case, kept off the common path's code.
    #[inline(never)]
    fn pop_ready(&mut self, level: usize) -> SubscriptionKey {
        self.pop_ready_inline(level)
    }

    fn level_is_ready(&self, level: usize) -> bool {
        self.ready_levels[level / 64] & (1 << (level % 64)) != 0
    }

    fn clear_bit_if_idle(&mut self, level: usize) {
        if self.levels[level].ready.is_empty() {
            self.ready_levels[level / 64] &= !(1 << (level % 64));
        }
    }

    /// The index of the level at `priority`, created if needed.
    fn level_for(&mut self, priority: i64) -> usize {
        match self
            .levels
            .binary_search_by_key(&priority, |level| level.priority)
        {
            Ok(found) => found,
            Err(at) => {
                self.insert_level(at, priority);
                at
            }
        }
    }

    /// One more member in `level`: its ready queue gets room for every
    /// member, so that it never grows while messages flow.
    fn join(&mut self, level: usize) {
        let level = &mut self.levels[level];
        level.members += 1;
        let room = level.members - level.ready.len();
        level.ready.reserve(room);
    }

    /// One member fewer in `level`; an empty level is removed.
    fn leave(&mut self, level: usize) {
        self.levels[level].members -= 1;
        if self.levels[level].members == 0 {
            self.remove_level(level);
        }
    }

    fn insert_level(&mut self, at: usize, priority: i64) {
        let weight = match &self.policy {
            SchedulingPolicy::Weighted(weights) => weights.of(priority),
            _ => 1,
        };
        self.levels.insert(
            at,
            Level {
                priority,
                members: 0,
                ready: VecDeque::new(),
                weight,
                deficit: 0,
                to_leave: self.reservations.to_leave(priority),
            },
        );
        self.shift_levels(|level| if level >= at { level + 1 } else { level });
    }

    fn remove_level(&mut self, at: usize) {
        debug_assert!(self.levels[at].ready.is_empty());
        self.levels.remove(at);
        if self.turn == Some(at) {
            self.turn = None;
        }
        self.shift_levels(|level| if level > at { level - 1 } else { level });
    }

    /// Renumbers the levels subscriptions and the turn point to, and
    /// recomputes the ready bits.
    fn shift_levels(&mut self, shift: impl Fn(usize) -> usize) {
        for (_, subscription) in self.subscriptions.iter_mut() {
            subscription.level = shift(subscription.level);
        }
        self.turn = self.turn.map(&shift);
        self.rebuild_ready_bits();
    }

    fn rebuild_ready_bits(&mut self) {
        self.ready_levels = vec![0; self.levels.len().div_ceil(64)];
        for (index, level) in self.levels.iter().enumerate() {
            if !level.ready.is_empty() {
                self.ready_levels[index / 64] |= 1 << (index % 64);
            }
        }
    }
}

/// A ready bit set for a level whose ready queue is empty: a bug. Cold
/// and without arguments, as is [`nothing_to_run`]: two `expect`s in one
/// pick get their panics merged into one call, whose message and location
/// the pick would prepare on every message (6 instructions, callgrind).
#[cold]
#[inline(never)]
fn empty_ready_level() -> ! {
    panic!("ready bit set for an empty level")
}

/// A subscription in a ready queue that holds no message that may run: a
/// bug (see [`empty_ready_level`]).
#[cold]
#[inline(never)]
fn nothing_to_run() -> ! {
    panic!("a ready subscription holds a message that may run")
}

/// The front subscription of a ready queue has taken its turn: it moves
/// to the back, as a pop and a push would, unless it is alone there.
/// Returns whether it is alone (or the queue empty: a subscription at its
/// in-flight limit is out of it), the case of [`Pick::next_in_line`].
/// Not `VecDeque::rotate_left(1)`: that is a call and a general copy,
/// about 50 instructions per pick with 1000 subscriptions at one level
/// (callgrind, `--profile ours-k1000`), against a few here. The queue keeps
/// its room (it never holds more than its level's members), so the push
/// never reallocates.
#[inline(always)]
fn take_turn(ready: &mut VecDeque<SubscriptionKey>) -> bool {
    let alone = ready.len() <= 1;
    if !alone {
        if let Some(front) = ready.pop_front() {
            ready.push_back(front);
        }
    }
    alone
}

/// The index of the first set bit at or after `from`.
fn first_set_bit(words: &[u64], from: usize) -> Option<usize> {
    let mut word_index = from / 64;
    let mut word = *words.get(word_index)? & (!0u64 << (from % 64));
    loop {
        if word != 0 {
            return Some(word_index * 64 + word.trailing_zeros() as usize);
        }
        word_index += 1;
        word = *words.get(word_index)?;
    }
}
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
