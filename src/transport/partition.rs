//! One partition of a subscription's topic (or a whole topic that is not
//! partitioned) and its `pulsar` crate consumer: creating it, creating it
//! again when its stream ends, settling on it, and closing it without
//! losing what was settled; and the partitions an operator adds to a
//! partitioned topic after it was subscribed, found by counting them again
//! every so often.
//!
//! The crate's consumer reconnects by itself after most connection
//! failures, but gives up on some (a connection reset while the broker
//! dies, for one): its stream then ends for good. A partition whose stream
//! ends subscribes again, retrying until it succeeds, and reports a receive
//! error meanwhile, so the dispatcher's `receive_failure_limit` bounds how
//! long that may take. Settlements made in between are kept and sent on the
//! new consumer, and so are those the crate refuses once it has given up,
//! while the stream still hands out what it had queued.
//!
//! On a Failover subscription each partition also checks, while it is
//! idle, that the broker has not stopped delivering its backlog (see
//! `rewind::StallCheck`): the consumer is lent to the check, which asks the
//! broker for the backlog, and settlements made meanwhile are kept as
//! during a resubscribe.

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures::future::LocalBoxFuture;
use futures::{FutureExt, StreamExt};
use pulsar::consumer::DeadLetterPolicy;
use pulsar::error::ConsumerError;
use pulsar::proto::MessageIdData;
use pulsar::{Pulsar, TokioExecutor};
use tracing::{debug, info, warn};

use super::rewind::StallCheck;
use super::settlement::Outage;
use super::sockets::BrokerSockets;
use super::{ConsumerSpec, TransportError};
use crate::topic::{is_non_persistent, partition_name};

/// The crate's consumer of one partition.
pub(super) type CrateConsumer = pulsar::Consumer<Vec<u8>, TokioExecutor>;

/// How long closing a consumer may take before the consumer is dropped.
const CONSUMER_CLOSE_LIMIT: Duration = Duration::from_secs(10);

/// How long one attempt to reach a consumer's engine waits before the
/// consumer's message channel is emptied again.
const ENGINE_ROUND_TRIP_ATTEMPT: Duration = Duration::from_millis(200);

/// How long a failed attempt to subscribe a partition again waits before
/// the next.
const RESUBSCRIBE_RETRY: Duration = Duration::from_secs(1);

/// How long a stall check waits for the broker's answer; without one the
/// check reads nothing, and the next interval asks again.
const STALL_CHECK_LIMIT: Duration = Duration::from_secs(5);

/// What it takes to subscribe a partition: the client, the subscription's
/// spec, and the broker sockets, to turn Nagle's algorithm off on and to
/// notice lost connections on.
pub(super) struct Subscriber {
    pub(super) client: Pulsar<TokioExecutor>,
    pub(super) spec: ConsumerSpec,
    pub(super) brokers: Rc<BrokerSockets>,
}

impl Subscriber {
    /// A consumer of `topic` (one partition, or a topic that is not
    /// partitioned) as the spec says.
    pub(super) async fn subscribe(&self, topic: &str) -> Result<CrateConsumer, TransportError> {
        let spec = &self.spec;
        let mut consumer_options = spec.consumer_options.clone();
        consumer_options.receiver_queue_size = Some(spec.receiver_queue_size);
        let mut builder = self
            .client
            .consumer()
            .with_topic(topic)
            .with_subscription_type(spec.subscription_type)
            .with_batch_size(spec.receiver_queue_size)
            .with_options(consumer_options)
            .with_unacked_message_resend_delay(spec.unacked_message_resend_delay);
        if let Some(name) = &spec.subscription {
            builder = builder.with_subscription(name);
        }
        if let Some(name) = &spec.consumer_name {
            builder = builder.with_consumer_name(name);
        }
        if let Some(policy) = &spec.dead_letter_policy {
            builder = builder.with_dead_letter_policy(crate_dead_letter_policy(policy));
        }
        // Boxed: the crate's futures are large (in debug builds, hundreds of
        // kilobytes), and every future holding one inline would be too.
        let consumer = Box::pin(builder.build()).await?;
        // The broker's address comes from a lookup through the client, not
        // from the consumer: asking the consumer's engine would wait behind
        // messages it cannot hand over until somebody receives them.
        if let Ok(broker) = self.client.lookup_topic(topic).await {
            self.brokers
                .add(broker.url.host_str(), broker.url.port())
                .await;
        }
        Ok(consumer)
    }
}

