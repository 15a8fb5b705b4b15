//! Workers: long-lived `spawn_local` tasks that run one handler's futures in
//! place, and the [`Job`] guard that each message in flight is.
//!
//! Each subscribed handler has a pool of workers. A worker is spawned only
//! when a message arrives for the handler and every worker it has is busy,
//! so a pool never holds more workers than the concurrency limit; after
//! that, dispatching a message allocates nothing: the handler's future lives
//! inside the worker's own task, which is reused message after message. When
//! a worker finishes a message whose subscription's next message is the one
//! a release and a pick would give its permit, it runs that one next under
//! the same permit, the two message boxes exchanged in place, from a slot or
//! a key buffer alike (see `Job::follow_on`). Otherwise it dispatches at
//! once (permit, then the best waiting messages, as the engine would): those
//! for its own handler go to its queue and run in the same poll, in the
//! order they were picked, while their handlers finish without waiting; the
//! first time one waits, the rest of the queue goes to other workers.
//! Messages for other handlers go to their pools' idle workers. An idle
//! worker offers to dispatch when a consumer wakes (see `wake`), and runs
//! what it picks the same way. Every few messages a worker yields to the
//! runtime, so that the broker connection's tasks and timers keep running;
//! when the next message may follow on, it keeps the ended job over that
//! turn, its permit counted as resting (see `Engine::rest`), unless the
//! ended message holds an ordering key, which would stay busy over the turn.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use futures::FutureExt;
use tokio::time::Instant;
use tracing::{warn, Instrument};

use super::stats::bump;
use super::subscription::Subscription;
use super::{Delivery, Engine, Handler, MessageBox, Phase, Pool};
use crate::message::Message;
use crate::outcome::{panicked, Deadline, HandlerError, IntoReply, Outcome, Verdict};
use crate::routing::{Action, Publish};
use crate::scheduler::Permit;
use crate::transport::Transport;

/// How many messages a worker handles in one poll before it yields. Tried
/// against tokio's own budget per task poll, 128, in the open-loop
/// benchmark (an arrival loop on the same thread, up to 64 messages per
/// turn): with 128 ours fell behind the arrivals at 65% of its sustained
/// rate in 5 runs of 5 and at 80% in 4 of 5; with 32, in none and in 1.
pub(crate) const JOBS_PER_POLL: u32 = 32;

/// The pool of workers of the handler type `F`.
pub(crate) struct WorkerPool<T: Transport, F, R, E> {
    /// Workers waiting for a message, most recently idle last.
    idle: RefCell<Vec<Rc<Inbox<T>>>>,
    /// Every worker's task, to cancel at the shutdown deadline, and
    /// whether it is publishing what its handler returned.
    tasks: RefCell<Vec<(tokio::task::AbortHandle, Rc<Cell<bool>>)>>,
    closed: Cell<bool>,
    types: PhantomData<fn(F) -> Result<R, E>>,
}

/// Where a worker waits for its next message, and its queue.
struct Inbox<T: Transport> {
    job: Cell<Option<Job<T>>>,
    waker: Cell<Option<Waker>>,
    /// Messages for the worker's handler that its dispatches picked behind
    /// the one it runs, each holding its permit, in the order picked.
    /// Empty while the worker waits for a job.
    queue: RefCell<VecDeque<Job<T>>>,
    /// Set while the worker publishes the reply, retry or dead letter of a
    /// handler that returned: the shutdown deadline lets that finish.
    publishing: Rc<Cell<bool>>,
}

