//! One subscription at run time: its consumer, how its messages are settled,
//! and the nacks it holds back for the negative-ack delay.
//!
//! The consumer is shared by the tasks of the engine: whoever empties the
//! subscription's slot polls it for the next message (with the
//! subscription's own waker, so a message that arrives later wakes the
//! engine for this subscription alone), and whoever finishes a message
//! settles it. Each use borrows the consumer for one synchronous call.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, warn};

use super::stats::{bump, Counters, SubscriptionStats};
use super::wake::{SubscriptionWaker, WokenList};
use super::Handler;
use crate::error::TransportError;
use crate::message::{Message, MessageId};
use crate::outcome::{SubscriptionInfo, Verdict};
use crate::routing::RoutingPolicy;
use crate::scheduler::SubscriptionKey;
use crate::transport::{Consumer, ConsumerSpec, Transport};

/// Everything the engine needs to create and run a subscription, besides
/// its handler: checked and resolved by the public API before it gets here.
#[derive(Clone, Debug)]
pub(crate) struct SubscriptionSpec {
    pub(crate) consumer: ConsumerSpec,
    pub(crate) priority: i64,
    pub(crate) nack_delay: Duration,
    pub(crate) routing: RoutingPolicy,
}

impl SubscriptionSpec {
    pub(crate) fn info(&self) -> SubscriptionInfo {
        SubscriptionInfo {
            topic: self.consumer.topic.clone(),
            subscription: self.consumer.subscription.clone(),
            subscription_type: self.consumer.subscription_type,
            priority: self.priority,
            retry_topic: self.routing.retry.as_ref().map(|retry| retry.topic.clone()),
        }
    }
}

pub(crate) struct Subscription<T: Transport> {
    /// Where the engine keeps it, and what its waker reports.
    #[allow(dead_code)]
    pub(crate) index: usize,
    /// Its slot in the scheduler.
    pub(crate) key: SubscriptionKey,
    pub(crate) info: SubscriptionInfo,
    pub(crate) topic: Rc<str>,
    pub(crate) handler: Handler<T>,
    pub(crate) routing: RoutingPolicy,
    pub(crate) counters: Counters,
    /// `None` once closed.
    consumer: RefCell<Option<T::Consumer>>,
    /// Whether the consumer may still deliver (its stream has not ended).
    receiving: Cell<bool>,
    waker_state: Arc<SubscriptionWaker>,
    waker: Waker,
    nack_delay: Duration,
    /// Nacks waiting out the delay, in the order they are due (the delay is
    /// the same for every message of the subscription).
    held: RefCell<VecDeque<(Instant, MessageId)>>,
}

impl<T: Transport> Subscription<T> {
    pub(crate) fn new(
        index: usize,
        key: SubscriptionKey,
        spec: SubscriptionSpec,
        consumer: T::Consumer,
        handler: Handler<T>,
        woken: Arc<WokenList>,
    ) -> Self {
        let waker_state = SubscriptionWaker::new(index, woken);
        let info = spec.info();
        Subscription {
            index,
            key,
            topic: Rc::from(info.topic.as_str()),
            info,
            handler,
            routing: spec.routing,
            counters: Counters::default(),
            consumer: RefCell::new(Some(consumer)),
            receiving: Cell::new(true),
            waker: Waker::from(waker_state.clone()),
            waker_state,
            nack_delay: spec.nack_delay,
            held: RefCell::default(),
        }
    }

    /// Whether the consumer may still deliver.
    pub(crate) fn is_receiving(&self) -> bool {
        self.receiving.get()
    }

    /// Lists the subscription as woken, so that its consumer is polled by
    /// the next dispatch.
    pub(crate) fn wake(&self) {
        self.waker.wake_by_ref();
    }

    /// Polls the consumer once, with the subscription's own waker. A stream
    /// that ended is remembered and never polled again.
    pub(crate) fn poll_receive(&self) -> Poll<Option<Result<Message, TransportError>>> {
        self.waker_state.unlist();
        let mut cx = Context::from_waker(&self.waker);
        let polled = match self.consumer.borrow_mut().as_mut() {
            Some(consumer) => consumer.poll_receive(&mut cx),
            None => Poll::Ready(None),
        };
        match &polled {
            Poll::Ready(Some(Ok(_))) => bump(&self.counters.received),
            Poll::Ready(Some(Err(_))) => bump(&self.counters.receive_errors),
            Poll::Ready(None) => self.receiving.set(false),
            Poll::Pending => {}
        }
        polled
    }

    /// Tells the broker the verdict on a message, now or, for a nack with a
    /// delay, once the delay has passed. Returns whether it held a nack
    /// back, which the engine's timer must then cover.
    pub(crate) fn settle(&self, verdict: Verdict, id: &MessageId) -> bool {
        if verdict == Verdict::Ack || self.nack_delay.is_zero() {
            self.send(verdict, id);
            return false;
        }
        let due = Instant::now()
            .checked_add(self.nack_delay)
            .unwrap_or_else(far_future);
        self.held.borrow_mut().push_back((due, id.clone()));
        true
    }

    /// Nacks a message without the delay.
    pub(crate) fn nack_at_once(&self, id: &MessageId) {
        self.send(Verdict::Nack, id);
    }

    fn send(&self, verdict: Verdict, id: &MessageId) {
        let sent = match self.consumer.borrow_mut().as_mut() {
            Some(consumer) => match verdict {
                Verdict::Ack => consumer.ack(id),
                Verdict::Nack => consumer.nack(id),
            },
            None => Err(TransportError::Closed),
        };
        let (done, failed) = match verdict {
            Verdict::Ack => (&self.counters.acked, &self.counters.acks_failed),
            Verdict::Nack => (&self.counters.nacked, &self.counters.nacks_failed),
        };
        match sent {
            Ok(()) => bump(done),
            Err(error) => {
                bump(failed);
                warn!(topic = %self.topic, message_id = %id, ?verdict, %error, "settling a message failed");
            }
        }
    }

    /// Sends the held nacks that are due by `now`; returns when the next one
    /// is due.
    pub(crate) fn send_due_nacks(&self, now: Instant) -> Option<Instant> {
        loop {
            let next = self.held.borrow().front().map(|(due, _)| *due);
            match next {
                Some(due) if due <= now => {
                    let (_, id) = self.held.borrow_mut().pop_front().expect("a held nack");
                    self.send(Verdict::Nack, &id);
                }
                other => return other,
            }
        }
    }

    /// Sends every held nack at once (shutdown does not wait for delays).
    pub(crate) fn send_held_nacks(&self) {
        let held: Vec<_> = self.held.borrow_mut().drain(..).collect();
        for (_, id) in held {
            self.send(Verdict::Nack, &id);
        }
    }

    /// Closes the consumer, after every settlement queued before.
    pub(crate) async fn close(&self) {
        let Some(mut consumer) = self.consumer.borrow_mut().take() else {
            return;
        };
        self.receiving.set(false);
        match consumer.close().await {
            Ok(()) => debug!(topic = %self.topic, "consumer closed"),
            Err(error) => warn!(topic = %self.topic, %error, "closing the consumer failed"),
        }
    }

    pub(crate) fn stats(&self) -> SubscriptionStats {
        self.counters.snapshot(
            &self.info.topic,
            self.info.subscription.as_deref(),
            self.info.priority,
        )
    }
}

/// A time so far ahead that it stands for "never" (about 30 years).
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(60 * 60 * 24 * 365 * 30)
}