/// Subscribes the partitions named `names`, all at once, in that order:
/// every one, or none (when one fails, those that did subscribe are closed
/// again, so that a failed subscribe leaves nothing behind).
pub(super) async fn subscribe_partitions(
    subscriber: &Rc<Subscriber>,
    names: &[String],
) -> Result<Vec<Partition>, TransportError> {
    let built =
        futures::future::join_all(names.iter().map(|name| subscriber.subscribe(name))).await;
    let mut partitions = Vec::with_capacity(built.len());
    let mut failure = None;
    for (name, result) in names.iter().zip(built) {
        match result {
            Ok(consumer) => partitions.push(Partition::new(name, consumer, subscriber.clone())),
            Err(error) => failure = failure.or(Some(error)),
        }
    }
    let Some(error) = failure else {
        return Ok(partitions);
    };
    if let Err(close_error) = close_partitions(&mut partitions).await {
        warn!(topic = %subscriber.spec.topic, error = %close_error, "closing the partitions of a failed subscribe failed");
    }
    Err(error)
}

/// Closes every partition's consumer, all at once.
pub(super) async fn close_partitions(partitions: &mut [Partition]) -> Result<(), TransportError> {
    let closed = futures::future::join_all(partitions.iter_mut().map(Partition::close)).await;
    closed.into_iter().collect()
}

/// Watches a partitioned topic for partitions added after it was
/// subscribed: every `partition_refresh_interval` of the spec it asks the
/// broker how many partitions the topic has and subscribes the new ones on
/// the same subscription. A failed count or subscribe is logged and tried
/// again at the next refresh; it does not disturb the partitions consumed.
pub(super) struct AddedPartitions {
    subscriber: Rc<Subscriber>,
    next_count: Pin<Box<tokio::time::Sleep>>,
    counting: Option<LocalBoxFuture<'static, Result<Vec<Partition>, TransportError>>>,
}

impl AddedPartitions {
    pub(super) fn new(subscriber: Rc<Subscriber>) -> Self {
        let first = tokio::time::sleep(subscriber.spec.partition_refresh_interval);
        AddedPartitions {
            subscriber,
            next_count: Box::pin(first),
            counting: None,
        }
    }

    /// How many messages each partition's consumer prefetches.
    pub(super) fn receiver_queue_size(&self) -> u32 {
        self.subscriber.spec.receiver_queue_size
    }

    /// The partitions numbered from `known` on, once a count finds the
    /// topic grown and they are subscribed; `Pending` until a count ends
    /// (the caller's waker is woken when one is due or done).
    pub(super) fn poll(&mut self, cx: &mut Context<'_>, known: usize) -> Poll<Vec<Partition>> {
        let counting = match &mut self.counting {
            Some(counting) => counting,
            None => {
                ready!(self.next_count.as_mut().poll(cx));
                let subscriber = self.subscriber.clone();
                self.counting
                    .insert(Box::pin(subscribe_added(subscriber, known)))
            }
        };
        let counted = ready!(counting.as_mut().poll(cx));
        self.counting = None;
        let every = self.subscriber.spec.partition_refresh_interval;
        self.next_count
            .as_mut()
            .reset(tokio::time::Instant::now() + every);
        Poll::Ready(counted.unwrap_or_else(|error| {
            warn!(topic = %self.subscriber.spec.topic, %error, "counting or subscribing added partitions failed; trying again at the next refresh");
            Vec::new()
        }))
    }
}

/// Subscribes the partitions of the subscriber's topic numbered from
/// `known` on, if it has more than `known` now.
async fn subscribe_added(
    subscriber: Rc<Subscriber>,
    known: usize,
) -> Result<Vec<Partition>, TransportError> {
    let topic = subscriber.spec.topic.as_str();
    let count = subscriber
        .client
        .lookup_partitioned_topic_number(topic)
        .await?;
    let names: Vec<String> = (known as u32..count)
        .map(|index| partition_name(topic, index))
        .collect();
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let added = subscribe_partitions(&subscriber, &names).await?;
    info!(%topic, from = known, to = count, "subscribed to partitions added to the topic");
    Ok(added)
}

/// One partition and its consumer.
pub(super) struct Partition {
    /// The partition's own topic name, shared by every message from it.
    pub(super) topic: Rc<str>,
    state: State,
    /// Settlements made while the consumer is being replaced, lent to a
    /// stall check, or once its engine has stopped: (id, ack?).
    pending: Vec<(MessageIdData, bool)>,
    /// Its last outage: when its consumer was first found stopped (a
    /// settlement refused, its stream ended, or its engine reported an
    /// error), and when it was subscribed again, if it is yet.
    outage: Option<Outage>,
    /// On a persistent Failover subscription with the check on.
    stall: Option<StallCheck>,
    subscriber: Rc<Subscriber>,
}

