//! The transport over the `pulsar` crate.
//!
//! One `pulsar::Consumer` per partition of a subscription's topic (one for a
//! topic that is not partitioned), so that every message is settled on the
//! partition it came from and every partition can be drained and closed on
//! its own. The crate's acks and nacks only queue a command for the
//! consumer's engine task, so settling is synchronous here. Producers wrap the crate's
//! `Producer` in an async mutex held only while a message is handed over,
//! not while its receipt is awaited, so concurrent sends to one topic
//! pipeline. The crate runs its connection tasks with `tokio::spawn`, which
//! works on a `current_thread` runtime.
//!
//! Messages that a producer sent in one batch share one broker entry, and
//! the crate acknowledges entries, not batch members: acking one member
//! would acknowledge all of them, including members still being handled.
//! The consumer therefore holds the settlements of batch members until the
//! whole batch is settled, then acks the entry if every member succeeded
//! and nacks it (redelivering the whole batch) otherwise.

use std::cell::RefCell;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use std::task::{Context, Poll};

use futures::{FutureExt, StreamExt};
use pulsar::producer::Message as PulsarOutgoing;
use pulsar::{Pulsar, PulsarBuilder, TokioExecutor};

use super::nodelay::disable_nagle;
use super::settlement::{entry_of, BatchSettlements, EntryKey, RecentAcks};
use super::{Consumer, ConsumerSpec, OutgoingMessage, Producer, Transport, TransportError};
use crate::message::{Message, MessageId};

/// A connection to a Pulsar cluster through the `pulsar` crate.
pub struct PulsarTransport {
    /// Taken on close, so that the connections go once the consumers and
    /// producers holding them are gone.
    client: RefCell<Option<Pulsar<TokioExecutor>>>,
    brokers: Rc<BrokerSockets>,
}

impl std::fmt::Debug for PulsarTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarTransport")
            .field("open", &self.client.borrow().is_some())
            .finish()
    }
}

impl PulsarTransport {
    /// Connects with a builder the caller has configured (authentication,
    /// TLS, retry options, ...).
    pub async fn from_builder(
        builder: PulsarBuilder<TokioExecutor>,
    ) -> Result<Self, TransportError> {
        Ok(Self::from_client(builder.build().await?))
    }

    /// Wraps a client the caller has already built.
    pub fn from_client(client: Pulsar<TokioExecutor>) -> Self {
        PulsarTransport {
            client: RefCell::new(Some(client)),
            brokers: Rc::default(),
        }
    }

    /// The underlying client, until the transport is closed.
    pub fn client(&self) -> Option<Pulsar<TokioExecutor>> {
        self.client.borrow().clone()
    }

    fn open_client(&self) -> Result<Pulsar<TokioExecutor>, TransportError> {
        self.client().ok_or(TransportError::Closed)
    }
}

impl PulsarTransport {
    /// One partition's consumer (or the whole topic's, when it is not
    /// partitioned).
    async fn partition_consumer(
        &self,
        client: &Pulsar<TokioExecutor>,
        topic: &str,
        spec: &ConsumerSpec,
    ) -> Result<pulsar::Consumer<Vec<u8>, TokioExecutor>, TransportError> {
        let mut consumer_options = spec.consumer_options.clone();
        consumer_options.receiver_queue_size = Some(spec.receiver_queue_size);
        let mut builder = client
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
            builder = builder.with_dead_letter_policy(policy.clone());
        }
        // Boxed: the crate's futures are large (in debug builds, hundreds of
        // kilobytes), and every future holding one inline would be too.
        let consumer = Box::pin(builder.build()).await?;
        // The broker's address comes from a lookup through the client, not
        // from the consumer: asking the consumer's engine would wait behind
        // messages it cannot hand over until somebody receives them.
        if let Ok(broker) = client.lookup_topic(topic).await {
            self.brokers
                .add(broker.url.host_str(), broker.url.port())
                .await;
        }
        Ok(consumer)
    }
}

impl Transport for PulsarTransport {
    type Consumer = PulsarConsumer;
    type Producer = PulsarProducer;

