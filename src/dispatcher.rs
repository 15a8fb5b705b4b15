//! The public API: building a dispatcher, subscribing, running and closing.
//!
//! [`Dispatcher`] is a handle on the engine (see `engine`), which owns the
//! transport, the scheduler, the subscriptions and the lifecycle. This
//! module checks what users ask for, resolves it into what the engine runs,
//! and turns the engine's lifecycle into `run()`, `close()` and
//! [`CloseHandle`]. Shutdown walks the phases `Running → Stopping → Drained
//! → Closed`: nothing new is received and the scheduler refuses new
//! messages; what is already queued is still dispatched; once no handler is
//! in flight, held nacks are sent and the consumers closed; last, the
//! producers and the connection are closed, whatever failed before.

use std::num::NonZeroUsize;
use std::rc::Rc;
use std::time::Duration;

use pulsar::{PulsarBuilder, TokioExecutor};
use tracing::debug;

use crate::engine::{Control, DispatcherStats, Engine, EngineSettings, Health, SubscriptionId};
use crate::error::{checked_duration, Error, MAX_CONCURRENCY};
use crate::family::{PriorityLevel, TopicFamily};
use crate::handle::{CloseHandle, FamilyHandle, SubscriptionHandle};
use crate::message::Message;
use crate::options::SubscribeOptions;
use crate::outcome::{HandlerError, IntoReply, SubscriptionInfo};
use crate::routing::{DeadLetterTargets, RetryTopicCheck};
use crate::scheduler::SchedulingPolicy;
use crate::transport::{PulsarTransport, Transport, DEFAULT_MAX_MESSAGE_SIZE};

/// The concurrency limit unless told otherwise.
pub const DEFAULT_CONCURRENCY: usize = 20;

/// How often the numbers are published to the `metrics` recorder unless
/// told otherwise.
pub const DEFAULT_METRICS_INTERVAL: Duration = Duration::from_secs(1);

/// How many times [`DispatcherBuilder::connect`] lets the `pulsar` crate
/// retry an operation the broker answered with a retryable error.
pub const CONNECT_OPERATION_RETRIES: u32 = 12;

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
#[must_use = "a builder does nothing until `connect` or `build` is called"]
pub struct DispatcherBuilder {
    concurrency: usize,
    settings: EngineSettings,
    max_message_size: usize,
}

impl Default for DispatcherBuilder {
    fn default() -> Self {
        DispatcherBuilder {
            concurrency: DEFAULT_CONCURRENCY,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            settings: EngineSettings {
                metrics_interval: Some(DEFAULT_METRICS_INTERVAL),
                ..EngineSettings::default()
            },
        }
    }
}

impl DispatcherBuilder {
    /// The most handlers that may run at once, across all subscriptions
    /// (20 by default; zero and more than [`MAX_CONCURRENCY`] are refused
    /// when the dispatcher is built).
    pub fn concurrency(mut self, limit: usize) -> Self {
        self.concurrency = limit;
        self
    }

    /// What `run()` does about retry topics that nothing on this dispatcher
    /// consumes, or that are consumed by subscriptions that ignore delays
    /// (warn through `tracing` by default).
    pub fn retry_topic_check(mut self, check: RetryTopicCheck) -> Self {
        self.settings.retry_topic_check = check;
        self
    }

    /// Which dead letter topics a message's DEAD_LETTER_TOPIC property may
    /// choose (by default only those of this dispatcher's subscriptions).
    pub fn dead_letter_targets(mut self, targets: DeadLetterTargets) -> Self {
        self.settings.dead_letter_targets = targets;
        self
    }

    /// How the next message is chosen among priority levels that have work:
    /// strictly by priority (the default), by weighted shares, or with
    /// aging. See [`SchedulingPolicy`].
    pub fn scheduling(mut self, policy: SchedulingPolicy) -> Self {
        self.settings.scheduling = policy;
        self
    }

    /// Keeps `permits` of the concurrency limit for messages at `priority`
    /// or better, so that a flood of worse work never takes them all: a
    /// message at a worse level starts only while more permits are free
    /// than are reserved for better levels. Reservations add up and must
    /// leave at least one permit unreserved, or a level worse than every
    /// reservation could never run (checked when the dispatcher is built).
    pub fn reserve(mut self, priority: i64, permits: usize) -> Self {
        self.settings.reservations.push((priority, permits));
        self
    }

    /// Measures how long each message waits in its slot and how long its
    /// handler runs (off by default: it reads the clock three times per
    /// message). The results are in [`SubscriptionStats::slot_wait`] and
    /// [`SubscriptionStats::handler_duration`], and recorded as the
    /// `pulsar_dispatcher_slot_wait_seconds` and
    /// `pulsar_dispatcher_handler_duration_seconds` histograms.
    ///
    /// [`SubscriptionStats::slot_wait`]: crate::SubscriptionStats::slot_wait
    /// [`SubscriptionStats::handler_duration`]: crate::SubscriptionStats::handler_duration
    pub fn timings(mut self, on: bool) -> Self {
        self.settings.timings = on;
        self
    }