/// What a stall check gives back: the consumer it borrowed, and the
/// backlog the broker reported (`None` if it could not be asked).
type StallReading = (Box<CrateConsumer>, Option<u64>);

enum State {
    /// Boxed: the crate's consumer is large, the other state small.
    Open(Box<CrateConsumer>),
    Resubscribing(LocalBoxFuture<'static, Result<CrateConsumer, TransportError>>),
    /// The consumer is lent to a stall check.
    Checking(LocalBoxFuture<'static, StallReading>),
}

impl Partition {
    pub(super) fn new(topic: &str, consumer: CrateConsumer, subscriber: Rc<Subscriber>) -> Self {
        let spec = &subscriber.spec;
        let stall = spec
            .stall_check
            .filter(|_| {
                spec.subscription_type == pulsar::SubType::Failover
                    && !is_non_persistent(&spec.topic)
            })
            .map(StallCheck::new);
        Partition {
            topic: Rc::from(topic),
            state: State::Open(Box::new(consumer)),
            pending: Vec::new(),
            outage: None,
            stall,
            subscriber,
        }
    }

    /// The next message of this partition, a receive error, or `Pending`.
    /// Never ends: a consumer whose stream ends is replaced (reported as an
    /// error meanwhile). `holds_unsettled` tells whether a message this
    /// partition delivered is not settled yet; a stall check asks it.
    pub(super) fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
        holds_unsettled: impl Fn() -> bool,
    ) -> Poll<Result<pulsar::consumer::Message<Vec<u8>>, TransportError>> {
        loop {
            match &mut self.state {
                State::Open(consumer) => {
                    return match consumer.poll_next_unpin(cx) {
                        Poll::Pending => {
                            let due = self.stall.as_mut().is_some_and(|stall| {
                                stall.poll_due(cx, &holds_unsettled).is_ready()
                            });
                            if due {
                                self.check_for_stall();
                                continue;
                            }
                            Poll::Pending
                        }
                        Poll::Ready(Some(received)) => {
                            if let Some(stall) = &mut self.stall {
                                stall.delivered();
                            }
                            Poll::Ready(received.map_err(Into::into))
                        }
                        Poll::Ready(None) => {
                            warn!(topic = %self.topic, "the consumer's stream ended (the `pulsar` crate gave up on its connection); subscribing again");
                            self.resubscribe(Duration::ZERO);
                            Poll::Ready(Err(TransportError::Resubscribing {
                                topic: self.topic.to_string(),
                            }))
                        }
                    };
                }
                State::Resubscribing(subscribing) => match subscribing.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(consumer)) => {
                        info!(topic = %self.topic, "subscribed again");
                        self.state = State::Open(Box::new(consumer));
                        if let Some(outage) = &mut self.outage {
                            outage.reopened = Some(tokio::time::Instant::now());
                        }
                        self.send_pending();
                    }
                    Poll::Ready(Err(error)) => {
                        self.resubscribe(RESUBSCRIBE_RETRY);
                        return Poll::Ready(Err(error));
                    }
                },
                State::Checking(checking) => {
                    let (consumer, backlog) = ready!(checking.as_mut().poll(cx));
                    self.state = State::Open(consumer);
                    self.after_stall_check(backlog);
                }
            }
        }
    }

    /// Lends the consumer to a check of the partition's backlog.
    fn check_for_stall(&mut self) {
        // A placeholder for the moment the consumer moves: a future that
        // never ends, of no size, allocates nothing.
        let placeholder = State::Resubscribing(Box::pin(std::future::pending()));
        let State::Open(mut consumer) = std::mem::replace(&mut self.state, placeholder) else {
            unreachable!("a check starts from an open consumer");
        };
        let topic = self.topic.clone();
        self.state = State::Checking(Box::pin(async move {
            let backlog = match tokio::time::timeout(STALL_CHECK_LIMIT, consumer.get_stats()).await
            {
                Ok(Ok(stats)) => stats.first().and_then(|stats| stats.msg_backlog),
                Ok(Err(error)) => {
                    debug!(%topic, %error, "asking the broker for the backlog failed");
                    None
                }
                Err(_) => {
                    debug!(%topic, limit = ?STALL_CHECK_LIMIT, "the broker did not report the backlog in time");
                    None
                }
            };
            (consumer, backlog)
        }));
    }

    /// Sends what was settled during the check, and asks for a rewind if
    /// the backlog stalled.
    fn after_stall_check(&mut self, backlog: Option<u64>) {
        self.send_pending();
        let Some(stall) = &mut self.stall else {
            return;
        };
        if !stall.stalled(backlog) {
            return;
        }
        info!(topic = %self.topic, backlog, "the broker has stopped delivering this partition's backlog (a Failover hand-over can leave it so); asking it to deliver again");
        // On a Failover subscription the broker rewinds whatever ids a
        // redelivery request names (it redelivers by id only on Shared and
        // Key_Shared), and this partition has delivered nothing to name.
        if let Err(error) = self.settle(MessageIdData::default(), false) {
            warn!(topic = %self.topic, %error, "asking for a rewind failed");
        }
    }

    /// A receive of this partition failed with `error`.
    ///
    /// While the partition is being subscribed again, each failed attempt
    /// has scheduled the next already. From an open consumer, a message it
    /// cannot read (see [`TransportError::is_unreadable_message`]) stays in
    /// the backlog, which the stall check counts as held. Any other error
    /// comes from the crate's engine, which sends one when it could not
    /// subscribe again after the broker closed the consumer (the topic
    /// deleted, say) and delivers nothing after it, or when it failed to
    /// dead-letter a message it then holds unacknowledged: either way the
    /// consumer is replaced, as when its stream ends, and the new one is
    /// given every unacknowledged message.
    pub(super) fn receive_failed(&mut self, error: &TransportError) {
        if !matches!(self.state, State::Open(_)) {
            return;
        }
        if error.is_unreadable_message() {
            if let Some(stall) = &mut self.stall {
                stall.unreadable();
            }
        } else {
            warn!(topic = %self.topic, %error, "the consumer failed and may deliver nothing more; subscribing again");
            self.resubscribe(RESUBSCRIBE_RETRY);
        }
    }

    /// Rewinds asked for because the backlog stalled.
    pub(super) fn stalls_rewound(&self) -> u64 {
        self.stall.as_ref().map_or(0, |stall| stall.rewound)
    }

    /// When its consumer was first found stopped, while it is being
    /// subscribed again.
    pub(super) fn resubscribing_since(&self) -> Option<tokio::time::Instant> {
        match self.state {
            State::Resubscribing(_) => self.outage.map(|outage| outage.ended),
            State::Open(_) | State::Checking(_) => None,
        }
    }

    /// Its last outage, if its consumer ever stopped: acks sent shortly
    /// before may have been lost with the connection, and acks made during
    /// it were held until it was subscribed again.
    pub(super) fn outage(&self) -> Option<Outage> {
        self.outage
    }

    /// Notes that the consumer has stopped (its engine is gone, or its
    /// stream ended), unless an outage is already under way: one outage
    /// lasts from the first sign until the partition is subscribed again.
    /// Returns whether this began one.
    fn begin_outage(&mut self) -> bool {
        let under_way = self.outage.is_some_and(|outage| outage.reopened.is_none());
        if !under_way {
            self.outage = Some(Outage {
                ended: tokio::time::Instant::now(),
                reopened: None,
            });
        }
        !under_way
    }

    fn resubscribe(&mut self, after: Duration) {
        self.begin_outage();
        if let Some(stall) = &mut self.stall {
            // The new consumer is given everything unacknowledged again.
            stall.rewinding();
        }
        let (subscriber, topic) = (self.subscriber.clone(), self.topic.clone());
        self.state = State::Resubscribing(Box::pin(async move {
            tokio::time::sleep(after).await;
            subscriber.subscribe(&topic).await
        }));
    }

    /// Acks (or nacks) an entry; kept for the new consumer while the
    /// consumer is being replaced, lent to a stall check, or once its
    /// engine has stopped.
    pub(super) fn settle(&mut self, id: MessageIdData, ack: bool) -> Result<(), TransportError> {
        if let (false, Some(stall)) = (ack, &mut self.stall) {
            stall.rewinding();
        }
        let State::Open(consumer) = &mut self.state else {
            self.pending.push((id, ack));
            return Ok(());
        };
        // The crate's ack and nack only queue a command on an unbounded
        // channel to the consumer's engine: they complete on the first poll.
        // The id is cloned to be kept if the engine has stopped (cheap:
        // only an id with an ack set or a chunk's first id allocates).
        let queued = if ack {
            consumer.ack_with_id(&self.topic, id.clone()).now_or_never()
        } else {
            consumer
                .nack_with_id(&self.topic, id.clone())
                .now_or_never()
        };
        match queued {
            Some(Ok(())) => Ok(()),
            // The consumer's engine has stopped (the crate gave up on its
            // connection): its stream ends once what it queued has been
            // received, and the partition is then subscribed again. Until
            // that, settlements wait for the new consumer, as they do while
            // it is being subscribed; sent to this one, they would be lost
            // and their messages handled again.
            Some(Err(ConsumerError::Closed)) => {
                if self.begin_outage() {
                    warn!(topic = %self.topic, "the consumer's engine has stopped; settlements wait for its replacement");
                }
                self.pending.push((id, ack));
                Ok(())
            }
            Some(Err(error)) => Err(error.into()),
            None => Err(TransportError::Pulsar(pulsar::Error::Custom(
                "the consumer's engine did not take the settlement at once".into(),
            ))),
        }
    }

    fn send_pending(&mut self) {
        for (id, ack) in std::mem::take(&mut self.pending) {
            if let Err(error) = self.settle(id, ack) {
                warn!(topic = %self.topic, %error, "settling on the new consumer failed");
            }
        }
    }

    /// Closes the consumer once every ack and nack sent to it has been
    /// handed to its connection; a partition being subscribed again just
    /// stops trying, and the settlements kept for its new consumer are
    /// dropped (the broker delivers those messages again: duplicates, not
    /// losses).
    pub(super) async fn close(&mut self) -> Result<(), TransportError> {
        if let State::Checking(checking) = &mut self.state {
            // Bounded by the check's own limit.
            let (consumer, _) = checking.await;
            self.state = State::Open(consumer);
            self.send_pending();
        }
        match &mut self.state {
            State::Open(consumer) => close_consumer(consumer).await,
            State::Resubscribing(_) => Ok(()),
            State::Checking(_) => unreachable!("the check ended above"),
        }
    }
}

