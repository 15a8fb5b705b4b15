//! An in-memory broker for unit tests and benchmarks.
//!
//! Topics are queues in memory. A consumer takes from its topic's queue; a
//! nack puts the message back at the front of what waits, with its
//! redelivery count raised;
//! every publish through a producer, and every ack and nack, is logged so
//! that tests can assert on them
//! (compactly: a log entry names the topic by index and the message id by
//! its parts, so logging an ack clones nothing), until a long run clears
//! the log.
//! Failures can be injected (a subscribe that fails or hangs; failing
//! receives, publishes, acks and nacks, producer creation or close; a
//! consumer stream that ends). Receiving, acking and nacking a
//! message with an empty payload allocates nothing in steady state, which
//! keeps the benchmarks about the dispatcher.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use super::{Consumer, ConsumerSpec, OutgoingMessage, Producer, Transport, TransportError};
use crate::hash::TrustedHashing;
use crate::message::{Message, MessageId, Metadata};
use crate::topic::full_topic_name;

/// An in-memory transport. Cloning it gives another handle to the same
/// broker, so a test can keep one while the dispatcher owns another.
#[derive(Clone, Default)]
pub struct MemoryTransport {
    broker: Rc<Broker>,
}

/// Something a client did to the in-memory broker, in the order it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A producer published to `topic`.
    Published {
        /// The full topic name.
        topic: Rc<str>,
    },
    /// A consumer acknowledged `id` on `topic`.
    Acked {
        /// The full topic name.
        topic: Rc<str>,
        /// The message.
        id: MessageId,
    },
    /// A consumer negatively acknowledged `id` on `topic`.
    Nacked {
        /// The full topic name.
        topic: Rc<str>,
        /// The message.
        id: MessageId,
    },
}

/// What a [`Record`] records.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Published,
    Acked,
    Nacked,
}

/// An [`Event`] as the broker logs it: the topic by its index and the
/// message id by its parts, so that logging an ack clones nothing. The ids
/// this broker sees are all built by [`MessageId::new`] (its own, or those
/// of messages a test builds), so the four parts are the whole id.
#[derive(Clone, Copy)]
struct Record {
    kind: Kind,
    topic: u32,
    ledger_id: u64,
    entry_id: u64,
    partition: i32,
    batch_index: Option<i32>,
}

impl Record {
    /// What the room [`MemoryTransport::reserve_events`] makes is filled
    /// with before the log is cut back; never read.
    const BLANK: Record = Record {
        kind: Kind::Published,
        topic: 0,
        ledger_id: 0,
        entry_id: 0,
        partition: -1,
        batch_index: None,
    };

    fn new(kind: Kind, topic: &Topic, id: Option<&MessageId>) -> Self {
        Record {
            kind,
            topic: topic.index,
            ledger_id: id.map_or(0, MessageId::ledger_id),
            entry_id: id.map_or(0, MessageId::entry_id),
            partition: id.map_or(-1, MessageId::partition),
            batch_index: id.and_then(MessageId::batch_index),
        }
    }

    fn id(&self) -> MessageId {
        MessageId::new(
            self.ledger_id,
            self.entry_id,
            self.partition,
            self.batch_index,
        )
    }
}

#[derive(Default)]
struct Broker {
    /// By full name, and by every other spelling used so far.
    /// Hashed cheaply: a benchmark's producer looks a topic up per send.
    topics: RefCell<HashMap<String, Rc<Topic>, TrustedHashing>>,
    /// Full topic names, by the index records name them with.
    names: RefCell<Vec<Rc<str>>>,
    /// Every publish through a producer, ack and nack, in order.
    log: RefCell<Vec<Record>>,
    next_entry: Cell<u64>,
    producers_created: RefCell<Vec<String>>,
    producers_closed: RefCell<Vec<String>>,
    failing_subscribes: RefCell<HashSet<String>>,
    hanging_subscribes: RefCell<HashSet<String>>,
    failing_producers: RefCell<HashMap<String, usize>>,
    failing_publishes: RefCell<HashMap<String, usize>>,
    fail_close: Cell<bool>,
    closed: Cell<bool>,
    open_consumers: Cell<usize>,
}

