//! The in-memory transport with hooks for what it cannot do itself: acks
//! that panic (a bug in the dispatcher's own path after a handler),
//! consumer closes that take a while, and a part of the consumer (a
//! partition) that has stopped delivering; it logs the closes, in order.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::transport::{Consumer, ConsumerSpec, MemoryTransport, Transport};
use crate::{Message, MessageId, TransportError};

#[derive(Clone, Default)]
pub(super) struct Hooked {
    pub(super) inner: MemoryTransport,
    acks_panic: Rc<Cell<bool>>,
    close_takes: Rc<Cell<Duration>>,
    part_failing_since: Rc<Cell<Option<tokio::time::Instant>>>,
    /// "consumer <topic> closed" and "transport closed", as they happen.
    pub(super) closes: Rc<RefCell<Vec<String>>>,
}

impl Hooked {
    pub(super) fn acks_panic(self) -> Self {
        self.acks_panic.set(true);
        self
    }

    pub(super) fn consumer_close_takes(self, time: Duration) -> Self {
        self.close_takes.set(time);
        self
    }

    /// Every consumer reports part of itself failing since `since`.
    pub(super) fn part_failing_since(&self, since: Option<tokio::time::Instant>) {
        self.part_failing_since.set(since);
    }
}

pub(super) struct HookedConsumer {
    inner: <MemoryTransport as Transport>::Consumer,
    topic: String,
    hooks: Hooked,
}

impl Transport for Hooked {
    type Consumer = HookedConsumer;
    type Producer = <MemoryTransport as Transport>::Producer;

    async fn subscribe(&self, spec: &ConsumerSpec) -> Result<HookedConsumer, TransportError> {
        Ok(HookedConsumer {
            inner: self.inner.subscribe(spec).await?,
            topic: spec.topic.clone(),
            hooks: self.clone(),
        })
    }

    async fn create_producer(&self, topic: &str) -> Result<Self::Producer, TransportError> {
        self.inner.create_producer(topic).await
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
        self.inner.poll_receive(cx, slot)
    }

    fn ack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        if self.hooks.acks_panic.get() {
            panic!("a broken transport");
        }
        self.inner.ack(id)
    }

    fn nack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        self.inner.nack(id)
    }

    fn failing_since(&self) -> Option<tokio::time::Instant> {
        self.hooks.part_failing_since.get()
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        tokio::time::sleep(self.hooks.close_takes.get()).await;
        let closed = format!("consumer {} closed", self.topic);
        self.hooks.closes.borrow_mut().push(closed);
        Consumer::close(&mut self.inner).await
    }
}
