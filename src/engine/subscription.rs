//! One subscription at run time: its consumer, how its messages are settled,
//! and the nacks it holds back for the negative-ack delay.
//!
//! The consumer is shared by the tasks of the engine: whoever empties the
//! subscription's slot polls it for the next message (with the
//! subscription's own waker, so a message that arrives later wakes the
//! engine for this subscription alone), and whoever finishes a message
//! settles it. Each use borrows the consumer for one synchronous call.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::health::SubscriptionHealth;
use super::metrics::SubscriptionMetrics;
use super::stats::{bump, Counters, LatencyHistogram, SubscriptionStats};
use super::wake::{SubscriptionWaker, WokenList};
use super::{wait_until, Handler, MessageBox};
use crate::error::{Error, ErrorChain, TransportError};
use crate::hash::hash_key;
use crate::log_limit::LogLimit;
use crate::message::{Message, MessageId};
use crate::outcome::{panicked, SubscriptionInfo, Verdict};
use crate::routing::RoutingPolicy;
use crate::scheduler::{Ordering, SubscriptionConfig, SubscriptionKey};
use crate::transport::{Consumer, ConsumerSpec, Transport};

/// Names a registered subscription: its place in the engine, and a serial
/// number that tells it from a later subscription in the same place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SubscriptionId {
    pub(crate) index: usize,
    pub(crate) serial: u64,
}

/// Everything the engine needs to create and run a subscription, besides
/// its handler: checked and resolved by the public API before it gets here.
#[derive(Clone, Debug)]
pub(crate) struct SubscriptionSpec {
    pub(crate) consumer: ConsumerSpec,
    pub(crate) scheduling: SubscriptionConfig,
    pub(crate) nack_delay: Duration,
    pub(crate) processing_timeout: Option<Duration>,
    pub(crate) subscribe_timeout: Duration,
    pub(crate) receive_failure_limit: Duration,
    pub(crate) routing: RoutingPolicy,
}

impl SubscriptionSpec {
    pub(crate) fn info(&self) -> SubscriptionInfo {
        SubscriptionInfo {
            topic: self.consumer.topic.clone(),
            subscription: self.consumer.subscription.clone(),
            subscription_type: self.consumer.subscription_type,
            priority: self.scheduling.priority,
            retry_topic: self.routing.retry.as_ref().map(|retry| retry.topic.clone()),
        }
    }
}

// In C order, the fields each message touches first (after the `Rc`'s
// counts, which a message touches too): with many subscriptions a message
// finds its subscription out of the cache, and these then share two or
// three cache lines instead of four or five. The hot part ends with
// `counters`, whose per-message counters come first (see its `layout`).
// `key` and `waker` are not read on the common path (a slot refilled
// within the pick, a consumer with a message waiting), nor is
// `processing_timeout` (`plain` says there is none), so they come after.
#[repr(C)]
pub(crate) struct Subscription<T: Transport> {
    /// `None` once closed.
    consumer: RefCell<Option<T::Consumer>>,
    /// Whether the consumer may still deliver (its stream has not ended).
    receiving: Cell<bool>,
    removing: Cell<bool>,
    /// Whether the last receive failed: `failures` is then worth reading.
    failing: Cell<bool>,
    /// Whether messages carry their ordering key into the scheduler.
    keyed: bool,
    /// Whether its handlers run with no processing deadline and no
    /// timings: the worker then runs them itself, unless a debug span is
    /// wanted.
    pub(crate) plain: bool,
    pub(crate) handler: Handler<T>,
    pub(crate) counters: Counters,
    pub(crate) processing_timeout: Option<Duration>,
    /// Its slot in the scheduler.
    pub(crate) key: SubscriptionKey,
    waker: Waker,
    nack_delay: Duration,
    pub(crate) routing: RoutingPolicy,
    /// Latency histograms, with timings on.
    timings: Option<Timings>,
    /// Where the engine keeps it (what its waker reports), and which of the
    /// subscriptions ever kept there it is.
    pub(crate) id: SubscriptionId,
    pub(crate) info: SubscriptionInfo,
    pub(crate) topic: Rc<str>,
    waker_state: Arc<SubscriptionWaker>,
    /// Nacks waiting out the delay, in the order they are due (the delay is
    /// the same for every message of the subscription).
    held: RefCell<VecDeque<(Instant, MessageId)>>,
    receive_failure_limit: Duration,
    failures: RefCell<ReceiveFailures>,
    settle_failures_log: LogLimit,
    /// While its consumer is being closed, and when that ends: a second
    /// close waits for the first.
    closing: Cell<bool>,
    consumer_closed: Notify,
    /// Its series in the metrics recorder; `None` with metrics off.
    metrics: RefCell<Option<SubscriptionMetrics>>,
    /// (messages received, when that count was first seen).
    last_received: Cell<(u64, Option<Instant>)>,
    /// Deadlines of its handlers running with a processing deadline.
    deadlines: RefCell<Vec<Instant>>,
    /// Permits of its ended jobs kept by workers over a runtime turn (see
    /// `Engine::rest`): taken, but no handler of its running.
    pub(crate) resting: Cell<usize>,
}

