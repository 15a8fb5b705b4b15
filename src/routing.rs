//! Failure routing: what happens to a message after its handler returns.
//!
//! A success is acked, after its reply (if any) has been published. A
//! failure is classified: a *fatal* error sends the message to a dead letter
//! topic, a *retry* error republishes it to the retry topic with a broker
//! delay, anything else (and any panic) nacks it; a handler past its
//! processing deadline is treated as a retryable failure. Republished
//! messages keep
//! payload, properties, keys and event time, and carry the property names
//! Pulsar's Java client uses (RECONSUMETIMES, REAL_TOPIC, ORIGIN_MESSAGE_ID,
//! DELAY_TIME) plus the Python dispatcher's DEAD_LETTER_TOPIC. The original is
//! acked only once the republish has succeeded. A subscription's retry,
//! dead letter and reply producers are created when it subscribes, and
//! shared; those only a DEAD_LETTER_TOPIC property names are created on
//! first use (at most `UNUSED_PRODUCERS` of them kept unused).

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::LocalBoxFuture;
use pulsar::SubType;
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::backoff::Backoff;
use crate::classify::ErrorClass;
use crate::error::{Error, ErrorChain, RetryTopicProblem, TransportError};
use crate::log_limit::LogLimit;
use crate::message::Message;
use crate::outcome::{panic_text, Outcome, SubscriptionInfo, Verdict};
use crate::topic::{full_topic_name, is_non_persistent, overlap, refuse_non_persistent};
use crate::transport::{OutgoingMessage, Producer, Transport};

/// How many times a message has been retried (Java client convention).
pub const RECONSUMETIMES: &str = "RECONSUMETIMES";
/// The topic a republished message was first consumed from.
pub const REAL_TOPIC: &str = "REAL_TOPIC";
/// The id of the original message, as `ledger:entry:partition[:batch]`.
pub const ORIGIN_MESSAGE_ID: &str = "ORIGIN_MESSAGE_ID";
/// The delay, in milliseconds, a retry was scheduled with.
pub const DELAY_TIME: &str = "DELAY_TIME";
/// The dead letter topic of the subscription that first retried a message.
pub const DEAD_LETTER_TOPIC: &str = "DEAD_LETTER_TOPIC";

/// Which dead letter topics a message's DEAD_LETTER_TOPIC property may
/// choose.
///
/// Anyone who can publish to a retry topic can set that property. By
/// default the dispatcher honours it only when it names the dead letter
/// topic of one of its own subscriptions; otherwise the message goes to the
/// dead letter topic of the subscription that received it, with a warning.
#[derive(Clone, Debug, Default)]
#[must_use]
pub struct DeadLetterTargets {
    any: bool,
    allowed: HashSet<String>,
}

impl DeadLetterTargets {
    /// Only the dead letter topics of this dispatcher's subscriptions (the
    /// default).
    pub fn known() -> Self {
        Self::default()
    }

    /// Also honour `topic` (for subscriptions that live in another service).
    /// A non-persistent topic is refused: it keeps nothing for a subscriber
    /// that is not connected, and the original is acked once published.
    pub fn allow(mut self, topic: &str) -> Result<Self, Error> {
        let full = full_topic_name(topic)?;
        refuse_non_persistent("dead_letter_targets", &full)?;
        self.allowed.insert(full);
        Ok(self)
    }

    /// Honour whatever the property names, as the Python dispatcher does.
    pub fn any() -> Self {
        DeadLetterTargets {
            any: true,
            allowed: HashSet::new(),
        }
    }
}

/// What `run()` does when the retry topic check finds a problem.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryTopicCheck {
    /// Log each problem as a `tracing` warning and start (the default).
    #[default]
    Warn,
    /// Start without checking, for example when another service consumes
    /// the retry topics.
    Ignore,
    /// Refuse to start: `run()` returns [`Error::RetryTopics`].
    Refuse,
}

/// Checks every retry topic against the subscriptions that consume it.
/// Names are full names, so `orders-retry` and
/// `persistent://public/default/orders-retry` are the same topic.
pub(crate) fn retry_topic_problems(subscriptions: &[SubscriptionInfo]) -> Vec<RetryTopicProblem> {
    let mut problems = Vec::new();
    let mut checked = HashSet::new();
    for subscription in subscriptions {
        let Some(retry_topic) = &subscription.retry_topic else {
            continue;
        };
        let consumers: Vec<_> = subscriptions
            .iter()
            .filter(|s| &s.topic == retry_topic)
            .collect();
        if consumers.is_empty() {
            problems.push(RetryTopicProblem::NotConsumed {
                retry_topic: retry_topic.clone(),
                topic: subscription.topic.clone(),
            });
        }
        if !checked.insert(retry_topic) {
            continue;
        }
        for consumer in consumers {
            if !matches!(
                consumer.subscription_type,
                SubType::Shared | SubType::KeyShared
            ) {
                problems.push(RetryTopicProblem::DelaysIgnored {
                    retry_topic: retry_topic.clone(),
                    subscription_type: consumer.subscription_type,
                });
            }
        }
    }
    problems
}

