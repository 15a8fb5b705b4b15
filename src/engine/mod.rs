//! The engine: run-time state and the data path of a dispatcher.
//!
//! One [`Engine`] per dispatcher owns the transport, the scheduler, the
//! subscriptions and the lifecycle. A message's way through it:
//!
//! 1. A subscription's slot is empty, so whoever emptied it (or, when the
//!    consumer wakes, the idle worker that offered to help, else the engine
//!    task) polls the consumer once, which writes the message into a reused
//!    [`MessageBox`]; the box goes in the slot.
//! 2. Whoever inserted a message or returned a permit dispatches: while a
//!    permit is free, the scheduler picks the best waiting message, the
//!    emptied slot is refilled, and the message becomes a [`Job`] for a
//!    worker of its handler (see `worker`).
//! 3. The worker runs the handler on the message where it is stored, routes
//!    the outcome, settles it on the consumer, returns the permit and
//!    dispatches again, often to itself (its own messages queue behind the
//!    one it runs).
//!
//! The engine task (`lifecycle`) does only what nobody else is there to
//! do: poll consumers that woke while no worker was idle, keep the one
//! timer (held nacks, receive retries, the shutdown deadline, publishing
//! metrics), and walk shutdown's phases. Subscribing and unsubscribing
//! (`registry`) happen beside it, at any time. Everything is on one thread;
//! no `RefCell` borrow is held across an `.await`.
//!
//! The small functions every message passes through (settling, routing,
//! returning the permit, recycling the box) are `#[inline(always)]`: the
//! optimizer kept them out of line even with LTO, and the calls cost about
//! 30 instructions per message under callgrind.

mod health;
mod lifecycle;
mod metrics;
mod registry;
mod stats;
mod subscription;
mod wake;
mod worker;

#[cfg(test)]
pub(crate) use worker::JOBS_PER_POLL;

use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use futures::future::LocalBoxFuture;

use slab::Slab;
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};
use tracing::debug;

pub use self::health::{Health, Phase as HealthPhase, SubscriptionHealth};
pub use self::lifecycle::PUBLISH_GRACE;
pub use self::stats::{DispatcherStats, Latency, SubscriptionStats};
pub(crate) use self::subscription::{SubscriptionId, SubscriptionSpec};

use self::stats::bump;
use self::subscription::{Received, Subscription};
use self::wake::WokenList;
use self::worker::Job;
use crate::error::Error;
use crate::message::Message;
use crate::outcome::{Outcome, SubscriptionInfo, Verdict};
use crate::routing::{Action, DeadLetterTargets, Publish, PublishKind, RetryTopicCheck, Router};
use crate::scheduler::{HeldPermit, Permit, Pick, Refilled, Rejected, Scheduler, SchedulingPolicy};
use crate::transport::Transport;

/// Where a dispatcher is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Accepting subscriptions; `run()` not called yet.
    Idle,
    /// Receiving and dispatching.
    Running,
    /// Shutdown started: nothing new is received; waiting messages are
    /// still dispatched and handlers run to completion.
    Stopping,
    /// Nothing waits or runs; held nacks are sent and consumers closed.
    Drained,
    /// Everything is closed.
    Closed,
}

impl Phase {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Running => "running",
            Phase::Stopping | Phase::Drained => "shutting down",
            Phase::Closed => "closed",
        }
    }
}

/// Storage for one message, reused from message to message: a message is
/// received into it, waits in its slot, and is read by its handler where it
/// is, so that it is never moved once stored. Emptied when its job ends.
/// The time it arrived in its slot lives here too, not in the
/// [`Delivery`] and [`Job`] that carry the box: those are moved from slot
/// to worker, and every byte they do not hold is a byte not copied.
pub(crate) struct MessageBox(Box<Contents>);

// Aligned to a cache line: a message waits in its slot while the other
// subscriptions' messages run, so with many subscriptions its box is out of
// the cache when it is picked, and its 128 bytes then take two lines, not
// three as they would from an allocation aligned to 16.
#[repr(align(64))]
struct Contents {
    message: Option<Message>,
    /// When the message arrived in its slot (with timings on).
    since: Option<Instant>,
}

