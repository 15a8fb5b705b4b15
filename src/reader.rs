//! Readers: one task per subscription that owns its consumer.
//!
//! A reader takes a message from its consumer only when its subscription's
//! slot is empty, so a busy subscription stops asking the broker for more
//! (backpressure per subscription, not global). Because the consumer needs
//! exclusive access both to receive and to settle, the reader also applies
//! the acks and nacks that handler tasks queue for it, and holds back nacks
//! for the subscription's negative-ack delay with a single timer. It stops
//! receiving when shutdown starts and keeps settling until every handler has
//! finished; then it sends the nacks it was holding and closes the consumer.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::{pending, poll_fn};
use std::pin::Pin;
use std::rc::Rc;
use std::time::Duration;

use tokio::time::{sleep_until, Instant, Sleep};
use tracing::{debug, warn};

use crate::dispatcher::{Core, Phase};
use crate::error::Error;
use crate::message::{Message, MessageId};
use crate::process::Spawn;
use crate::routing::RoutingPolicy;
use crate::scheduler::{Rejected, SubscriptionKey};
use crate::sync::LocalNotify;
use crate::transport::{Consumer, Transport};

/// What a handler task asks its reader to do with a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Ack,
    Nack,
}

/// Everything about one subscription that its reader and its handler tasks
/// share.
pub(crate) struct SubscriptionContext<T: Transport> {
    pub(crate) key: SubscriptionKey,
    pub(crate) topic: Rc<str>,
    pub(crate) handler: Rc<dyn Spawn<T>>,
    pub(crate) nack_delay: Duration,
    pub(crate) routing: RoutingPolicy,
    /// Settlements waiting for the reader, in the order they were decided.
    requests: RefCell<VecDeque<(MessageId, Verdict)>>,
    /// Wakes the reader for a settlement or a change of phase.
    wake: LocalNotify,
}

impl<T: Transport> SubscriptionContext<T> {
    pub(crate) fn new(
        key: SubscriptionKey,
        topic: Rc<str>,
        handler: Rc<dyn Spawn<T>>,
        nack_delay: Duration,
        routing: RoutingPolicy,
    ) -> Self {
        SubscriptionContext {
            key,
            topic,
            handler,
            nack_delay,
            routing,
            requests: RefCell::default(),
            wake: LocalNotify::default(),
        }
    }

    pub(crate) fn request(&self, id: MessageId, verdict: Verdict) {
        self.requests.borrow_mut().push_back((id, verdict));
        self.wake.notify();
    }

    pub(crate) fn wake_reader(&self) {
        self.wake.notify();
    }

    fn next_request(&self) -> Option<(MessageId, Verdict)> {
        self.requests.borrow_mut().pop_front()
    }
}

/// Runs one subscription's reader until every handler has finished.
/// Failures are reported to `core`, which starts shutdown.
pub(crate) async fn read<T: Transport>(
    core: Rc<Core<T>>,
    subscription: Rc<SubscriptionContext<T>>,
    mut consumer: T::Consumer,
) {
    let topic = &subscription.topic;
    let mut held = HeldNacks::new(subscription.nack_delay);
    let mut consumer_alive = true;
    loop {
        apply_requests(&subscription, &mut consumer, &mut held).await;
        let phase = core.phase();
        if phase == Phase::Drained {
            break;
        }
        let receiving = consumer_alive && phase == Phase::Running;
        tokio::select! {
            biased;
            () = subscription.wake.notified() => {}
            id = held.next_due() => nack(&mut consumer, topic, id).await,
            received = next_message(&core, subscription.key, &mut consumer), if receiving => {
                match received {
                    Some(Ok(message)) => offer(&core, &subscription, &mut consumer, message).await,
                    Some(Err(error)) => warn!(%topic, %error, "receiving failed"),
                    None => {
                        consumer_alive = false;
                        core.fail(Error::ConsumerEnded { topic: topic.to_string() });
                    }
                }
            }
        }
    }
    apply_requests(&subscription, &mut consumer, &mut held).await;
    for id in held.take_all() {
        nack(&mut consumer, topic, id).await;
    }
    if let Err(error) = consumer.close().await {
        warn!(%topic, %error, "closing the consumer failed");
    }
    debug!(%topic, "reader stopped");
}