/// The retry half of a subscription's routing.
#[derive(Clone, Debug)]
pub(crate) struct RetryPolicy {
    pub(crate) topic: String,
    pub(crate) errors: ErrorClass,
    pub(crate) backoff: Backoff,
    pub(crate) max_retries: Option<u32>,
}

/// One subscription's routing, resolved to full topic names at subscribe.
#[derive(Clone, Debug, Default)]
pub(crate) struct RoutingPolicy {
    pub(crate) fatal: Option<ErrorClass>,
    pub(crate) retry: Option<RetryPolicy>,
    pub(crate) dead_letter_topic: Option<String>,
    pub(crate) reply_topic: Option<String>,
}

/// What to do with a handled message: settle it now, or publish first and
/// settle by the publish's result.
pub(crate) enum Action {
    Settle(Verdict),
    /// Boxed: a publish is the rare path, and the common one (a verdict)
    /// then stays a few bytes that cost nothing to move.
    Publish(Box<Publish>),
}

/// A reply, retry or dead letter to publish before settling.
pub(crate) struct Publish {
    kind: PublishKind,
    topic: String,
    outgoing: OutgoingMessage,
}

/// What a [`Publish`] is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PublishKind {
    Reply,
    Retry,
    DeadLetter,
}

impl PublishKind {
    fn describe(self) -> &'static str {
        match self {
            PublishKind::Reply => "reply",
            PublishKind::Retry => "retry",
            PublishKind::DeadLetter => "dead letter",
        }
    }
}

impl Publish {
    pub(crate) fn kind(&self) -> PublishKind {
        self.kind
    }
}

/// Where a failed message goes.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Nack,
    Retry,
    DeadLetter,
}

impl RoutingPolicy {
    /// The topics a subscription with this policy publishes to by itself,
    /// whose producers it makes at subscribe: its retry topic, its dead
    /// letter topic if it dead-letters (see `dead_letters_own`), its reply
    /// topic.
    pub(crate) fn producer_topics(&self) -> Vec<String> {
        let retry = self.retry.as_ref().map(|retry| &retry.topic);
        let dead_letters = self
            .dead_letters_own()
            .then_some(self.dead_letter_topic.as_ref())
            .flatten();
        [retry, dead_letters, self.reply_topic.as_ref()]
            .into_iter()
            .flatten()
            .cloned()
            .collect()
    }

    /// Whether the subscription itself can dead-letter: only a fatal error
    /// or the last of its retries does. Without either, its dead letter
    /// topic is only a name its retries carry, and no producer is made for
    /// it (the topic may not exist, or the client may not publish to it).
    fn dead_letters_own(&self) -> bool {
        self.fatal.is_some()
            || self
                .retry
                .as_ref()
                .is_some_and(|retry| retry.max_retries.is_some())
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static), message: &Message) -> Route {
        if self
            .fatal
            .as_ref()
            .is_some_and(|class| class.matches(error))
        {
            return Route::DeadLetter;
        }
        match &self.retry {
            Some(retry) if retry.errors.matches(error) => self.retry_route(message),
            _ => Route::Nack,
        }
    }

    /// A retry, or a dead letter once the retries are used up; a nack
    /// without a retry topic.
    fn retry_route(&self, message: &Message) -> Route {
        let Some(retry) = &self.retry else {
            return Route::Nack;
        };
        let exhausted = retry
            .max_retries
            .is_some_and(|max| reconsume_times(message) >= max);
        if exhausted {
            Route::DeadLetter
        } else {
            Route::Retry
        }
    }
}

/// The dispatcher-wide half of routing: shared producers and the dead
/// letter topics messages may choose.
pub(crate) struct Router<T: Transport> {
    producers: Producers<T>,
    targets: DeadLetterTargets,
    known_dead_letter_topics: RefCell<HashSet<String>>,
    /// Failed publishes are counted each and logged at most once an
    /// interval: an outage of a retry or dead letter topic fails every
    /// message that fails its handler.
    publish_failures_log: LogLimit,
    /// Whether a reply was dropped for want of a reply topic yet: the
    /// first is a warning, the rest debug lines, since the original's
    /// behaviour (returned bytes ignored) may be meant, by a handler shared
    /// with subscriptions that have a reply topic.
    dropped_a_reply: Cell<bool>,
}

impl<T: Transport> Router<T> {
    pub(crate) fn new(targets: DeadLetterTargets) -> Self {
        Router {
            producers: Producers::default(),
            targets,
            known_dead_letter_topics: RefCell::default(),
            publish_failures_log: LogLimit::default(),
            dropped_a_reply: Cell::new(false),
        }
    }

    pub(crate) fn register(&self, policy: &RoutingPolicy) {
        if let Some(topic) = &policy.dead_letter_topic {
            self.known_dead_letter_topics
                .borrow_mut()
                .insert(topic.clone());
        }
    }

    pub(crate) async fn close(&self) {
        self.producers.close_all().await
    }