impl<T: Transport, F, R, E> WorkerPool<T, F, R, E>
where
    F: AsyncFn(&Message) -> Result<R, E> + 'static,
    R: IntoReply + 'static,
    E: Into<HandlerError> + 'static,
{
    pub(crate) fn new() -> Rc<Self> {
        Rc::new(WorkerPool {
            idle: RefCell::default(),
            tasks: RefCell::default(),
            closed: Cell::new(false),
            types: PhantomData,
        })
    }

    /// `handler`, to be run by the workers of `pool` (a pool of this type).
    pub(crate) fn handler(pool: Rc<dyn Pool<T>>, handler: F) -> Handler<T> {
        Handler::new(Rc::new(handler), pool)
    }

    fn id(&self) -> *const () {
        self as *const Self as *const ()
    }

    /// Spawns a worker that starts with `first`.
    fn spawn(self: Rc<Self>, first: Job<T>) {
        let engine = first.engine.clone();
        let publishing = Rc::new(Cell::new(false));
        let inbox = Rc::new(Inbox {
            job: Cell::new(None),
            waker: Cell::new(None),
            queue: RefCell::default(),
            publishing: publishing.clone(),
        });
        let task = WorkerTask {
            inbox: inbox.clone(),
            work: Box::pin(self.clone().work(engine, first, inbox)),
        };
        let task = tokio::task::spawn_local(task);
        self.tasks
            .borrow_mut()
            .push((task.abort_handle(), publishing));
    }

    /// A worker's life: run the job it was spawned with, then every job it
    /// picks for itself or is handed, until the pool closes.
    ///
    /// The further messages for its own handler that a dispatch picks go
    /// to the worker's queue (see [`WorkerTask`]); the worker runs them in
    /// the order they were picked, in the same poll while handlers finish
    /// without waiting, so that a burst costs no task poll per message.
    async fn work(self: Rc<Self>, engine: Rc<Engine<T>>, first: Job<T>, inbox: Rc<Inbox<T>>) {
        // The job it runs stays in this one place: a job ends here and a
        // dispatch writes the next one here, so that a job is not copied
        // on its way from the dispatch to the run.
        let mut current = Some(first);
        // Counted down, not up: a decrement tells zero by itself, without
        // a comparison (about 3 instructions per message).
        let mut left_in_poll = JOBS_PER_POLL;
        while let Some(job) = current.as_mut() {
            if job.start() {
                // Better messages handed to other workers before this one
                // was picked start first.
                left_in_poll = JOBS_PER_POLL;
                tokio::task::yield_now().await;
            }
            if job.runs_plain() {
                // The common configuration, run here rather than in `run`:
                // its future nested in this one cost a state of its own and
                // a drop per message. The handler's future is built where
                // it is awaited (see `run`), and polled under its panic
                // guard here, not through `CatchUnwind`, whose poll stayed
                // a call of its own.
                let handled = {
                    let mut handler = std::pin::pin!(job.handler::<F>()(job.message()));
                    std::future::poll_fn(|cx| poll_caught(handler.as_mut(), cx)).await
                };
                if let Some(publish) = self.conclude(job, Some(handled), None, &engine) {
                    self.publish(job, publish, None, &engine, &inbox).await;
                }
            } else {
                self.run(job, &engine, &inbox).await;
            }
            left_in_poll -= 1;
            // The hint first: false for a subscription that takes turns
            // with others at its level. At the end of the poll, a job whose
            // message holds a key ends as usual: kept over the runtime's
            // turn, it would keep the key busy.
            if job.next_in_line
                && inbox.queue.borrow().is_empty()
                && (left_in_poll != 0 || !job.holds_key())
            {
                if left_in_poll == 0 {
                    // The runtime's turn, the ended job kept: its message
                    // handled and settled, its permit resting, no key
                    // busy, so that nothing waits on it, and the next
                    // message may still follow on (`follow_on` checks
                    // again what the turn may have changed).
                    left_in_poll = JOBS_PER_POLL;
                    let _resting = engine.rest(&job.subscription);
                    tokio::task::yield_now().await;
                }
                if job.follow_on() {
                    continue;
                }
            }
            current = None;
            if left_in_poll == 0 {
                left_in_poll = JOBS_PER_POLL;
                engine.step_aside().await;
            }
            engine.dispatch(self.id(), &mut inbox.queue.borrow_mut(), &mut current);
            if current.is_none() {
                current = inbox.queue.borrow_mut().pop_front();
            }
            if current.is_none() {
                current = self.wait_for_job(&inbox, &engine).await;
            }
        }
    }

    /// Runs the handler on the job's message where it is stored, then
    /// settles the message by the handler's outcome: with a span, a
    /// processing deadline or timings (without them, the worker runs the
    /// handler itself, see `work`).
    async fn run(&self, job: &mut Job<T>, engine: &Engine<T>, inbox: &Inbox<T>) {
        let span = job.span(engine);
        let since = job.since();
        let started = since.map(|_| Instant::now());
        let handler: &F = job.handler();
        let subscription = &job.subscription;
        // Each branch builds the handler's future where it is awaited: a
        // future passed on by value (to a helper `async fn`, say) is copied
        // on the way, twice per message, and a handler's future can be
        // large.
        let handle = || AssertUnwindSafe(handler(job.message())).catch_unwind();
        let handled = match (&span, subscription.processing_timeout) {
            (None, None) => Some(handle().await),
            (Some(span), None) => Some(handle().instrument(span.clone()).await),
            (span, Some(limit)) => {
                let deadline = Instant::now() + limit;
                // Also when the worker is cancelled (at the shutdown
                // deadline) while the handler runs.
                let _watched = subscription.watch_deadline(deadline);
                // Under a panic guard of its own too: a handler past its
                // deadline is dropped as the timeout completes, and a
                // panic in that drop is the handler's, not the worker's.
                let timed = async {
                    match span {
                        None => tokio::time::timeout_at(deadline, handle()).await,
                        Some(span) => {
                            let handled = handle().instrument(span.clone());
                            tokio::time::timeout_at(deadline, handled).await
                        }
                    }
                };
                match AssertUnwindSafe(timed).catch_unwind().await {
                    Ok(handled) => handled.ok(),
                    Err(panic) => Some(Err(panic)),
                }
            }
        };
        if let (Some(since), Some(started)) = (since, started) {
            let ran = started.elapsed();
            job.subscription
                .record_timings(started.saturating_duration_since(since), ran);
        }
        if let Some(publish) = self.conclude(job, handled, span.as_ref(), engine) {
            self.publish(job, publish, span, engine, inbox).await;
        }
    }

    /// Routes and settles what the handler gave (`None`: it ran past its
    /// processing deadline), in its span; returns what to publish first,
    /// if anything.
    #[inline(always)]
    fn conclude(
        &self,
        job: &mut Job<T>,
        handled: Option<std::thread::Result<Result<R, E>>>,
        span: Option<&tracing::Span>,
        engine: &Engine<T>,
    ) -> Option<Box<Publish>> {
        let entered = span.map(tracing::Span::enter);
        // The common outcome, a success without a reply, is told apart
        // before any `Outcome` is built: one built and matched stayed in
        // memory, its drop checked on every message (about 8 instructions
        // per message). `None` is that success.
        let outcome = match handled {
            Some(Ok(Ok(reply))) => match reply.into_reply() {
                None => None,
                reply => Some(Outcome::Succeeded(reply)),
            },
            Some(Ok(result)) => Some(Outcome::of(result)),
            Some(Err(panic)) => Some(Outcome::panicked(panic.as_ref())),
            None => {
                let limit = job.subscription.processing_timeout.unwrap_or_default();
                warn!(topic = %job.message().topic(), message_id = %job.message().id(), deadline = ?limit, "handler still running at its processing deadline; dropped");
                Some(Outcome::TimedOut(Deadline(limit)))
            }
        };
        // Routing and settling are the dispatcher's own code; a panic there
        // is a bug that must not pass unnoticed. The job's guard still
        // nacks the message and returns the permit. The common outcomes
        // settle without awaiting; only a publish is a future. The common
        // one, a success without a reply, hands the guard the job alone.
        let concluded = match outcome {
            None => std::panic::catch_unwind(AssertUnwindSafe(|| job.succeed())).map(|()| None),
            Some(outcome) => std::panic::catch_unwind(AssertUnwindSafe(|| job.conclude(outcome))),
        };
        drop(entered);
        concluded.unwrap_or_else(|panic| {
            settling_panicked(engine, panic);
            None
        })
    }

    /// Publishes the reply, retry or dead letter of a handler that
    /// returned, then settles the message by how that went.
    async fn publish(
        &self,
        job: &mut Job<T>,
        publish: Box<Publish>,
        span: Option<tracing::Span>,
        engine: &Engine<T>,
        inbox: &Inbox<T>,
    ) {
        inbox.publishing.set(true);
        let published = AssertUnwindSafe(job.publish_and_settle(publish)).catch_unwind();
        let published = match span {
            None => published.await,
            Some(span) => published.instrument(span).await,
        };
        inbox.publishing.set(false);
        if engine.is_cancelling() {
            // Spared at the shutdown deadline to finish this
            // publish (only a publishing worker outlives it): the
            // jobs it had picked are not started (dropped, each
            // nacked and counted as cancelled), and with nothing
            // left to pick it waits idle until the pool closes.
            inbox.queue.borrow_mut().clear();
        }
        if let Err(panic) = published {
            settling_panicked(engine, panic);
        }
    }

    /// Waits in the idle list until a job is handed over, or until a
    /// consumer wakes while this worker is the engine's helper, in which
    /// case it dispatches itself and keeps what it picks for its own
    /// handler (the first to run, the rest queued), handing the others
    /// over, as after a job; `None` once the pool is closed.
    async fn wait_for_job(&self, inbox: &Rc<Inbox<T>>, engine: &Rc<Engine<T>>) -> Option<Job<T>> {
        loop {
            if self.closed.get() {
                return None;
            }
            self.idle.borrow_mut().push(inbox.clone());
            let woke = std::future::poll_fn(|cx| {
                if let Some(job) = inbox.job.take() {
                    return Poll::Ready(Woke::Job(job));
                }
                if self.closed.get() {
                    return Poll::Ready(Woke::Closed);
                }
                if engine.woken.any() {
                    return Poll::Ready(Woke::Consumers);
                }
                inbox.waker.set(Some(cx.waker().clone()));
                engine.woken.register_helper(cx.waker());
                Poll::Pending
            })
            .await;
            match woke {
                Woke::Job(job) => {
                    // Woken as the engine's helper for a consumer, then
                    // handed a job before it ran: the consumer is someone
                    // else's to poll now, or its message waits for a job
                    // to end while a permit may be free.
                    if engine.woken.any() {
                        engine.woken.wake_engine();
                    }
                    return Some(job);
                }
                Woke::Closed => return None,
                Woke::Consumers => {
                    // Off the idle list first: from here on this worker is
                    // busy, and no hand-over may pick it.
                    self.leave_idle(inbox);
                    // The queue is empty while a worker waits, so the
                    // first message picked comes back here.
                    let mut picked = None;
                    engine.dispatch(self.id(), &mut inbox.queue.borrow_mut(), &mut picked);
                    if picked.is_some() {
                        return picked;
                    }
                }
            }
        }
    }

    fn leave_idle(&self, inbox: &Rc<Inbox<T>>) {
        drop(inbox.waker.take());
        let mut idle = self.idle.borrow_mut();
        if let Some(at) = idle.iter().position(|other| Rc::ptr_eq(other, inbox)) {
            idle.remove(at);
        }
    }
}