impl MessageBox {
    fn empty() -> Self {
        MessageBox(Box::new(Contents {
            message: None,
            since: None,
        }))
    }

    /// Where a consumer writes the message it receives.
    pub(crate) fn slot(&mut self) -> &mut Option<Message> {
        &mut self.0.message
    }

    pub(crate) fn get(&self) -> &Message {
        self.0
            .message
            .as_ref()
            .expect("a box in use holds a message")
    }

    /// Empties it, for the next message.
    #[inline(always)]
    pub(crate) fn clear(&mut self) {
        Message::clear(&mut self.0.message);
    }

    /// When the message arrived in its slot, if timings are on.
    pub(crate) fn since(&self) -> Option<Instant> {
        self.0.since
    }
}

/// A message in a slot, with the subscription it came from.
pub(crate) struct Delivery<T: Transport> {
    subscription: Rc<Subscription<T>>,
    message: MessageBox,
}

/// A message received within a pick, for the slot or key buffer its pick
/// emptied: its ordering key is hashed only when the scheduler refills a
/// key buffer with it and asks.
pub(crate) struct Refill<T: Transport>(Delivery<T>);

impl<T: Transport> Refilled<Delivery<T>> for Refill<T> {
    const TELLS_KEY: bool = true;

    #[inline(always)]
    fn refill_key(&self) -> Option<u64> {
        self.0.subscription.order_key(self.0.message.get())
    }

    #[inline(always)]
    fn into_refilled(self) -> Delivery<T> {
        self.0
    }
}

/// The pool of workers of one handler type, with the type erased.
pub(crate) trait Pool<T: Transport> {
    /// Runs `job` on an idle worker, or on a new one when all are busy.
    fn assign(self: Rc<Self>, job: Job<T>);

    /// Lets the workers end: idle ones at once, busy ones after their job.
    fn close(&self);

    /// Drops the workers' tasks (the shutdown deadline): those whose
    /// handler returned and whose reply, retry or dead letter is being
    /// published only with `publishing_too`. Returns whether any such
    /// worker was left.
    fn cancel(&self, publishing_too: bool) -> bool;
}

/// A subscription's handler: the value the user gave, and the pool whose
/// workers can run it. In C order, what every message reads first: the
/// value's address and type, and the pool's address; the value's and the
/// pool's `Rc`s are only needed to drop them and to hand a message to
/// another worker.
#[repr(C)]
pub(crate) struct Handler<T: Transport> {
    /// Where `value` is, and its type: read on every message, instead of
    /// `downcast_ref`, whose call through the vtable for the type cost about
    /// 15 instructions per message.
    value_at: *const (),
    value_type: TypeId,
    /// The pool's address, kept at hand: it is compared on every dispatch.
    pool_id: *const (),
    value: Rc<dyn Any>,
    pool: Rc<dyn Pool<T>>,
}

impl<T: Transport> Clone for Handler<T> {
    fn clone(&self) -> Self {
        Handler {
            value_at: self.value_at,
            value_type: self.value_type,
            pool_id: self.pool_id,
            value: self.value.clone(),
            pool: self.pool.clone(),
        }
    }
}

impl<T: Transport> Handler<T> {
    pub(crate) fn new<F: 'static>(value: Rc<F>, pool: Rc<dyn Pool<T>>) -> Self {
        Handler {
            value_at: Rc::as_ptr(&value).cast(),
            value_type: TypeId::of::<F>(),
            pool_id: Rc::as_ptr(&pool) as *const (),
            value,
            pool,
        }
    }

    /// The handler value, if it is an `F`.
    #[inline(always)]
    pub(crate) fn value<F: 'static>(&self) -> Option<&F> {
        if self.value_type != TypeId::of::<F>() {
            return None;
        }
        // SAFETY: `value_at` is the address of the value `self.value` keeps
        // alive, for as long as `self` lives (which the borrow returned is
        // tied to), and that value is an `F`: `new` took it as an `Rc<F>`
        // and recorded `TypeId::of::<F>()`, compared just above. These
        // fields are written only by `new` and `clone` (which copies all
        // three); no other code, here or in a submodule, touches them.
        Some(unsafe { &*self.value_at.cast::<F>() })
    }

    /// Identifies the pool, to tell whether a message is for the worker
    /// that picked it.
    pub(crate) fn pool_id(&self) -> *const () {
        self.pool_id
    }
}

