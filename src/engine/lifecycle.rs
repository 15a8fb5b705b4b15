//! The engine's life: starting, the engine task, timers (held nacks,
//! receive retries, metrics publishing, the shutdown deadline), and
//! shutdown.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::FutureExt;
use tokio::time::{sleep_until, Instant};
use tracing::{debug, error, info, warn};

use super::subscription::Subscription;
use super::{wait_until, Delivery, Engine, Phase, NO_POOL};
use crate::error::{Error, ErrorChain, MAX_DURATION};
use crate::outcome::panicked;
use crate::routing::{retry_topic_problems, RetryTopicCheck};
use crate::transport::Transport;

/// How much longer than a shutdown deadline (`shutdown_timeout`,
/// `close_within`) a handler that returned before it may take to publish
/// its reply, retry or dead letter before that publish is cancelled too.
pub const PUBLISH_GRACE: Duration = Duration::from_secs(1);

impl<T: Transport> Engine<T> {
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

    /// The retry topic check for subscriptions added while running: it
    /// cannot refuse to start any more, so it warns (unless ignored).
    pub(super) fn warn_about_retry_topics(&self) {
        if self.retry_topic_check == RetryTopicCheck::Ignore {
            return;
        }
        for problem in retry_topic_problems(&self.subscription_infos()) {
            warn!(%problem, "retry topic check");
        }
    }

