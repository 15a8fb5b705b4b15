//! The engine: run-time state and the data path of a dispatcher.
//!
//! One [`Engine`] per dispatcher owns the transport, the scheduler, the
//! subscriptions and the lifecycle. A message's way through it:
//!
//! 1. A subscription's slot is empty, so whoever emptied it (or the engine
//!    task, when the consumer wakes) polls the consumer once. A message is
//!    stored in a reused [`MessageBox`] and put in the slot.
//! 2. Whoever inserted a message or returned a permit dispatches: while a
//!    permit is free, the scheduler picks the best waiting message, the
//!    emptied slot is refilled, and the message becomes a [`Job`] for a
//!    worker of its handler (see `worker`).
//! 3. The worker runs the handler on the message where it is stored, routes
//!    the outcome, settles it on the consumer, returns the permit and
//!    dispatches again, often to itself.
//!
//! The engine task (`drive`) does only what nobody else is there to do:
//! poll consumers that woke while every worker was idle, send held nacks
//! when they are due, and walk shutdown's phases. Everything is on one
//! thread; no `RefCell` borrow is held across an `.await`.

mod stats;
mod subscription;
mod wake;
mod worker;

use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::num::NonZeroUsize;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::LocalBoxFuture;
use futures::FutureExt;
use slab::Slab;
use tokio::sync::Notify;
use tokio::time::{sleep_until, Instant, Sleep};
use tracing::{debug, error, info, warn};

pub use self::stats::{DispatcherStats, SubscriptionStats};
pub(crate) use self::subscription::SubscriptionSpec;
use self::worker::WorkerPool;

use self::stats::bump;
use self::subscription::{Received, Subscription};
use self::wake::WokenList;
use self::worker::Job;
use crate::error::{Error, MAX_DURATION};
use crate::message::Message;
use crate::outcome::{panic_text, HandlerError, IntoReply, Outcome, SubscriptionInfo, Verdict};
use crate::routing::{
    retry_topic_problems, Action, DeadLetterTargets, PublishKind, RetryTopicCheck, Router,
};
use crate::scheduler::{Rejected, Scheduler};
use crate::transport::{Consumer, Transport};

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
pub(crate) struct MessageBox(Box<Option<Message>>);

impl MessageBox {
    pub(crate) fn get(&self) -> &Message {
        self.0
            .as_ref()
            .as_ref()
            .expect("a box in use holds a message")
    }
}

/// A message in a slot, with the subscription it came from.
pub(crate) struct Delivery<T: Transport> {
    subscription: Rc<Subscription<T>>,
    message: MessageBox,
}

/// The pool of workers of one handler type, with the type erased.
pub(crate) trait Pool<T: Transport> {
    /// Runs `job` on an idle worker, or on a new one when all are busy.
    fn assign(self: Rc<Self>, job: Job<T>);

    /// Lets the workers end: idle ones at once, busy ones after their job.
    fn close(&self);

    /// Drops every worker's task, busy or idle (the shutdown deadline).
    fn cancel(&self);
}

/// A subscription's handler: the value the user gave, and the pool whose
/// workers can run it.
pub(crate) struct Handler<T: Transport> {
    value: Rc<dyn Any>,
    pool: Rc<dyn Pool<T>>,
}

impl<T: Transport> Clone for Handler<T> {
    fn clone(&self) -> Self {
        Handler {
            value: self.value.clone(),
            pool: self.pool.clone(),
        }
    }
}

impl<T: Transport> Handler<T> {
    /// Identifies the pool, to tell whether a message is for the worker
    /// that picked it.
    pub(crate) fn pool_id(&self) -> *const () {
        Rc::as_ptr(&self.pool) as *const ()
    }
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
    /// Jobs handed to a worker that has not started them yet.
    handovers: Cell<usize>,
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
    /// Handlers cancelled by the shutdown deadline.
    cancelled: Cell<usize>,
    phase: Cell<Phase>,
    /// The first unexpected failure; `run()` returns it.
    failure: RefCell<Option<Error>>,
    closed: Notify,
}

/// What a [`CloseHandle`](crate::CloseHandle) may do, without the transport
/// type.
pub(crate) trait Lifecycle {
    fn close_dyn(self: Rc<Self>) -> LocalBoxFuture<'static, ()>;
    fn close_within_dyn(self: Rc<Self>, limit: Duration) -> LocalBoxFuture<'static, usize>;
    fn stats(&self) -> DispatcherStats;
}