/// What a subscription records: timings (its latency histograms, also to
/// the metrics recorder) and metrics (its series in the recorder).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Recording {
    pub(crate) timings: bool,
    pub(crate) metrics: bool,
}

/// What one subscription records with timings on.
#[derive(Default)]
struct Timings {
    slot_wait: LatencyHistogram,
    handler_duration: LatencyHistogram,
}

/// What polling a subscription's consumer gave.
pub(crate) enum Received {
    /// A message, now in the box the engine passed.
    Stored,
    /// Nothing for now: the consumer wakes the subscription when it has a
    /// message, or the engine's timer does when a failed receive is retried.
    Nothing,
    /// Receiving failed and will be retried; the engine's timer must cover
    /// the subscription.
    RetryLater,
    /// The consumer cannot go on: the dispatcher stops with this error.
    Failed(Error),
}

/// Errors the consumer returned in a row, and when to try it again.
#[derive(Default)]
struct ReceiveFailures {
    /// Whether the last error was a part of the consumer (a partition)
    /// starting to be subscribed again: the consumer then tells when it
    /// is back (`Consumer::failing_since`), before any message shows it.
    last_was_resubscribe: bool,
    /// Whether a poll since the last error found the consumer answering,
    /// with nothing to deliver: health counts it as receiving again (the
    /// spell itself, and its count toward the limit, end only quietly).
    answered_since_error: bool,
    in_a_row: u32,
    since: Option<Instant>,
    last_error: Option<Instant>,
    retry_at: Option<Instant>,
    log: LogLimit,
    /// For messages that cannot be read, which are no failure.
    unreadable_log: LogLimit,
}

/// The first retry after a receive error waits this long, doubling up to
/// [`RECEIVE_RETRY_MAX`].
const RECEIVE_RETRY_FIRST: Duration = Duration::from_millis(10);
const RECEIVE_RETRY_MAX: Duration = Duration::from_secs(5);
/// The shortest quiet after a receive error that ends its spell (see
/// `Subscription::still_failing`): twice the longest retry wait.
const RECEIVE_QUIET_MIN: Duration = Duration::from_secs(10);

impl<T: Transport> Subscription<T> {
    pub(crate) fn new(
        id: SubscriptionId,
        key: SubscriptionKey,
        spec: SubscriptionSpec,
        consumer: T::Consumer,
        handler: Handler<T>,
        woken: Arc<WokenList>,
        recording: Recording,
    ) -> Self {
        let waker_state = SubscriptionWaker::new(id.index, woken);
        let info = spec.info();
        let (info_topic, info_subscription) = (info.topic.clone(), info.subscription.clone());
        Subscription {
            id,
            key,
            topic: Rc::from(info.topic.as_str()),
            info,
            handler,
            routing: spec.routing,
            counters: Counters::default(),
            consumer: RefCell::new(Some(consumer)),
            receiving: Cell::new(true),
            removing: Cell::new(false),
            waker: Waker::from(waker_state.clone()),
            waker_state,
            nack_delay: spec.nack_delay,
            held: RefCell::default(),
            processing_timeout: spec.processing_timeout,
            keyed: spec.scheduling.ordering == Ordering::Key,
            plain: spec.processing_timeout.is_none() && !recording.timings,
            receive_failure_limit: spec.receive_failure_limit,
            failing: Cell::new(false),
            failures: RefCell::default(),
            settle_failures_log: LogLimit::default(),
            closing: Cell::new(false),
            consumer_closed: Notify::new(),
            metrics: RefCell::new(recording.metrics.then(|| {
                SubscriptionMetrics::register(
                    &info_topic,
                    info_subscription.as_deref(),
                    spec.scheduling.priority,
                )
            })),
            timings: recording.timings.then(Timings::default),
            last_received: Cell::new((0, None)),
            deadlines: RefCell::default(),
            resting: Cell::new(0),
        }
    }