    /// Gives up one use of each producer of `topics` (those a
    /// [`prepare`](Self::prepare) took), closing and forgetting a producer
    /// no subscription uses any more: a failed subscribe leaves nothing
    /// behind, and an unsubscribed subscription's producers go with it
    /// unless another subscription publishes there too. Boxed: a
    /// transport's close can be a large future (the `pulsar` crate's is,
    /// in debug builds), and a subscribe's own future would grow by it.
    pub(crate) fn release<'a>(&'a self, topics: &'a [String]) -> LocalBoxFuture<'a, ()> {
        Box::pin(self.producers.release(topics))
    }

    /// Creates (or finds) the producers `policy` publishes with, so that a
    /// topic the broker refuses fails at subscribe, and takes one use of
    /// each into `taken`. On failure, the topic and the transport's error.
    pub(crate) async fn prepare(
        &self,
        transport: &T,
        policy: &RoutingPolicy,
        taken: &mut TakenProducers<'_, T>,
    ) -> Result<(), (String, TransportError)> {
        for topic in policy.producer_topics() {
            taken.creating = Some(topic.clone());
            let acquired = self.producers.acquire(transport, &topic).await;
            taken.creating = None;
            match acquired {
                Ok(()) => taken.topics.push(topic),
                Err(error) => return Err((topic, error)),
            }
        }
        Ok(())
    }

    /// Publishes a reply, retry or dead letter, and gives the verdict its
    /// result calls for. Boxed: it is the rare path, and keeping its state
    /// out of every message's task keeps those tasks small.
    pub(crate) fn publish<'a>(
        &'a self,
        transport: &'a T,
        publish: Box<Publish>,
        message: &'a Message,
    ) -> LocalBoxFuture<'a, Verdict> {
        Box::pin(async move {
            let Publish {
                kind,
                topic,
                outgoing,
            } = *publish;
            let published = self.producers.send(transport, &topic, outgoing).await;
            self.ack_if_published(published, kind.describe(), &topic, message)
        })
    }

    /// A handler returned reply bytes, but its subscription has no reply
    /// topic: they are dropped (the message is acked all the same), as in
    /// the original, and said so.
    #[cold]
    #[inline(never)]
    fn reply_dropped(&self, message: &Message) {
        if self.dropped_a_reply.replace(true) {
            debug!(topic = %message.topic(), message_id = %message.id(), "no reply_topic: the handler's reply is dropped");
        } else {
            warn!(topic = %message.topic(), message_id = %message.id(), "the handler returned a reply, but the subscription has no reply_topic: the reply is dropped (this warning is not repeated)");
        }
    }

    /// What becomes of a handled message; logs failures. Success, the
    /// common case, is decided inline; the rest (logging, retry and dead
    /// letter) out of line.
    #[inline(always)]
    pub(crate) fn decide(
        &self,
        policy: &RoutingPolicy,
        message: &Message,
        outcome: Outcome,
    ) -> Action {
        match outcome {
            // The reply first: most handlers return none, and then the
            // policy is not read at all.
            Outcome::Succeeded(reply) => match (reply, &policy.reply_topic) {
                (Some(reply), Some(reply_topic)) => Action::Publish(Box::new(Publish {
                    kind: PublishKind::Reply,
                    topic: reply_topic.clone(),
                    outgoing: OutgoingMessage::new(reply),
                })),
                (Some(_), None) => {
                    self.reply_dropped(message);
                    Action::Settle(Verdict::Ack)
                }
                (None, _) => Action::Settle(Verdict::Ack),
            },
            failure => {
                // A failure's route runs the user's error classes and retry
                // backoff curve (which may be asked for any retry number up
                // to u32::MAX: whoever publishes to a retry topic sets it).
                // A panic in them fails this one message, not the dispatcher.
                let decided = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    self.decide_failure(policy, message, failure)
                }));
                decided.unwrap_or_else(|panic| {
                    let panic = panic_text(panic.as_ref());
                    error!(topic = %message.topic(), message_id = %message.id(), %panic, "routing the handler's failure panicked (in an error class or the retry backoff); nacking");
                    Action::Settle(Verdict::Nack)
                })
            }
        }
    }

    /// What becomes of a message whose handler failed, panicked or ran out
    /// of time.
    #[inline(never)]
    fn decide_failure(
        &self,
        policy: &RoutingPolicy,
        message: &Message,
        failure: Outcome,
    ) -> Action {
        let (topic, id) = (message.topic(), message.id());
        let (route, error): (Route, &dyn std::fmt::Display) = match &failure {
            Outcome::Panicked(panic) => {
                error!(%topic, message_id = %id, %panic, "handler panicked; nacking");
                return Action::Settle(Verdict::Nack);
            }
            Outcome::Failed(error) => (
                policy.classify(error.as_ref(), message),
                &ErrorChain(error.as_ref()),
            ),
            // A handler that ran out of time failed in a way worth trying
            // again later, whatever its error would have been.
            Outcome::TimedOut(deadline) => (policy.retry_route(message), deadline),
            Outcome::Succeeded(_) => unreachable!("decided inline"),
        };
        match route {
            Route::Nack => {
                warn!(%topic, message_id = %id, %error, "handler failed; nacking");
                Action::Settle(Verdict::Nack)
            }
            Route::Retry => {
                let retry = policy.retry.as_ref().expect("a retry route has a policy");
                let (outgoing, delay) =
                    retry_message(message, retry, policy.dead_letter_topic.as_deref());
                info!(%topic, message_id = %id, %error, retry_topic = %retry.topic, ?delay, "handler failed; retrying later");
                Action::Publish(Box::new(Publish {
                    kind: PublishKind::Retry,
                    topic: retry.topic.clone(),
                    outgoing,
                }))
            }
            Route::DeadLetter => match self.dead_letter_destination(policy, message) {
                Some(destination) => {
                    warn!(%topic, message_id = %id, %error, dead_letter_topic = %destination, "handler failed; dead-lettering");
                    Action::Publish(Box::new(Publish {
                        kind: PublishKind::DeadLetter,
                        topic: destination,
                        outgoing: dead_letter_message(message),
                    }))
                }
                None => {
                    warn!(%topic, message_id = %id, %error, "no dead letter topic; nacking");
                    Action::Settle(Verdict::Nack)
                }
            },
        }
    }

    fn ack_if_published(
        &self,
        published: Result<(), TransportError>,
        what: &str,
        destination: &str,
        message: &Message,
    ) -> Verdict {
        match published {
            Ok(()) => Verdict::Ack,
            Err(error) => {
                match self.publish_failures_log.admit(Instant::now()) {
                    Some(not_logged) => {
                        error!(topic = %message.topic(), message_id = %message.id(), %destination, error = %ErrorChain(&error), not_logged, "publishing the {what} failed; nacking")
                    }
                    None => {
                        debug!(topic = %message.topic(), message_id = %message.id(), %destination, error = %ErrorChain(&error), "publishing the {what} failed; nacking")
                    }
                }
                Verdict::Nack
            }
        }
    }

    /// The property's topic when it is trusted; the receiving
    /// subscription's own dead letter topic otherwise.
    ///
    /// The property is expanded like any topic name first: the Python
    /// dispatcher stamps the name as its user wrote it (`orders-sub-DLQ`),
    /// which is the same topic as its full form.
    ///
    /// Never the topic the message came from: a subscription that reads a
    /// dead letter topic (to inspect or reprocess) and dead-letters in turn
    /// would otherwise publish its failures back to itself, for ever, as
    /// messages retried before they were dead-lettered name it. Nor a
    /// non-persistent topic, which keeps nothing for a subscriber that is
    /// not connected while the original is acked.
    fn dead_letter_destination(&self, policy: &RoutingPolicy, message: &Message) -> Option<String> {
        let own = policy
            .dead_letter_topic
            .clone()
            .filter(|own| !overlap(own, message.topic()));
        let Some(named) = message.property(DEAD_LETTER_TOPIC) else {
            return own;
        };
        let why = match full_topic_name(named) {
            Ok(full) if overlap(&full, message.topic()) => "the topic the message came from",
            Ok(full) if is_non_persistent(&full) => "a non-persistent topic",
            Ok(full) => {
                let trusted = self.targets.any
                    || self.targets.allowed.contains(&full)
                    || self.known_dead_letter_topics.borrow().contains(&full);
                if trusted {
                    return Some(full);
                }
                "a topic this dispatcher does not trust"
            }
            Err(_) => "no topic",
        };
        warn!(
            topic = %message.topic(),
            message_id = %message.id(),
            requested = %named,
            "DEAD_LETTER_TOPIC names {why}; using the subscription's own"
        );
        own
    }
}

