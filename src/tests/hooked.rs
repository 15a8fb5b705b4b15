//! The in-memory transport with hooks for what it cannot do itself: acks
//! and nacks that panic (a bug in the dispatcher's own path after a
//! handler), receives and consumer closes that panic, consumer closes that
//! take a while, a part of the consumer (a
//! partition) that has stopped delivering and is subscribed again later,
//! messages that cannot be read,
//! producers whose creation is
//! answered late, and publishes that take a while; it logs the closes, in
//! order.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::Notify;

use crate::transport::{
    Consumer, ConsumerSpec, MemoryTransport, OutgoingMessage, Producer, Transport,
};
use crate::{full_topic_name, Message, MessageId, TransportError};

#[derive(Clone, Default)]
pub(super) struct Hooked {
    pub(super) inner: MemoryTransport,
    acks_panic: Rc<Cell<bool>>,
    nacks_panic: Rc<Cell<bool>>,
    /// The topic whose consumer's close panics.
    consumer_close_panics: Rc<RefCell<Option<String>>>,
    /// How many more receives succeed before one panics (none: no
    /// receive panics).
    pub(super) receives_before_panic: Rc<Cell<Option<u32>>>,
    close_takes: Rc<Cell<Duration>>,
    part_failing_since: Rc<Cell<Option<tokio::time::Instant>>>,
    /// Errors the next receives return, first first.
    receive_errors: Rc<RefCell<VecDeque<TransportError>>>,
    /// The last consumer's waker, woken as a partition's resubscribe is.
    receiver: Rc<RefCell<Option<Waker>>>,
    /// "consumer <topic> closed" and "transport closed", as they happen.
    pub(super) closes: Rc<RefCell<Vec<String>>>,
    held_producers: Rc<HeldProducers>,
    publish_takes: Rc<Cell<Duration>>,
}

/// Producer creations answered late: made on the broker, then held until
/// released (as the `pulsar` crate's answer can come after the dispatcher
/// began to close).
#[derive(Default)]
struct HeldProducers {
    topics: RefCell<Vec<String>>,
    waiting: Cell<usize>,
    released: Cell<bool>,
    release: Notify,
}

impl Hooked {
    pub(super) fn acks_panic(self) -> Self {
        self.acks_panic.set(true);
        self
    }

    pub(super) fn nacks_panic(self) -> Self {
        self.nacks_panic.set(true);
        self
    }

    pub(super) fn consumer_close_panics(self, topic: &str) -> Self {
        *self.consumer_close_panics.borrow_mut() = Some(full_topic_name(topic).unwrap());
        self
    }

    pub(super) fn consumer_close_takes(self, time: Duration) -> Self {
        self.close_takes.set(time);
        self
    }

    /// Producers for `topic` are made, then held until
    /// [`release_producers`](Self::release_producers).
    pub(super) fn hold_producers(self, topic: &str) -> Self {
        self.held_producers
            .topics
            .borrow_mut()
            .push(full_topic_name(topic).unwrap());
        self
    }

    pub(super) fn publishes_take(self, time: Duration) -> Self {
        self.publish_takes.set(time);
        self
    }

    /// How many producer creations are held now.
    pub(super) fn producers_held(&self) -> usize {
        self.held_producers.waiting.get()
    }

    pub(super) fn release_producers(&self) {
        self.held_producers.released.set(true);
        self.held_producers.release.notify_waiters();
    }

    /// Every consumer reports part of itself failing since `since`.
    pub(super) fn part_failing_since(&self, since: Option<tokio::time::Instant>) {
        self.part_failing_since.set(since);
    }

    /// Part of the consumer stops delivering as a partition whose stream
    /// ended: the next receive fails with `TransportError::Resubscribing`,
    /// and the consumer reports the part failing until
    /// [`part_resubscribed`](Self::part_resubscribed).
    pub(super) fn part_resubscribing(&self) {
        self.part_failing_since(Some(tokio::time::Instant::now()));
        let topic = "persistent://public/default/a-partition".to_owned();
        self.fail_next_receive(TransportError::Resubscribing { topic });
    }