impl Broker {
    /// Logs a publish (no id), an ack or a nack on `topic`.
    fn log(&self, kind: Kind, topic: &Topic, id: Option<&MessageId>) {
        self.log.borrow_mut().push(Record::new(kind, topic, id));
    }
}

// In C order, what each receive and ack touches first, so that with many
// topics a message finds those fields in two cache lines: aligned to a
// line, they start one (the `Rc`'s counts, which no message touches, keep
// the line before to themselves); from an allocation aligned only to 16,
// as an `Rc`'s otherwise is, their 104 bytes would usually span three.
#[derive(Default)]
#[repr(C, align(64))]
struct Topic {
    ended: Cell<bool>,
    /// Whether acks and nacks fail.
    failing_settlements: Cell<bool>,
    /// Receives still to fail.
    failing_receives: Cell<usize>,
    received: Cell<u64>,
    acked: Cell<usize>,
    /// How many messages at the front of `queue` were handed to a consumer
    /// and are neither acked nor nacked yet.
    delivered: Cell<usize>,
    /// The topic's messages, unsettled ones first, in the order they were
    /// delivered, then the waiting ones, in the order they will be. A
    /// receive copies the first waiting message out and moves the boundary;
    /// its ack (usually of the oldest unsettled message) pops the front. So
    /// a receive and its ack touch the same few cache lines, nothing is
    /// hashed, and steady traffic allocates nothing.
    queue: RefCell<VecDeque<Message>>,
    /// Its place in the broker's `names`.
    index: u32,
    settle_waker: Cell<Option<Waker>>,
    consumer_waker: Cell<Option<Waker>>,
    name: Rc<str>,
    published: RefCell<Vec<OutgoingMessage>>,
}

impl Topic {
    /// Adds `message` to the waiting ones: first (a redelivery) or last.
    fn push(&self, message: Message, first: bool) {
        let mut queue = self.queue.borrow_mut();
        if first {
            queue.insert(self.delivered.get(), message);
        } else {
            queue.push_back(message);
        }
        drop(queue);
        self.wake_consumer();
    }

    fn wake_consumer(&self) {
        if let Some(waker) = self.consumer_waker.take() {
            waker.wake();
        }
    }

    /// The next waiting message, now delivered and unsettled.
    fn deliver(&self) -> Option<Message> {
        let delivered = self.delivered.get();
        let message = self.queue.borrow().get(delivered)?.clone();
        self.delivered.set(delivered + 1);
        self.received.set(self.received.get() + 1);
        Some(message)
    }

    /// The unsettled message `id`, no longer unsettled; `None` if it is not
    /// (an id this topic never delivered, or one settled already).
    fn settle(&self, id: &MessageId) -> Option<Message> {
        let delivered = self.delivered.get();
        let mut queue = self.queue.borrow_mut();
        let is_id = |message: &Message| message.id.entry_id() == id.entry_id();
        // Messages are mostly settled in the order delivered: the oldest
        // first, a pop without a search.
        let at = if delivered > 0 && queue.front().is_some_and(is_id) {
            0
        } else {
            queue.iter().take(delivered).position(is_id)?
        };
        self.delivered.set(delivered - 1);
        if at == 0 {
            queue.pop_front()
        } else {
            queue.remove(at)
        }
    }

    /// Makes every unsettled message wait again, first, in the order they
    /// were first published, as a broker does with what a closed consumer
    /// left unsettled.
    fn redeliver_unsettled(&self) {
        let delivered = self.delivered.replace(0);
        if delivered == 0 {
            return;
        }
        self.queue.borrow_mut().make_contiguous()[..delivered]
            .sort_by_key(|message| message.id.entry_id());
        self.wake_consumer();
    }

    fn settled(&self) {
        if let Some(waker) = self.settle_waker.take() {
            waker.wake();
        }
    }
}