    /// The engine task. If it panics (a bug), the dispatcher still fails
    /// with an error and closes, rather than leave `run()` waiting.
    async fn supervise(self: Rc<Self>) {
        let driven = AssertUnwindSafe(self.clone().drive()).catch_unwind().await;
        let Err(panic) = driven else {
            return;
        };
        self.fail(panicked("the engine task", panic.as_ref()));
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
        let (mut queue, mut next) = (VecDeque::new(), None);
        self.dispatch(NO_POOL, &mut queue, &mut next);
        debug_assert!(
            next.is_none() && queue.is_empty(),
            "the engine keeps no job"
        );
        self.poll_timers(cx);
        if self.phase() != Phase::Running && self.scheduler.borrow().is_idle() {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    // ----- timers -----

    /// Notes that `subscription` has something due later (a held nack, a
    /// receive to retry), so that the engine's timer covers it.
    pub(crate) fn watch_timers(&self, subscription: &Rc<Subscription<T>>) {
        self.timers_changed.set(true);
        let mut timed = self.timed.borrow_mut();
        if !timed
            .iter()
            .any(|watched| Rc::ptr_eq(watched, subscription))
        {
            timed.push(subscription.clone());
        }
        self.woken.wake_engine();
    }

    /// Does what is due (held nacks, receive retries, the shutdown deadline
    /// and its publish grace, metrics publishing) and sets the timer for
    /// what comes next.
    ///
    /// The clock is read only when the timer has fired or something was
    /// added to what it covers: an engine poll otherwise costs no clock
    /// read.
    fn poll_timers(&self, cx: &mut Context<'_>) {
        {
            let mut timer = self.timer.borrow_mut();
            let unchanged = !self.timers_changed.replace(false);
            if let Some(timer) = timer.as_mut() {
                if unchanged && timer.as_mut().poll(cx).is_pending() {
                    return;
                }
            }
        }
        let now = Instant::now();
        let mut next = self.stop_deadline.get().filter(|_| !self.cancelling.get());
        if next.is_some_and(|deadline| deadline <= now) {
            self.cancel_handlers(now);
            next = self.publish_deadline.get();
        } else if let Some(deadline) = self.publish_deadline.get() {
            if deadline <= now {
                self.cancel_publishes();
            } else {
                next = Some(deadline);
            }
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
        if let Some(interval) = self.metrics_interval {
            let due = *self.next_publish.get().get_or_insert(now);
            let due = if due <= now {
                self.publish_metrics(now);
                now + interval
            } else {
                due
            };
            self.next_publish.set(Some(due));
            next = Some(next.map_or(due, |next| next.min(due)));
        }
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
        error!(error = %ErrorChain(&failure), "dispatcher failure; shutting down");
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

    /// Publishes every subscription's numbers to the metrics recorder.
    pub(super) fn publish_metrics(&self, now: Instant) {
        for subscription in self.all_subscriptions() {
            subscription.publish(&self.stats_of(&subscription), now);
        }
        if let Some(gauge) = &self.permits_gauge {
            gauge.show(self.scheduler.borrow().available());
        }
    }

    /// Makes a shutdown cancel the handlers still running after `limit`
    /// (from now), unless an earlier deadline is set.
    fn shorten_stop_deadline(&self, limit: Duration) {
        self.timers_changed.set(true);
        let deadline = Instant::now() + limit;
        let earlier = self
            .stop_deadline
            .get()
            .map_or(deadline, |set| set.min(deadline));
        self.stop_deadline.set(Some(earlier));
        self.woken.wake_engine();
    }

    /// Past the shutdown deadline: messages still waiting are nacked and
    /// every handler still running is dropped (its message nacked). A
    /// handler that returned and whose reply, retry or dead letter is being
    /// published is given [`PUBLISH_GRACE`] more to finish: cancelled, it
    /// would be nacked and handled again (and its reply sent twice).
    fn cancel_handlers(&self, now: Instant) {
        self.cancelling.set(true);
        loop {
            let waiting = self.scheduler.borrow_mut().take_waiting();
            let Some((
                _,
                Delivery {
                    subscription,
                    message,
                    ..
                },
            )) = waiting
            else {
                break;
            };
            self.give_back(&subscription, message);
        }
        let running = self.running();
        warn!(
            running,
            "shutdown deadline passed; cancelling the handlers still running"
        );
        let mut publishing = false;
        for pool in self.pools.borrow().values() {
            publishing |= pool.cancel(false);
        }
        if publishing {
            self.publish_deadline.set(Some(now + PUBLISH_GRACE));
        }
    }

    /// Past the shutdown deadline and its grace: publishes still under
    /// way are dropped too (their messages nacked).
    fn cancel_publishes(&self) {
        self.publish_deadline.set(None);
        warn!("publishes still under way past the shutdown deadline's grace; cancelling them");
        for pool in self.pools.borrow().values() {
            pool.cancel(true);
        }
    }

    /// Whether the shutdown deadline has passed.
    pub(crate) fn is_cancelling(&self) -> bool {
        self.cancelling.get()
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
    ///
    /// Each step runs whatever the steps before it did: a transport that panics (a bug) in a nack or a close
    /// fails the dispatcher, and the rest still closes, the connection
    /// last.
    async fn shut_down(&self) {
        debug!("queued messages handled; closing consumers");
        self.phase.set(Phase::Drained);
        for pool in self.pools.borrow().values() {
            pool.close();
        }
        self.timed.borrow_mut().clear();
        self.close_consumers(&self.all_subscriptions()).await;
        self.close_transport().await;
    }

    /// Closes every consumer, each whatever the others do.
    async fn close_consumers(&self, subscriptions: &[Rc<Subscription<T>>]) {
        let closing = subscriptions.iter().map(|s| self.close_consumer(s));
        futures::future::join_all(closing).await;
    }

    /// Sends a subscription's held nacks at once (a close does not wait
    /// for their delay), then closes its consumer; a step that panics fails
    /// the dispatcher, and the next still runs.
    pub(super) async fn close_consumer(&self, subscription: &Subscription<T>) {
        let sending = async { subscription.send_held_nacks() };
        self.survive("sending held nacks", sending).await;
        self.survive("closing a consumer", subscription.close())
            .await;
    }

    async fn close_transport(&self) {
        if self.metrics_interval.is_some() {
            self.publish_metrics(Instant::now());
        }
        self.survive("closing the producers", self.router.close())
            .await;
        let closing = async {
            if let Err(error) = self.transport.close().await {
                error!(%error, "closing the connection failed");
                self.failure.borrow_mut().get_or_insert(Error::Close(error));
            }
        };
        self.survive("closing the connection", closing).await;
        self.mark_closed();
        info!("dispatcher closed");
    }

    /// Runs a closing step; one that panics (a transport's bug) fails the
    /// dispatcher, and the steps after it still run. Not an `async fn`:
    /// as one, it kept `work` and its guarded copy in one more state
    /// machine, and overflowed a test thread's stack in a debug build
    /// (`tests/routing_pulsar.rs`, the burst of replies).
    pub(super) fn survive<'a>(
        &'a self,
        step: &'a str,
        work: impl Future<Output = ()> + 'a,
    ) -> impl Future<Output = ()> + 'a {
        AssertUnwindSafe(work).catch_unwind().map(move |caught| {
            if let Err(panic) = caught {
                self.fail(panicked(step, panic.as_ref()));
            }
        })
    }

    fn mark_closed(&self) {
        self.phase.set(Phase::Closed);
        self.closed.notify_waiters();
        // An unsubscribe waiting for its subscription to drain ends with
        // the dispatcher too.
        self.drained.notify_waiters();
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
                    engine.close_consumers(&engine.all_subscriptions()).await;
                    engine.close_transport().await;
                });
            }
            Phase::Running => self.request_stop(),
            Phase::Stopping | Phase::Drained | Phase::Closed => {}
        }
    }

    pub(crate) async fn wait_closed(&self) {
        wait_until(&self.closed, || self.phase() == Phase::Closed).await
    }
}
