//! The transport seam: the narrow interface between the dispatcher and a
//! message broker.
//!
//! The dispatcher needs four things from a broker: create a consumer, take
//! messages from it, settle them (ack or nack), and publish messages (for
//! replies, retries and dead letters). [`Transport`], [`Consumer`] and
//! [`Producer`] say exactly that and nothing more; [`ConsumerSpec`] is all a
//! transport is told about a subscription. [`PulsarTransport`] implements
//! them over the `pulsar` crate; [`MemoryTransport`] implements them in
//! memory for unit tests and benchmarks. Everything above this module is
//! written against the traits, so both transports run the same scheduling
//! and settlement code.
//!
//! Receiving is a poll, so that the dispatcher can refill a subscription's
//! slot from wherever the slot empties, and settling is synchronous, so that
//! a handler's task settles its own message: a consumer is shared by the
//! dispatcher's tasks, each borrowing it only for the length of a call.
//! The traits carry no `Send` bounds on purpose: the whole dispatcher lives
//! on one thread.

mod chunks;
mod memory;
mod partition;
mod pulsar;
mod rewind;
mod settlement;
mod sockets;

use std::task::{Context, Poll};
use std::time::Duration;

pub use self::memory::{Event, MemoryConsumer, MemoryProducer, MemoryTransport};
pub use self::pulsar::{PulsarConsumer, PulsarProducer, PulsarTransport, DEFAULT_MAX_MESSAGE_SIZE};
pub use crate::error::TransportError;

use ::pulsar::consumer::DeadLetterPolicy;
use ::pulsar::{ConsumerOptions, SubType};

use crate::message::{find_property, Message, MessageId};

/// What a transport needs to know to create a consumer.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConsumerSpec {
    /// The full topic name.
    pub topic: String,
    /// The subscription name; without it the transport makes one up, one
    /// for the whole consumer (every partition, and every time a partition
    /// is subscribed again).
    pub subscription: Option<String>,
    /// The subscription type.
    pub subscription_type: SubType,
    /// How many messages the consumer may prefetch (per partition of a
    /// partitioned topic).
    pub receiver_queue_size: u32,
    /// The consumer name the broker shows.
    pub consumer_name: Option<String>,
    /// The `pulsar` crate's consumer options, passed through.
    pub consumer_options: ConsumerOptions,
    /// The `pulsar` crate's dead letter policy, passed through.
    pub dead_letter_policy: Option<DeadLetterPolicy>,
    /// The `pulsar` crate's ack timeout, passed through.
    pub unacked_message_resend_delay: Option<Duration>,
    /// How often a partitioned topic's partition count is looked up, so
    /// that partitions added after subscribing are consumed too.
    pub partition_refresh_interval: Duration,
    /// On a persistent Failover subscription, how long each partition may
    /// deliver nothing (while nothing it delivered waits to be settled)
    /// before the consumer asks the broker for its backlog; a backlog that
    /// is not empty and stood still over two such checks makes it ask the
    /// broker to deliver again. `None` turns the checks off.
    pub stall_check: Option<Duration>,
}

/// How often the partitions of a partitioned topic are counted again
/// unless told otherwise (the Java client's default as well).
pub const DEFAULT_PARTITION_REFRESH_INTERVAL: Duration = Duration::from_secs(60);

/// How long a partition of a Failover subscription may deliver nothing
/// before the consumer checks that the broker has not stopped delivering
/// its backlog, unless told otherwise.
pub const DEFAULT_STALL_CHECK: Duration = Duration::from_secs(5);

impl ConsumerSpec {
    /// A spec for `topic` with the crate's defaults and a receiver queue
    /// of 1.
    pub fn new(topic: impl Into<String>) -> Self {
        ConsumerSpec {
            topic: topic.into(),
            subscription: None,
            subscription_type: SubType::Exclusive,
            receiver_queue_size: 1,
            consumer_name: None,
            consumer_options: ConsumerOptions::default(),
            dead_letter_policy: None,
            unacked_message_resend_delay: None,
            partition_refresh_interval: DEFAULT_PARTITION_REFRESH_INTERVAL,
            stall_check: Some(DEFAULT_STALL_CHECK),
        }
    }
}

/// A message to publish: the fields a faithful republish needs. Build one
/// with [`OutgoingMessage::new`] and set the fields that apply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutgoingMessage {
    /// The message body.
    pub payload: Vec<u8>,
    /// Application properties.
    pub properties: Vec<(String, String)>,
    /// Partition key (Pulsar's message key).
    pub partition_key: Option<String>,
    /// The partition key is the base64 text of a key given as bytes
    /// (Pulsar's `partition_key_b64_encoded`).
    pub partition_key_b64_encoded: bool,
    /// Ordering key for Key_Shared subscriptions.
    pub ordering_key: Option<Vec<u8>>,
    /// Event time in milliseconds since the Unix epoch.
    pub event_time: Option<u64>,
    /// Delivery time in milliseconds since the Unix epoch; honoured by the
    /// broker on Shared and Key_Shared subscriptions.
    pub deliver_at_time: Option<i64>,
}

impl OutgoingMessage {
    /// A message with this payload and nothing else.
    pub fn new(payload: impl Into<Vec<u8>>) -> Self {
        OutgoingMessage {
            payload: payload.into(),
            ..Default::default()
        }
    }

    /// Adds a property.
    #[must_use]
    pub fn with_property(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.push((key.into(), value.into()));
        self
    }