    async fn subscribe(&self, spec: &ConsumerSpec) -> Result<PulsarConsumer, TransportError> {
        let topic = spec.topic.as_str();
        let client = self.open_client()?;
        // A partitioned topic gets one consumer per partition, so that each
        // message is settled on the partition it came from and each
        // partition can be drained and closed on its own.
        let partition_count = client.lookup_partitioned_topic_number(topic).await?;
        let names: Vec<String> = match partition_count {
            0 => vec![topic.to_owned()],
            n => (0..n).map(|i| format!("{topic}-partition-{i}")).collect(),
        };
        let built = futures::future::join_all(
            names
                .iter()
                .map(|name| self.partition_consumer(&client, name, spec)),
        )
        .await;
        let mut partitions = Vec::with_capacity(built.len());
        let mut failure = None;
        for (name, result) in names.into_iter().zip(built) {
            match result {
                Ok(consumer) => partitions.push(Partition {
                    consumer,
                    topic: Rc::from(name),
                }),
                Err(error) => failure = failure.or(Some(error)),
            }
        }
        if let Some(error) = failure {
            // The partitions that did subscribe are closed again: a failed
            // subscribe leaves nothing behind.
            if let Err(close_error) = close_partitions(&mut partitions).await {
                tracing::warn!(%topic, error = %close_error, "closing the partitions of a failed subscribe failed");
            }
            return Err(error);
        }
        self.brokers.disable_nagle();
        let remembered = RECENT_ACKS + 2 * spec.receiver_queue_size as usize * partitions.len();
        Ok(PulsarConsumer {
            partitioned: partition_count > 0,
            partitions,
            next_partition: 0,
            batches: BatchSettlements::default(),
            recent_acks: RecentAcks::new(remembered),
            brokers: self.brokers.clone(),
        })
    }

    async fn create_producer(&self, topic: &str) -> Result<PulsarProducer, TransportError> {
        let client = self.open_client()?;
        let producer = Box::pin(client.producer().with_topic(topic).build()).await?;
        if let Ok(broker) = client.lookup_topic(topic).await {
            self.brokers
                .add(broker.url.host_str(), broker.url.port())
                .await;
            self.brokers.disable_nagle();
        }
        Ok(PulsarProducer {
            producer: tokio::sync::Mutex::new(producer),
        })
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.client.borrow_mut().take();
        Ok(())
    }
}

/// A consumer of the Pulsar transport: one `pulsar` crate consumer per
/// partition of a partitioned topic, or one for a topic that is not.
pub struct PulsarConsumer {
    /// Indexed by partition number.
    partitions: Vec<Partition>,
    partitioned: bool,
    /// Where the next receive starts looking, so that partitions take turns.
    next_partition: usize,
    batches: BatchSettlements,
    recent_acks: RecentAcks,
    brokers: Rc<BrokerSockets>,
}

/// How many acknowledged entries a consumer remembers, besides twice its
/// receiver queues: enough for the messages in flight and prefetched when a
/// connection fails (see `settlement::RecentAcks`).
const RECENT_ACKS: usize = 2048;

/// How many redeliveries of acked entries one receive skips before it lets
/// other tasks run.
const SKIPS_PER_RECEIVE: usize = 256;

impl std::fmt::Debug for PulsarConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let topics: Vec<&str> = self.partitions.iter().map(|p| &*p.topic).collect();
        f.debug_struct("PulsarConsumer")
            .field("topics", &topics)
            .finish()
    }
}

/// One partition (or a whole non-partitioned topic) and its consumer.
struct Partition {
    consumer: pulsar::Consumer<Vec<u8>, TokioExecutor>,
    /// The partition's own topic name, shared by every message from it.
    topic: Rc<str>,
}

/// The broker addresses this transport talks to, and when their sockets
/// were last checked for Nagle's algorithm (see `nodelay`).
#[derive(Default)]
struct BrokerSockets {
    peers: RefCell<HashSet<SocketAddr>>,
    last_check: std::cell::Cell<Option<Instant>>,
    /// Messages received by every consumer of the transport.
    received: std::cell::Cell<u64>,
}

/// How long closing a consumer may take before the consumer is dropped.
const CONSUMER_CLOSE_LIMIT: Duration = Duration::from_secs(10);

/// How long one attempt to reach a consumer's engine waits before the
/// consumer's message channel is emptied again.
const ENGINE_ROUND_TRIP_ATTEMPT: Duration = Duration::from_millis(200);

/// How often a consumer that is receiving looks again, so that a connection
/// the crate re-establishes after a failure also gets Nagle's algorithm off.
const NODELAY_RECHECK: Duration = Duration::from_secs(10);