    /// How often the counters and gauges are published to the `metrics`
    /// facade's recorder (every second by default; `None`: never). They are
    /// kept in the dispatcher and published as what they grew by since the
    /// last publish, so the data path never touches the recorder. Install the recorder before the
    /// dispatcher is built: its permits gauge is registered then, and a
    /// subscription's metrics at subscribe.
    pub fn metrics_interval(mut self, interval: Option<Duration>) -> Self {
        self.settings.metrics_interval = interval;
        self
    }

    /// How long any shutdown may wait for running handlers (none by
    /// default: it waits for them). Past it, the handlers still running are
    /// cancelled (their futures dropped) and their messages nacked, messages
    /// still waiting are nacked, the consumers and the connection are closed
    /// all the same, and `run()` returns
    /// [`Error::HandlersCancelled`]. A handler that returned before it and
    /// whose reply, retry or dead letter is being published gets
    /// [`PUBLISH_GRACE`](crate::PUBLISH_GRACE) more to finish.
    /// [`CloseHandle::close_within`] sets a deadline for one shutdown.
    pub fn shutdown_timeout(mut self, limit: Duration) -> Self {
        self.settings.shutdown_timeout = Some(limit);
        self
    }

    /// The largest message a reply, retry or dead letter may be on the
    /// Pulsar transport of [`connect`](Self::connect) and
    /// [`connect_with`](Self::connect_with): the broker's `maxMessageSize`,
    /// [`DEFAULT_MAX_MESSAGE_SIZE`] (5 MiB) unless its operators changed it.
    /// A message counts its payload, properties and keys, and 1 KiB for the
    /// headers around them. A larger one is not sent (a broker drops the
    /// connection such a frame arrives on, with every consumer and producer
    /// sharing it; a bookie whose frame limit is that size refuses an entry
    /// a little smaller, and the broker retries the write for ever): the publish
    /// fails with [`TransportError::MessageTooLarge`](crate::TransportError::MessageTooLarge)
    /// and the original is nacked. `connect` refuses zero.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// Connects to Pulsar at `url` with the `pulsar` crate's default client
    /// settings, except that operations the broker answers with a
    /// retryable error ("service not ready", "consumer busy", ...) are
    /// retried at most 12 times (5 s apart) rather than for ever. A broker
    /// that cannot be reached fails it after the crate's own connection
    /// retries (about 40 s against a port that refuses connections): bound
    /// it with `tokio::time::timeout`, or set the crate's
    /// `ConnectionRetryOptions` through
    /// [`connect_with`](Self::connect_with). A `url` that is not
    /// `pulsar://` or `pulsar+ssl://` is refused at once, as the option
    /// `url` (the crate would only fail to look it up).
    pub async fn connect(self, url: &str) -> Result<Dispatcher<PulsarTransport>, Error> {
        check_service_url(url)?;
        let retries = pulsar::OperationRetryOptions {
            max_retries: Some(CONNECT_OPERATION_RETRIES),
            ..Default::default()
        };
        self.connect_with(
            pulsar::Pulsar::builder(url, TokioExecutor).with_operation_retry_options(retries),
        )
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
        let concurrency = self.checked()?;
        if self.max_message_size == 0 {
            return Err(Error::InvalidOption {
                option: "max_message_size",
                reason: "must be more than zero bytes".into(),
            });
        }
        let transport = PulsarTransport::from_builder(client)
            .await
            .map_err(Error::Connect)?
            .with_max_message_size(self.max_message_size);
        Ok(self.dispatcher(transport, concurrency))
    }

    /// A dispatcher over any transport, such as
    /// [`MemoryTransport`](crate::transport::MemoryTransport) in tests.
    pub fn build<T: Transport>(self, transport: T) -> Result<Dispatcher<T>, Error> {
        let concurrency = self.checked()?;
        Ok(self.dispatcher(transport, concurrency))
    }

    fn dispatcher<T: Transport>(self, transport: T, concurrency: NonZeroUsize) -> Dispatcher<T> {
        Dispatcher {
            engine: Rc::new(Engine::new(transport, concurrency, self.settings)),
        }
    }