/// The dispatcher-wide settings an engine is built with (checked by the
/// public API).
#[derive(Clone, Debug, Default)]
pub(crate) struct EngineSettings {
    pub(crate) retry_topic_check: RetryTopicCheck,
    pub(crate) dead_letter_targets: DeadLetterTargets,
    pub(crate) shutdown_timeout: Option<Duration>,
    pub(crate) scheduling: SchedulingPolicy,
    /// (priority, permits) kept for that level or better.
    pub(crate) reservations: Vec<(i64, usize)>,
    /// Whether slot waits and handler durations are measured.
    pub(crate) timings: bool,
    /// How often the numbers are published to the metrics recorder (never
    /// when `None`).
    pub(crate) metrics_interval: Option<Duration>,
}

/// The run-time state of one dispatcher.
pub(crate) struct Engine<T: Transport> {
    transport: T,
    router: Router<T>,
    retry_topic_check: RetryTopicCheck,
    scheduler: RefCell<Scheduler<Delivery<T>>>,
    subscriptions: RefCell<Slab<Rc<Subscription<T>>>>,
    /// One pool of workers per handler type.
    pools: RefCell<HashMap<TypeId, Rc<dyn Pool<T>>>>,
    woken: Arc<WokenList>,
    /// The buffer woken subscriptions are taken into, kept for reuse.
    woken_buffer: RefCell<Vec<usize>>,
    /// Empty message boxes.
    spares: RefCell<Vec<MessageBox>>,
    /// The empty box to reuse first, outside `spares`: a job's end leaves
    /// its box here and the refill that follows its dispatch takes it back,
    /// without borrowing the list.
    last_spare: Cell<Option<MessageBox>>,
    /// Jobs handed to a worker that has not started them yet.
    handovers: Cell<usize>,
    /// The best priority handed over since their count was last zero: as
    /// good as the best of those still pending or better, so a wait for a
    /// better one is sometimes taken needlessly but never skipped.
    best_handed_over: Cell<i64>,
    /// The serial number of the next subscription.
    next_serial: Cell<u64>,
    /// Woken when a subscription being removed releases a message.
    drained: Notify,
    /// Subscriptions with something due later (held nacks, a receive to
    /// retry), and the one timer for all of them and the shutdown deadline.
    timed: RefCell<Vec<Rc<Subscription<T>>>>,
    timer: RefCell<Option<Pin<Box<Sleep>>>>,
    /// How long shutdown may wait for handlers before cancelling them.
    shutdown_timeout: Option<Duration>,
    /// When a shutdown under way cancels the handlers still running.
    stop_deadline: Cell<Option<Instant>>,
    /// Set once the handlers of a shutdown past its deadline are cancelled.
    cancelling: Cell<bool>,
    /// When the publishes under way at the shutdown deadline (of handlers
    /// that had returned) are cancelled too, if any were.
    publish_deadline: Cell<Option<Instant>>,
    /// Handlers cancelled by the shutdown deadline.
    cancelled: Cell<usize>,
    /// Whether something was added to what the timer covers since it was
    /// last set.
    timers_changed: Cell<bool>,
    timings: bool,
    /// Whether the scheduling policy is aging, the one that reads a clock.
    aging: bool,
    metrics_interval: Option<Duration>,
    next_publish: Cell<Option<Instant>>,
    /// `None` with metrics off.
    permits_gauge: Option<metrics::SummedGauge>,
    phase: Cell<Phase>,
    /// Permits kept by workers over a runtime turn with their ended jobs
    /// (see [`Engine::rest`]): taken, but no handler running.
    resting: Cell<usize>,
    /// The first unexpected failure; `run()` returns it.
    failure: RefCell<Option<Error>>,
    closed: Notify,
}

/// A permit resting (see [`Engine::rest`]) while this lives; also when its
/// worker is cancelled during its turn.
pub(crate) struct Resting<'a, T: Transport> {
    engine: &'a Engine<T>,
    subscription: &'a Subscription<T>,
}