impl<T: Transport> Lifecycle for Engine<T> {
    fn close_dyn(self: Rc<Self>) -> LocalBoxFuture<'static, ()> {
        Box::pin(async move { self.close().await })
    }

    fn close_within_dyn(self: Rc<Self>, limit: Duration) -> LocalBoxFuture<'static, usize> {
        Box::pin(async move { self.close_within(limit).await })
    }

    fn stats(&self) -> DispatcherStats {
        Engine::stats(self)
    }
}

/// No worker: what the engine task passes when it dispatches.
const NO_POOL: *const () = std::ptr::null();

impl<T: Transport> Engine<T> {
    pub(crate) fn new(
        transport: T,
        concurrency: NonZeroUsize,
        retry_topic_check: RetryTopicCheck,
        dead_letter_targets: DeadLetterTargets,
        shutdown_timeout: Option<Duration>,
    ) -> Self {
        Engine {
            transport,
            router: Router::new(dead_letter_targets),
            retry_topic_check,
            scheduler: RefCell::new(Scheduler::new(concurrency)),
            subscriptions: RefCell::default(),
            pools: RefCell::default(),
            woken: Arc::default(),
            woken_buffer: RefCell::default(),
            spares: RefCell::default(),
            handovers: Cell::new(0),
            timed: RefCell::default(),
            timer: RefCell::default(),
            shutdown_timeout,
            stop_deadline: Cell::new(None),
            cancelling: Cell::new(false),
            cancelled: Cell::new(0),
            phase: Cell::new(Phase::Idle),
            failure: RefCell::default(),
            closed: Notify::new(),
        }
    }

    pub(crate) fn transport(&self) -> &T {
        &self.transport
    }

    pub(crate) fn phase(&self) -> Phase {
        self.phase.get()
    }

    /// The registered subscriptions, in the order they were made.
    pub(crate) fn subscription_infos(&self) -> Vec<SubscriptionInfo> {
        self.subscriptions
            .borrow()
            .iter()
            .map(|(_, subscription)| subscription.info.clone())
            .collect()
    }

    pub(crate) fn stats(&self) -> DispatcherStats {
        let scheduler = self.scheduler.borrow();
        DispatcherStats {
            subscriptions: self
                .subscriptions
                .borrow()
                .iter()
                .map(|(_, subscription)| subscription.stats())
                .collect(),
            in_flight: scheduler.in_flight(),
            waiting: scheduler.waiting(),
            concurrency: scheduler.in_flight() + scheduler.available(),
        }
    }

    // ----- subscribing -----

    /// Creates a consumer for every spec, then registers them all at once,
    /// with one handler. If any creation fails, or the dispatcher started or
    /// closed in the meantime, closes what it created and registers nothing.
    pub(crate) async fn subscribe_all<F, R, E>(
        &self,
        specs: Vec<SubscriptionSpec>,
        handler: F,
    ) -> Result<(), Error>
    where
        F: AsyncFn(&Message) -> Result<R, E> + 'static,
        R: IntoReply + 'static,
        E: Into<HandlerError> + 'static,
    {
        let Some(first) = specs.first() else {
            return Ok(());
        };
        let first_topic = first.consumer.topic.clone();
        self.accepting_subscriptions(&first_topic)?;
        let mut consumers = Vec::with_capacity(specs.len());
        for spec in &specs {
            match self.create(spec).await {
                Ok(consumer) => consumers.push(consumer),
                Err(error) => {
                    close_consumers::<T>(consumers, "of a failed subscribe").await;
                    return Err(error);
                }
            }
        }
        if let Err(refused) = self.accepting_subscriptions(&first_topic) {
            close_consumers::<T>(consumers, "of a refused subscribe").await;
            return Err(refused);
        }
        let pool = self
            .pools
            .borrow_mut()
            .entry(TypeId::of::<F>())
            .or_insert_with(|| WorkerPool::<T, F, R, E>::new())
            .clone();
        let handler = WorkerPool::<T, F, R, E>::handler(pool, handler);
        for (spec, consumer) in specs.into_iter().zip(consumers) {
            self.register(spec, consumer, handler.clone());
        }
        Ok(())
    }