fn full(topic: &str) -> String {
    full_topic_name(topic).expect("a valid topic name")
}

impl MemoryTransport {
    /// An empty broker.
    pub fn new() -> Self {
        Self::default()
    }

    /// The topic, by full or short name. Each spelling is remembered, so
    /// repeated calls cost one lookup.
    fn topic(&self, name: &str) -> Rc<Topic> {
        if let Some(topic) = self.broker.topics.borrow().get(name) {
            return topic.clone();
        }
        let full_name = full(name);
        let mut topics = self.broker.topics.borrow_mut();
        let topic = topics
            .entry(full_name.clone())
            .or_insert_with(|| {
                let mut names = self.broker.names.borrow_mut();
                let name: Rc<str> = full_name.into();
                names.push(name.clone());
                Rc::new(Topic {
                    name,
                    index: u32::try_from(names.len() - 1).expect("fewer than 2^32 topics"),
                    ..Default::default()
                })
            })
            .clone();
        topics.insert(name.to_owned(), topic.clone());
        topic
    }

    fn next_id(&self) -> MessageId {
        let entry = self.broker.next_entry.get();
        self.broker.next_entry.set(entry + 1);
        MessageId::new(0, entry, -1, None)
    }

    /// Appends a message with this payload to `topic`, as a producer would.
    pub fn send(&self, topic: &str, payload: impl Into<Vec<u8>>) -> MessageId {
        self.send_message(topic, OutgoingMessage::new(payload))
    }

    /// Appends `message` to `topic`, as a producer would. A delivery time
    /// is ignored: the message waits like any other.
    pub fn send_message(&self, topic: &str, message: OutgoingMessage) -> MessageId {
        let topic = self.topic(topic);
        let id = self.next_id();
        let mut received = Message::new(topic.name.clone(), id.clone(), message.payload);
        received.set_metadata(Metadata {
            properties: message.properties,
            partition_key: message.partition_key,
            partition_key_b64_encoded: message.partition_key_b64_encoded,
            ordering_key: message.ordering_key,
            event_time: message.event_time,
        });
        received.redelivery_count = Some(0);
        topic.push(received, false);
        id
    }

    /// Makes room in the log of [`events`](Self::events) for `additional`
    /// more publishes, acks and nacks, and writes to it once, so that a
    /// long run (a benchmark's) appends without reallocating and without
    /// touching memory for the first time. A reallocation copies the whole
    /// log, and the allocator may do other deferred work along with it
    /// (glibc merges the small blocks freed since its last large request).
    /// The first write to a fresh page is a page fault, and in a virtual
    /// machine that hands its free memory back to the host (free page
    /// reporting) the host must back the page again, which on the machine
    /// the benchmarks were measured on stops the thread for about half a
    /// millisecond per block of 2 MiB. Either would be counted against
    /// whatever the run measures.
    ///
    /// ```
    /// use pulsar_dispatcher::transport::MemoryTransport;
    ///
    /// let transport = MemoryTransport::new();
    /// transport.reserve_events(100_000);
    /// assert!(transport.events().is_empty());
    /// ```
    pub fn reserve_events(&self, additional: usize) {
        let mut log = self.broker.log.borrow_mut();
        let len = log.len();
        log.resize(len + additional, Record::BLANK);
        log.truncate(len);
    }

    /// Forgets every publish, ack and nack logged so far: [`events`],
    /// [`acked`], [`nacked`] and [`published`] start again from empty. What
    /// waits on the topics, and what consumers hold, stays. The log keeps
    /// its room (see [`reserve_events`]), so a long run that clears it as
    /// it goes, a benchmark's or a soak test's, runs in bounded memory
    /// rather than growing by an entry per ack.
    ///
    /// [`events`]: Self::events
    /// [`acked`]: Self::acked
    /// [`nacked`]: Self::nacked
    /// [`published`]: Self::published
    /// [`reserve_events`]: Self::reserve_events
    pub fn clear_events(&self) {
        self.broker.log.borrow_mut().clear();
        for topic in self.broker.topics.borrow().values() {
            topic.published.borrow_mut().clear();
        }
    }