    /// Checks the settings together; returns the concurrency limit.
    fn checked(&self) -> Result<NonZeroUsize, Error> {
        let concurrency =
            NonZeroUsize::new(self.concurrency).ok_or_else(|| Error::InvalidOption {
                option: "concurrency",
                reason: "must be at least 1".to_owned(),
            })?;
        if concurrency.get() > MAX_CONCURRENCY {
            return Err(Error::InvalidOption {
                option: "concurrency",
                reason: format!("{concurrency} is more than MAX_CONCURRENCY ({MAX_CONCURRENCY})"),
            });
        }
        if let Some(limit) = self.settings.shutdown_timeout {
            checked_duration("shutdown_timeout", limit, false)?;
        }
        if let Some(interval) = self.settings.metrics_interval {
            checked_duration("metrics_interval", interval, false)?;
        }
        let reserved = self
            .settings
            .reservations
            .iter()
            .try_fold(0usize, |sum, &(_, permits)| sum.checked_add(permits));
        match reserved {
            Some(reserved) if reserved < concurrency.get() => Ok(concurrency),
            _ => Err(Error::InvalidOption {
                option: "reserve",
                reason: format!(
                    "{} permits reserved of a concurrency limit of {concurrency}; at least one must stay unreserved",
                    reserved.map_or_else(|| "more than usize::MAX".to_owned(), |n| n.to_string())
                ),
            }),
        }
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
    engine: Rc<Engine<T>>,
}

impl<T: Transport> std::fmt::Debug for Dispatcher<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("phase", &self.engine.phase())
            .field("subscriptions", &self.engine.subscription_infos())
            .finish()
    }
}

