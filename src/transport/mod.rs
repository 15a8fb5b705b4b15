//! The transport seam: the narrow interface between the dispatcher and a
//! message broker.
//!
//! The dispatcher needs four things from a broker: create a consumer, take
//! messages from it, settle them (ack or nack), and publish messages (for
//! replies, retries and dead letters). [`Transport`], [`Consumer`] and
//! [`Producer`] say exactly that and nothing more. [`PulsarTransport`] implements them over
//! the `pulsar` crate; [`MemoryTransport`] implements them in memory for unit
//! tests and benchmarks. Everything above this module is written against the
//! traits, so both transports run the same scheduling and settlement code.
//!
//! The traits use `async fn` without `Send` bounds on purpose: the whole
//! dispatcher lives on one thread.

mod memory;
mod nodelay;
mod pulsar;

pub use self::memory::{Event, MemoryConsumer, MemoryProducer, MemoryTransport};
pub use self::pulsar::{PulsarConsumer, PulsarProducer, PulsarTransport};

use crate::message::{find_property, Message, MessageId};
use crate::subscription::SubscribeOptions;

/// A failure reported by a transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The `pulsar` crate reported an error.
    #[error(transparent)]
    Pulsar(#[from] ::pulsar::Error),
    /// The transport, or the consumer, has been closed.
    #[error("the transport is closed")]
    Closed,
    /// A failure injected into the in-memory transport by a test.
    #[error("injected failure: {0}")]
    Injected(String),
}

/// A message to publish: the fields a faithful republish needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// The message body.
    pub payload: Vec<u8>,
    /// Application properties.
    pub properties: Vec<(String, String)>,
    /// Partition key (Pulsar's message key).
    pub partition_key: Option<String>,
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

    /// The value of one property.
    pub fn property(&self, key: &str) -> Option<&str> {
        find_property(&self.properties, key)
    }

    /// The same content as a received message, ready to be republished.
    pub fn from_received(message: &Message) -> Self {
        OutgoingMessage {
            payload: message.payload.clone(),
            properties: message.properties.clone(),
            partition_key: message.partition_key.clone(),
            ordering_key: message.ordering_key.clone(),
            event_time: message.event_time,
            deliver_at_time: None,
        }
    }
}

/// A connection to a broker.
#[allow(async_fn_in_trait)]
pub trait Transport: 'static {
    /// The consumer type this transport creates.
    type Consumer: Consumer;

    /// Creates a consumer for `topic` (a full topic name) with `options`.
    async fn subscribe(
        &self,
        topic: &str,
        options: &SubscribeOptions,
    ) -> Result<Self::Consumer, TransportError>;

    /// The producer type this transport creates.
    type Producer: Producer;

    /// Creates a producer for `topic` (a full topic name). The dispatcher
    /// creates one per topic, lazily, and shares it.
    async fn create_producer(&self, topic: &str) -> Result<Self::Producer, TransportError>;

    /// Closes the connection; called once, last, during shutdown.
    async fn close(&self) -> Result<(), TransportError>;
}

/// One subscription's consumer. It is owned by a single reader task, which
/// both receives and settles through it.
#[allow(async_fn_in_trait)]
pub trait Consumer: 'static {
    /// The next message; `None` when the consumer has ended for good.
    ///
    /// Must be cancel-safe: dropping the future before it completes loses no
    /// message. The reader relies on this to stop receiving at any moment.
    async fn receive(&mut self) -> Option<Result<Message, TransportError>>;

    /// Acknowledges a message.
    async fn ack(&mut self, id: MessageId) -> Result<(), TransportError>;

    /// Asks for a message to be redelivered.
    async fn nack(&mut self, id: MessageId) -> Result<(), TransportError>;

    /// Closes the consumer after every earlier ack and nack has been sent.
    async fn close(&mut self) -> Result<(), TransportError>;
}

/// A producer for one topic, shared by every task that publishes there.
#[allow(async_fn_in_trait)]
pub trait Producer: 'static {
    /// Publishes `message` and waits for the broker's receipt. Concurrent
    /// calls are allowed.
    async fn send(&self, message: OutgoingMessage) -> Result<(), TransportError>;

    /// Closes the producer; called during shutdown.
    async fn close(&self) -> Result<(), TransportError>;
}