    /// Every publish through a producer, ack and nack so far (since the last
    /// [`clear_events`](Self::clear_events)), in order.
    pub fn events(&self) -> Vec<Event> {
        let names = self.broker.names.borrow();
        self.broker
            .log
            .borrow()
            .iter()
            .map(|record| {
                let topic = names[record.topic as usize].clone();
                match record.kind {
                    Kind::Published => Event::Published { topic },
                    Kind::Acked => Event::Acked {
                        topic,
                        id: record.id(),
                    },
                    Kind::Nacked => Event::Nacked {
                        topic,
                        id: record.id(),
                    },
                }
            })
            .collect()
    }

    /// Ids acknowledged on `topic`, in order.
    pub fn acked(&self, topic: &str) -> Vec<MessageId> {
        self.settled_ids(topic, true)
    }

    /// Ids negatively acknowledged on `topic`, in order.
    pub fn nacked(&self, topic: &str) -> Vec<MessageId> {
        self.settled_ids(topic, false)
    }

    fn settled_ids(&self, topic: &str, acked: bool) -> Vec<MessageId> {
        let Some(topic) = self.broker.topics.borrow().get(&full(topic)).cloned() else {
            return Vec::new();
        };
        let kind = if acked { Kind::Acked } else { Kind::Nacked };
        self.broker
            .log
            .borrow()
            .iter()
            .filter(|record| record.kind == kind && record.topic == topic.index)
            .map(Record::id)
            .collect()
    }

    /// How many messages consumers of `topic` have received, redeliveries
    /// included.
    pub fn received_count(&self, topic: &str) -> u64 {
        self.topic(topic).received.get()
    }

    /// Messages waiting on `topic` to be delivered, redeliveries included.
    pub fn backlog_len(&self, topic: &str) -> usize {
        let topic = self.topic(topic);
        let waiting = topic.queue.borrow().len() - topic.delivered.get();
        waiting
    }

    /// Messages published to `topic` through a producer, in order.
    pub fn published(&self, topic: &str) -> Vec<OutgoingMessage> {
        self.topic(topic).published.borrow().clone()
    }

    /// Topics a producer was created for, in creation order.
    pub fn producers_created(&self) -> Vec<String> {
        self.broker.producers_created.borrow().clone()
    }

    /// The topics of the producers closed so far, in order.
    pub fn producers_closed(&self) -> Vec<String> {
        self.broker.producers_closed.borrow().clone()
    }

    /// Waits until `count` messages have been acknowledged on `topic`.
    pub async fn wait_acked(&self, topic: &str, count: usize) {
        let topic = self.topic(topic);
        poll_fn(|cx| {
            if topic.acked.get() >= count {
                return Poll::Ready(());
            }
            topic.settle_waker.set(Some(cx.waker().clone()));
            Poll::Pending
        })
        .await
    }

    /// Makes every later subscribe to `topic` fail.
    pub fn fail_subscribe(&self, topic: &str) {
        self.broker
            .failing_subscribes
            .borrow_mut()
            .insert(full(topic));
    }

    /// Makes the next `times` producer creations for `topic` fail.
    pub fn fail_producer_creation(&self, topic: &str, times: usize) {
        self.broker
            .failing_producers
            .borrow_mut()
            .insert(full(topic), times);
    }

    /// Makes every later subscribe to `topic` wait for ever, as a broker
    /// that keeps answering "consumer busy" would.
    pub fn hang_subscribe(&self, topic: &str) {
        self.broker
            .hanging_subscribes
            .borrow_mut()
            .insert(full(topic));
    }

    /// Makes the next `times` receives on `topic` return an error (pass
    /// `usize::MAX` for ever).
    pub fn fail_receives(&self, topic: &str, times: usize) {
        let topic = self.topic(topic);
        topic.failing_receives.set(times);
        topic.wake_consumer();
    }