/// Polls `future` once under a panic guard, as `CatchUnwind` does.
#[inline(always)]
fn poll_caught<F: Future>(
    future: Pin<&mut F>,
    cx: &mut Context<'_>,
) -> Poll<std::thread::Result<F::Output>> {
    match std::panic::catch_unwind(AssertUnwindSafe(|| future.poll(cx))) {
        Ok(polled) => polled.map(Ok),
        Err(panic) => Poll::Ready(Err(panic)),
    }
}

/// Routing or settling a message panicked: a bug of the dispatcher's, which
/// stops it.
#[inline(never)]
fn settling_panicked<T: Transport>(engine: &Engine<T>, panic: Box<dyn std::any::Any + Send>) {
    engine.fail(panicked("settling a message", panic.as_ref()));
}

/// Why an idle worker woke.
enum Woke<T: Transport> {
    Job(Job<T>),
    Closed,
    Consumers,
}

impl<T: Transport, F, R, E> Pool<T> for WorkerPool<T, F, R, E>
where
    F: AsyncFn(&Message) -> Result<R, E> + 'static,
    R: IntoReply + 'static,
    E: Into<HandlerError> + 'static,
{
    fn assign(self: Rc<Self>, job: Job<T>) {
        // Taken off the idle list before the job goes in, so that the pool
        // never holds a job (and through it the engine) itself.
        let idle = self.idle.borrow_mut().pop();
        match idle {
            Some(inbox) => {
                // It may be the engine's helper; a busy worker must not be
                // the one consumers wake.
                job.engine.woken.clear_helper();
                inbox.job.set(Some(job));
                if let Some(waker) = inbox.waker.take() {
                    waker.wake();
                }
            }
            None => self.spawn(job),
        }
    }

    fn cancel(&self, publishing_too: bool) -> bool {
        let mut tasks = self.tasks.borrow_mut();
        tasks.retain(|(task, publishing)| {
            let spared = publishing.get() && !publishing_too;
            if !spared {
                task.abort();
            }
            spared
        });
        !tasks.is_empty()
    }

    fn close(&self) {
        self.closed.set(true);
        for inbox in self.idle.borrow_mut().drain(..) {
            if let Some(waker) = inbox.waker.take() {
                waker.wake();
            }
        }
    }
}