/// Closes one crate consumer once every ack and nack sent to it has been
/// handed to its connection.
///
/// The crate's consumer engine handles messages from the broker, acks,
/// nacks and requests in one queue, and hands messages over through a
/// bounded channel: while the channel is full, the engine waits and
/// everything queued behind the message waits with it. Nothing receives any
/// more at this point, so the channel is emptied (those messages were never
/// handled, and the broker redelivers them) before each attempt to reach the
/// engine. A round trip through the engine's queue proves that the acks and
/// nacks queued before it were passed on; then the consumer is closed. If
/// the engine is gone, or cannot be reached in time, the consumer is
/// dropped, which also closes it on the broker once its engine stops.
async fn close_consumer(consumer: &mut CrateConsumer) -> Result<(), TransportError> {
    let deadline = tokio::time::Instant::now() + CONSUMER_CLOSE_LIMIT;
    let over_limit = || {
        TransportError::Pulsar(pulsar::Error::Custom(format!(
            "closing the consumer took over {CONSUMER_CLOSE_LIMIT:?}"
        )))
    };
    loop {
        if tokio::time::Instant::now() >= deadline {
            return Err(over_limit());
        }
        while let Some(Some(_)) = consumer.next().now_or_never() {}
        match tokio::time::timeout(ENGINE_ROUND_TRIP_ATTEMPT, consumer.connections()).await {
            Ok(Ok(_)) => break,
            // The engine has stopped: nothing left to pass on.
            Ok(Err(error)) => return Err(error.into()),
            Err(_) => continue,
        }
    }
    while let Some(Some(_)) = consumer.next().now_or_never() {}
    match tokio::time::timeout_at(deadline, consumer.close()).await {
        Ok(closed) => Ok(closed?),
        Err(_) => Err(over_limit()),
    }
}

/// `policy` as the crate reads it. Pulsar's Java and C++ clients (the
/// Python original's) hand a message over `max_redeliver_count + 1` times
/// and dead-letter it at the redelivery after that; the crate dead-letters a
/// message on arrival once its redelivery count reaches the maximum, one
/// hand-over sooner. Given one more, it gives a message as many tries as
/// they do, so a mixed fleet gives it the same number whichever side
/// receives it.
fn crate_dead_letter_policy(policy: &DeadLetterPolicy) -> DeadLetterPolicy {
    DeadLetterPolicy {
        max_redeliver_count: policy.max_redeliver_count.saturating_add(1),
        dead_letter_topic: policy.dead_letter_topic.clone(),
    }
}