    /// Makes the next `times` publishes to `topic` fail.
    pub fn fail_publishes(&self, topic: &str, times: usize) {
        self.broker
            .failing_publishes
            .borrow_mut()
            .insert(full(topic), times);
    }

    /// Makes every later ack and nack on `topic` fail, as acks into a
    /// broken connection would.
    pub fn fail_settlements(&self, topic: &str) {
        self.topic(topic).failing_settlements.set(true);
    }

    /// Makes `close` report an error (after closing all the same).
    pub fn fail_close(&self) {
        self.broker.fail_close.set(true);
    }

    /// Ends the consumer stream of `topic`, as a broken connection would.
    pub fn end_stream(&self, topic: &str) {
        let topic = self.topic(topic);
        topic.ended.set(true);
        topic.wake_consumer();
    }

    /// Whether `close` has been called.
    pub fn is_closed(&self) -> bool {
        self.broker.closed.get()
    }

    /// Consumers created and not yet closed. One dropped without a close
    /// stays open: a broker would hold its subscription until it learned
    /// of the drop, and the engine closes every consumer it makes.
    pub fn open_consumers(&self) -> usize {
        self.broker.open_consumers.get()
    }

    /// Producers created and not yet closed.
    pub fn open_producers(&self) -> usize {
        let created = self.broker.producers_created.borrow().len();
        created - self.broker.producers_closed.borrow().len()
    }
}

impl Transport for MemoryTransport {
    type Consumer = MemoryConsumer;
    type Producer = MemoryProducer;

    async fn subscribe(&self, spec: &ConsumerSpec) -> Result<MemoryConsumer, TransportError> {
        let topic = spec.topic.as_str();
        // A real subscribe takes a round trip, during which the dispatcher
        // may start or close.
        tokio::task::yield_now().await;
        if self.broker.closed.get() {
            return Err(TransportError::Closed);
        }
        if self.broker.hanging_subscribes.borrow().contains(topic) {
            std::future::pending::<()>().await;
        }
        if self.broker.failing_subscribes.borrow().contains(topic) {
            return Err(TransportError::Injected(format!("subscribe to {topic}")));
        }
        self.broker
            .open_consumers
            .set(self.broker.open_consumers.get() + 1);
        Ok(MemoryConsumer {
            topic: self.topic(topic),
            broker: self.broker.clone(),
            closed: false,
        })
    }

    async fn create_producer(&self, topic: &str) -> Result<MemoryProducer, TransportError> {
        // A real creation takes a round trip; yielding once lets tests see
        // concurrent first uses overlap.
        tokio::task::yield_now().await;
        if self.broker.closed.get() {
            return Err(TransportError::Closed);
        }
        if let Some(left) = self.broker.failing_producers.borrow_mut().get_mut(topic) {
            if *left > 0 {
                *left -= 1;
                return Err(TransportError::Injected(format!("producer for {topic}")));
            }
        }
        self.broker
            .producers_created
            .borrow_mut()
            .push(topic.to_owned());
        Ok(MemoryProducer {
            transport: self.clone(),
            topic: self.topic(topic),
        })
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.broker.closed.set(true);
        if self.broker.fail_close.get() {
            return Err(TransportError::Injected("close".into()));
        }
        Ok(())
    }
}

impl std::fmt::Debug for MemoryTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut topics: Vec<_> = self
            .broker
            .topics
            .borrow()
            .values()
            .map(|topic| topic.name.clone())
            .collect();
        topics.sort();
        topics.dedup();
        f.debug_struct("MemoryTransport")
            .field("topics", &topics)
            .field("closed", &self.broker.closed.get())
            .finish()
    }
}

/// A consumer of the in-memory transport.
pub struct MemoryConsumer {
    topic: Rc<Topic>,
    broker: Rc<Broker>,
    closed: bool,
}

impl MemoryConsumer {
    fn refuse_if_failing(&self, what: &str) -> Result<(), TransportError> {
        if !self.topic.failing_settlements.get() {
            return Ok(());
        }
        Err(TransportError::Injected(format!(
            "{what} on {}",
            self.topic.name
        )))
    }
}

