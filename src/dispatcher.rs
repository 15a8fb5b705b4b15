//! The public API: building a dispatcher, subscribing, running and closing.
//!
//! [`Dispatcher`] owns the shared core: the transport, the scheduler, the
//! registered subscriptions and the lifecycle. `run()` starts one reader per
//! subscription and the dispatch loop, which waits for a permit, picks the
//! best waiting message and spawns its task. Shutdown walks the phases
//! `Running → Stopping → Drained → Closed`: readers stop receiving and the
//! scheduler refuses new messages; what is already queued is still
//! dispatched; once no handler is in flight the readers settle what remains
//! and close their consumers; last, the transport is closed, whatever failed
//! before.

use std::cell::{Cell, Ref, RefCell, RefMut};
use std::future::poll_fn;
use std::num::NonZeroUsize;
use std::rc::Rc;

use futures::future::LocalBoxFuture;
use pulsar::{PulsarBuilder, SubType, TokioExecutor};
use tokio::sync::Notify;
use tracing::{debug, error, info, warn};

use crate::error::Error;
use crate::family::{PriorityLevel, TopicFamily};
use crate::message::Message;
use crate::process::{HandlerError, HandlerTask, InFlight, IntoReply, Spawn};
use crate::reader::{self, Delivery, SubscriptionContext, Verdict};
use crate::routing::{
    retry_topic_problems, DeadLetterTargets, Publish, RetryTopicCheck, Router, RoutingPolicy,
};
use crate::scheduler::Scheduler;
use crate::subscription::SubscribeOptions;
use crate::topic::full_topic_name;
use crate::transport::{Consumer, PulsarTransport, Transport};

/// The concurrency limit unless told otherwise.
pub const DEFAULT_CONCURRENCY: usize = 20;

/// Where a dispatcher is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Accepting subscriptions; `run()` not called yet.
    Idle,
    /// Readers receive and the dispatch loop dispatches.
    Running,
    /// Shutdown started: nothing new is received; queued messages are
    /// still dispatched and handlers run to completion.
    Stopping,
    /// No handler is in flight; readers settle the rest and close.
    Drained,
    /// Everything is closed.
    Closed,
}

impl Phase {
    fn describe(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Running => "running",
            Phase::Stopping | Phase::Drained => "shutting down",
            Phase::Closed => "closed",
        }
    }
}

/// Configures and creates a [`Dispatcher`].
///
/// ```no_run
/// # async fn example() -> Result<(), pulsar_dispatcher::Error> {
/// use pulsar_dispatcher::Dispatcher;
///
/// let dispatcher = Dispatcher::builder()
///     .concurrency(50)
///     .connect("pulsar://127.0.0.1:6650")
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct DispatcherBuilder {
    concurrency: usize,
    retry_topic_check: RetryTopicCheck,
    dead_letter_targets: DeadLetterTargets,
}

impl Default for DispatcherBuilder {
    fn default() -> Self {
        DispatcherBuilder {
            concurrency: DEFAULT_CONCURRENCY,
            retry_topic_check: RetryTopicCheck::default(),
            dead_letter_targets: DeadLetterTargets::default(),
        }
    }
}

impl DispatcherBuilder {
    /// The most handlers that may run at once, across all subscriptions
    /// (20 by default; zero is refused when the dispatcher is built).
    pub fn concurrency(mut self, limit: usize) -> Self {
        self.concurrency = limit;
        self
    }

    /// What `run()` does about retry topics that nothing on this dispatcher
    /// consumes, or that are consumed by subscriptions that ignore delays
    /// (warn through `tracing` by default).
    pub fn retry_topic_check(mut self, check: RetryTopicCheck) -> Self {
        self.retry_topic_check = check;
        self
    }

    /// Which dead letter topics a message's DEAD_LETTER_TOPIC property may
    /// choose (by default only those of this dispatcher's subscriptions).
    pub fn dead_letter_targets(mut self, targets: DeadLetterTargets) -> Self {
        self.dead_letter_targets = targets;
        self
    }

    /// Connects to Pulsar at `url` with the `pulsar` crate's default client
    /// settings.
    pub async fn connect(self, url: &str) -> Result<Dispatcher<PulsarTransport>, Error> {
        self.connect_with(pulsar::Pulsar::builder(url, TokioExecutor))
            .await
    }