    /// The next receive gives a message that cannot be read, as an
    /// encrypted one.
    pub(super) fn unreadable_message(&self) {
        self.fail_next_receive(TransportError::Encrypted {
            topic: "persistent://public/default/a-partition".to_owned(),
            message_id: "1:2:-1".into(),
        });
    }

    fn fail_next_receive(&self, error: TransportError) {
        self.receive_errors.borrow_mut().push_back(error);
        self.wake_receiver();
    }

    /// The part is subscribed again, and wakes the consumer, as a
    /// partition's resubscribe does.
    pub(super) fn part_resubscribed(&self) {
        self.part_failing_since(None);
        self.wake_receiver();
    }

    fn wake_receiver(&self) {
        if let Some(waker) = self.receiver.borrow_mut().take() {
            waker.wake();
        }
    }
}

pub(super) struct HookedConsumer {
    inner: <MemoryTransport as Transport>::Consumer,
    topic: String,
    hooks: Hooked,
}

impl Transport for Hooked {
    type Consumer = HookedConsumer;
    type Producer = HookedProducer;

    async fn subscribe(&self, spec: &ConsumerSpec) -> Result<HookedConsumer, TransportError> {
        Ok(HookedConsumer {
            inner: self.inner.subscribe(spec).await?,
            topic: spec.topic.clone(),
            hooks: self.clone(),
        })
    }

    async fn create_producer(&self, topic: &str) -> Result<Self::Producer, TransportError> {
        let producer = self.inner.create_producer(topic).await?;
        let held = &self.held_producers;
        if held.topics.borrow().iter().any(|held| held == topic) {
            held.waiting.set(held.waiting.get() + 1);
            while !held.released.get() {
                held.release.notified().await;
            }
            held.waiting.set(held.waiting.get() - 1);
        }
        Ok(HookedProducer {
            inner: producer,
            hooks: self.clone(),
        })
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.closes.borrow_mut().push("transport closed".into());
        Transport::close(&self.inner).await
    }
}

impl Consumer for HookedConsumer {
    fn poll_receive(
        &mut self,
        cx: &mut Context<'_>,
        slot: &mut Option<Message>,
    ) -> Poll<Option<Result<(), TransportError>>> {
        *self.hooks.receiver.borrow_mut() = Some(cx.waker().clone());
        match self.hooks.receives_before_panic.get() {
            Some(0) => {
                self.hooks.receives_before_panic.set(None);
                panic!("a broken receive");
            }
            Some(left) => self.hooks.receives_before_panic.set(Some(left - 1)),
            None => {}
        }
        if let Some(error) = self.hooks.receive_errors.borrow_mut().pop_front() {
            return Poll::Ready(Some(Err(error)));
        }
        self.inner.poll_receive(cx, slot)
    }

    fn ack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        if self.hooks.acks_panic.get() {
            panic!("a broken transport");
        }
        self.inner.ack(id)
    }

    fn nack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        if self.hooks.nacks_panic.get() {
            panic!("a broken nack");
        }
        self.inner.nack(id)
    }

    fn failing_since(&self) -> Option<tokio::time::Instant> {
        self.hooks.part_failing_since.get()
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        tokio::time::sleep(self.hooks.close_takes.get()).await;
        if self.hooks.consumer_close_panics.borrow().as_ref() == Some(&self.topic) {
            panic!("a broken close");
        }
        let closed = format!("consumer {} closed", self.topic);
        self.hooks.closes.borrow_mut().push(closed);
        Consumer::close(&mut self.inner).await
    }
}

pub(super) struct HookedProducer {
    inner: <MemoryTransport as Transport>::Producer,
    hooks: Hooked,
}

impl Producer for HookedProducer {
    async fn send(&self, message: OutgoingMessage) -> Result<(), TransportError> {
        tokio::time::sleep(self.hooks.publish_takes.get()).await;
        self.inner.send(message).await
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}