/// Refuses a broker URL of a scheme the `pulsar` crate cannot connect with
/// (an admin `http://` URL is the usual mistake).
fn check_service_url(url: &str) -> Result<(), Error> {
    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("pulsar" | "pulsar+ssl") => Ok(()),
        _ => Err(Error::InvalidOption {
            option: "url",
            reason: format!(
                "{url:?} is not a broker service URL: expected pulsar://host:6650 or pulsar+ssl://host:6651"
            ),
        }),
    }
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
    /// The transport, for publishing or inspection.
    pub fn transport(&self) -> &T {
        self.engine.transport()
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
    /// Works before and while the dispatcher runs; the subscription takes
    /// part in the next pick. Returns a handle to change its priority or
    /// remove it again ([`unsubscribe`](Self::unsubscribe)).
    ///
    /// Fails if the options are invalid (the error names the option), if
    /// the broker refuses the subscription or one of the topics it publishes
    /// to, or if the dispatcher is shutting down or closed; a failed call
    /// leaves nothing behind.
    pub async fn subscribe<F, R, E>(
        &self,
        topic: &str,
        handler: F,
        options: SubscribeOptions,
    ) -> Result<SubscriptionHandle, Error>
    where
        F: AsyncFn(&Message) -> Result<R, E> + 'static,
        R: IntoReply + 'static,
        E: Into<HandlerError> + 'static,
    {
        let spec = options.resolve(topic)?;
        let full_topic = spec.consumer.topic.clone();
        let ids = self.engine.subscribe_all(vec![spec], handler).await?;
        Ok(self.handle(ids[0], &full_topic))
    }

    fn handle(&self, id: SubscriptionId, topic: &str) -> SubscriptionHandle {
        SubscriptionHandle::new(&self.control(), id, topic)
    }

    fn control(&self) -> Rc<dyn Control> {
        self.engine.clone()
    }

    /// Removes a subscription, while the others go on: it stops receiving,
    /// the messages it holds that have not started go back to the broker
    /// at once (nacked: under strict priority they could otherwise wait for
    /// every better backlog), its running handlers
    /// finish and their messages are settled, held nacks are sent at once,
    /// and its consumer is closed, with the producers no other subscription
    /// publishes with; then its place is free for reuse. Returns
    /// once all that is done. Fails with [`Error::UnknownSubscription`] if
    /// the handle is not this dispatcher's or the subscription is gone
    /// (unsubscribed already); after `close` it returns `Ok` at once, the
    /// shutdown having done all of that.
    pub async fn unsubscribe(&self, handle: SubscriptionHandle) -> Result<(), Error> {
        if !handle.belongs_to(&self.control()) || !self.engine.unsubscribe(handle.id()).await {
            return Err(handle.unknown());
        }
        Ok(())
    }

    /// Removes every subscription of a topic family, together (see
    /// [`unsubscribe`](Self::unsubscribe)).
    pub async fn unsubscribe_family(&self, family: FamilyHandle) -> Result<(), Error> {
        let removals = family
            .into_members()
            .into_iter()
            .map(|member| self.unsubscribe(member));
        futures::future::join_all(removals)
            .await
            .into_iter()
            .collect()
    }

    /// Subscribes one handler to every topic of `family`, each at its
    /// family priority, with `options` applied to all (their priority is
    /// replaced by the family's, and with a retry sublevel each topic's
    /// retry topic is its level's).
    ///
    /// Every rule is checked, and every consumer created, before any
    /// subscription is registered: a call that fails leaves the dispatcher
    /// unchanged. Works before and while the dispatcher runs; the returned
    /// handle removes the family as a unit
    /// ([`unsubscribe_family`](Self::unsubscribe_family)).
    pub async fn subscribe_family<L, S, F, R, E>(
        &self,
        family: &TopicFamily<L, S>,
        handler: F,
        options: SubscribeOptions,
    ) -> Result<FamilyHandle, Error>
    where
        L: PriorityLevel,
        S: PriorityLevel,
        F: AsyncFn(&Message) -> Result<R, E> + 'static,
        R: IntoReply + 'static,
        E: Into<HandlerError> + 'static,
    {
        if family.has_retry_sublevel() && !options.has_retry_errors() {
            return Err(Error::InvalidOption {
                option: "retry_errors",
                reason: "a family with a retry sublevel needs retry_errors: the errors that retry"
                    .into(),
            });
        }
        if family.has_retry_sublevel() && options.has_retry_topic() {
            return Err(Error::InvalidOption {
                option: "retry_topic",
                reason: "a family takes either a retry sublevel or a retry topic, not both".into(),
            });
        }
        let specs = family
            .topics()?
            .into_iter()
            .map(|member| {
                let mut options = options.clone().priority(member.priority);
                if let Some(retry_topic) = member.retry_topic {
                    options = options.retry_topic(retry_topic);
                }
                options.resolve(&member.name)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let topics: Vec<String> = specs
            .iter()
            .map(|spec| spec.consumer.topic.clone())
            .collect();
        let ids = self.engine.subscribe_all(specs, handler).await?;
        let members = ids
            .into_iter()
            .zip(topics)
            .map(|(id, topic)| self.handle(id, &topic))
            .collect();
        Ok(FamilyHandle::new(members))
    }

    /// The registered subscriptions, in the order they were made.
    pub fn subscriptions(&self) -> Vec<SubscriptionInfo> {
        self.engine.subscription_infos()
    }

    /// The counters of every subscription, and how many handlers run.
    pub fn stats(&self) -> DispatcherStats {
        self.engine.stats()
    }

    /// Where the dispatcher is in its life, and whether each subscription
    /// is receiving: for liveness and readiness checks.
    pub fn health(&self) -> Health {
        self.engine.health()
    }

    /// A handle that can close this dispatcher from any task on the same
    /// thread, such as a signal handler.
    pub fn close_handle(&self) -> CloseHandle {
        CloseHandle::new(&self.control())
    }

    /// Runs until the dispatcher is closed.
    ///
    /// Starts receiving and dispatching (the engine task), then waits for
    /// shutdown to
    /// finish. Returns `Ok(())` after [`close`](Self::close) was requested
    /// (unless its deadline cancelled handlers,
    /// [`Error::HandlersCancelled`], or closing the connection failed,
    /// [`Error::Close`]), and the failure that forced a shutdown otherwise
    /// (a consumer stream that ended, for example). Fails at once if called twice or after
    /// `close()`.
    ///
    /// Dropping the returned future before it completes requests the same
    /// graceful shutdown as `close()`: the work runs in its own task on the
    /// `LocalSet`, so queued messages are still handled, in-flight handlers
    /// finish, and the connection is closed. If the `LocalSet` itself is
    /// dropped, every unacknowledged message stays with the broker, which
    /// redelivers it once the connection is gone.
    pub async fn run(&self) -> Result<(), Error> {
        self.engine.start()?;
        let stop_if_dropped = StopOnDrop(&*self.engine);
        self.engine.wait_closed().await;
        std::mem::forget(stop_if_dropped);
        if let Some(failure) = self.engine.take_failure() {
            return Err(failure);
        }
        match self.engine.cancelled() {
            0 => Ok(()),
            cancelled => Err(Error::HandlersCancelled { cancelled }),
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
        self.engine.close().await
    }

    /// Like [`close`](Self::close), but cancels the handlers still running
    /// after `limit` (their messages are nacked) and closes all the same;
    /// returns how many handlers were cancelled (messages handed to a
    /// worker and not started yet count too). A reply, retry or dead
    /// letter being published at `limit` for a handler that had returned
    /// gets [`PUBLISH_GRACE`](crate::PUBLISH_GRACE) more. A limit beyond
    /// [`MAX_DURATION`](crate::MAX_DURATION) is cut to it.
    pub async fn close_within(&self, limit: Duration) -> usize {
        self.engine.close_within(limit).await
    }
}

impl<T: Transport> Drop for Dispatcher<T> {
    fn drop(&mut self) {
        self.engine.request_stop();
    }
}

struct StopOnDrop<'a, T: Transport>(&'a Engine<T>);

impl<T: Transport> Drop for StopOnDrop<'_, T> {
    fn drop(&mut self) {
        debug!("run() dropped; shutting down");
        self.0.request_stop();
    }
}