impl<T: Transport> Drop for Resting<'_, T> {
    fn drop(&mut self) {
        self.engine.resting.set(self.engine.resting.get() - 1);
        let resting = &self.subscription.resting;
        resting.set(resting.get() - 1);
    }
}

/// What the handles of the public API may do with an engine, without its
/// transport type.
pub(crate) trait Control {
    fn close_dyn(self: Rc<Self>) -> LocalBoxFuture<'static, ()>;
    fn close_within_dyn(self: Rc<Self>, limit: Duration) -> LocalBoxFuture<'static, usize>;
    fn stats(&self) -> DispatcherStats;
    fn set_priority(&self, id: SubscriptionId, priority: i64) -> bool;
    fn subscription_info(&self, id: SubscriptionId) -> Option<SubscriptionInfo>;
    fn subscription_stats(&self, id: SubscriptionId) -> Option<SubscriptionStats>;
    fn health(&self) -> Health;
}

impl<T: Transport> Control for Engine<T> {
    fn close_dyn(self: Rc<Self>) -> LocalBoxFuture<'static, ()> {
        Box::pin(async move { self.close().await })
    }

    fn close_within_dyn(self: Rc<Self>, limit: Duration) -> LocalBoxFuture<'static, usize> {
        Box::pin(async move { self.close_within(limit).await })
    }

    fn stats(&self) -> DispatcherStats {
        Engine::stats(self)
    }

    fn set_priority(&self, id: SubscriptionId, priority: i64) -> bool {
        Engine::set_priority(self, id, priority)
    }

    fn subscription_info(&self, id: SubscriptionId) -> Option<SubscriptionInfo> {
        let subscription = self.subscription(id)?;
        let mut info = subscription.info.clone();
        info.priority = self.scheduler.borrow().priority(subscription.key);
        Some(info)
    }

    fn subscription_stats(&self, id: SubscriptionId) -> Option<SubscriptionStats> {
        let subscription = self.subscription(id)?;
        Some(self.stats_of(&subscription))
    }

    fn health(&self) -> Health {
        Engine::health(self)
    }
}

/// No worker: what the engine task passes when it dispatches.
const NO_POOL: *const () = std::ptr::null();

impl<T: Transport> Engine<T> {
    pub(crate) fn new(transport: T, concurrency: NonZeroUsize, settings: EngineSettings) -> Self {
        if settings.metrics_interval.is_some() {
            metrics::describe();
        }
        let aging = matches!(settings.scheduling, SchedulingPolicy::Aging(_));
        // The runtime's clock, as the nack delays and deadlines read it:
        // paused in a test, aging pauses with it.
        let mut scheduler = Scheduler::with_policy(concurrency, settings.scheduling)
            .with_clock(|| tokio::time::Instant::now().into_std());
        for (priority, permits) in settings.reservations {
            scheduler.reserve(priority, permits);
        }
        Engine {
            transport,
            router: Router::new(settings.dead_letter_targets),
            retry_topic_check: settings.retry_topic_check,
            scheduler: RefCell::new(scheduler),
            subscriptions: RefCell::default(),
            pools: RefCell::default(),
            woken: Arc::default(),
            woken_buffer: RefCell::default(),
            spares: RefCell::default(),
            last_spare: Cell::new(None),
            handovers: Cell::new(0),
            best_handed_over: Cell::new(i64::MAX),
            next_serial: Cell::new(0),
            drained: Notify::new(),
            timed: RefCell::default(),
            timer: RefCell::default(),
            shutdown_timeout: settings.shutdown_timeout,
            stop_deadline: Cell::new(None),
            cancelling: Cell::new(false),
            publish_deadline: Cell::new(None),
            cancelled: Cell::new(0),
            timers_changed: Cell::new(true),
            timings: settings.timings,
            aging,
            metrics_interval: settings.metrics_interval,
            next_publish: Cell::new(None),
            permits_gauge: settings
                .metrics_interval
                .map(|_| metrics::permits_available()),
            phase: Cell::new(Phase::Idle),
            failure: RefCell::default(),
            resting: Cell::new(0),
            closed: Notify::new(),
        }
    }

    pub(crate) fn transport(&self) -> &T {
        &self.transport
    }

    pub(crate) fn phase(&self) -> Phase {
        self.phase.get()
    }