    /// Whether its messages are ordered by key (it may then hold several).
    pub(crate) fn is_keyed(&self) -> bool {
        self.keyed
    }

    /// The hash of the key that orders `message`, for a key-ordered
    /// subscription: its ordering key, else its partition key, the key a
    /// broker's Key_Shared dispatch goes by (so that the order holds across
    /// processes too). A partition key given as bytes is taken as its
    /// base64 text, the same text for the same bytes.
    pub(crate) fn order_key(&self, message: &Message) -> Option<u64> {
        if !self.keyed {
            return None;
        }
        let key: &[u8] = match (message.ordering_key(), message.partition_key()) {
            (Some(key), _) => key,
            (None, Some(key)) => key.as_bytes(),
            (None, None) => return None,
        };
        Some(hash_key(key))
    }

    /// Whether the consumer may still deliver, and the subscription is not
    /// being removed.
    pub(crate) fn is_receiving(&self) -> bool {
        self.receiving.get() && !self.removing.get()
    }

    /// Whether the subscription is being removed.
    pub(crate) fn is_removing(&self) -> bool {
        self.removing.get()
    }

    /// Stops taking messages from the consumer, for good.
    pub(crate) fn start_removing(&self) {
        self.removing.set(true);
    }

    /// Lists the subscription as woken, so that its consumer is polled by
    /// the next dispatch.
    pub(crate) fn wake(&self) {
        self.waker.wake_by_ref();
    }

    /// Takes the subscription off the woken list's books, before its
    /// consumer is polled for a wake-up: a wake-up during or after that poll
    /// lists it again. (A poll for any other reason leaves the books alone:
    /// a subscription still listed is polled again when the list is taken.)
    pub(crate) fn unlist(&self) {
        self.waker_state.unlist();
    }

    /// Polls the consumer once, with the subscription's own waker, unless a
    /// failed receive is waiting to be retried. A message goes straight
    /// into `into`, where it stays until it is settled.
    #[inline(always)]
    pub(crate) fn receive(&self, into: &mut MessageBox) -> Received {
        let mut not_stored = Received::Stored;
        if self.receive_or(into, |received| not_stored = received) {
            return Received::Stored;
        }
        not_stored
    }