/// The retries a message has had so far; missing, malformed or negative
/// values count as none.
pub(crate) fn reconsume_times(message: &Message) -> u32 {
    message.property(RECONSUMETIMES).map_or(0, count_of)
}

/// A decimal count, around it whitespace and before it a sign, however many
/// digits it has (the Python original's `int()` has no limit either): a
/// count too large for a `u32` is `u32::MAX`, so that it is spent, not
/// started over.
fn count_of(value: &str) -> u32 {
    let value = value.trim();
    let (negative, digits) = match value.strip_prefix('-') {
        Some(digits) => (true, digits),
        None => (false, value.strip_prefix('+').unwrap_or(value)),
    };
    if negative || digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return 0;
    }
    digits.parse().unwrap_or(u32::MAX)
}

/// The republished form of `message`, bound for the retry topic, and the
/// delay it was given.
fn retry_message(
    message: &Message,
    retry: &RetryPolicy,
    dead_letter_topic: Option<&str>,
) -> (OutgoingMessage, Duration) {
    let attempt = reconsume_times(message).saturating_add(1);
    let delay = retry.backoff.delay(attempt);
    let mut outgoing = republished(message);
    set_property(&mut outgoing, RECONSUMETIMES, attempt.to_string());
    set_property(&mut outgoing, DELAY_TIME, delay.as_millis().to_string());
    if let Some(topic) = dead_letter_topic {
        set_property_if_absent(&mut outgoing, DEAD_LETTER_TOPIC, topic);
    }
    let due = SystemTime::now()
        .checked_add(delay)
        .unwrap_or(SystemTime::UNIX_EPOCH + Duration::from_millis(i64::MAX as u64));
    let due_ms = due
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    outgoing.deliver_at_time = Some(due_ms.min(i64::MAX as u128) as i64);
    (outgoing, delay)
}