    /// Connects with a `pulsar` client builder configured by the caller:
    /// authentication, TLS, timeouts and retry options are the crate's own.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), pulsar_dispatcher::Error> {
    /// use pulsar::{Authentication, Pulsar, TokioExecutor};
    /// use pulsar_dispatcher::Dispatcher;
    ///
    /// let client = Pulsar::builder("pulsar+ssl://pulsar.example.com:6651", TokioExecutor)
    ///     .with_auth(Authentication { name: "token".into(), data: b"secret".to_vec() })
    ///     .with_certificate_chain_file("/etc/ssl/certs/pulsar-ca.pem")
    ///     .expect("readable certificate");
    /// let dispatcher = Dispatcher::builder().connect_with(client).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(
        self,
        client: PulsarBuilder<TokioExecutor>,
    ) -> Result<Dispatcher<PulsarTransport>, Error> {
        let concurrency = self.checked_concurrency()?;
        let transport = PulsarTransport::from_builder(client)
            .await
            .map_err(Error::Connect)?;
        Ok(Dispatcher::new(transport, concurrency, self))
    }

    /// A dispatcher over any transport, such as
    /// [`MemoryTransport`](crate::transport::MemoryTransport) in tests.
    pub fn build<T: Transport>(self, transport: T) -> Result<Dispatcher<T>, Error> {
        Ok(Dispatcher::new(
            transport,
            self.checked_concurrency()?,
            self,
        ))
    }

    fn checked_concurrency(&self) -> Result<NonZeroUsize, Error> {
        NonZeroUsize::new(self.concurrency).ok_or(Error::ZeroConcurrency)
    }
}

/// Consumes Pulsar topics and dispatches their messages to async handlers
/// by priority, on the current thread.
///
/// A dispatcher lives on one thread: it must be created and run inside a
/// [`tokio::task::LocalSet`] on a runtime with time enabled, and it is not
/// `Send`:
///
/// ```compile_fail
/// fn assert_send<T: Send>() {}
/// assert_send::<pulsar_dispatcher::Dispatcher>();
/// ```
///
/// To use more cores, run one dispatcher per core, each with its own
/// runtime and connection.
pub struct Dispatcher<T: Transport = PulsarTransport> {
    core: Rc<Core<T>>,
}

/// A subscription registered before `run()`, with its consumer waiting for
/// its reader.
struct Registered<T: Transport> {
    info: SubscriptionInfo,
    context: Rc<SubscriptionContext<T>>,
    consumer: Option<T::Consumer>,
}

/// What a dispatcher knows about one of its subscriptions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscriptionInfo {
    /// The full topic name.
    pub topic: String,
    /// The subscription name, if one was given.
    pub subscription: Option<String>,
    /// The subscription type.
    pub subscription_type: SubType,
    /// The scheduling priority.
    pub priority: i64,
    /// The full name of the retry topic, if failures may be retried.
    pub retry_topic: Option<String>,
}

/// A subscription checked and resolved, not yet created.
struct Plan {
    topic: String,
    options: SubscribeOptions,
    routing: RoutingPolicy,
}

impl Plan {
    fn new(topic: &str, options: SubscribeOptions) -> Result<Self, Error> {
        let topic = full_topic_name(topic)?;
        let routing = options.routing_policy(&topic)?;
        Ok(Plan {
            topic,
            options,
            routing,
        })
    }

    fn info(&self) -> SubscriptionInfo {
        SubscriptionInfo {
            topic: self.topic.clone(),
            subscription: self.options.subscription.clone(),
            subscription_type: self.options.subscription_type,
            priority: self.options.priority,
            retry_topic: self.routing.retry.as_ref().map(|retry| retry.topic.clone()),
        }
    }
}

/// State shared by the dispatcher, its readers and its handler tasks.
pub(crate) struct Core<T: Transport> {
    transport: T,
    router: Router<T>,
    retry_topic_check: RetryTopicCheck,
    scheduler: RefCell<Scheduler<Delivery<T>>>,
    subscriptions: RefCell<Vec<Registered<T>>>,
    phase: Cell<Phase>,
    /// The first unexpected failure; `run()` returns it.
    failure: RefCell<Option<Error>>,
    closed: Notify,
}

impl Dispatcher<PulsarTransport> {
    /// Options for a new dispatcher.
    pub fn builder() -> DispatcherBuilder {
        DispatcherBuilder::default()
    }

    /// A dispatcher connected to `url` with the default concurrency of 20.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder().connect(url).await
    }
}

impl<T: Transport> Dispatcher<T> {
    fn new(transport: T, concurrency: NonZeroUsize, settings: DispatcherBuilder) -> Self {
        Dispatcher {
            core: Rc::new(Core {
                transport,
                router: Router::new(settings.dead_letter_targets),
                retry_topic_check: settings.retry_topic_check,
                scheduler: RefCell::new(Scheduler::new(concurrency)),
                subscriptions: RefCell::default(),
                phase: Cell::new(Phase::Idle),
                failure: RefCell::default(),
                closed: Notify::new(),
            }),
        }
    }