    /// Refills the slots of consumers that woke, then, while a permit is
    /// free, hands the best waiting message to a worker of its handler,
    /// refilling each slot it empties. Messages for the pool `keep` are for
    /// the worker that asked to run them itself: the first goes to `next`
    /// (which must be empty) when its `queue` is empty, the others to the
    /// back of the queue, so that the worker runs them in the order they
    /// were picked. (The first is written where the worker keeps the job
    /// it runs, rather than returned or queued, because that is the common
    /// case, one message per dispatch, and each move of a job is a copy.)
    pub(crate) fn dispatch(
        self: &Rc<Self>,
        keep: *const (),
        queue: &mut VecDeque<Job<T>>,
        next: &mut Option<Job<T>>,
    ) {
        debug_assert!(next.is_none(), "a dispatch starts with no job kept");
        if !self.aging {
            return self.dispatch_round(keep, queue, next);
        }
        // One burst with no waiting in it: aging reads the clock once.
        self.scheduler.borrow_mut().begin_round();
        self.dispatch_round(keep, queue, next);
        self.scheduler.borrow_mut().end_round();
    }

    fn dispatch_round(
        self: &Rc<Self>,
        keep: *const (),
        queue: &mut VecDeque<Job<T>>,
        next: &mut Option<Job<T>>,
    ) {
        if self.woken.any() {
            self.refill_woken();
        }
        loop {
            // A slot or key buffer is refilled within the pick (see
            // `receive_next`); what the receive needs done besides (a
            // retry to time, a failure) waits until the scheduler is free.
            let mut not_stored = None;
            let picked = self
                .scheduler
                .borrow_mut()
                .try_dispatch_refilling(|delivery| {
                    self.receive_next(&delivery.subscription, &mut not_stored)
                });
            let Some(Pick {
                permit,
                message: delivery,
                refill_called,
                permits_left,
                next_in_line,
            }) = picked
            else {
                break;
            };
            let Delivery {
                subscription,
                message,
            } = delivery;
            bump(&subscription.counters.dispatched);
            if !refill_called {
                self.refill(&subscription);
            }
            // Looked at on every path (it is `None` without a refill), so
            // that no drop of it is left after a branch that did not look:
            // such a drop tests the error's discriminant again (about 5
            // instructions per message with its layout). Taken, not moved:
            // a move in one arm leaves a drop flag tested at the loop's end
            // (7 instructions per message).
            if let Some(received) = not_stored.take() {
                self.after_receive(&subscription, received);
            }
            let mut job = Job::new(self.clone(), subscription, message, permit, next_in_line);
            if job.pool() != keep {
                job.hand_over();
            } else if next.is_none() && queue.is_empty() {
                *next = Some(job);
            } else {
                // Picked and not started, as a handed-over job is.
                job.wait_in_queue();
                queue.push_back(job);
            }
            // Nothing between two picks returns a permit.
            if !permits_left {
                break;
            }
        }
    }

    /// A subscription's current priority.
    pub(crate) fn priority_of(&self, subscription: &Subscription<T>) -> i64 {
        self.scheduler.borrow().priority(subscription.key)
    }

    /// A job picked at `priority` was handed to a worker.
    pub(crate) fn handed_over(&self, priority: i64) {
        self.handovers.set(self.handovers.get() + 1);
        self.best_handed_over
            .set(self.best_handed_over.get().min(priority));
    }

    /// A handed-over job started.
    pub(crate) fn handover_started(&self) {
        let left = self.handovers.get() - 1;
        self.handovers.set(left);
        if left == 0 {
            self.best_handed_over.set(i64::MAX);
        }
    }

    /// Whether a job handed to a worker, not started yet, may have a better
    /// priority than `priority`. A worker that picked a job for itself
    /// lets such jobs start first, so that no handler starts before one of
    /// a better priority picked earlier.
    pub(crate) fn better_handover_pending(&self, priority: i64) -> bool {
        self.handovers.get() > 0 && self.best_handed_over.get() < priority
    }

    fn refill_woken(&self) {
        let mut indices = std::mem::take(&mut *self.woken_buffer.borrow_mut());
        self.woken.take(&mut indices);
        for &index in &indices {
            let subscription = self.subscriptions.borrow().get(index).cloned();
            if let Some(subscription) = subscription {
                subscription.unlist();
                self.refill(&subscription);
            }
        }
        indices.clear();
        *self.woken_buffer.borrow_mut() = indices;
    }