fn dead_letter_message(message: &Message) -> OutgoingMessage {
    republished(message)
}

/// The message's content with its origin recorded, once: a message that
/// already names an origin keeps it.
fn republished(message: &Message) -> OutgoingMessage {
    let mut outgoing = OutgoingMessage::from_received(message);
    set_property_if_absent(&mut outgoing, REAL_TOPIC, message.topic());
    set_property_if_absent(&mut outgoing, ORIGIN_MESSAGE_ID, &message.id().to_string());
    outgoing
}

fn set_property(message: &mut OutgoingMessage, key: &str, value: String) {
    match message.properties.iter_mut().find(|(k, _)| k == key) {
        Some((_, existing)) => *existing = value,
        None => message.properties.push((key.to_owned(), value)),
    }
}

fn set_property_if_absent(message: &mut OutgoingMessage, key: &str, value: &str) {
    if message.property(key).is_none() {
        message.properties.push((key.to_owned(), value.to_owned()));
    }
}

/// The uses of producers a subscribe has taken so far
/// ([`Router::prepare`]). Given back if the subscribe fails, and also if its
/// caller drops it half way (a timeout or `select!` around the call): the
/// uses are then given up at once and the producers left without one are
/// closed by the next release or by close.
pub(crate) struct TakenProducers<'a, T: Transport> {
    router: &'a Router<T>,
    topics: Vec<String>,
    /// The topic whose producer is being made or found now, if any: what a
    /// subscribe that times out was waiting for.
    pub(crate) creating: Option<String>,
}

impl<'a, T: Transport> TakenProducers<'a, T> {
    pub(crate) fn new(router: &'a Router<T>) -> Self {
        TakenProducers {
            router,
            topics: Vec::new(),
            creating: None,
        }
    }

    /// The subscribe completed: its subscriptions hold these uses now.
    pub(crate) fn keep(mut self) {
        self.topics.clear();
    }

    /// The subscribe failed: gives the uses back, closing the producers
    /// no subscription uses any more.
    pub(crate) async fn give_back(mut self) {
        let topics = std::mem::take(&mut self.topics);
        self.router.release(&topics).await;
    }
}

impl<T: Transport> Drop for TakenProducers<'_, T> {
    fn drop(&mut self) {
        if !self.topics.is_empty() {
            self.router.producers.release_later(&self.topics);
        }
    }
}

/// One producer per topic, created on first use. Concurrent first uses wait
/// for the same creation; a failed creation leaves the cell empty, so the
/// next caller tries again.
struct Producers<T: Transport> {
    by_topic: RefCell<HashMap<String, SharedProducer<T::Producer>>>,
    /// Counts sends and creations, to tell which producer was used last.
    uses: Cell<u64>,
    /// Producers no subscription uses any more, taken out of the map
    /// where nothing could wait for their close: closed by the next
    /// release or by `close_all`.
    retired: RefCell<Vec<(String, ProducerCell<T::Producer>)>>,
    /// Set by `close_all`: no producer is made after it, and one whose
    /// creation was under way is closed by the task that made it.
    closed: Cell<bool>,
}

/// One topic's producer, created on first use, and how many subscriptions
/// publish with it by themselves. A producer only messages'
/// `DEAD_LETTER_TOPIC` properties asked for has none: at most
/// [`UNUSED_PRODUCERS`] of those are kept, the least recently used closed
/// first, since the names come from whoever publishes to a retry topic.
struct SharedProducer<P> {
    cell: ProducerCell<P>,
    users: usize,
    /// When it was last made or sent with, in [`Producers::tick`]s: one
    /// just made, its first send still to come, is not the oldest.
    last_used: Cell<u64>,
}

/// A topic's producer once made, shared by the tasks that send with it.
type ProducerCell<P> = Rc<OnceCell<P>>;

/// How many producers no subscription uses by itself are kept open.
const UNUSED_PRODUCERS: usize = 16;

impl<P> SharedProducer<P> {
    /// Whether only the map holds it: no task creates it or sends with it
    /// now. Only such an entry is ever taken out of the map (before the
    /// dispatcher closes), so a task that holds a producer's cell always
    /// finds it in the map again: no producer is made into a cell the map
    /// has let go, out of reach of `release` and `close_all`.
    fn is_idle(&self) -> bool {
        Rc::strong_count(&self.cell) == 1
    }
}

impl<T: Transport> Default for Producers<T> {
    fn default() -> Self {
        Producers {
            by_topic: RefCell::default(),
            uses: Cell::new(0),
            retired: RefCell::default(),
            closed: Cell::new(false),
        }
    }
}

impl<T: Transport> Producers<T> {
    async fn send(
        &self,
        transport: &T,
        topic: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        let cell = self.producer(transport, topic).await?;
        if let Some((unused, evicted)) = self.note_send(topic) {
            close_producer(&unused, &evicted.cell).await;
        }
        cell.get().expect("created").send(message).await
    }

    fn tick(&self) -> u64 {
        let now = self.uses.get() + 1;
        self.uses.set(now);
        now
    }