    /// The transport, for publishing or inspection.
    pub fn transport(&self) -> &T {
        &self.core.transport
    }

    /// Subscribes `handler` to `topic`.
    ///
    /// The handler receives each message by reference and returns `Ok` to
    /// have it acknowledged (after publishing its reply, if it returns one
    /// and the options name a reply topic) or `Err`, which the options route
    /// to a dead letter topic, a delayed retry or, by default, a negative
    /// acknowledgement after the subscription's negative-ack delay. A panic
    /// is always nacked. Handlers never ack themselves.
    ///
    /// Fails if the options are invalid (the error names the option), if
    /// the broker refuses the subscription, or if `run()` or `close()` has
    /// been called; a failed call leaves nothing behind.
    pub async fn subscribe<F, R, E>(
        &self,
        topic: &str,
        handler: F,
        options: SubscribeOptions,
    ) -> Result<(), Error>
    where
        F: AsyncFn(&Message) -> Result<R, E> + 'static,
        R: IntoReply + 'static,
        E: Into<HandlerError> + 'static,
    {
        let plan = Plan::new(topic, options)?;
        self.core
            .subscribe_all(vec![plan], Rc::new(HandlerTask::new(handler)))
            .await
    }

    /// Subscribes one handler to every topic of `family`, each at its
    /// family priority, with `options` applied to all (their priority is
    /// replaced by the family's, and with a retry sublevel each topic's
    /// retry topic is its level's).
    ///
    /// Every rule is checked, and every consumer created, before any
    /// subscription is registered: a call that fails leaves the dispatcher
    /// unchanged.
    pub async fn subscribe_family<L, S, F, R, E>(
        &self,
        family: &TopicFamily<L, S>,
        handler: F,
        options: SubscribeOptions,
    ) -> Result<(), Error>
    where
        L: PriorityLevel,
        S: PriorityLevel,
        F: AsyncFn(&Message) -> Result<R, E> + 'static,
        R: IntoReply + 'static,
        E: Into<HandlerError> + 'static,
    {
        if family.has_retry_sublevel() && options.has_retry_topic() {
            return Err(Error::InvalidOption {
                option: "retry_topic",
                reason: "a family takes either a retry sublevel or a retry topic, not both".into(),
            });
        }
        let plans = family
            .topics()?
            .into_iter()
            .map(|member| {
                let mut options = options.clone().priority(member.priority);
                if let Some(retry_topic) = member.retry_topic {
                    options = options.retry_topic(retry_topic);
                }
                Plan::new(&member.name, options)
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.core
            .subscribe_all(plans, Rc::new(HandlerTask::new(handler)))
            .await
    }

    /// The core and the subscription contexts, for white-box tests.
    #[cfg(test)]
    pub(crate) fn internals(&self) -> (Rc<Core<T>>, Vec<Rc<SubscriptionContext<T>>>) {
        let contexts = self
            .core
            .contexts()
            .iter()
            .map(|registered| registered.context.clone())
            .collect();
        (self.core.clone(), contexts)
    }

    /// The registered subscriptions, in the order they were made.
    pub fn subscriptions(&self) -> Vec<SubscriptionInfo> {
        self.core
            .contexts()
            .iter()
            .map(|registered| registered.info.clone())
            .collect()
    }

    /// A handle that can close this dispatcher from any task on the same
    /// thread, such as a signal handler.
    pub fn close_handle(&self) -> CloseHandle {
        CloseHandle {
            core: self.core.clone(),
        }
    }

    /// Runs until the dispatcher is closed.
    ///
    /// Starts the readers and the dispatch loop, then waits for shutdown to
    /// finish. Returns `Ok(())` after [`close`](Self::close) was requested,
    /// and the failure that forced a shutdown otherwise (a consumer stream
    /// that ended, for example). Fails at once if called twice or after
    /// `close()`.
    ///
    /// Dropping the returned future before it completes requests the same
    /// graceful shutdown as `close()`: the work runs in its own task on the
    /// `LocalSet`, so queued messages are still handled, in-flight handlers
    /// finish, and the connection is closed. If the `LocalSet` itself is
    /// dropped, every unacknowledged message stays with the broker, which
    /// redelivers it once the connection is gone.
    pub async fn run(&self) -> Result<(), Error> {
        self.core.start()?;
        let stop_if_dropped = StopOnDrop(&*self.core);
        self.core.wait_closed().await;
        std::mem::forget(stop_if_dropped);
        match self.core.failure.borrow_mut().take() {
            Some(failure) => Err(failure),
            None => Ok(()),
        }
    }

    /// Shuts down gracefully and waits until shutdown has finished.
    ///
    /// Idempotent: every caller, concurrent ones included, waits for the
    /// same shutdown, and a caller dropped mid-way does not abort it. Do not
    /// await it from inside a handler: shutdown waits for in-flight handlers,
    /// so the handler would wait for itself. Without a prior `run()`, it
    /// closes the connection and leaves every message with the broker.
    pub async fn close(&self) {
        self.core.close().await
    }
}

impl<T: Transport> Drop for Dispatcher<T> {
    fn drop(&mut self) {
        if self.core.phase() == Phase::Running {
            self.core.request_stop();
        }
    }
}

/// Closes a [`Dispatcher`] from elsewhere on its thread. Cheap to clone.
///
/// ```no_run
/// # async fn example(dispatcher: pulsar_dispatcher::Dispatcher) {
/// let closer = dispatcher.close_handle();
/// tokio::task::spawn_local(async move {
///     tokio::signal::ctrl_c().await.ok();
///     closer.close().await;
/// });
/// dispatcher.run().await.expect("clean shutdown");
/// # }
/// ```
#[derive(Clone)]
pub struct CloseHandle {
    core: Rc<dyn Lifecycle>,
}

impl CloseHandle {
    /// The same as [`Dispatcher::close`].
    pub async fn close(&self) {
        self.core.clone().close_dyn().await
    }
}

/// The part of the core that a [`CloseHandle`] needs, without the transport
/// type.
trait Lifecycle {
    fn close_dyn(self: Rc<Self>) -> LocalBoxFuture<'static, ()>;
}

impl<T: Transport> Lifecycle for Core<T> {
    fn close_dyn(self: Rc<Self>) -> LocalBoxFuture<'static, ()> {
        Box::pin(async move { self.close().await })
    }
}

struct StopOnDrop<'a, T: Transport>(&'a Core<T>);

