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
use pulsar::{PulsarBuilder, TokioExecutor};
use tokio::sync::Notify;
use tracing::{debug, error, info, warn};

use crate::error::Error;
use crate::message::Message;
use crate::process::{HandlerError, HandlerTask, InFlight, IntoReply};
use crate::reader::{self, Delivery, SubscriptionContext};
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
}

impl Default for DispatcherBuilder {
    fn default() -> Self {
        DispatcherBuilder {
            concurrency: DEFAULT_CONCURRENCY,
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
        Ok(Dispatcher::new(transport, concurrency))
    }

    /// A dispatcher over any transport, such as
    /// [`MemoryTransport`](crate::transport::MemoryTransport) in tests.
    pub fn build<T: Transport>(self, transport: T) -> Result<Dispatcher<T>, Error> {
        Ok(Dispatcher::new(transport, self.checked_concurrency()?))
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
    context: Rc<SubscriptionContext<T>>,
    consumer: Option<T::Consumer>,
}

/// State shared by the dispatcher, its readers and its handler tasks.
pub(crate) struct Core<T: Transport> {
    transport: T,
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
    fn new(transport: T, concurrency: NonZeroUsize) -> Self {
        Dispatcher {
            core: Rc::new(Core {
                transport,
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
    /// The handler receives each message by reference and returns
    /// `Ok` to have it acknowledged or `Err` to have it negatively
    /// acknowledged (after the subscription's negative-ack delay); a panic
    /// counts as an error. Handlers never ack themselves.
    ///
    /// Fails if the options are invalid, if the broker refuses the
    /// subscription, or if `run()` or `close()` has been called; a failed
    /// call leaves nothing behind.
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
        let topic = full_topic_name(topic)?;
        options.validate()?;
        self.core.accepting_subscriptions(&topic)?;
        let mut consumer = self
            .core
            .transport
            .subscribe(&topic, &options)
            .await
            .map_err(|source| Error::Subscribe {
                topic: topic.clone(),
                source,
            })?;
        // `run()` or `close()` may have been called while the broker answered.
        if let Err(refused) = self.core.accepting_subscriptions(&topic) {
            if let Err(error) = consumer.close().await {
                warn!(%topic, %error, "closing a refused consumer failed");
            }
            return Err(refused);
        }
        let key = self.core.scheduler().add_subscription(options.priority);
        let context = SubscriptionContext::new(
            key,
            topic.into(),
            Box::new(HandlerTask::new(handler)),
            options.negative_ack_redelivery_delay,
        );
        self.core.subscriptions.borrow_mut().push(Registered {
            context: Rc::new(context),
            consumer: Some(consumer),
        });
        Ok(())
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
        poll_fn(|cx| self.scheduler().poll_idle(cx)).await;
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
            let in_flight = InFlight::new(self.clone(), subscription.clone(), message.id.clone());
            subscription.handler.spawn(message, in_flight);
        }
    }

    async fn close_transport(&self) {
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
                    close_unstarted::<T>(unstarted).await;
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

async fn close_unstarted<T: Transport>(consumers: Vec<T::Consumer>) {
    for mut consumer in consumers {
        if let Err(error) = consumer.close().await {
            warn!(%error, "closing an unstarted consumer failed");
        }
    }
}