    /// Marks `topic`'s producer as used now; if that leaves more than
    /// [`UNUSED_PRODUCERS`] that no subscription uses, takes the least
    /// recently used of them out, to be closed.
    fn note_send(&self, topic: &str) -> Option<(String, SharedProducer<T::Producer>)> {
        let now = self.tick();
        let mut by_topic = self.by_topic.borrow_mut();
        let shared = by_topic.get(topic)?;
        shared.last_used.set(now);
        if shared.users > 0 {
            return None;
        }
        let unused = by_topic.values().filter(|shared| shared.users == 0);
        if unused.count() <= UNUSED_PRODUCERS {
            return None;
        }
        let oldest = by_topic
            .iter()
            .filter(|(_, shared)| shared.users == 0 && shared.is_idle())
            .min_by_key(|(_, shared)| shared.last_used.get())
            .map(|(name, _)| name.clone())?;
        by_topic.remove_entry(&oldest)
    }

    /// The topic's producer, created on first use; none once closed.
    async fn producer(
        &self,
        transport: &T,
        topic: &str,
    ) -> Result<ProducerCell<T::Producer>, TransportError> {
        if self.closed.get() {
            return Err(TransportError::Closed);
        }
        let cell = self.cell(topic);
        let made = Cell::new(false);
        let created = cell
            .get_or_try_init(|| {
                made.set(true);
                transport.create_producer(topic)
            })
            .await;
        if let Err(error) = created {
            drop(cell);
            self.forget_if_empty(topic);
            return Err(error);
        }
        if self.closed.get() {
            // `close_all` ran while this creation was under way (no await
            // lies between its end and here), so it found the cell empty:
            // what was made is this task's to close.
            if made.get() {
                close_producer(topic, &cell).await;
            }
            return Err(TransportError::Closed);
        }
        Ok(cell)
    }

    /// Forgets a topic whose producer could not be made, that no
    /// subscription uses and no other task is making, so that refused
    /// names leave nothing behind.
    fn forget_if_empty(&self, topic: &str) {
        let mut by_topic = self.by_topic.borrow_mut();
        if by_topic.get(topic).is_some_and(|shared| {
            shared.users == 0 && !shared.cell.initialized() && shared.is_idle()
        }) {
            by_topic.remove(topic);
        }
    }

    /// Creates (or finds) the topic's producer and counts one more user.
    async fn acquire(&self, transport: &T, topic: &str) -> Result<(), TransportError> {
        let _held = self.producer(transport, topic).await?;
        // Held, so still in the map (see `SharedProducer::is_idle`).
        let mut by_topic = self.by_topic.borrow_mut();
        let shared = by_topic
            .get_mut(topic)
            .expect("a held producer stays in the map");
        shared.users += 1;
        Ok(())
    }

    fn cell(&self, topic: &str) -> ProducerCell<T::Producer> {
        if let Some(shared) = self.by_topic.borrow().get(topic) {
            return shared.cell.clone();
        }
        self.by_topic
            .borrow_mut()
            .entry(topic.to_owned())
            .or_insert_with(|| SharedProducer {
                cell: Rc::default(),
                users: 0,
                last_used: Cell::new(self.tick()),
            })
            .cell
            .clone()
    }

    /// Counts one user less of each of `topics`, and closes and forgets
    /// the producers left without one (and those retired before).
    async fn release(&self, topics: &[String]) {
        self.release_later(topics);
        let retired = self.retired.take();
        for (topic, cell) in retired {
            close_producer(&topic, &cell).await;
        }
    }

    /// Counts one user less of each of `topics` and retires the producers
    /// left without one, without waiting: for a subscribe dropped by its
    /// caller.
    fn release_later(&self, topics: &[String]) {
        let mut by_topic = self.by_topic.borrow_mut();
        for topic in topics {
            match by_topic.get_mut(topic) {
                Some(shared) if shared.users > 1 || !shared.is_idle() => {
                    // Still used, or a send is under way with it (a dead
                    // letter another subscription's message named): kept,
                    // and left to the cap on unused ones.
                    shared.users = shared.users.saturating_sub(1);
                }
                Some(_) => {
                    let shared = by_topic.remove(topic).expect("just found");
                    self.retired.borrow_mut().push((topic.clone(), shared.cell));
                }
                None => {}
            }
        }
    }

    async fn close_all(&self) {
        self.closed.set(true);
        let mut all: Vec<(String, ProducerCell<T::Producer>)> = self.retired.take();
        all.extend(
            self.by_topic
                .borrow_mut()
                .drain()
                .map(|(topic, shared)| (topic, shared.cell)),
        );
        for (topic, cell) in all {
            close_producer(&topic, &cell).await;
        }
    }
}