/// A worker's task: its life, and its queue handed on whenever the task
/// waits. The worker runs queued jobs one after another while their
/// handlers finish without waiting; when the task waits for anything (a
/// handler or a publish pending, stepping aside for the runtime, yielding
/// to better messages), every job still in the queue goes to another
/// worker, so no picked message waits behind a waiting one. Checking at the
/// task's edge costs nothing per message: the task is polled once for many.
struct WorkerTask<T: Transport, W> {
    inbox: Rc<Inbox<T>>,
    work: Pin<Box<W>>,
}

impl<T: Transport, W: Future<Output = ()>> Future for WorkerTask<T, W> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let polled = this.work.as_mut().poll(cx);
        if polled.is_pending() {
            // One at a time, the borrow released before each hand-over
            // (which may spawn a worker), and the queue's room kept.
            loop {
                let queued = this.inbox.queue.borrow_mut().pop_front();
                match queued {
                    Some(job) => job.assign(),
                    None => break,
                }
            }
        }
        polled
    }
}

/// One dispatched message: its permit, its storage and its settlement.
///
/// The guard settles and releases however the message's work ends: through
/// [`succeed`](Job::succeed) or [`conclude`](Job::conclude), or by being
/// dropped half-way (a worker's task dropped with its runtime), in which
/// case the message is nacked and the engine woken to dispatch in the
/// worker's place.
pub(crate) struct Job<T: Transport> {
    engine: Rc<Engine<T>>,
    subscription: Rc<Subscription<T>>,
    /// Taken back into the engine's spares when the job ends (by `drop`,
    /// the only `ManuallyDrop::take`), or exchanged by
    /// [`follow_on`](Job::follow_on) for its subscription's next message,
    /// the ended box going to the slot, key buffer or spares. Not an
    /// `Option`, whose check every read of the message would pay.
    message: ManuallyDrop<MessageBox>,
    /// Given back to the scheduler when the job ends.
    permit: Option<Permit>,
    /// What its start has to do; `Nothing` once started.
    before_start: BeforeStart,
    finished: bool,
    /// Whether its subscription's next message was next in line at its
    /// level when this one was picked or followed on
    /// ([`Pick::next_in_line`]): only then
    /// may the job's end take it in place (see [`Job::follow_on`]).
    ///
    /// [`Pick::next_in_line`]: crate::scheduler::Pick::next_in_line
    next_in_line: bool,
}

