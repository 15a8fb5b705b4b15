//! Registering subscriptions, before or while the dispatcher runs:
//! creating their consumers and producers, adding them to the scheduler,
//! changing their priority, removing them again, and what is known about
//! them.

use std::any::TypeId;
use std::rc::Rc;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::subscription::{Recording, Subscription, SubscriptionId, SubscriptionSpec};
use super::worker::WorkerPool;
use super::{wait_until, DispatcherStats, Engine, Handler, Phase, SubscriptionStats};
use crate::error::Error;
use crate::message::Message;
use crate::outcome::{HandlerError, IntoReply, SubscriptionInfo};
use crate::routing::TakenProducers;
use crate::topic::overlap;
use crate::transport::{Consumer, Transport};

impl<T: Transport> Engine<T> {
    /// Creates a consumer for every spec, then registers them all at once,
    /// with one handler. If any creation fails, or in the meantime the
    /// dispatcher began to close or the same subscription was registered,
    /// closes what it created and registers nothing.
    pub(crate) async fn subscribe_all<F, R, E>(
        &self,
        specs: Vec<SubscriptionSpec>,
        handler: F,
    ) -> Result<Vec<SubscriptionId>, Error>
    where
        F: AsyncFn(&Message) -> Result<R, E> + 'static,
        R: IntoReply + 'static,
        E: Into<HandlerError> + 'static,
    {
        let Some(first) = specs.first() else {
            return Ok(Vec::new());
        };
        let first_topic = first.consumer.topic.clone();
        self.accepting_subscriptions(&first_topic)?;
        self.not_yet_subscribed(&specs)?;
        let mut consumers = Vec::with_capacity(specs.len());
        // The producers this call took: given up again if it fails, so
        // that those it made go with its consumers.
        let mut taken = TakenProducers::new(&self.router);
        for spec in &specs {
            match self.create(spec, &mut taken).await {
                Ok(consumer) => consumers.push(consumer),
                Err(error) => {
                    close_consumers::<T>(consumers, "of a failed subscribe").await;
                    taken.give_back().await;
                    // A close that began meanwhile is the cause to report
                    // (it also fails the creations still under way).
                    return Err(self
                        .accepting_subscriptions(&first_topic)
                        .err()
                        .unwrap_or(error));
                }
            }
        }
        // Asked again: the same subscription may have been made meanwhile.
        let accepted = self
            .accepting_subscriptions(&first_topic)
            .and_then(|()| self.not_yet_subscribed(&specs));
        if let Err(refused) = accepted {
            close_consumers::<T>(consumers, "of a refused subscribe").await;
            taken.give_back().await;
            return Err(refused);
        }
        taken.keep();
        let pool = self
            .pools
            .borrow_mut()
            .entry(TypeId::of::<F>())
            .or_insert_with(|| WorkerPool::<T, F, R, E>::new())
            .clone();
        let handler = WorkerPool::<T, F, R, E>::handler(pool, handler);
        let ids: Vec<_> = specs
            .into_iter()
            .zip(consumers)
            .map(|(spec, consumer)| self.register(spec, consumer, handler.clone()))
            .collect();
        if self.phase() == Phase::Running {
            self.warn_about_retry_topics();
        }
        Ok(ids)
    }

    /// Creates a subscription's consumer and the producers it publishes
    /// with (so that a topic the broker refuses fails `subscribe`, not every
    /// message later), within the subscription's time limit.
    async fn create(
        &self,
        spec: &SubscriptionSpec,
        taken: &mut TakenProducers<'_, T>,
    ) -> Result<T::Consumer, Error> {
        let topic = &spec.consumer.topic;
        let timed_out = || Error::SubscribeTimeout {
            topic: topic.clone(),
            subscription: spec.consumer.subscription.clone(),
            waited: spec.subscribe_timeout,
        };
        let deadline = Instant::now() + spec.subscribe_timeout;
        // The transport's futures may be large (the `pulsar` crate's are,
        // in debug builds); boxed, they do not make every future around
        // them, and the stack that polls them, large too.
        let subscribing = Box::pin(self.transport.subscribe(&spec.consumer));
        let consumer = match tokio::time::timeout_at(deadline, subscribing).await {
            Ok(Ok(consumer)) => consumer,
            Ok(Err(source)) => {
                return Err(Error::Subscribe {
                    topic: topic.clone(),
                    source,
                })
            }
            Err(_) => return Err(timed_out()),
        };
        let preparing = Box::pin(self.router.prepare(&self.transport, &spec.routing, taken));
        let prepared = tokio::time::timeout_at(deadline, preparing).await;
        let failure = match prepared {
            Ok(Ok(())) => return Ok(consumer),
            Ok(Err((topic, source))) => Error::Producer { topic, source },
            Err(_) => match taken.creating.take() {
                Some(producer_topic) => Error::ProducerTimeout {
                    topic: producer_topic,
                    subscribed: topic.clone(),
                    waited: spec.subscribe_timeout,
                },
                None => timed_out(),
            },
        };
        close_consumers::<T>(vec![consumer], "of a failed subscribe").await;
        Err(failure)
    }