    /// Creates a subscription's consumer and the producers it publishes
    /// with (so that a topic the broker refuses fails `subscribe`, not every
    /// message later), within the subscription's time limit.
    async fn create(&self, spec: &SubscriptionSpec) -> Result<T::Consumer, Error> {
        let topic = &spec.consumer.topic;
        let timed_out = || Error::SubscribeTimeout {
            topic: topic.clone(),
            subscription: spec.consumer.subscription.clone(),
            waited: spec.subscribe_timeout,
        };
        let deadline = Instant::now() + spec.subscribe_timeout;
        // The transport's futures may be large (the `pulsar` crate's are,
        // in debug builds); boxed, they do not make every future around
        // them, and the stack that polls them, large too.
        let subscribing = Box::pin(self.transport.subscribe(&spec.consumer));
        let consumer = match tokio::time::timeout_at(deadline, subscribing).await {
            Ok(Ok(consumer)) => consumer,
            Ok(Err(source)) => {
                return Err(Error::Subscribe {
                    topic: topic.clone(),
                    source,
                })
            }
            Err(_) => return Err(timed_out()),
        };
        let preparing = Box::pin(self.router.prepare(&self.transport, &spec.routing));
        let prepared = tokio::time::timeout_at(deadline, preparing).await;
        let failure = match prepared {
            Ok(Ok(())) => return Ok(consumer),
            Ok(Err((topic, source))) => Error::Producer { topic, source },
            Err(_) => timed_out(),
        };
        close_consumers::<T>(vec![consumer], "of a failed subscribe").await;
        Err(failure)
    }

    fn accepting_subscriptions(&self, topic: &str) -> Result<(), Error> {
        match self.phase() {
            Phase::Idle => Ok(()),
            phase => Err(Error::SubscribeNotAllowed {
                topic: topic.to_owned(),
                state: phase.describe(),
            }),
        }
    }

    fn register(&self, spec: SubscriptionSpec, consumer: T::Consumer, handler: Handler<T>) {
        self.router.register(&spec.routing);
        let key = self.scheduler.borrow_mut().add_subscription(spec.priority);
        let mut subscriptions = self.subscriptions.borrow_mut();
        let entry = subscriptions.vacant_entry();
        let subscription = Subscription::new(
            entry.key(),
            key,
            spec,
            consumer,
            handler,
            self.woken.clone(),
        );
        entry.insert(Rc::new(subscription));
    }

    // ----- running -----

    /// Moves from `Idle` to `Running` and spawns the engine task.
    pub(crate) fn start(self: &Rc<Self>) -> Result<(), Error> {
        match self.phase() {
            Phase::Idle => {}
            phase => {
                return Err(Error::RunNotAllowed {
                    state: phase.describe(),
                })
            }
        }
        self.check_retry_topics()?;
        self.phase.set(Phase::Running);
        let subscriptions = self.all_subscriptions();
        // Every consumer is polled once, which also hands it its waker.
        for subscription in &subscriptions {
            subscription.wake();
        }
        info!(subscriptions = subscriptions.len(), "dispatcher running");
        tokio::task::spawn_local(self.clone().supervise());
        Ok(())
    }

    fn check_retry_topics(&self) -> Result<(), Error> {
        if self.retry_topic_check == RetryTopicCheck::Ignore {
            return Ok(());
        }
        let problems = retry_topic_problems(&self.subscription_infos());
        if problems.is_empty() {
            return Ok(());
        }
        if self.retry_topic_check == RetryTopicCheck::Refuse {
            return Err(Error::RetryTopics(problems));
        }
        for problem in &problems {
            warn!(%problem, "retry topic check");
        }
        Ok(())
    }

    fn all_subscriptions(&self) -> Vec<Rc<Subscription<T>>> {
        self.subscriptions
            .borrow()
            .iter()
            .map(|(_, subscription)| subscription.clone())
            .collect()
    }

    /// The engine task. If it panics (a bug), the dispatcher still fails
    /// with an error and closes, rather than leave `run()` waiting.
    async fn supervise(self: Rc<Self>) {
        let driven = AssertUnwindSafe(self.clone().drive()).catch_unwind().await;
        let Err(panic) = driven else {
            return;
        };
        self.fail(Error::EngineFailed {
            reason: format!("the engine task panicked: {}", panic_text(panic.as_ref())),
        });
        let closed = AssertUnwindSafe(self.shut_down()).catch_unwind().await;
        if closed.is_err() {
            self.mark_closed();
        }
    }