/// What a job has to do as it starts, told in one look for nearly every
/// job, which has nothing to do (about 4 instructions per message, against
/// two flags).
#[derive(Clone, Copy, PartialEq, Eq)]
enum BeforeStart {
    Nothing,
    /// When it was picked, a message of a better priority picked earlier
    /// had been handed to a worker and not started: it lets such messages
    /// start first.
    WaitForBetter,
    /// Handed to a worker, or queued behind the job its picker runs, and
    /// not started yet: its start is counted. (Such a job waits for no
    /// better one: only the job a worker picked to run next does.)
    CountHandover,
}

impl<T: Transport> Job<T> {
    pub(crate) fn new(
        engine: Rc<Engine<T>>,
        subscription: Rc<Subscription<T>>,
        message: MessageBox,
        permit: Permit,
        next_in_line: bool,
    ) -> Self {
        let priority = permit.priority();
        let before_start = if engine.better_handover_pending(priority) {
            BeforeStart::WaitForBetter
        } else {
            BeforeStart::Nothing
        };
        Job {
            engine,
            subscription,
            message: ManuallyDrop::new(message),
            permit: Some(permit),
            before_start,
            finished: false,
            next_in_line,
        }
    }

    /// Hands the job to a worker of its handler.
    pub(crate) fn hand_over(mut self) {
        self.wait_in_queue();
        self.assign();
    }