impl Consumer for MemoryConsumer {
    fn poll_receive(
        &mut self,
        cx: &mut Context<'_>,
        slot: &mut Option<Message>,
    ) -> Poll<Option<Result<(), TransportError>>> {
        if self.topic.ended.get() {
            return Poll::Ready(None);
        }
        let failing = self.topic.failing_receives.get();
        if failing > 0 {
            self.topic.failing_receives.set(failing - 1);
            return Poll::Ready(Some(Err(TransportError::Injected(format!(
                "receive from {}",
                self.topic.name
            )))));
        }
        *slot = self.topic.deliver();
        if slot.is_none() {
            self.topic.consumer_waker.set(Some(cx.waker().clone()));
            return Poll::Pending;
        }
        Poll::Ready(Some(Ok(())))
    }

    fn ack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        self.refuse_if_failing("ack")?;
        drop(self.topic.settle(id));
        self.topic.acked.set(self.topic.acked.get() + 1);
        self.broker.log(Kind::Acked, &self.topic, Some(id));
        self.topic.settled();
        Ok(())
    }

    fn nack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        self.refuse_if_failing("nack")?;
        let redelivery = self.topic.settle(id);
        self.broker.log(Kind::Nacked, &self.topic, Some(id));
        if let Some(mut message) = redelivery {
            message.redelivery_count = Some(message.redelivery_count.unwrap_or(0) + 1);
            self.topic.push(message, true);
        }
        self.topic.settled();
        Ok(())
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        if !std::mem::replace(&mut self.closed, true) {
            self.broker
                .open_consumers
                .set(self.broker.open_consumers.get() - 1);
            // Like a broker, hand whatever this consumer left unsettled to
            // the next consumer.
            self.topic.redeliver_unsettled();
        }
        Ok(())
    }
}

impl std::fmt::Debug for MemoryConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryConsumer")
            .field("topic", &self.topic.name)
            .field("closed", &self.closed)
            .finish()
    }
}

/// A producer of the in-memory transport.
pub struct MemoryProducer {
    transport: MemoryTransport,
    topic: Rc<Topic>,
}

impl std::fmt::Debug for MemoryProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryProducer")
            .field("topic", &self.topic.name)
            .finish()
    }
}

impl Producer for MemoryProducer {
    async fn send(&self, message: OutgoingMessage) -> Result<(), TransportError> {
        if self.transport.is_closed() {
            return Err(TransportError::Closed);
        }
        let failing = &self.transport.broker.failing_publishes;
        if let Some(left) = failing.borrow_mut().get_mut(&*self.topic.name) {
            if *left > 0 {
                *left -= 1;
                return Err(TransportError::Injected(format!(
                    "publish to {}",
                    self.topic.name
                )));
            }
        }
        self.topic.published.borrow_mut().push(message.clone());
        self.transport
            .broker
            .log(Kind::Published, &self.topic, None);
        self.transport.send_message(&self.topic.name, message);
        Ok(())
    }