impl<T: Transport> Drop for StopOnDrop<'_, T> {
    fn drop(&mut self) {
        debug!("run() dropped; shutting down");
        self.0.request_stop();
    }
}

impl<T: Transport> Core<T> {
    pub(crate) fn phase(&self) -> Phase {
        self.phase.get()
    }

    pub(crate) fn scheduler(&self) -> RefMut<'_, Scheduler<Delivery<T>>> {
        self.scheduler.borrow_mut()
    }

    pub(crate) fn release_permit(&self) {
        self.scheduler().release_permit();
    }

    pub(crate) fn router(&self) -> &Router<T> {
        &self.router
    }

    pub(crate) fn publish<'a>(
        &'a self,
        publish: Publish,
        message: &'a Message,
    ) -> LocalBoxFuture<'a, Verdict> {
        self.router.publish(&self.transport, publish, message)
    }

    /// Creates a consumer for every plan, then registers them all at once;
    /// if any creation fails, or the dispatcher started or closed in the
    /// meantime, closes what it created and registers nothing.
    async fn subscribe_all(
        &self,
        plans: Vec<Plan>,
        handler: Rc<dyn Spawn<T>>,
    ) -> Result<(), Error> {
        let Some(first) = plans.first() else {
            return Ok(());
        };
        self.accepting_subscriptions(&first.topic)?;
        let mut consumers = Vec::with_capacity(plans.len());
        for plan in &plans {
            match self.transport.subscribe(&plan.topic, &plan.options).await {
                Ok(consumer) => consumers.push(consumer),
                Err(source) => {
                    close_consumers::<T>(consumers, "of a failed subscribe").await;
                    return Err(Error::Subscribe {
                        topic: plan.topic.clone(),
                        source,
                    });
                }
            }
        }
        if let Err(refused) = self.accepting_subscriptions(&first.topic) {
            close_consumers::<T>(consumers, "of a refused subscribe").await;
            return Err(refused);
        }
        for (plan, consumer) in plans.into_iter().zip(consumers) {
            self.register(plan, handler.clone(), consumer);
        }
        Ok(())
    }

    fn register(&self, plan: Plan, handler: Rc<dyn Spawn<T>>, consumer: T::Consumer) {
        let info = plan.info();
        let key = self.scheduler().add_subscription(plan.options.priority);
        self.router.register(&plan.routing);
        let context = SubscriptionContext::new(
            key,
            plan.topic.into(),
            handler,
            plan.options.negative_ack_redelivery_delay,
            plan.routing,
        );
        self.subscriptions.borrow_mut().push(Registered {
            info,
            context: Rc::new(context),
            consumer: Some(consumer),
        });
    }

    fn contexts(&self) -> Ref<'_, Vec<Registered<T>>> {
        self.subscriptions.borrow()
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

    /// Moves from `Idle` to `Running` and spawns the engine.
    fn start(self: &Rc<Self>) -> Result<(), Error> {
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
        let consumers: Vec<_> = self
            .subscriptions
            .borrow_mut()
            .iter_mut()
            .map(|registered| {
                let consumer = registered
                    .consumer
                    .take()
                    .expect("consumer not yet started");
                (registered.context.clone(), consumer)
            })
            .collect();
        info!(subscriptions = consumers.len(), "dispatcher running");
        tokio::task::spawn_local(self.clone().engine(consumers));
        Ok(())
    }

    fn check_retry_topics(&self) -> Result<(), Error> {
        if self.retry_topic_check == RetryTopicCheck::Ignore {
            return Ok(());
        }
        let subscriptions: Vec<SubscriptionInfo> =
            self.contexts().iter().map(|r| r.info.clone()).collect();
        let problems = retry_topic_problems(&subscriptions);
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

    /// Readers, dispatch loop and the shutdown that follows it.
    async fn engine(self: Rc<Self>, consumers: Vec<(Rc<SubscriptionContext<T>>, T::Consumer)>) {
        let readers: Vec<_> = consumers
            .into_iter()
            .map(|(context, consumer)| {
                let topic = context.topic.clone();
                let reader =
                    tokio::task::spawn_local(reader::read(self.clone(), context, consumer));
                (topic, reader)
            })
            .collect();
        self.dispatch_until_closed().await;
        debug!(
            in_flight = self.scheduler().in_flight(),
            "queued messages dispatched; waiting for handlers"
        );
        poll_fn(|cx| self.scheduler().poll_idle(cx)).await;
        debug!("handlers finished; readers settle and close");
        self.phase.set(Phase::Drained);
        self.wake_readers();
        for (topic, reader) in readers {
            if let Err(join_error) = reader.await {
                self.fail(Error::ReaderFailed {
                    topic: topic.to_string(),
                    reason: join_error.to_string(),
                });
            }
        }
        self.close_transport().await;
    }

    /// Takes a permit, then the best waiting message, and spawns its task,
    /// until the scheduler is closed and empty.
    async fn dispatch_until_closed(self: &Rc<Self>) {
        while let Some((_, delivery)) = poll_fn(|cx| self.scheduler().poll_dispatch(cx)).await {
            let Delivery {
                subscription,
                message,
            } = delivery;
            let in_flight = InFlight::new(self.clone(), subscription.clone(), message);
            subscription.handler.spawn(in_flight);
        }
    }

    async fn close_transport(&self) {
        self.router.close().await;
        if let Err(error) = self.transport.close().await {
            error!(%error, "closing the connection failed");
            self.fail(Error::Close(error));
        }
        self.phase.set(Phase::Closed);
        self.closed.notify_waiters();
        info!("dispatcher closed");
    }

    /// Records an unexpected failure and starts shutdown.
    pub(crate) fn fail(&self, failure: Error) {
        error!(error = %failure, "dispatcher failure; shutting down");
        self.failure.borrow_mut().get_or_insert(failure);
        self.request_stop();
    }

    /// Starts shutdown if the dispatcher is running; otherwise does nothing.
    fn request_stop(&self) {
        if self.phase() != Phase::Running {
            return;
        }
        self.phase.set(Phase::Stopping);
        self.scheduler().close();
        self.wake_readers();
    }

    fn wake_readers(&self) {
        for registered in self.contexts().iter() {
            registered.context.wake_reader();
        }
    }

    async fn close(self: &Rc<Self>) {
        match self.phase() {
            Phase::Idle => {
                self.phase.set(Phase::Stopping);
                let unstarted: Vec<_> = self
                    .subscriptions
                    .borrow_mut()
                    .iter_mut()
                    .filter_map(|registered| registered.consumer.take())
                    .collect();
                // The work happens in its own task so that a caller dropped
                // mid-way does not abort it.
                let core = self.clone();
                tokio::task::spawn_local(async move {
                    close_consumers::<T>(unstarted, "that never started").await;
                    core.close_transport().await;
                });
            }
            Phase::Running => self.request_stop(),
            Phase::Stopping | Phase::Drained | Phase::Closed => {}
        }
        self.wait_closed().await
    }

    async fn wait_closed(&self) {
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