    /// Marks the job as waiting, picked and not started, in a worker's
    /// queue or inbox: until it starts, workers that pick a job of a worse
    /// priority let it start first.
    pub(crate) fn wait_in_queue(&mut self) {
        self.before_start = BeforeStart::CountHandover;
        self.engine.handed_over(self.priority());
    }

    /// Gives a waiting job to an idle worker of its handler, or a new one.
    fn assign(self) {
        self.subscription.handler.pool.clone().assign(self);
    }

    /// Marks the job started; returns whether it must first let start a
    /// message of a better priority, picked before this one, that waits
    /// to start on another worker. Messages of its own priority or worse
    /// may start after it: that breaks no priority order, and key ordering
    /// holds by the scheduler's claims whatever the start order.
    #[inline(always)]
    fn start(&mut self) -> bool {
        if self.before_start == BeforeStart::Nothing {
            return false;
        }
        self.start_rarely()
    }

    /// [`start`](Self::start) with something to do, out of line.
    #[inline(never)]
    fn start_rarely(&mut self) -> bool {
        match std::mem::replace(&mut self.before_start, BeforeStart::Nothing) {
            BeforeStart::Nothing => false,
            BeforeStart::WaitForBetter => self.engine.better_handover_pending(self.priority()),
            BeforeStart::CountHandover => {
                self.engine.handover_started();
                false
            }
        }
    }

    /// Whether its message holds an ordering key (of a key-ordered
    /// subscription) until the job ends.
    fn holds_key(&self) -> bool {
        self.permit
            .as_ref()
            .is_some_and(|permit| permit.holds_key())
    }

    /// The priority it was picked at.
    fn priority(&self) -> i64 {
        self.permit
            .as_ref()
            .expect("a job holds its permit until it ends")
            .priority()
    }

    /// The pool that runs this message's handler.
    pub(crate) fn pool(&self) -> *const () {
        self.subscription.handler.pool_id()
    }

    /// The span the message's handling runs in: topic, message id,
    /// priority and redelivery count, at debug level, so that a subscriber
    /// at info pays one check for it. `None` when no subscriber wants it,
    /// so that the handler then runs with no span to enter, clone or drop.
    #[inline(always)]
    fn span(&self, engine: &Engine<T>) -> Option<tracing::Span> {
        if !debug_spans_wanted() {
            return None;
        }
        self.new_span(engine)
    }