async fn close_producer<P: Producer>(topic: &str, cell: &OnceCell<P>) {
    if let Some(producer) = cell.get() {
        if let Err(error) = producer.close().await {
            warn!(%topic, %error, "closing a producer failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backoff::default_backoff;
    use crate::message::MessageId;
    use crate::outcome::HandlerError;
    use crate::tests::run_local;
    use crate::transport::MemoryTransport;

    fn message(properties: &[(&str, &str)]) -> Message {
        let mut message = Message::new(
            "persistent://public/default/orders",
            MessageId::new(7, 3, -1, None),
            b"payload".to_vec(),
        )
        .with_partition_key("customer-1")
        .with_ordering_key(b"order-key".to_vec())
        .with_event_time(1234);
        for (key, value) in properties {
            message = message.with_property(*key, *value);
        }
        message
    }

    fn retry_policy(max_retries: Option<u32>) -> RetryPolicy {
        RetryPolicy {
            topic: "persistent://public/default/orders-retry".into(),
            errors: ErrorClass::matching(|e| e.to_string() == "retry"),
            backoff: Backoff::new(default_backoff),
            max_retries,
        }
    }

    #[test]
    fn a_first_retry_records_the_origin_and_the_dead_letter_topic() {
        let original = message(&[("app", "x")]);
        let now_ms = || {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_millis() as i64
        };
        let before = now_ms();
        let (outgoing, delay) = retry_message(&original, &retry_policy(None), Some("dlq-a"));
        let after = now_ms();
        assert_eq!(delay, Duration::from_secs(1));
        assert_eq!(outgoing.payload, b"payload");
        assert_eq!(outgoing.partition_key.as_deref(), Some("customer-1"));
        assert_eq!(outgoing.ordering_key.as_deref(), Some(&b"order-key"[..]));
        assert_eq!(outgoing.event_time, Some(1234));
        assert_eq!(outgoing.property("app"), Some("x"));
        assert_eq!(outgoing.property(RECONSUMETIMES), Some("1"));
        assert_eq!(outgoing.property(DELAY_TIME), Some("1000"));
        assert_eq!(
            outgoing.property(REAL_TOPIC),
            Some("persistent://public/default/orders")
        );
        assert_eq!(outgoing.property(ORIGIN_MESSAGE_ID), Some("7:3:-1"));
        assert_eq!(outgoing.property(DEAD_LETTER_TOPIC), Some("dlq-a"));
        // Due one second after the retry was made, read off the clock
        // between these two readings.
        let due = outgoing.deliver_at_time.unwrap();
        assert!(
            (before + 1000..=after + 1000).contains(&due),
            "due {due}, made between {before} and {after}"
        );
    }

    #[test]
    fn later_retries_keep_the_origin_and_count_up() {
        let retried = message(&[
            (RECONSUMETIMES, "3"),
            (REAL_TOPIC, "persistent://public/default/first"),
            (ORIGIN_MESSAGE_ID, "1:1:-1"),
            (DEAD_LETTER_TOPIC, "dlq-first"),
        ]);
        let (outgoing, delay) = retry_message(&retried, &retry_policy(None), Some("dlq-retry"));
        assert_eq!(delay, Duration::from_secs(8));
        assert_eq!(outgoing.property(RECONSUMETIMES), Some("4"));
        assert_eq!(
            outgoing.property(REAL_TOPIC),
            Some("persistent://public/default/first")
        );
        assert_eq!(outgoing.property(ORIGIN_MESSAGE_ID), Some("1:1:-1"));
        assert_eq!(outgoing.property(DEAD_LETTER_TOPIC), Some("dlq-first"));
        assert_eq!(
            outgoing
                .properties
                .iter()
                .filter(|(k, _)| k == RECONSUMETIMES)
                .count(),
            1
        );
    }

    #[test]
    fn malformed_or_negative_retry_counts_count_as_none() {
        for bad in ["-4", "many", "", "1.5", "-99999999999999999999", "+", "--1"] {
            assert_eq!(
                reconsume_times(&message(&[(RECONSUMETIMES, bad)])),
                0,
                "{bad:?}"
            );
        }
        assert_eq!(reconsume_times(&message(&[(RECONSUMETIMES, " 12 ")])), 12);
        assert_eq!(reconsume_times(&message(&[(RECONSUMETIMES, "+3")])), 3);
        for huge in ["99999999999", "99999999999999999999"] {
            assert_eq!(
                reconsume_times(&message(&[(RECONSUMETIMES, huge)])),
                u32::MAX,
                "{huge:?}"
            );
        }
    }

    #[test]
    fn fatal_wins_over_retry_and_exhausted_retries_are_dead_lettered() {
        let both = ErrorClass::matching(|_| true);
        let policy = RoutingPolicy {
            fatal: Some(ErrorClass::matching(|e| e.to_string() == "fatal")),
            retry: Some(RetryPolicy {
                errors: both,
                ..retry_policy(Some(2))
            }),
            dead_letter_topic: Some("dlq".into()),
            reply_topic: None,
        };
        let fatal: HandlerError = "fatal".into();
        let other: HandlerError = "other".into();
        assert_eq!(
            policy.classify(fatal.as_ref(), &message(&[])),
            Route::DeadLetter
        );
        assert_eq!(policy.classify(other.as_ref(), &message(&[])), Route::Retry);
        assert_eq!(
            policy.classify(other.as_ref(), &message(&[(RECONSUMETIMES, "1")])),
            Route::Retry
        );
        assert_eq!(
            policy.classify(other.as_ref(), &message(&[(RECONSUMETIMES, "2")])),
            Route::DeadLetter
        );
        let plain = RoutingPolicy::default();
        assert_eq!(plain.classify(fatal.as_ref(), &message(&[])), Route::Nack);
    }

    #[test]
    fn dead_letters_keep_the_retry_count_and_honour_only_trusted_topics() {
        let router: Router<MemoryTransport> = Router::new(DeadLetterTargets::known());
        let known = RoutingPolicy {
            dead_letter_topic: Some("persistent://public/default/orders-sub-DLQ".into()),
            ..Default::default()
        };
        router.register(&known);
        let own = RoutingPolicy {
            dead_letter_topic: Some("persistent://public/default/retry-sub-DLQ".into()),
            ..Default::default()
        };
        let stamped = message(&[
            (
                DEAD_LETTER_TOPIC,
                "persistent://public/default/orders-sub-DLQ",
            ),
            (RECONSUMETIMES, "5"),
        ]);
        assert_eq!(
            router.dead_letter_destination(&own, &stamped).as_deref(),
            Some("persistent://public/default/orders-sub-DLQ")
        );
        assert_eq!(
            dead_letter_message(&stamped).property(RECONSUMETIMES),
            Some("5")
        );
        let forged = message(&[(DEAD_LETTER_TOPIC, "persistent://public/default/elsewhere")]);
        assert_eq!(
            router.dead_letter_destination(&own, &forged).as_deref(),
            Some("persistent://public/default/retry-sub-DLQ")
        );
        let allowing: Router<MemoryTransport> =
            Router::new(DeadLetterTargets::known().allow("elsewhere").unwrap());
        assert_eq!(
            allowing.dead_letter_destination(&own, &forged).as_deref(),
            Some("persistent://public/default/elsewhere")
        );
        let trusting: Router<MemoryTransport> = Router::new(DeadLetterTargets::any());
        assert_eq!(
            trusting.dead_letter_destination(&own, &forged).as_deref(),
            Some("persistent://public/default/elsewhere")
        );
    }

    #[test]
    fn a_dead_letter_topic_property_with_a_short_name_is_expanded_before_the_trust_check() {
        let router: Router<MemoryTransport> = Router::new(DeadLetterTargets::known());
        router.register(&RoutingPolicy {
            dead_letter_topic: Some("persistent://public/default/orders-orders-sub-DLQ".into()),
            ..Default::default()
        });
        let own = RoutingPolicy {
            dead_letter_topic: Some("persistent://public/default/retry-sub-DLQ".into()),
            ..Default::default()
        };
        // As the Python dispatcher stamps it: the name its user wrote.
        let short = message(&[(DEAD_LETTER_TOPIC, "orders-orders-sub-DLQ")]);
        assert_eq!(
            router.dead_letter_destination(&own, &short).as_deref(),
            Some("persistent://public/default/orders-orders-sub-DLQ")
        );
        let allowing: Router<MemoryTransport> =
            Router::new(DeadLetterTargets::known().allow("audit-DLQ").unwrap());
        let allowed = message(&[(DEAD_LETTER_TOPIC, "public/default/audit-DLQ")]);
        assert_eq!(
            allowing.dead_letter_destination(&own, &allowed).as_deref(),
            Some("persistent://public/default/audit-DLQ")
        );
        let malformed = message(&[(DEAD_LETTER_TOPIC, "a//b")]);
        assert_eq!(
            router.dead_letter_destination(&own, &malformed).as_deref(),
            Some("persistent://public/default/retry-sub-DLQ"),
            "a malformed name is not trusted"
        );
    }

    #[test]
    fn concurrent_first_uses_share_one_producer_creation() {
        run_local(async {
            let transport = MemoryTransport::new();
            let producers: Rc<Producers<MemoryTransport>> = Rc::default();
            let sends: Vec<_> = (0..5)
                .map(|n| {
                    let (producers, transport) = (producers.clone(), transport.clone());
                    tokio::task::spawn_local(async move {
                        producers
                            .send(
                                &transport,
                                "persistent://public/default/dlq",
                                OutgoingMessage::new(vec![n]),
                            )
                            .await
                    })
                })
                .collect();
            for send in sends {
                send.await.unwrap().unwrap();
            }
            assert_eq!(
                transport.producers_created(),
                ["persistent://public/default/dlq"]
            );
            assert_eq!(transport.published("dlq").len(), 5);
        });
    }

    #[test]
    fn a_failed_producer_creation_is_retried_by_the_next_caller() {
        run_local(async {
            let transport = MemoryTransport::new();
            transport.fail_producer_creation("dlq", 1);
            let producers: Producers<MemoryTransport> = Producers::default();
            let topic = "persistent://public/default/dlq";
            assert!(producers
                .send(&transport, topic, OutgoingMessage::new("a"))
                .await
                .is_err());
            assert!(transport.producers_created().is_empty());
            producers
                .send(&transport, topic, OutgoingMessage::new("b"))
                .await
                .unwrap();
            assert_eq!(transport.producers_created(), [topic]);
            assert_eq!(transport.published("dlq"), [OutgoingMessage::new("b")]);
        });
    }
}