    async fn close(&self) -> Result<(), TransportError> {
        let closed = self.topic.name.to_string();
        self.transport
            .broker
            .producers_closed
            .borrow_mut()
            .push(closed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn subscribe(transport: &MemoryTransport, topic: &str) -> MemoryConsumer {
        transport
            .subscribe(&ConsumerSpec::new(topic))
            .await
            .expect("subscribed")
    }

    /// Receives the next waiting message of `consumer`, which must have one.
    fn receive(consumer: &mut MemoryConsumer) -> Message {
        let mut slot = None;
        let mut cx = Context::from_waker(Waker::noop());
        match consumer.poll_receive(&mut cx, &mut slot) {
            Poll::Ready(Some(Ok(()))) => slot.expect("a message in the slot"),
            _ => panic!("a message was waiting"),
        }
    }

    #[tokio::test]
    async fn settling_out_of_order_keeps_the_rest_unsettled_and_waiting_in_order() {
        let transport = MemoryTransport::new();
        let mut consumer = subscribe(&transport, "jobs").await;
        let ids: Vec<MessageId> = (0..5).map(|n| transport.send("jobs", [n])).collect();
        let received: Vec<Message> = (0..3).map(|_| receive(&mut consumer)).collect();
        assert_eq!(received[2].id, ids[2]);
        assert_eq!(transport.backlog_len("jobs"), 2);

        // The middle one acked, the last one nacked: it waits again, first.
        consumer.ack(&ids[1]).expect("acked");
        consumer.nack(&ids[2]).expect("nacked");
        // Settling an id twice, or one never delivered, changes nothing.
        consumer.nack(&ids[1]).expect("nacked");
        consumer.nack(&ids[4]).expect("nacked");
        assert_eq!(transport.backlog_len("jobs"), 3);
        let again = receive(&mut consumer);
        assert_eq!(
            (again.id.clone(), again.redelivery_count),
            (ids[2].clone(), Some(1))
        );
        assert_eq!(receive(&mut consumer).id, ids[3]);
        consumer.nack(&ids[0]).expect("nacked");
        assert_eq!(receive(&mut consumer).id, ids[0]);

        // What a closed consumer left unsettled (2, 3 and 0, in the order
        // delivered) waits again, in publish order, before what never was
        // delivered (4).
        consumer.close().await.expect("closed");
        let mut next = subscribe(&transport, "jobs").await;
        let order: Vec<MessageId> = (0..4).map(|_| receive(&mut next).id).collect();
        assert_eq!(
            order,
            [&ids[0], &ids[2], &ids[3], &ids[4]].map(Clone::clone)
        );
        assert_eq!(transport.received_count("jobs"), 10);
    }

    #[tokio::test]
    async fn the_log_keeps_every_event_in_order_with_its_topic_and_id() {
        let transport = MemoryTransport::new();
        let mut jobs = subscribe(&transport, "jobs").await;
        let mut other = subscribe(&transport, "persistent://public/default/other").await;
        let first = transport.send("jobs", "a");
        let second = transport.send("other", "b");
        jobs.ack(&first).expect("acked");
        // Room made (and written) between two events is no event itself.
        transport.reserve_events(1_000);
        other.nack(&second).expect("nacked");

        let jobs_topic: Rc<str> = "persistent://public/default/jobs".into();
        let other_topic: Rc<str> = "persistent://public/default/other".into();
        // Publishes through `send` are not a producer's, so not logged.
        assert_eq!(
            transport.events(),
            [
                Event::Acked {
                    topic: jobs_topic,
                    id: first.clone()
                },
                Event::Nacked {
                    topic: other_topic,
                    id: second.clone()
                },
            ]
        );
        assert_eq!(transport.acked("persistent://public/default/jobs"), [first]);
        assert!(transport.acked("other").is_empty());
        assert_eq!(transport.nacked("other"), [second]);
        assert!(transport.nacked("never-used").is_empty());
    }

    #[tokio::test]
    async fn clearing_the_log_forgets_what_happened_and_keeps_what_waits() {
        let transport = MemoryTransport::new();
        let mut jobs = subscribe(&transport, "jobs").await;
        let producer = transport.create_producer("jobs").await.expect("producer");
        producer
            .send(OutgoingMessage::new(b"p".to_vec()))
            .await
            .expect("published");
        let waiting = transport.send("jobs", "w");
        let published = receive(&mut jobs).id;
        jobs.ack(&published).expect("acked");
        transport.reserve_events(100);
        let room = transport.broker.log.borrow().capacity();

        transport.clear_events();
        assert!(transport.events().is_empty());
        assert!(transport.acked("jobs").is_empty());
        assert!(transport.published("jobs").is_empty());
        assert_eq!(transport.broker.log.borrow().capacity(), room);
        // The message that waited still does, and what follows is logged.
        assert_eq!(transport.backlog_len("jobs"), 1);
        assert_eq!(receive(&mut jobs).id, waiting);
        jobs.ack(&waiting).expect("acked");
        assert_eq!(transport.acked("jobs"), [waiting]);
    }
}