    /// [`receive`](Self::receive) for the common path: returns whether a
    /// message was stored, and passes anything else to `not_stored`.
    /// Inline (a message is received on every dispatch); the failure state
    /// and every outcome but a message are handled out of line. A flag,
    /// not a `Received`: a `Received` would merge the stored case with the
    /// out-of-line outcomes, written to memory to be matched again.
    #[inline(always)]
    pub(crate) fn receive_or(
        &self,
        into: &mut MessageBox,
        not_stored: impl FnOnce(Received),
    ) -> bool {
        // One look at the failure state, kept for after the poll: nothing
        // between here and there changes it.
        let failing = self.failing.get();
        if failing {
            if let Some(early) = self.wait_before_retry() {
                not_stored(early);
                return false;
            }
        }
        let mut cx = Context::from_waker(&self.waker);
        // A consumer that panics (a transport's bug) must not unwind
        // through the dispatch that polls it, which holds a permit and a
        // picked message with no guard yet: the dispatcher fails instead,
        // and shuts down with every message accounted for.
        // The guarded call returns a flag, and any other outcome through
        // `other`: the poll's whole result, passed through the guard's
        // memory, cost 11 instructions per message (`cargo bench --bench
        // report -- --instructions`, 565 against 554); the flag costs 1.
        let mut other = None;
        let stored = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let polled = match self.consumer.borrow_mut().as_mut() {
                Some(consumer) => consumer.poll_receive(&mut cx, into.slot()),
                None => Poll::Ready(None),
            };
            if let Poll::Ready(Some(Ok(()))) = polled {
                return true;
            }
            other = Some(polled);
            false
        }));
        match stored {
            Ok(true) => {
                bump(&self.counters.received);
                if failing {
                    self.received_while_failing();
                }
                true
            }
            Ok(false) => {
                let other = other.expect("set when nothing was stored");
                not_stored(self.nothing_received(other));
                false
            }
            Err(panic) => {
                not_stored(self.receive_panicked(panic));
                false
            }
        }
    }

    /// While receives fail: the failure to stop with, or `Nothing` until
    /// the retry is due; `None` to poll the consumer now.
    #[inline(never)]
    fn wait_before_retry(&self) -> Option<Received> {
        if let Some(failure) = self.failing_too_long(Instant::now()) {
            return Some(Received::Failed(failure));
        }
        let retry_at = self.failures.borrow().retry_at;
        if retry_at.is_some_and(|retry_at| Instant::now() < retry_at) {
            return Some(Received::Nothing);
        }
        None
    }

    /// A message arrived while receives were failing: a message from one
    /// partition says nothing of another that is being subscribed again.
    #[inline(never)]
    fn received_while_failing(&self) {
        if self.consumer_failing_since().is_none() {
            self.recovered();
        }
    }

    /// Nothing to receive while receives were failing: if the failure was
    /// a part being subscribed again and no part is failing any more, the
    /// consumer works again, though no message may come to show it for a
    /// long time (an idle topic after a broker restart). The spell's count
    /// stays until it ends quietly: a partition whose stream keeps ending
    /// backs off and meets the limit, its spell's count kept.
    fn pending_while_failing(&self) {
        let mut failures = self.failures.borrow_mut();
        failures.answered_since_error = true;
        if failures.last_was_resubscribe && self.consumer_failing_since().is_none() {
            self.failing.set(false);
            info!(topic = %self.topic, subscription = self.info.subscription.as_deref(), errors = failures.in_a_row, "subscribed again; receiving works again");
        }
    }

    /// A consumer that panicked while polled: receiving stops, and the
    /// dispatcher fails.
    #[cold]
    #[inline(never)]
    fn receive_panicked(&self, panic: Box<dyn std::any::Any + Send>) -> Received {
        self.receiving.set(false);
        let receiving = format!("receiving from {}", self.info.topic);
        Received::Failed(panicked(receiving, panic.as_ref()))
    }

    /// What a poll that gave no message means.
    #[inline(never)]
    fn nothing_received(&self, polled: Poll<Option<Result<(), TransportError>>>) -> Received {
        match polled {
            Poll::Pending => {
                if self.failing.get() {
                    self.pending_while_failing();
                }
                Received::Nothing
            }
            Poll::Ready(Some(Ok(()))) => unreachable!("a message is received inline"),
            Poll::Ready(Some(Err(error))) => {
                bump(&self.counters.receive_errors);
                if error.is_unreadable_message() {
                    return self.unreadable(error);
                }
                self.receive_failed(error)
            }
            Poll::Ready(None) => {
                self.receiving.set(false);
                Received::Failed(Error::ConsumerEnded {
                    topic: self.info.topic.clone(),
                })
            }
        }
    }

    /// A message the consumer could not read, which it leaves
    /// unacknowledged: no failure of receiving (health, the failure limit
    /// and the retry backoff ignore it; the broker may deliver it again,
    /// after a rewind or a reconnection). Logged
    /// at most every [`LOG_INTERVAL`](crate::log_limit::LOG_INTERVAL); the
    /// next message is received at once.
    fn unreadable(&self, error: TransportError) -> Received {
        let now = Instant::now();
        if let Some(not_logged) = self.failures.borrow().unreadable_log.admit(now) {
            warn!(topic = %self.topic, subscription = self.info.subscription.as_deref(), error = %ErrorChain(&error), not_logged, "a message cannot be read; left unacknowledged, receiving goes on");
        }
        self.wake();
        Received::Nothing
    }

    /// Schedules the next attempt after a receive error, logging at most
    /// every [`LOG_INTERVAL`](crate::log_limit::LOG_INTERVAL); gives up
    /// past the limit.
    fn receive_failed(&self, error: TransportError) -> Received {
        let now = Instant::now();
        let mut failures = self.failures.borrow_mut();
        if !self.still_failing(&failures, now) {
            // The last spell ended quietly (a consumer that works but has
            // had nothing to deliver): this error starts a new one.
            *failures = ReceiveFailures::default();
        }
        failures.last_error = Some(now);
        failures.answered_since_error = false;
        failures.last_was_resubscribe = matches!(error, TransportError::Resubscribing { .. });
        self.failing.set(true);
        failures.in_a_row = failures.in_a_row.saturating_add(1);
        let since = *failures.since.get_or_insert(now);
        let failing_for = now - since;
        if failing_for >= self.receive_failure_limit {
            warn!(topic = %self.topic, subscription = self.info.subscription.as_deref(), error = %ErrorChain(&error), ?failing_for, "receiving keeps failing; stopping");
            return Received::Failed(Error::ConsumerFailing {
                topic: self.info.topic.clone(),
                failing_for,
                last_error: error,
            });
        }
        if let Some(not_logged) = failures.log.admit(now) {
            warn!(topic = %self.topic, subscription = self.info.subscription.as_deref(), error = %ErrorChain(&error), in_a_row = failures.in_a_row, not_logged, "receiving failed; retrying");
        }
        let doublings = (failures.in_a_row - 1).min(16);
        let wait = (RECEIVE_RETRY_FIRST * 2u32.pow(doublings)).min(RECEIVE_RETRY_MAX);
        failures.retry_at = Some(now + wait);
        Received::RetryLater
    }

    /// Whether the errors recorded are a spell still going on at `now`.
    /// While a consumer fails, an error follows each retry, at most
    /// `RECEIVE_RETRY_MAX` apart (or the consumer's own retry, such as a
    /// partition subscribing again); a consumer that has gone the longer of
    /// the limit and `RECEIVE_QUIET_MIN` without one worked meanwhile, even
    /// if no message came to show it. Without this, one old error and a
    /// long idle time would make the next error count as a failure all
    /// along.
    fn still_failing(&self, failures: &ReceiveFailures, now: Instant) -> bool {
        let quiet = self.receive_failure_limit.max(RECEIVE_QUIET_MIN);
        failures
            .last_error
            .is_some_and(|last| now.saturating_duration_since(last) < quiet)
    }

    /// Since when part of the consumer (a partition being subscribed
    /// again) has not been delivering, if it is so now.
    fn consumer_failing_since(&self) -> Option<Instant> {
        self.consumer
            .borrow()
            .as_ref()
            .and_then(Consumer::failing_since)
    }

    /// The failure to stop with, once part of the consumer has not been
    /// delivering for the limit, however well the rest delivers.
    fn failing_too_long(&self, now: Instant) -> Option<Error> {
        let failing_for = now.saturating_duration_since(self.consumer_failing_since()?);
        if failing_for < self.receive_failure_limit {
            return None;
        }
        warn!(topic = %self.topic, subscription = self.info.subscription.as_deref(), ?failing_for, "part of the topic (a partition being subscribed again) keeps failing; stopping");
        Some(Error::ConsumerFailing {
            topic: self.info.topic.clone(),
            failing_for,
            last_error: TransportError::Resubscribing {
                topic: self.info.topic.clone(),
            },
        })
    }

    fn recovered(&self) {
        self.failing.set(false);
        let failures = std::mem::take(&mut *self.failures.borrow_mut());
        info!(topic = %self.topic, subscription = self.info.subscription.as_deref(), errors = failures.in_a_row, "receiving works again");
    }

    /// Tells the broker the verdict on a message, now or, for a nack with a
    /// delay, once the delay has passed. Returns whether it held a nack
    /// back, which the engine's timer must then cover.
    #[inline(always)]
    pub(crate) fn settle(&self, verdict: Verdict, id: &MessageId) -> bool {
        if verdict == Verdict::Ack || self.nack_delay.is_zero() {
            self.send(verdict, id);
            return false;
        }
        let due = Instant::now()
            .checked_add(self.nack_delay)
            .unwrap_or_else(far_future);
        self.held.borrow_mut().push_back((due, id.clone()));
        true
    }

    /// Acks a message: [`settle`](Self::settle) with [`Verdict::Ack`].
    #[inline(always)]
    pub(crate) fn ack(&self, id: &MessageId) {
        self.send(Verdict::Ack, id);
    }

    /// Nacks a message without the delay.
    pub(crate) fn nack_at_once(&self, id: &MessageId) {
        self.send(Verdict::Nack, id);
    }

    #[inline(always)]
    fn send(&self, verdict: Verdict, id: &MessageId) {
        let sent = match self.consumer.borrow_mut().as_mut() {
            Some(consumer) => match verdict {
                Verdict::Ack => consumer.ack(id),
                Verdict::Nack => consumer.nack(id),
            },
            None => Err(TransportError::Closed),
        };
        let (done, failed) = match verdict {
            Verdict::Ack => (&self.counters.acked, &self.counters.acks_failed),
            Verdict::Nack => (&self.counters.nacked, &self.counters.nacks_failed),
        };
        match sent {
            Ok(()) => bump(done),
            Err(error) => {
                bump(failed);
                self.settling_failed(verdict, id, error);
            }
        }
    }

    /// Logs a failed ack or nack, out of line.
    #[inline(never)]
    fn settling_failed(&self, verdict: Verdict, id: &MessageId, error: TransportError) {
        // Counted each; logged at most once an interval, since a broken
        // connection refuses every message in flight.
        match self.settle_failures_log.admit(Instant::now()) {
            Some(not_logged) => {
                warn!(topic = %self.topic, subscription = self.info.subscription.as_deref(), message_id = %id, ?verdict, error = %ErrorChain(&error), not_logged, "settling a message failed")
            }
            None => {
                debug!(topic = %self.topic, message_id = %id, ?verdict, %error, "settling a message failed")
            }
        }
    }

    /// Does what is due by `now` (held nacks, a retry of a failed receive)
    /// and returns when the next thing is due.
    pub(crate) fn on_timers(&self, now: Instant) -> Option<Instant> {
        let next_nack = loop {
            let next = self.held.borrow().front().map(|(due, _)| *due);
            match next {
                Some(due) if due <= now => {
                    let (_, id) = self.held.borrow_mut().pop_front().expect("a held nack");
                    self.send(Verdict::Nack, &id);
                }
                other => break other,
            }
        };
        let retry_at = self.failures.borrow().retry_at;
        let retry_at = match retry_at {
            Some(at) if at <= now => {
                self.failures.borrow_mut().retry_at = None;
                self.poll_soon();
                None
            }
            other => other,
        };
        // While part of the consumer fails, its limit is watched here too:
        // no error may come to have it checked (a subscribe that hangs).
        let limit_at = match self.failing.get().then(|| self.consumer_failing_since()) {
            Some(Some(since)) if since + self.receive_failure_limit <= now => {
                self.poll_soon();
                None
            }
            Some(Some(since)) => Some(since + self.receive_failure_limit),
            _ => None,
        };
        [next_nack, retry_at, limit_at].into_iter().flatten().min()
    }

    /// Lists it again, so that the next dispatch polls its consumer.
    fn poll_soon(&self) {
        self.waker_state.unlist();
        self.wake();
    }

    /// Sends every held nack at once (shutdown does not wait for delays).
    pub(crate) fn send_held_nacks(&self) {
        let held: Vec<_> = self.held.borrow_mut().drain(..).collect();
        for (_, id) in held {
            self.send(Verdict::Nack, &id);
        }
    }

    /// Closes the consumer, after every settlement queued before.
    /// A close while another is under way (an unsubscribe's, when
    /// shutdown begins) waits for that one, so that the connection, closed
    /// next, closes after the consumer.
    pub(crate) async fn close(&self) {
        let taken = self.consumer.borrow_mut().take();
        let Some(mut consumer) = taken else {
            return wait_until(&self.consumer_closed, || !self.closing.get()).await;
        };
        struct Closing<'a>(&'a Cell<bool>, &'a Notify);
        impl Drop for Closing<'_> {
            // Also when the close is dropped half-way.
            fn drop(&mut self) {
                self.0.set(false);
                self.1.notify_waiters();
            }
        }
        self.closing.set(true);
        let _closing = Closing(&self.closing, &self.consumer_closed);
        self.counters.copy_repairs(consumer.repairs());
        self.receiving.set(false);
        match consumer.close().await {
            Ok(()) => {
                debug!(topic = %self.topic, subscription = self.info.subscription.as_deref(), "consumer closed")
            }
            Err(error) => {
                warn!(topic = %self.topic, subscription = self.info.subscription.as_deref(), %error, "closing the consumer failed")
            }
        }
    }

    /// Its numbers, given where it stands in the scheduler.
    pub(crate) fn stats(
        &self,
        priority: i64,
        waiting: usize,
        in_flight: usize,
    ) -> SubscriptionStats {
        let mut stats = SubscriptionStats {
            topic: self.info.topic.clone(),
            subscription: self.info.subscription.clone(),
            priority,
            in_flight,
            waiting,
            slot_wait: self.timings.as_ref().map(|t| t.slot_wait.summary()),
            handler_duration: self.timings.as_ref().map(|t| t.handler_duration.summary()),
            ..SubscriptionStats::default()
        };
        if let Some(consumer) = self.consumer.borrow().as_ref() {
            self.counters.copy_repairs(consumer.repairs());
        }
        self.counters.copy_into(&mut stats);
        stats
    }

    /// Records how long a message waited in its slot and how long its
    /// handler ran (with timings on).
    pub(crate) fn record_timings(&self, waited: Duration, ran: Duration) {
        if let Some(timings) = &self.timings {
            timings.slot_wait.record(waited);
            timings.handler_duration.record(ran);
            if let Some(metrics) = self.metrics.borrow().as_ref() {
                metrics.slot_wait.record(waited.as_secs_f64());
                metrics.handler_duration.record(ran.as_secs_f64());
            }
        }
    }

    /// Registers its metrics again, labelled with its new `priority`,
    /// after publishing `stats` (taken before the change) to the old ones
    /// and zeroing their gauges.
    pub(crate) fn relabel(&self, priority: i64, stats: &SubscriptionStats) {
        if let Some(metrics) = self.metrics.borrow_mut().as_mut() {
            metrics.relabel(
                &self.info.topic,
                self.info.subscription.as_deref(),
                priority,
                stats,
            );
        }
    }

    /// Publishes its numbers to the metrics recorder, and notes whether it
    /// received anything since the last look.
    pub(crate) fn publish(&self, stats: &SubscriptionStats, now: Instant) {
        if let Some(metrics) = self.metrics.borrow_mut().as_mut() {
            metrics.publish(stats);
        }
        self.note_received(stats.received, now);
    }

    fn note_received(&self, received: u64, now: Instant) {
        let (seen, _) = self.last_received.get();
        if received != seen {
            self.last_received.set((received, Some(now)));
        }
    }

    /// Whether its consumer delivers, when it last received (to within the
    /// metrics publishing interval; with metrics off, to within the time
    /// since the previous `health()` call), and how many of its handlers
    /// run past their deadline.
    pub(crate) fn health(&self, now: Instant) -> SubscriptionHealth {
        self.note_received(self.counters.received.get(), now);
        let failing = self.failing.get() && {
            let failures = self.failures.borrow();
            let spell = self.still_failing(&failures, now) && !failures.answered_since_error;
            spell || self.consumer_failing_since().is_some()
        };
        SubscriptionHealth {
            topic: self.info.topic.clone(),
            subscription: self.info.subscription.clone(),
            receiving: self.is_receiving() && !failing && self.consumer.borrow().is_some(),
            last_received: self
                .last_received
                .get()
                .1
                .map(|at| now.saturating_duration_since(at)),
            overdue_handlers: self
                .deadlines
                .borrow()
                .iter()
                .filter(|deadline| **deadline < now)
                .count(),
        }
    }

    /// Notes a handler that must finish by `deadline`, until the guard it
    /// returns is dropped (however the handler's run ends).
    pub(crate) fn watch_deadline(&self, deadline: Instant) -> WatchedDeadline<'_> {
        self.deadlines.borrow_mut().push(deadline);
        WatchedDeadline {
            deadlines: &self.deadlines,
            deadline,
        }
    }
}

/// A handler's processing deadline, counted by health until dropped.
pub(crate) struct WatchedDeadline<'a> {
    deadlines: &'a RefCell<Vec<Instant>>,
    deadline: Instant,
}

impl Drop for WatchedDeadline<'_> {
    fn drop(&mut self) {
        let mut deadlines = self.deadlines.borrow_mut();
        if let Some(at) = deadlines.iter().position(|d| *d == self.deadline) {
            deadlines.swap_remove(at);
        }
    }
}

/// A time so far ahead that it stands for "never" (about 30 years).
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(60 * 60 * 24 * 365 * 30)
}