    /// Takes the next message from the subscription's consumer if its slot
    /// is empty and the dispatcher still receives. A key-ordered
    /// subscription takes more, up to its buffer, while every message it
    /// holds waits for a busy key: the keys behind them must not wait too,
    /// and nothing else would take them (a refill follows a dispatch).
    fn refill(&self, subscription: &Rc<Subscription<T>>) {
        while self.phase() == Phase::Running
            && subscription.is_receiving()
            && self.scheduler.borrow().has_vacancy(subscription.key)
        {
            let mut spare = self.spare();
            let received = subscription.receive(&mut spare);
            if let Received::Stored = received {
                let queued = self.offer(subscription, spare);
                // A subscription that is not key-ordered holds one message,
                // so its slot is full now.
                if !queued
                    || !subscription.is_keyed()
                    || self.scheduler.borrow().holds_dispatchable(subscription.key)
                {
                    return;
                }
                continue;
            }
            self.keep_spare(spare);
            self.after_receive(subscription, received);
            return;
        }
    }

    /// The next message for the slot or key buffer of `subscription`,
    /// whose message was just picked, while the dispatcher still receives:
    /// the refill of [`refill`](Self::refill) without the scheduler, which
    /// the caller holds (the pick left room and the scheduler is open, so
    /// it takes the message; a key buffer asks again while everything it
    /// holds waits for a busy key). What else the receive gave goes to
    /// `not_stored`, for [`after_receive`](Self::after_receive) once the
    /// scheduler is free.
    #[inline(always)]
    fn receive_next(
        &self,
        subscription: &Rc<Subscription<T>>,
        not_stored: &mut Option<Received>,
    ) -> Option<Refill<T>> {
        if self.phase() != Phase::Running || !subscription.is_receiving() {
            return None;
        }
        let mut spare = self.spare();
        if !self.receive_into(subscription, &mut spare, not_stored) {
            self.keep_spare(spare);
            return None;
        }
        Some(Refill(Delivery {
            subscription: subscription.clone(),
            message: spare,
        }))
    }

    /// Receives the subscription's next message into `into`, an empty box;
    /// returns whether one was stored. The caller has checked that the
    /// dispatcher runs and the subscription receives. What else the receive
    /// gave goes to `not_stored`, as for [`receive_next`](Self::receive_next).
    #[inline(always)]
    fn receive_into(
        &self,
        subscription: &Subscription<T>,
        into: &mut MessageBox,
        not_stored: &mut Option<Received>,
    ) -> bool {
        if !subscription.receive_or(into, |received| *not_stored = Some(received)) {
            return false;
        }
        into.0.since = self.timings.then(Instant::now);
        true
    }

    /// What a receive that stored nothing calls for.
    fn after_receive(&self, subscription: &Rc<Subscription<T>>, received: Received) {
        match received {
            Received::RetryLater => self.watch_timers(subscription),
            Received::Failed(failure) => self.fail(failure),
            Received::Stored | Received::Nothing => {}
        }
    }

    /// Puts a received message in its subscription's slot. One that cannot
    /// be queued goes straight back to the broker; refilling only an empty
    /// slot while running makes that a safety net. Returns whether it was
    /// queued.
    fn offer(&self, subscription: &Rc<Subscription<T>>, mut message: MessageBox) -> bool {
        let order_key = subscription.order_key(message.get());
        message.0.since = self.timings.then(Instant::now);
        let delivery = Delivery {
            subscription: subscription.clone(),
            message,
        };
        let inserted =
            self.scheduler
                .borrow_mut()
                .try_insert_keyed(subscription.key, delivery, order_key);
        if let Err(Rejected::Closed(rejected) | Rejected::Full(rejected)) = inserted {
            let id = rejected.message.get().id();
            debug!(topic = %subscription.topic, message_id = %id, "not queued; nacking");
            subscription.nack_at_once(id);
            self.recycle(rejected.message);
            return false;
        }
        true
    }

