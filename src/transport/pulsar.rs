//! The transport over the `pulsar` crate.
//!
//! One `pulsar::Consumer` per subscription, owned by that subscription's
//! reader task (the crate's `Consumer` needs `&mut self` both to receive and
//! to ack, so a single owner does both). Producers wrap the crate's
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
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use pulsar::producer::Message as PulsarOutgoing;
use pulsar::{Pulsar, PulsarBuilder, TokioExecutor};

use super::nodelay::disable_nagle;
use super::{Consumer, OutgoingMessage, Producer, Transport, TransportError};
use crate::message::{Message, MessageId};
use crate::subscription::SubscribeOptions;

/// A connection to a Pulsar cluster through the `pulsar` crate.
pub struct PulsarTransport {
    /// Taken on close, so that the connections go once the consumers and
    /// producers holding them are gone.
    client: RefCell<Option<Pulsar<TokioExecutor>>>,
    brokers: Rc<BrokerSockets>,
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

impl Transport for PulsarTransport {
    type Consumer = PulsarConsumer;
    type Producer = PulsarProducer;

    async fn subscribe(
        &self,
        topic: &str,
        options: &SubscribeOptions,
    ) -> Result<PulsarConsumer, TransportError> {
        let mut consumer_options = options.consumer_options.clone();
        consumer_options.receiver_queue_size = Some(options.receiver_queue_size);
        let mut builder = self
            .open_client()?
            .consumer()
            .with_topic(topic)
            .with_subscription_type(options.subscription_type)
            .with_batch_size(options.receiver_queue_size)
            .with_options(consumer_options)
            .with_unacked_message_resend_delay(options.unacked_message_resend_delay);
        if let Some(name) = &options.subscription {
            builder = builder.with_subscription(name);
        }
        if let Some(name) = &options.consumer_name {
            builder = builder.with_consumer_name(name);
        }
        if let Some(policy) = &options.dead_letter_policy {
            builder = builder.with_dead_letter_policy(policy.clone());
        }
        let mut consumer = builder.build().await?;
        if let Ok(urls) = consumer.connections().await {
            for url in urls {
                self.brokers.add(url.host_str(), url.port()).await;
            }
        }
        self.brokers.disable_nagle();
        Ok(PulsarConsumer {
            consumer,
            topic: Rc::from(topic),
            batches: BatchSettlements::default(),
            brokers: self.brokers.clone(),
        })
    }