    /// Until shutdown has drained everything, polls the consumers that
    /// woke, dispatches and keeps the timers; then shuts down.
    async fn drive(self: Rc<Self>) {
        poll_fn(|cx| self.poll_until_drained(cx)).await;
        self.shut_down().await;
    }

    fn poll_until_drained(self: &Rc<Self>, cx: &mut Context<'_>) -> Poll<()> {
        // Registered before anything is looked at, so that no wake-up
        // between the look and the return is lost.
        self.woken.register_engine(cx.waker());
        let kept = self.dispatch(NO_POOL);
        debug_assert!(kept.is_none(), "the engine keeps no job");
        self.poll_timers(cx);
        if self.phase() != Phase::Running && self.scheduler.borrow().is_idle() {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Refills the slots of consumers that woke, then, while a permit is
    /// free, hands the best waiting message to a worker of its handler,
    /// refilling each slot it empties. A message for the pool `keep` is
    /// returned instead, for the worker that asked to run it itself.
    pub(crate) fn dispatch(self: &Rc<Self>, keep: *const ()) -> Option<Job<T>> {
        if self.woken.any() {
            self.refill_woken();
        }
        let mut kept = None;
        loop {
            let picked = self.scheduler.borrow_mut().try_dispatch();
            let Some((_, delivery)) = picked else {
                break;
            };
            let Delivery {
                subscription,
                message,
            } = delivery;
            bump(&subscription.counters.dispatched);
            self.refill(&subscription);
            let job = Job::new(self.clone(), subscription, message);
            if kept.is_none() && job.pool() == keep {
                kept = Some(job);
            } else {
                job.hand_over();
            }
        }
        kept
    }

    /// Whether jobs handed to workers wait to start. A worker that picked
    /// a job for itself lets them start first, so that handlers start in
    /// the order their messages were picked.
    pub(crate) fn handovers_pending(&self) -> bool {
        self.handovers.get() > 0
    }

    fn refill_woken(&self) {
        let mut indices = std::mem::take(&mut *self.woken_buffer.borrow_mut());
        self.woken.take(&mut indices);
        for &index in &indices {
            let subscription = self.subscriptions.borrow().get(index).cloned();
            if let Some(subscription) = subscription {
                self.refill(&subscription);
            }
        }
        indices.clear();
        *self.woken_buffer.borrow_mut() = indices;
    }

    /// Takes the next message from the subscription's consumer if its slot
    /// is empty and the dispatcher still receives.
    fn refill(&self, subscription: &Rc<Subscription<T>>) {
        if self.phase() != Phase::Running
            || !subscription.is_receiving()
            || !self.scheduler.borrow().has_vacancy(subscription.key)
        {
            return;
        }
        match subscription.receive() {
            Received::Nothing => {}
            Received::Message(message) => self.offer(subscription, message),
            Received::RetryLater => self.watch_timers(subscription),
            Received::Failed(failure) => self.fail(failure),
        }
    }

    /// Puts a received message in its subscription's slot. One that cannot
    /// be queued goes straight back to the broker; refilling only an empty
    /// slot while running makes that a safety net.
    fn offer(&self, subscription: &Rc<Subscription<T>>, message: Message) {
        let delivery = Delivery {
            subscription: subscription.clone(),
            message: self.store(message),
        };
        let inserted = self
            .scheduler
            .borrow_mut()
            .try_insert(subscription.key, delivery);
        if let Err(Rejected::Closed(rejected) | Rejected::Full(rejected)) = inserted {
            let id = rejected.message.get().id();
            debug!(topic = %subscription.topic, message_id = %id, "not queued; nacking");
            subscription.nack_at_once(id);
            self.recycle(rejected.message);
        }
    }

    fn store(&self, message: Message) -> MessageBox {
        match self.spares.borrow_mut().pop() {
            Some(mut spare) => {
                *spare.0 = Some(message);
                spare
            }
            None => MessageBox(Box::new(Some(message))),
        }
    }

    /// Takes an emptied message box back for the next message.
    pub(crate) fn recycle(&self, mut message: MessageBox) {
        *message.0 = None;
        self.spares.borrow_mut().push(message);
    }

    /// Returns a permit. The worker whose job ended dispatches next itself;
    /// otherwise (`wake`), and whenever shutdown waits for the last permit,
    /// the engine task is woken.
    pub(crate) fn release_permit(&self, wake: bool) {
        self.scheduler.borrow_mut().release_permit();
        if wake || self.phase() != Phase::Running {
            self.woken.wake_engine();
        }
    }

    /// Turns a handler's outcome into a verdict: publishes the reply, retry
    /// or dead letter it calls for first, and counts what happened.
    pub(crate) async fn route(
        &self,
        subscription: &Subscription<T>,
        message: &Message,
        outcome: Outcome,
    ) -> Verdict {
        let counters = &subscription.counters;
        bump(match &outcome {
            Outcome::Succeeded(_) => &counters.succeeded,
            Outcome::Failed(_) => &counters.failed,
            Outcome::Panicked(_) => &counters.panicked,
            Outcome::TimedOut(_) => &counters.deadline_exceeded,
        });
        match self.router.decide(&subscription.routing, message, outcome) {
            Action::Settle(verdict) => verdict,
            Action::Publish(publish) => {
                let published = match publish.kind() {
                    PublishKind::Reply => &counters.replied,
                    PublishKind::Retry => &counters.retried,
                    PublishKind::DeadLetter => &counters.dead_lettered,
                };
                let verdict = self.router.publish(&self.transport, publish, message).await;
                if verdict == Verdict::Ack {
                    bump(published);
                }
                verdict
            }
        }
    }

    // ----- timers -----

    /// Notes that `subscription` has something due later (a held nack, a
    /// receive to retry), so that the engine's timer covers it.
    pub(crate) fn watch_timers(&self, subscription: &Rc<Subscription<T>>) {
        let mut timed = self.timed.borrow_mut();
        if !timed
            .iter()
            .any(|watched| Rc::ptr_eq(watched, subscription))
        {
            timed.push(subscription.clone());
        }
        self.woken.wake_engine();
    }

    /// Does what is due (held nacks, receive retries, the shutdown
    /// deadline) and sets the timer for what comes next.
    fn poll_timers(&self, cx: &mut Context<'_>) {
        let now = Instant::now();
        let mut next = self.stop_deadline.get().filter(|_| !self.cancelling.get());
        if next.is_some_and(|deadline| deadline <= now) {
            self.cancel_handlers();
            next = None;
        }
        self.timed
            .borrow_mut()
            .retain(|subscription| match subscription.on_timers(now) {
                Some(due) => {
                    next = Some(next.map_or(due, |next| next.min(due)));
                    true
                }
                None => false,
            });
        let Some(next) = next else {
            return;
        };
        let mut timer = self.timer.borrow_mut();
        let timer = timer.get_or_insert_with(|| Box::pin(sleep_until(next)));
        if timer.deadline() != next {
            timer.as_mut().reset(next);
        }
        if timer.as_mut().poll(cx).is_ready() {
            cx.waker().wake_by_ref();
        }
    }

    // ----- shutting down -----

    /// Records an unexpected failure and starts shutdown.
    pub(crate) fn fail(&self, failure: Error) {
        error!(error = %failure, "dispatcher failure; shutting down");
        self.failure.borrow_mut().get_or_insert(failure);
        self.request_stop();
    }

    /// The failure that forced a shutdown, if any.
    pub(crate) fn take_failure(&self) -> Option<Error> {
        self.failure.borrow_mut().take()
    }

    /// Starts shutdown if the dispatcher is running; otherwise does nothing.
    pub(crate) fn request_stop(&self) {
        if self.phase() != Phase::Running {
            return;
        }
        debug!("shutdown requested; no more messages are received");
        self.phase.set(Phase::Stopping);
        self.scheduler.borrow_mut().close();
        if let Some(limit) = self.shutdown_timeout {
            self.shorten_stop_deadline(limit);
        }
        self.woken.wake_engine();
    }

    /// Makes a shutdown cancel the handlers still running after `limit`
    /// (from now), unless an earlier deadline is set.
    fn shorten_stop_deadline(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let earlier = self
            .stop_deadline
            .get()
            .map_or(deadline, |set| set.min(deadline));
        self.stop_deadline.set(Some(earlier));
        self.woken.wake_engine();
    }

    /// Past the shutdown deadline: messages still waiting are nacked and
    /// every handler still running is dropped (its message nacked).
    fn cancel_handlers(&self) {
        self.cancelling.set(true);
        loop {
            let waiting = self.scheduler.borrow_mut().take_waiting();
            let Some((
                _,
                Delivery {
                    subscription,
                    message,
                },
            )) = waiting
            else {
                break;
            };
            subscription.nack_at_once(message.get().id());
            self.recycle(message);
        }
        let running = self.scheduler.borrow().in_flight();
        warn!(
            running,
            "shutdown deadline passed; cancelling the handlers still running"
        );
        for pool in self.pools.borrow().values() {
            pool.cancel();
        }
    }

    /// Counts a job dropped by the shutdown deadline.
    pub(crate) fn note_cancelled(&self) {
        if self.cancelling.get() {
            self.cancelled.set(self.cancelled.get() + 1);
        }
    }

    /// How many handlers the shutdown deadline cancelled.
    pub(crate) fn cancelled(&self) -> usize {
        self.cancelled.get()
    }

    /// Once nothing waits or runs: ends the workers, sends held nacks,
    /// closes the consumers, then the producers and the connection.
    async fn shut_down(&self) {
        debug!("queued messages handled; closing consumers");
        self.phase.set(Phase::Drained);
        for pool in self.pools.borrow().values() {
            pool.close();
        }
        let subscriptions = self.all_subscriptions();
        for subscription in &subscriptions {
            subscription.send_held_nacks();
        }
        self.timed.borrow_mut().clear();
        futures::future::join_all(subscriptions.iter().map(|s| s.close())).await;
        self.close_transport().await;
    }

    async fn close_transport(&self) {
        self.router.close().await;
        if let Err(error) = self.transport.close().await {
            error!(%error, "closing the connection failed");
            self.failure.borrow_mut().get_or_insert(Error::Close(error));
        }
        self.mark_closed();
        info!("dispatcher closed");
    }

    fn mark_closed(&self) {
        self.phase.set(Phase::Closed);
        self.closed.notify_waiters();
    }

    /// Shuts down (or, before `run()`, closes the consumers and the
    /// connection) and waits until everything is closed. The work runs in
    /// a task of its own, so a caller dropped mid-way does not abort it.
    pub(crate) async fn close(self: &Rc<Self>) {
        self.begin_close();
        self.wait_closed().await
    }

    /// Like [`close`](Self::close), but cancels the handlers still running
    /// after `limit`; returns how many were cancelled.
    pub(crate) async fn close_within(self: &Rc<Self>, limit: Duration) -> usize {
        self.begin_close();
        if self.phase() == Phase::Stopping {
            self.shorten_stop_deadline(limit.min(MAX_DURATION));
        }
        self.wait_closed().await;
        self.cancelled()
    }

    fn begin_close(self: &Rc<Self>) {
        match self.phase() {
            Phase::Idle => {
                self.phase.set(Phase::Stopping);
                let engine = self.clone();
                tokio::task::spawn_local(async move {
                    let subscriptions = engine.all_subscriptions();
                    futures::future::join_all(subscriptions.iter().map(|s| s.close())).await;
                    engine.close_transport().await;
                });
            }
            Phase::Running => self.request_stop(),
            Phase::Stopping | Phase::Drained | Phase::Closed => {}
        }
    }

    pub(crate) async fn wait_closed(&self) {
        loop {
            let notified = self.closed.notified();
            if self.phase() == Phase::Closed {
                return;
            }
            notified.await;
        }
    }
}

async fn close_consumers<T: Transport>(consumers: Vec<T::Consumer>, which: &str) {
    for mut consumer in consumers {
        if let Err(error) = consumer.close().await {
            warn!(%error, "closing a consumer {which} failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;
    use crate::options::SubscribeOptions;
    use crate::transport::MemoryTransport;

    fn run_local<F: Future>(test: F) -> F::Output {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&runtime, test)
    }

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
                RetryTopicCheck::Ignore,
                DeadLetterTargets::known(),
                None,
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
            let Received::Message(message) = subscription.receive() else {
                panic!("the message is there");
            };
            engine.scheduler.borrow_mut().close();
            engine.offer(&subscription, message);
            assert_eq!(transport.nacked("jobs"), [id], "at once, not after 60 s");
            assert!(engine.scheduler.borrow().has_vacancy(subscription.key));
            assert_eq!(engine.spares.borrow().len(), 1, "its box is reused");
        });
    }
}