    /// An empty box for the next message: a spare, or a new one while
    /// fewer than the messages ever held at once exist.
    #[inline(always)]
    fn spare(&self) -> MessageBox {
        self.last_spare
            .take()
            .unwrap_or_else(|| self.spare_from_list())
    }

    /// [`spare`](Self::spare) when the last box kept is taken: out of line,
    /// as it is rare once messages flow (a job's end keeps its box for the
    /// refill that follows), so that the dispatch does not set up this
    /// path's constants on every message (6 instructions per message,
    /// callgrind).
    #[cold]
    #[inline(never)]
    fn spare_from_list(&self) -> MessageBox {
        self.spares
            .borrow_mut()
            .pop()
            .unwrap_or_else(MessageBox::empty)
    }

    /// Keeps an empty box for the next message.
    #[inline(always)]
    fn keep_spare(&self, spare: MessageBox) {
        if let Some(older) = self.last_spare.replace(Some(spare)) {
            self.spares.borrow_mut().push(older);
        }
    }

    /// Hands a message that never started back to the broker (nacked at
    /// once) and takes its box back.
    pub(crate) fn give_back(&self, subscription: &Subscription<T>, message: MessageBox) {
        subscription.nack_at_once(message.get().id());
        self.recycle(message);
        if subscription.is_removing() {
            self.notify_drained();
        }
    }

    /// A subscription being removed released a message. Cold: the drop of
    /// every job checks for it.
    #[cold]
    #[inline(never)]
    pub(crate) fn notify_drained(&self) {
        self.drained.notify_waiters();
    }

    /// Takes an emptied message box back for the next message.
    #[inline(always)]
    pub(crate) fn recycle(&self, mut message: MessageBox) {
        message.clear();
        self.keep_spare(message);
    }

    /// How many empty boxes are kept.
    #[cfg(test)]
    fn spare_count(&self) -> usize {
        let last = self.last_spare.take();
        let count = usize::from(last.is_some()) + self.spares.borrow().len();
        self.last_spare.set(last);
        count
    }

    /// Gives the runtime a turn, keeping meanwhile the permit the caller's
    /// job has just returned: a worker steps aside between jobs holding no
    /// message (so no message waits picked but not started, and no key
    /// stays busy) and without leaving its permit to be handed elsewhere.
    pub(crate) async fn step_aside(&self) {
        struct Holding<'a, T: Transport> {
            engine: &'a Engine<T>,
            permit: Option<HeldPermit>,
        }
        impl<T: Transport> Drop for Holding<'_, T> {
            // Also when the worker is cancelled during its turn.
            fn drop(&mut self) {
                if let Some(permit) = self.permit.take() {
                    self.engine.scheduler.borrow_mut().unhold(permit);
                    if self.engine.phase() != Phase::Running {
                        self.engine.woken.wake_engine();
                    }
                }
            }
        }
        let _holding = Holding {
            engine: self,
            permit: self.scheduler.borrow_mut().hold(),
        };
        tokio::task::yield_now().await;
    }

    /// Counts, until the guard returned is dropped, the permit of a job of
    /// `subscription` that has ended, settled, as resting rather than as a
    /// running handler, in the stats and the health, as a permit held by
    /// [`step_aside`](Self::step_aside) is: its worker keeps the job over a
    /// runtime turn, so that the subscription's next message may still
    /// follow on in it after the turn.
    pub(crate) fn rest<'a>(&'a self, subscription: &'a Subscription<T>) -> Resting<'a, T> {
        self.resting.set(self.resting.get() + 1);
        subscription.resting.set(subscription.resting.get() + 1);
        Resting {
            engine: self,
            subscription,
        }
    }

    /// Handlers running: the permits taken by dispatched messages whose
    /// processing has not ended (neither held nor resting).
    pub(crate) fn running(&self) -> usize {
        self.scheduler.borrow().running() - self.resting.get()
    }

    /// Returns a permit. The worker whose job ended dispatches next itself;
    /// whenever shutdown waits for the last permit, the engine task is
    /// woken. (A job that did not end in its worker wakes it itself.)
    #[inline(always)]
    pub(crate) fn release_permit(&self, permit: Permit) {
        self.scheduler.borrow_mut().release(permit);
        if self.phase() != Phase::Running {
            self.wake_for_permit();
        }
    }

    /// [`release_permit`](Self::release_permit)'s rare wake-up, out of
    /// line: the drop of every job carried its code.
    #[cold]
    #[inline(never)]
    pub(crate) fn wake_for_permit(&self) {
        self.woken.wake_engine();
    }

    /// Decides what a handler's outcome calls for, and counts what
    /// happened.
    ///
    /// Decides at once, without awaiting: what most outcomes need (an ack
    /// or a nack) comes back as [`Action::Settle`]; a reply, retry or dead
    /// letter comes back as [`Action::Publish`], for [`publish`](Self::publish).
    #[inline(always)]
    pub(crate) fn route(
        &self,
        subscription: &Subscription<T>,
        message: &Message,
        outcome: Outcome,
    ) -> Action {
        let counters = &subscription.counters;
        bump(match &outcome {
            Outcome::Succeeded(_) => &counters.succeeded,
            Outcome::Failed(_) => &counters.failed,
            Outcome::Panicked(_) => &counters.panicked,
            Outcome::TimedOut(_) => &counters.deadline_exceeded,
        });
        self.router.decide(&subscription.routing, message, outcome)
    }

    /// Publishes what [`route`](Self::route) decided, and gives the verdict
    /// its result calls for.
    pub(crate) async fn publish(
        &self,
        subscription: &Subscription<T>,
        message: &Message,
        publish: Box<Publish>,
    ) -> Verdict {
        let counters = &subscription.counters;
        let published = match publish.kind() {
            PublishKind::Reply => &counters.replied,
            PublishKind::Retry => &counters.retried,
            PublishKind::DeadLetter => &counters.dead_lettered,
        };
        // Counted as it ends, however: a publish cancelled before its end
        // (its worker aborted at the shutdown deadline) counts as failed,
        // as its original is nacked.
        struct CountAtEnd<'a>(&'a Cell<u64>);
        impl Drop for CountAtEnd<'_> {
            fn drop(&mut self) {
                bump(self.0);
            }
        }
        let mut count = CountAtEnd(&counters.publishes_failed);
        let verdict = self.router.publish(&self.transport, publish, message).await;
        if verdict == Verdict::Ack {
            count.0 = published;
        }
        verdict
    }
}

