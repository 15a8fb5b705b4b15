//! Handles on a running dispatcher: closing it from another task
//! ([`CloseHandle`]), and changing or inspecting one subscription
//! ([`SubscriptionHandle`]) or a topic family ([`FamilyHandle`]).
//!
//! Handles are cheap to clone and hold the dispatcher weakly: a handler that
//! keeps one does not keep its own dispatcher alive, and a handle outlives
//! its dispatcher harmlessly.

use std::rc::{Rc, Weak};
use std::time::Duration;

use crate::engine::{Control, DispatcherStats, Health, SubscriptionId, SubscriptionStats};
use crate::error::Error;
use crate::outcome::SubscriptionInfo;

/// Closes a [`Dispatcher`](crate::Dispatcher) from elsewhere on its thread. Cheap to clone.
///
/// ```no_run
/// # async fn example(dispatcher: pulsar_dispatcher::Dispatcher) {
/// let closer = dispatcher.close_handle();
/// tokio::task::spawn_local(async move {
///     tokio::signal::ctrl_c().await.ok();
///     closer.close().await;
/// });
/// dispatcher.run().await.expect("clean shutdown");
/// # }
/// ```
#[derive(Clone)]
pub struct CloseHandle {
    /// Weak, so that a handler holding the handle does not keep its own
    /// dispatcher alive.
    engine: Weak<dyn Control>,
}

impl std::fmt::Debug for CloseHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CloseHandle")
            .field("dispatcher_alive", &(self.engine.strong_count() > 0))
            .finish()
    }
}

impl CloseHandle {
    /// The same as [`Dispatcher::close`](crate::Dispatcher::close). Returns at once if the dispatcher
    /// is gone.
    pub async fn close(&self) {
        if let Some(engine) = self.engine.upgrade() {
            engine.close_dyn().await
        }
    }

    /// The same as [`Dispatcher::close_within`](crate::Dispatcher::close_within); 0 if the dispatcher is
    /// gone.
    pub async fn close_within(&self, limit: Duration) -> usize {
        match self.engine.upgrade() {
            Some(engine) => engine.close_within_dyn(limit).await,
            None => 0,
        }
    }

    /// The same as [`Dispatcher::health`](crate::Dispatcher::health);
    /// `None` if the dispatcher is gone.
    pub fn health(&self) -> Option<Health> {
        self.engine.upgrade().map(|engine| engine.health())
    }

    /// The same as [`Dispatcher::stats`](crate::Dispatcher::stats); `None` if the dispatcher is gone.
    pub fn stats(&self) -> Option<DispatcherStats> {
        self.engine.upgrade().map(|engine| engine.stats())
    }
}

impl CloseHandle {
    pub(crate) fn new(engine: &Rc<dyn Control>) -> Self {
        CloseHandle {
            engine: Rc::downgrade(engine),
        }
    }
}

/// One subscription of a dispatcher, as [`Dispatcher::subscribe`](crate::Dispatcher::subscribe)
/// returns it: change its priority at run time, look at it, or pass it to
/// [`Dispatcher::unsubscribe`](crate::Dispatcher::unsubscribe).
///
/// ```no_run
/// # async fn example(dispatcher: pulsar_dispatcher::Dispatcher) -> Result<(), pulsar_dispatcher::Error> {
/// use pulsar_dispatcher::{Message, SubscribeOptions};
///
/// let reports = dispatcher
///     .subscribe(
///         "reports",
///         async |_: &Message| Ok::<(), std::convert::Infallible>(()),
///         SubscribeOptions::new().priority(50),
///     )
///     .await?;
/// // Month end: reports go first from the next pick on.
/// reports.set_priority(1)?;
/// // Later: stop consuming reports; running handlers finish, and messages
/// // received but not started go back to the broker.
/// dispatcher.unsubscribe(reports).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SubscriptionHandle {
    engine: Weak<dyn Control>,
    id: SubscriptionId,
    topic: Rc<str>,
}

impl std::fmt::Debug for SubscriptionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubscriptionHandle")
            .field("topic", &self.topic)
            .field("registered", &self.info().is_some())
            .finish()
    }
}

impl SubscriptionHandle {
    pub(crate) fn new(engine: &Rc<dyn Control>, id: SubscriptionId, topic: &str) -> Self {
        SubscriptionHandle {
            engine: Rc::downgrade(engine),
            id,
            topic: Rc::from(topic),
        }
    }

    /// The full topic name.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Moves the subscription to another priority, effective at the next
    /// pick; a message it holds moves with it. Fails with
    /// [`Error::UnknownSubscription`] once it is unsubscribed or its
    /// dispatcher is gone.
    pub fn set_priority(&self, priority: i64) -> Result<(), Error> {
        let changed = self
            .engine
            .upgrade()
            .is_some_and(|engine| engine.set_priority(self.id, priority));
        if changed {
            Ok(())
        } else {
            Err(self.unknown())
        }
    }

    /// What the dispatcher knows about the subscription (its current
    /// priority included); `None` once it is gone.
    pub fn info(&self) -> Option<SubscriptionInfo> {
        self.engine.upgrade()?.subscription_info(self.id)
    }

    /// The subscription's counters; `None` once it is gone.
    pub fn stats(&self) -> Option<SubscriptionStats> {
        self.engine.upgrade()?.subscription_stats(self.id)
    }

    /// Whether the handle is one of `engine`'s.
    pub(crate) fn belongs_to(&self, engine: &Rc<dyn Control>) -> bool {
        std::ptr::addr_eq(self.engine.as_ptr(), Rc::as_ptr(engine))
    }

    pub(crate) fn id(&self) -> SubscriptionId {
        self.id
    }

    pub(crate) fn unknown(&self) -> Error {
        Error::UnknownSubscription {
            topic: self.topic.to_string(),
        }
    }
}

/// The subscriptions of one topic family, as
/// [`Dispatcher::subscribe_family`](crate::Dispatcher::subscribe_family)
/// returns them: remove them together with
/// [`Dispatcher::unsubscribe_family`](crate::Dispatcher::unsubscribe_family).
#[derive(Clone, Debug)]
pub struct FamilyHandle {
    members: Vec<SubscriptionHandle>,
}

impl FamilyHandle {
    pub(crate) fn new(members: Vec<SubscriptionHandle>) -> Self {
        FamilyHandle { members }
    }

    /// One handle per member topic, in the family's order.
    pub fn members(&self) -> &[SubscriptionHandle] {
        &self.members
    }

    pub(crate) fn into_members(self) -> Vec<SubscriptionHandle> {
        self.members
    }
}