async fn next_message<T: Transport>(
    core: &Core<T>,
    key: SubscriptionKey,
    consumer: &mut T::Consumer,
) -> Option<Result<Message, crate::transport::TransportError>> {
    poll_fn(|cx| core.scheduler().poll_vacancy(key, cx)).await;
    consumer.receive().await
}

async fn offer<T: Transport>(
    core: &Core<T>,
    subscription: &Rc<SubscriptionContext<T>>,
    consumer: &mut T::Consumer,
    message: Message,
) {
    let delivery = Delivery {
        subscription: subscription.clone(),
        message,
    };
    let rejected = match core.scheduler().try_insert(subscription.key, delivery) {
        Ok(()) => return,
        Err(Rejected::Closed(delivery) | Rejected::Full(delivery)) => delivery,
    };
    // Received after shutdown began: hand it straight back to the broker.
    debug!(topic = %subscription.topic, message_id = %rejected.message.id(), "not queued; nacking");
    nack(consumer, &subscription.topic, rejected.message.id).await;
}

async fn apply_requests<T: Transport>(
    subscription: &SubscriptionContext<T>,
    consumer: &mut T::Consumer,
    held: &mut HeldNacks,
) {
    while let Some((id, verdict)) = subscription.next_request() {
        match verdict {
            Verdict::Ack => {
                if let Err(error) = consumer.ack(id.clone()).await {
                    warn!(topic = %subscription.topic, message_id = %id, %error, "ack failed");
                }
            }
            Verdict::Nack if held.delay.is_zero() => nack(consumer, &subscription.topic, id).await,
            Verdict::Nack => held.push(id),
        }
    }
}

async fn nack<C: Consumer>(consumer: &mut C, topic: &str, id: MessageId) {
    if let Err(error) = consumer.nack(id.clone()).await {
        warn!(%topic, message_id = %id, %error, "nack failed");
    }
}

/// A message in a slot, with the subscription it came from.
pub(crate) struct Delivery<T: Transport> {
    pub(crate) subscription: Rc<SubscriptionContext<T>>,
    pub(crate) message: Message,
}

/// Nacks waiting out the negative-ack delay. The delay is the same for every
/// message of a subscription, so deadlines arrive in order and one timer,
/// created on first use and reset thereafter, serves them all.
struct HeldNacks {
    delay: Duration,
    due: VecDeque<(Instant, MessageId)>,
    timer: Option<Pin<Box<Sleep>>>,
}

impl HeldNacks {
    fn new(delay: Duration) -> Self {
        HeldNacks {
            delay,
            due: VecDeque::new(),
            timer: None,
        }
    }

    fn push(&mut self, id: MessageId) {
        self.due.push_back((Instant::now() + self.delay, id));
    }

    /// The next nack whose delay has passed. Cancel-safe: the entry leaves
    /// the queue only when this returns.
    async fn next_due(&mut self) -> MessageId {
        let Some(&(deadline, _)) = self.due.front() else {
            return pending().await;
        };
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(sleep_until(deadline)));
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        timer.as_mut().await;
        self.due.pop_front().expect("a due nack").1
    }

    fn take_all(&mut self) -> impl Iterator<Item = MessageId> + '_ {
        self.due.drain(..).map(|(_, id)| id)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;
    use crate::transport::MemoryTransport;
    use crate::{Dispatcher, SubscribeOptions};

    /// Readers only receive while the scheduler is open and insert in the
    /// same step, so this path is a safety net: a message that cannot be
    /// queued goes straight back to the broker.
    #[test]
    fn a_message_received_after_the_scheduler_closed_is_nacked_at_once() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&runtime, async {
            let transport = MemoryTransport::new();
            let dispatcher = Dispatcher::builder().build(transport.clone()).unwrap();
            dispatcher
                .subscribe(
                    "jobs",
                    async |_: &Message| Ok::<_, Infallible>(()),
                    SubscribeOptions::new(),
                )
                .await
                .unwrap();
            let (core, contexts) = dispatcher.internals();
            let mut consumer = transport
                .subscribe("persistent://public/default/jobs", &SubscribeOptions::new())
                .await
                .unwrap();
            let id = transport.send("jobs", "late");
            let message = consumer.receive().await.unwrap().unwrap();
            core.scheduler().close();
            offer(&core, &contexts[0], &mut consumer, message).await;
            assert_eq!(transport.nacked("jobs"), [id]);
            assert!(core.scheduler().has_vacancy(contexts[0].key));
        });
    }
}