    async fn create_producer(&self, topic: &str) -> Result<PulsarProducer, TransportError> {
        let client = self.open_client()?;
        let producer = client.producer().with_topic(topic).build().await?;
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

/// A consumer of the Pulsar transport.
pub struct PulsarConsumer {
    consumer: pulsar::Consumer<Vec<u8>, TokioExecutor>,
    topic: Rc<str>,
    batches: BatchSettlements,
    brokers: Rc<BrokerSockets>,
}

/// The broker addresses this transport talks to, and when their sockets
/// were last checked for Nagle's algorithm (see `nodelay`).
#[derive(Default)]
struct BrokerSockets {
    peers: RefCell<HashSet<SocketAddr>>,
    last_check: std::cell::Cell<Option<Instant>>,
}

/// How long closing a consumer may take before the consumer is dropped.
const CONSUMER_CLOSE_LIMIT: Duration = Duration::from_secs(10);

/// How often a consumer that is receiving looks again, so that a connection
/// the crate re-establishes after a failure also gets Nagle's algorithm off.
const NODELAY_RECHECK: Duration = Duration::from_secs(10);

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

    fn recheck_if_due(&self) {
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
    fn convert(&self, received: pulsar::consumer::Message<Vec<u8>>) -> Message {
        let pulsar::Payload { metadata, data } = received.payload;
        // Partitions of a partitioned topic report their own name.
        let topic = if received.topic == *self.topic {
            self.topic.clone()
        } else {
            Rc::from(received.topic)
        };
        let mut id = received.message_id.id;
        id.batch_size = id.batch_size.or(received.message_id.batch_size);
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
}

impl PulsarConsumer {
    async fn settle(&mut self, id: MessageId, succeeded: bool) -> Result<(), TransportError> {
        let Some(succeeded) = self.batches.settle(&id, succeeded) else {
            return Ok(());
        };
        let topic = &self.topic;
        let sent = if succeeded {
            self.consumer.ack_with_id(topic, id.0).await
        } else {
            self.consumer.nack_with_id(topic, id.0).await
        };
        sent.map_err(|e| TransportError::Pulsar(e.into()))
    }
}

/// Settlements of batch members, held until their batch is complete.
#[derive(Default)]
struct BatchSettlements {
    by_entry: HashMap<(u64, u64, i32), BatchProgress>,
}

struct BatchProgress {
    /// One flag per member: settled yet?
    settled: Vec<bool>,
    all_succeeded: bool,
}

impl BatchSettlements {
    /// Records one settlement. Returns what to tell the broker about the
    /// message's entry, once there is something to tell: `Some(true)` to ack
    /// it, `Some(false)` to nack it, `None` while batch-mates are pending.
    /// Messages outside a batch are passed straight through.
    fn settle(&mut self, id: &MessageId, succeeded: bool) -> Option<bool> {
        let raw = &id.0;
        let (Some(index), Some(size)) = (raw.batch_index, raw.batch_size) else {
            return Some(succeeded);
        };
        let (Ok(index), Ok(size)) = (usize::try_from(index), usize::try_from(size)) else {
            return Some(succeeded);
        };
        if size <= 1 || index >= size {
            return Some(succeeded);
        }
        let entry = (raw.ledger_id, raw.entry_id, id.partition());
        let progress = self.by_entry.entry(entry).or_insert_with(|| BatchProgress {
            settled: vec![false; size],
            all_succeeded: true,
        });
        progress.settled[index] = true;
        progress.all_succeeded &= succeeded;
        if progress.settled.iter().all(|&settled| settled) {
            let all_succeeded = progress.all_succeeded;
            self.by_entry.remove(&entry);
            Some(all_succeeded)
        } else {
            None
        }
    }
}

impl Consumer for PulsarConsumer {
    async fn receive(&mut self) -> Option<Result<Message, TransportError>> {
        // `Stream::next` is cancel-safe: the crate keeps undelivered messages
        // in its own queue.
        let received = self.consumer.next().await?;
        self.brokers.recheck_if_due();
        match received {
            Ok(received) => Some(Ok(self.convert(received))),
            Err(error) => Some(Err(error.into())),
        }
    }

    async fn ack(&mut self, id: MessageId) -> Result<(), TransportError> {
        self.settle(id, true).await
    }

    async fn nack(&mut self, id: MessageId) -> Result<(), TransportError> {
        self.settle(id, false).await
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        // The crate's engine hands messages over through a bounded channel
        // and handles a close only between messages. With the reader no
        // longer taking messages, a full channel would block the engine, and
        // so this close, for good. Emptying the channel first leaves room for
        // all the broker may still send before the close is handled; those
        // messages were never handled, and the broker redelivers them.
        while let Some(Some(_)) = self.consumer.next().now_or_never() {}
        // The close is routed through the engine's queue behind every ack
        // and nack sent earlier, so they reach the broker first.
        match tokio::time::timeout(CONSUMER_CLOSE_LIMIT, self.consumer.close()).await {
            Ok(closed) => Ok(closed?),
            // Dropping the consumer still closes it on the broker (the
            // crate's engine does so when it stops).
            Err(_) => Err(TransportError::Pulsar(pulsar::Error::Custom(format!(
                "closing the consumer took over {CONSUMER_CLOSE_LIMIT:?}"
            )))),
        }
    }
}

/// A producer of the Pulsar transport.
pub struct PulsarProducer {
    producer: tokio::sync::Mutex<pulsar::Producer<TokioExecutor>>,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn member(entry: u64, index: i32, size: i32) -> MessageId {
        let mut id = MessageId::new(1, entry, -1, Some(index));
        id.0.batch_size = Some(size);
        id
    }

    #[test]
    fn unbatched_messages_settle_at_once() {
        let mut batches = BatchSettlements::default();
        assert_eq!(
            batches.settle(&MessageId::new(1, 2, -1, None), true),
            Some(true)
        );
        assert_eq!(
            batches.settle(&MessageId::new(1, 3, -1, None), false),
            Some(false)
        );
        assert_eq!(batches.settle(&member(4, 0, 1), true), Some(true));
    }

    #[test]
    fn a_batch_is_acked_when_its_last_member_succeeds() {
        let mut batches = BatchSettlements::default();
        assert_eq!(batches.settle(&member(7, 2, 3), true), None);
        assert_eq!(
            batches.settle(&member(8, 0, 2), true),
            None,
            "another entry"
        );
        assert_eq!(batches.settle(&member(7, 0, 3), true), None);
        assert_eq!(
            batches.settle(&member(7, 0, 3), true),
            None,
            "a repeat changes nothing"
        );
        assert_eq!(batches.settle(&member(7, 1, 3), true), Some(true));
        assert!(batches.by_entry.contains_key(&(1, 8, -1)));
        assert!(!batches.by_entry.contains_key(&(1, 7, -1)));
    }

    #[test]
    fn a_batch_with_a_failed_member_is_nacked_once_all_are_settled() {
        let mut batches = BatchSettlements::default();
        assert_eq!(batches.settle(&member(7, 0, 3), true), None);
        assert_eq!(batches.settle(&member(7, 1, 3), false), None);
        assert_eq!(batches.settle(&member(7, 2, 3), true), Some(false));
        assert!(batches.by_entry.is_empty());
    }
}