/// Received messages between two looks at the clock for [`NODELAY_RECHECK`].
const NODELAY_RECHECK_EVERY: u64 = 256;

impl BrokerSockets {
    async fn add(&self, host: Option<&str>, port: Option<u16>) {
        let (Some(host), Some(port)) = (host, port) else {
            return;
        };
        if let Ok(addresses) = tokio::net::lookup_host((host, port)).await {
            self.peers.borrow_mut().extend(addresses);
        }
    }

    fn disable_nagle(&self) {
        self.last_check.set(Some(Instant::now()));
        let changed = disable_nagle(&self.peers.borrow());
        if changed > 0 {
            tracing::debug!(changed, "TCP_NODELAY set on broker connections");
        }
    }

    /// Called for every message received; looks at the clock only every
    /// [`NODELAY_RECHECK_EVERY`] messages, as reading it costs more than the
    /// rest of this bookkeeping.
    fn recheck_if_due(&self) {
        let received = self.received.get().wrapping_add(1);
        self.received.set(received);
        if received % NODELAY_RECHECK_EVERY != 0 {
            return;
        }
        if self
            .last_check
            .get()
            .is_none_or(|last| last.elapsed() >= NODELAY_RECHECK)
        {
            self.disable_nagle();
        }
    }
}

impl PulsarConsumer {
    /// The next message of any partition, trying each in turn from where the
    /// last receive stopped.
    fn poll_partitions(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Message, TransportError>>> {
        for _ in 0..SKIPS_PER_RECEIVE {
            match self.poll_next_partition(cx) {
                Poll::Ready(Some(Ok(message))) if self.was_acked(message.id()) => continue,
                polled => return polled,
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Whether the message is one the broker delivered again although it was
    /// acked (the ack was lost with a connection); if so, acks it again.
    fn was_acked(&mut self, id: &MessageId) -> bool {
        let Some(resend) = self.recent_acks.redelivered(entry_of(id), Instant::now()) else {
            return false;
        };
        tracing::info!(message_id = %id, resending = resend.len(), "the broker delivered an acked message again (its ack was lost with a connection); acking again");
        for entry in resend {
            self.ack_entry(entry);
        }
        true
    }

    /// Sends the ack of a whole entry again, as the crate acks entries.
    fn ack_entry(&mut self, (partition, ledger_id, entry_id): EntryKey) {
        let id = MessageId::new(ledger_id, entry_id, partition, None);
        if let Err(error) = self.send_settlement(&id, true) {
            tracing::warn!(message_id = %id, %error, "acking again failed");
        }
    }

    fn poll_next_partition(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Message, TransportError>>> {
        let count = self.partitions.len();
        for step in 0..count {
            let index = (self.next_partition + step) % count;
            match self.partitions[index].consumer.poll_next_unpin(cx) {
                Poll::Pending => continue,
                // One partition's stream ending ends the consumer: the
                // dispatcher reports it rather than carry on with part of
                // the topic.
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error.into()))),
                Poll::Ready(Some(Ok(received))) => {
                    self.next_partition = (index + 1) % count;
                    return Poll::Ready(Some(Ok(self.convert(index, received))));
                }
            }
        }
        Poll::Pending
    }

    fn convert(&self, partition: usize, received: pulsar::consumer::Message<Vec<u8>>) -> Message {
        let pulsar::Payload { metadata, data } = received.payload;
        let mut id = received.message_id.id;
        id.batch_size = id.batch_size.or(received.message_id.batch_size);
        if self.partitioned {
            // The partition is also what settlement goes by.
            id.partition = Some(partition as i32);
        }
        let topic = self.partitions[partition].topic.clone();
        let mut message = Message::new(topic, MessageId(id), data);
        message.properties = metadata
            .properties
            .into_iter()
            .map(|pair| (pair.key, pair.value))
            .collect();
        message.partition_key = metadata.partition_key;
        message.ordering_key = metadata.ordering_key;
        message.event_time = metadata.event_time;
        message.publish_time = metadata.publish_time;
        message
    }

    /// The partition a message id belongs to.
    fn partition_of(&mut self, id: &MessageId) -> Result<&mut Partition, TransportError> {
        let index = if self.partitioned {
            usize::try_from(id.partition()).ok()
        } else {
            Some(0)
        };
        let count = self.partitions.len();
        index
            .and_then(|index| self.partitions.get_mut(index))
            .ok_or_else(|| {
                TransportError::Pulsar(pulsar::Error::Custom(format!(
                    "message {id} names partition {} of a topic with {count}",
                    id.partition()
                )))
            })
    }

    fn settle(&mut self, id: &MessageId, succeeded: bool) -> Result<(), TransportError> {
        let Some(succeeded) = self.batches.settle(id, succeeded) else {
            return Ok(());
        };
        self.send_settlement(id, succeeded)?;
        if succeeded {
            self.recent_acks.record(entry_of(id));
        }
        Ok(())
    }

    fn send_settlement(&mut self, id: &MessageId, succeeded: bool) -> Result<(), TransportError> {
        let partition = self.partition_of(id)?;
        let topic = &partition.topic;
        let raw = id.0.clone();
        // The crate's ack and nack only queue a command on an unbounded
        // channel to the consumer's engine: they complete on the first poll.
        let queued = if succeeded {
            partition.consumer.ack_with_id(topic, raw).now_or_never()
        } else {
            partition.consumer.nack_with_id(topic, raw).now_or_never()
        };
        match queued {
            Some(result) => Ok(result?),
            None => Err(TransportError::Pulsar(pulsar::Error::Custom(
                "the consumer's engine did not take the settlement at once".into(),
            ))),
        }
    }
}

impl Consumer for PulsarConsumer {
    fn poll_receive(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Message, TransportError>>> {
        let received = self.poll_partitions(cx);
        if received.is_ready() {
            self.brokers.recheck_if_due();
        }
        received
    }

    fn ack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        self.settle(id, true)
    }

    fn nack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        self.settle(id, false)
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        close_partitions(&mut self.partitions).await
    }

    fn redelivered_after_ack(&self) -> u64 {
        self.recent_acks.recognised
    }
}

/// Closes every partition's consumer, all at once.
async fn close_partitions(partitions: &mut [Partition]) -> Result<(), TransportError> {
    let closed = futures::future::join_all(
        partitions
            .iter_mut()
            .map(|p| close_consumer(&mut p.consumer)),
    )
    .await;
    closed.into_iter().collect()
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
/// the engine cannot be reached in time, the consumer is dropped, which also
/// closes it on the broker once its engine stops.
async fn close_consumer(
    consumer: &mut pulsar::Consumer<Vec<u8>, TokioExecutor>,
) -> Result<(), TransportError> {
    let deadline = tokio::time::Instant::now() + CONSUMER_CLOSE_LIMIT;
    let mut settled = false;
    while !settled && tokio::time::Instant::now() < deadline {
        while let Some(Some(_)) = consumer.next().now_or_never() {}
        settled = tokio::time::timeout(ENGINE_ROUND_TRIP_ATTEMPT, consumer.connections())
            .await
            .is_ok_and(|reached| reached.is_ok());
    }
    let over_limit = || {
        TransportError::Pulsar(pulsar::Error::Custom(format!(
            "closing the consumer took over {CONSUMER_CLOSE_LIMIT:?}"
        )))
    };
    if !settled {
        return Err(over_limit());
    }
    while let Some(Some(_)) = consumer.next().now_or_never() {}
    match tokio::time::timeout_at(deadline, consumer.close()).await {
        Ok(closed) => Ok(closed?),
        Err(_) => Err(over_limit()),
    }
}

/// A producer of the Pulsar transport.
pub struct PulsarProducer {
    producer: tokio::sync::Mutex<pulsar::Producer<TokioExecutor>>,
}

impl std::fmt::Debug for PulsarProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarProducer").finish_non_exhaustive()
    }
}

impl Producer for PulsarProducer {
    async fn send(&self, message: OutgoingMessage) -> Result<(), TransportError> {
        let outgoing = PulsarOutgoing {
            payload: message.payload,
            properties: message.properties.into_iter().collect(),
            partition_key: message.partition_key,
            ordering_key: message.ordering_key,
            event_time: message.event_time,
            deliver_at_time: message.deliver_at_time,
            ..Default::default()
        };
        let receipt = {
            let mut producer = self.producer.lock().await;
            producer.send_non_blocking(outgoing).await?
        };
        receipt.await?;
        Ok(())
    }

    async fn close(&self) -> Result<(), TransportError> {
        Ok(self.producer.lock().await.close().await?)
    }
}