/// Waits until `done` holds, checking it again each time `notify` wakes
/// its waiters. The wake-up is asked for before each check, so one that
/// comes between the check and the wait is not missed.
pub(crate) async fn wait_until(notify: &Notify, mut done: impl FnMut() -> bool) {
    loop {
        let notified = notify.notified();
        if done() {
            return;
        }
        notified.await;
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;
    use crate::options::SubscribeOptions;
    use crate::tests::run_local;
    use crate::transport::MemoryTransport;

    /// Slots are refilled only while running and in the same step as the
    /// consumer is polled, so this path is a safety net: a message that
    /// cannot be queued goes straight back to the broker.
    #[test]
    fn a_message_received_after_the_scheduler_closed_is_nacked_at_once() {
        run_local(async {
            let transport = MemoryTransport::new();
            let engine = Rc::new(Engine::new(
                transport.clone(),
                NonZeroUsize::new(1).unwrap(),
                EngineSettings::default(),
            ));
            let spec = SubscribeOptions::new()
                .negative_ack_redelivery_delay(std::time::Duration::from_secs(60))
                .resolve("jobs")
                .unwrap();
            engine
                .subscribe_all(vec![spec], async |_: &Message| Ok::<_, Infallible>(()))
                .await
                .unwrap();
            let subscription = engine.all_subscriptions().remove(0);
            let id = transport.send("jobs", "late");
            let mut message = engine.spare();
            let Received::Stored = subscription.receive(&mut message) else {
                panic!("the message is there");
            };
            engine.scheduler.borrow_mut().close();
            assert!(!engine.offer(&subscription, message));
            assert_eq!(transport.nacked("jobs"), [id], "at once, not after 60 s");
            assert!(engine.scheduler.borrow().has_vacancy(subscription.key));
            assert_eq!(engine.spare_count(), 1, "its box is reused");
            // Emptied, so that a spare box keeps no payload alive.
            assert!(engine.spare().slot().is_none());
        });
    }
}