    #[inline(never)]
    fn new_span(&self, engine: &Engine<T>) -> Option<tracing::Span> {
        let message = self.message();
        let span = tracing::debug_span!(
            "message",
            topic = %message.topic(),
            subscription = self.subscription.info.subscription.as_deref(),
            message_id = %message.id(),
            priority = engine.priority_of(&self.subscription),
            redelivery_count = message.redelivery_count(),
        );
        (!span.is_disabled()).then_some(span)
    }

    /// Whether the handler runs with nothing around it: no span wanted, no
    /// processing deadline, no timings. What [`WorkerPool::run`] does then,
    /// the worker does itself.
    #[inline(always)]
    fn runs_plain(&self) -> bool {
        !debug_spans_wanted() && self.subscription.plain
    }

    /// The handler value, as the type its pool runs.
    fn handler<F: 'static>(&self) -> &F {
        self.subscription
            .handler
            .value()
            .expect("a pool runs only handlers of its own type")
    }

    fn message_box(&self) -> &MessageBox {
        &self.message
    }

    /// When the message arrived in its slot, if timings are on.
    fn since(&self) -> Option<Instant> {
        self.message_box().since()
    }

    fn message(&self) -> &Message {
        self.message_box().get()
    }

    /// Counts and acks a success without a reply, the common outcome, at
    /// once, as routing would decide, without building its decision.
    #[inline(always)]
    fn succeed(&mut self) {
        bump(&self.subscription.counters.succeeded);
        self.subscription.ack(self.message().id());
        self.finished = true;
    }

    /// Routes any other outcome and, when that takes no publish, settles
    /// the message; otherwise returns what to publish first. Out of line:
    /// the common outcome takes [`succeed`](Self::succeed).
    #[inline(never)]
    fn conclude(&mut self, outcome: Outcome) -> Option<Box<Publish>> {
        match self
            .engine
            .route(&self.subscription, self.message(), outcome)
        {
            Action::Settle(verdict) => {
                self.settle(verdict);
                self.finished = true;
                None
            }
            Action::Publish(publish) => Some(publish),
        }
    }

    /// Takes, once settled, its subscription's next message, with the
    /// permit it holds, when ending and dispatching would pick that message
    /// under that permit (see [`Scheduler::try_redispatch`]) and nothing
    /// else waits on its end: no consumer woke, no job of a better priority
    /// handed over waits to start, the engine runs and the subscription
    /// stays. The box of the message it ends takes the subscription's next
    /// message, and goes to the slot or key buffer in exchange for the
    /// message the permit goes to (a key buffer releases the ended
    /// message's key first, and takes more while everything it holds
    /// waits for busy keys, as after a pick). Returns
    /// false, having changed nothing, otherwise; the job then ends as usual.
    /// Its worker asks only when the job's hint says its subscription's next
    /// message was next in line, and with no job queued behind this one,
    /// which must run first. (The scheduler refuses under any policy but
    /// strict, the aging one's rounds among them.)
    ///
    /// The common end of a job in a busy dispatcher: it skips the job's
    /// drop, its permit's round trip, the building of the next job and the
    /// new delivery of the message stored.
    ///
    /// [`Scheduler::try_redispatch`]: crate::scheduler::Scheduler::try_redispatch
    #[inline(always)]
    fn follow_on(&mut self) -> bool {
        let Job {
            engine,
            subscription,
            message,
            permit,
            finished,
            next_in_line,
            ..
        } = self;
        if !*finished
            || engine.woken.any()
            || engine.phase() != Phase::Running
            || subscription.is_removing()
        {
            return false;
        }
        let permit = permit
            .as_mut()
            .expect("a job holds its permit until it ends");
        let ended: &mut MessageBox = message;
        let mut not_stored = None;
        {
            let mut scheduler = engine.scheduler.borrow_mut();
            let Some(redispatch) = scheduler.try_redispatch(permit) else {
                return false;
            };
            // A job picked now would let such a message start first (see
            // `Job::new`); this one starts at once, so it leaves it to
            // the usual way.
            if engine.better_handover_pending(redispatch.priority()) {
                return false;
            }
            // The consumer cannot reach the scheduler, which this holds,
            // and a panic in it is caught (`Subscription::receive_or`): it
            // takes the second branch below, and fails the dispatcher.
            ended.clear();
            // The engine runs (checked above); a paused subscription takes
            // nothing more from its consumer.
            if subscription.is_receiving()
                && engine.receive_into(subscription, ended, &mut not_stored)
            {
                *next_in_line = redispatch.exchange(
                    |next| std::mem::swap(ended, &mut next.message),
                    |stored| subscription.order_key(stored.message.get()),
                    || engine.receive_next(subscription, &mut not_stored),
                );
            } else {
                let Delivery { message: next, .. } = redispatch.take();
                engine.keep_spare(std::mem::replace(ended, next));
                *next_in_line = false;
            }
            // From here the job is the next message's: unsettled, so that
            // however it ends now, its message is nacked if not settled.
            *finished = false;
        }
        bump(&subscription.counters.dispatched);
        if let Some(received) = not_stored.take() {
            engine.after_receive(subscription, received);
        }
        true
    }

    /// Publishes a reply, retry or dead letter, then settles the message by
    /// how the publish went.
    async fn publish_and_settle(&mut self, publish: Box<Publish>) {
        let verdict = self
            .engine
            .publish(&self.subscription, self.message(), publish)
            .await;
        self.settle(verdict);
        self.finished = true;
    }

    /// A job dropped before it was settled (its worker cancelled, or the
    /// job never started): the message is nacked, and the engine task
    /// woken to dispatch in the worker's place (it runs after the drop has
    /// returned the permit). Cold and out of line, so that the drop of
    /// every settled job carries none of this.
    #[cold]
    #[inline(never)]
    fn cancelled(&mut self) {
        self.start();
        self.engine.note_cancelled();
        // A nack that panics (a transport's bug) must not unwind out of the
        // job's drop before it has returned its permit: shutdown would wait
        // for that permit for ever.
        let nacked = std::panic::catch_unwind(AssertUnwindSafe(|| self.settle(Verdict::Nack)));
        if let Err(panic) = nacked {
            settling_panicked(&self.engine, panic);
        }
        self.engine.wake_for_permit();
    }

    #[inline(always)]
    fn settle(&self, verdict: Verdict) {
        let id = self.message().id();
        if self.subscription.settle(verdict, id) {
            self.engine.watch_timers(&self.subscription);
        }
    }
}