    /// Refuses a topic this dispatcher already consumes with a
    /// subscription of the same name, whole or by one of its partitions
    /// (named either way, a partition would have two consumers here).
    fn not_yet_subscribed(&self, specs: &[SubscriptionSpec]) -> Result<(), Error> {
        let subscriptions = self.subscriptions.borrow();
        for spec in specs {
            let Some(name) = &spec.consumer.subscription else {
                continue;
            };
            let taken = subscriptions.iter().any(|(_, existing)| {
                overlap(&existing.info.topic, &spec.consumer.topic)
                    && existing.info.subscription.as_ref() == Some(name)
            });
            if taken {
                return Err(Error::AlreadySubscribed {
                    topic: spec.consumer.topic.clone(),
                    subscription: name.clone(),
                });
            }
        }
        Ok(())
    }

    fn accepting_subscriptions(&self, topic: &str) -> Result<(), Error> {
        match self.phase() {
            Phase::Idle | Phase::Running => Ok(()),
            phase => Err(Error::SubscribeNotAllowed {
                topic: topic.to_owned(),
                state: phase.describe(),
            }),
        }
    }

    fn register(
        &self,
        spec: SubscriptionSpec,
        consumer: T::Consumer,
        handler: Handler<T>,
    ) -> SubscriptionId {
        self.router.register(&spec.routing);
        let key = self.scheduler.borrow_mut().add(spec.scheduling);
        let serial = self.next_serial.get();
        self.next_serial.set(serial + 1);
        let subscription = {
            let mut subscriptions = self.subscriptions.borrow_mut();
            let entry = subscriptions.vacant_entry();
            let id = SubscriptionId {
                index: entry.key(),
                serial,
            };
            let subscription = Rc::new(Subscription::new(
                id,
                key,
                spec,
                consumer,
                handler,
                self.woken.clone(),
                Recording {
                    timings: self.timings,
                    metrics: self.metrics_interval.is_some(),
                },
            ));
            entry.insert(subscription.clone());
            subscription
        };
        if self.phase() == Phase::Running {
            // Polled at once, which also hands the consumer its waker.
            subscription.wake();
        }
        subscription.id
    }

    /// The subscription `id` names, if it is still registered.
    pub(crate) fn subscription(&self, id: SubscriptionId) -> Option<Rc<Subscription<T>>> {
        self.subscriptions
            .borrow()
            .get(id.index)
            .filter(|subscription| subscription.id == id)
            .cloned()
    }

    /// Every registered subscription, in the order they were made.
    pub(super) fn all_subscriptions(&self) -> Vec<Rc<Subscription<T>>> {
        let mut all: Vec<_> = self
            .subscriptions
            .borrow()
            .iter()
            .map(|(_, subscription)| subscription.clone())
            .collect();
        all.sort_by_key(|subscription| subscription.id.serial);
        all
    }

    /// The registered subscriptions, in the order they were made, with
    /// their current priorities.
    pub(crate) fn subscription_infos(&self) -> Vec<SubscriptionInfo> {
        self.all_subscriptions()
            .iter()
            .map(|subscription| {
                let mut info = subscription.info.clone();
                info.priority = self.scheduler.borrow().priority(subscription.key);
                info
            })
            .collect()
    }