    /// Sets the partition key.
    #[must_use]
    pub fn with_partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Sets the ordering key.
    #[must_use]
    pub fn with_ordering_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// The value of one property.
    pub fn property(&self, key: &str) -> Option<&str> {
        find_property(&self.properties, key)
    }

    /// The same content as a received message, ready to be republished.
    pub fn from_received(message: &Message) -> Self {
        let metadata = message.metadata();
        OutgoingMessage {
            payload: message.payload.clone(),
            properties: metadata.properties.clone(),
            partition_key: metadata.partition_key.clone(),
            partition_key_b64_encoded: metadata.partition_key_b64_encoded,
            ordering_key: metadata.ordering_key.clone(),
            event_time: metadata.event_time,
            deliver_at_time: None,
        }
    }
}

/// A connection to a broker.
#[allow(async_fn_in_trait)]
pub trait Transport: 'static {
    /// The consumer type this transport creates.
    type Consumer: Consumer;

    /// Creates a consumer as `spec` says.
    async fn subscribe(&self, spec: &ConsumerSpec) -> Result<Self::Consumer, TransportError>;

    /// The producer type this transport creates.
    type Producer: Producer;

    /// Creates a producer for `topic` (a full topic name). The dispatcher
    /// creates one per topic and shares it.
    async fn create_producer(&self, topic: &str) -> Result<Self::Producer, TransportError>;

    /// Closes the connection; called once, last, during shutdown.
    async fn close(&self) -> Result<(), TransportError>;
}

/// One subscription's consumer.
#[allow(async_fn_in_trait)]
pub trait Consumer: 'static {
    /// Polls for the next message and, when one is ready, writes it into
    /// `slot` (whatever `slot` held is dropped) and returns
    /// `Ready(Some(Ok(())))`. `Ready(None)` when the consumer has ended for
    /// good; on `Ready(None)`, an error or `Pending`, `slot` may be left
    /// `None`. When it returns `Pending`, the waker of `cx` is woken once a
    /// message may be ready.
    ///
    /// The caller owns the slot so that a message is written once, where it
    /// stays until it is settled: the dispatcher passes the box the message
    /// will be handled from, not a place to copy it out of. The dispatcher
    /// polls only while it has room for a message, which is how its
    /// backpressure reaches the broker.
    fn poll_receive(
        &mut self,
        cx: &mut Context<'_>,
        slot: &mut Option<Message>,
    ) -> Poll<Option<Result<(), TransportError>>>;

    /// Acknowledges a message. Does not wait for the broker: the
    /// acknowledgement is queued, in order, for the connection (a transport
    /// may hold it first, e.g. until the rest of its batch is settled).
    fn ack(&mut self, id: &MessageId) -> Result<(), TransportError>;

    /// Asks for a message to be redelivered; queued like [`ack`](Self::ack).
    fn nack(&mut self, id: &MessageId) -> Result<(), TransportError>;

    /// Closes the consumer once every ack and nack queued earlier has been
    /// passed on where the consumer can (what it cannot pass on is
    /// delivered again: duplicates, not losses). Messages received and not
    /// settled go back to the broker.
    async fn close(&mut self) -> Result<(), TransportError>;

    /// What the consumer did on its own to keep delivery whole; all zero
    /// for a transport that does nothing of the kind.
    fn repairs(&self) -> Repairs {
        Repairs::default()
    }

    /// Since when part of what the consumer consumes has not been
    /// delivering (a partition being subscribed again), if it is so now;
    /// `None` for a transport without parts. Messages from the other parts
    /// do not show the consumer healthy meanwhile: the dispatcher holds
    /// this against the subscription's `receive_failure_limit` too.
    fn failing_since(&self) -> Option<tokio::time::Instant> {
        None
    }
}

/// What a consumer did on its own, beyond what it was asked, to keep
/// delivery whole (see [`Consumer::repairs`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Repairs {
    /// Messages the broker delivered again after they had been acked (an
    /// ack lost with a connection), recognised, acked again and not handed
    /// out.
    pub redelivered_after_ack: u64,
    /// Rewinds asked for again on an Exclusive or Failover subscription,
    /// once idle after a nack, in case the broker lost part of the nack's
    /// own rewind (one per partition).
    pub rewinds_repeated: u64,
    /// Rewinds asked for on a Failover subscription for a partition whose
    /// backlog the broker had stopped delivering (see
    /// [`ConsumerSpec::stall_check`]).
    pub stalls_rewound: u64,
    /// Second copies of messages still being handled, which the broker
    /// delivered again (a reconnection on any subscription type, a nack's
    /// rewind on Exclusive and Failover): dropped, since the copy being
    /// handled settles the message. Also second copies of producer batch
    /// members settled while their batch-mates are still being handled.
    pub dropped_in_flight: u64,
    /// Members of a producer batch that came back with their batch, nacked
    /// for a batch-mate, after they had succeeded: settled as succeeded
    /// again and not handed out.
    pub redelivered_after_success: u64,
}

/// A producer for one topic, shared by every task that publishes there.
#[allow(async_fn_in_trait)]
pub trait Producer: 'static {
    /// Publishes `message` and waits for the broker's receipt. Concurrent
    /// calls are allowed.
    async fn send(&self, message: OutgoingMessage) -> Result<(), TransportError>;

    /// Closes the producer; called during shutdown, and earlier once the
    /// dispatcher no longer needs it (no subscription publishes with it
    /// after an unsubscribe or a failed subscribe, or it is among the
    /// producers only messages' DEAD_LETTER_TOPIC asked for, past the 16
    /// kept).
    async fn close(&self) -> Result<(), TransportError>;
}