/// Whether a subscriber may take the per-message debug span: the span
/// macro's own first check, made inline so that nothing else of it runs
/// when none does.
#[inline(always)]
fn debug_spans_wanted() -> bool {
    tracing::level_filters::LevelFilter::current() >= tracing::Level::DEBUG
}

impl<T: Transport> Drop for Job<T> {
    fn drop(&mut self) {
        // A settled job has started (the worker starts a job before it
        // runs it), so only an unsettled one may still be handed over and
        // not started, and only an unsettled one calls for a wake-up: both
        // in the cold path (about 5 instructions per message).
        if !self.finished {
            self.cancelled();
        }
        // SAFETY: `drop` runs once, and nothing reads `message` after it.
        let message = unsafe { ManuallyDrop::take(&mut self.message) };
        self.engine.recycle(message);
        let permit = self
            .permit
            .take()
            .expect("a job holds its permit until it ends");
        self.engine.release_permit(permit);
        if self.subscription.is_removing() {
            self.engine.notify_drained();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Job;
    use crate::transport::MemoryTransport;

    #[test]
    fn a_job_fits_in_one_cache_line() {
        // A job is moved from the dispatch to its worker, through a queue
        // or an inbox; the time its message arrived stays in the box.
        assert!(std::mem::size_of::<Job<MemoryTransport>>() <= 64);
    }
}