    pub(crate) fn stats(&self) -> DispatcherStats {
        let subscriptions = self
            .all_subscriptions()
            .iter()
            .map(|subscription| self.stats_of(subscription))
            .collect();
        let running = self.running();
        let scheduler = self.scheduler.borrow();
        DispatcherStats {
            subscriptions,
            in_flight: running,
            waiting: scheduler.waiting(),
            concurrency: scheduler.in_flight() + scheduler.available(),
        }
    }

    /// A subscription's numbers, with where it stands in the scheduler.
    pub(super) fn stats_of(&self, subscription: &Subscription<T>) -> SubscriptionStats {
        let scheduler = self.scheduler.borrow();
        let (waiting, in_flight) = scheduler.load(subscription.key);
        let running = in_flight - subscription.resting.get();
        subscription.stats(scheduler.priority(subscription.key), waiting, running)
    }

    /// Moves a subscription to another priority; false if it is gone.
    pub(crate) fn set_priority(&self, id: SubscriptionId, priority: i64) -> bool {
        let Some(subscription) = self.subscription(id) else {
            return false;
        };
        let before = self.stats_of(&subscription);
        self.scheduler
            .borrow_mut()
            .set_priority(subscription.key, priority);
        subscription.relabel(priority, &before);
        // A message it holds may now be the best: whoever dispatches next
        // will see it.
        self.woken.wake_engine();
        true
    }

    /// Removes a subscription: it stops receiving, what it holds and has not
    /// started is nacked at once, its handlers finish, its held nacks are sent,
    /// its consumer is closed, and its place is freed. Other subscriptions
    /// go on meanwhile. Returns false if it was gone already.
    ///
    /// The removal runs in a task of its own, as a close does, and every
    /// call waits for it: a caller dropped mid-way (a timeout around the
    /// call) neither stops it half-way nor leaves a later call waiting for
    /// a removal that nobody finishes.
    pub(crate) async fn unsubscribe(self: &Rc<Self>, id: SubscriptionId) -> bool {
        let Some(subscription) = self.subscription(id) else {
            return false;
        };
        if !subscription.is_removing() {
            subscription.start_removing();
            // What it holds has not started: handed back now, not after
            // every better priority's backlog (under strict priority it
            // would wait for them all).
            while let Some(held) = self.scheduler.borrow_mut().take_held(subscription.key) {
                self.give_back(&subscription, held.message);
            }
            tokio::task::spawn_local(self.clone().remove(id, subscription));
        }
        wait_until(&self.drained, || {
            self.subscription(id).is_none() || self.phase() == Phase::Closed
        })
        .await;
        true
    }

    /// The removal [`unsubscribe`](Self::unsubscribe) starts.
    async fn remove(self: Rc<Self>, id: SubscriptionId, subscription: Rc<Subscription<T>>) {
        debug!(topic = %subscription.topic, "unsubscribing");
        wait_until(&self.drained, || {
            let (held, in_flight) = self.scheduler.borrow().load(subscription.key);
            (held == 0 && in_flight == 0) || self.phase() == Phase::Closed
        })
        .await;
        self.close_consumer(&subscription).await;
        if self.phase() != Phase::Closed {
            // Shutdown closes every producer itself.
            let topics = subscription.routing.producer_topics();
            self.survive("closing the producers", self.router.release(&topics))
                .await;
        }
        if self.metrics_interval.is_some() {
            // Its last numbers: what it counted since the last tick would
            // otherwise never reach the recorder.
            subscription.publish(&self.stats_of(&subscription), Instant::now());
        }
        if self.phase() != Phase::Closed {
            let removed = self
                .scheduler
                .borrow_mut()
                .remove_subscription(subscription.key);
            debug_assert!(removed, "a drained subscription leaves the scheduler");
            self.subscriptions.borrow_mut().remove(id.index);
            self.timed
                .borrow_mut()
                .retain(|watched| !Rc::ptr_eq(watched, &subscription));
        }
        self.drained.notify_waiters();
        info!(topic = %subscription.topic, "unsubscribed");
    }
}

async fn close_consumers<T: Transport>(consumers: Vec<T::Consumer>, which: &str) {
    for mut consumer in consumers {
        if let Err(error) = consumer.close().await {
            warn!(%error, "closing a consumer {which} failed");
        }
    }
}
