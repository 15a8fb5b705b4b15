//! Health and statistics of a per-core group, read from outside its
//! threads.
//!
//! A dispatcher is `!Send`, so only its own thread may look at it. Each
//! worker therefore runs a small task that answers queries sent over a
//! channel, and the [`Monitor`] holds the sending ends. Every query carries
//! a `oneshot` for its answer; one dropped unanswered (the dispatcher is
//! gone, or its thread ended and dropped the queue) reads as `None`, so a
//! query never waits on a group that has ended.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tracing::debug;

use crate::engine::{DispatcherStats, Health};
use crate::handle::CloseHandle;

/// Asks the dispatchers of a [`PerCore`](super::PerCore) group for their
/// health and statistics from any thread or runtime. `Send`, `Sync` and
/// cheap to clone; it stays usable after [`PerCore::join`](super::PerCore::join)
/// and then reports every core as gone.
///
/// Each core answers on its own thread, between its other tasks: a core
/// whose thread is blocked (a handler that blocks instead of awaiting)
/// answers late, so give a probe a timeout. A monitor exists only once
/// [`PerCore::start`](super::PerCore::start) has built every dispatcher;
/// right after, a core may report
/// [`HealthPhase::Idle`](crate::HealthPhase::Idle) until its worker has
/// started running.
///
/// ```no_run
/// # async fn probe(monitor: pulsar_dispatcher::per_core::Monitor) {
/// use std::time::Duration;
///
/// let ready = tokio::time::timeout(Duration::from_secs(1), monitor.health())
///     .await
///     .is_ok_and(|health| health.is_ready());
/// # }
/// ```
#[derive(Clone)]
pub struct Monitor {
    cores: Arc<[mpsc::UnboundedSender<Query>]>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let alive = self.cores.iter().filter(|core| !core.is_closed()).count();
        f.debug_struct("Monitor")
            .field("cores", &self.cores.len())
            .field("threads_alive", &alive)
            .finish()
    }
}

impl Monitor {
    /// A monitor for `cores` dispatchers, and the query queue each worker
    /// answers, by core index.
    pub(super) fn new(cores: usize) -> (Monitor, Vec<Queries>) {
        let (senders, queues) = (0..cores)
            .map(|_| {
                let (sender, receiver) = mpsc::unbounded_channel();
                (sender, Queries(receiver))
            })
            .unzip::<_, _, Vec<_>, Vec<_>>();
        let monitor = Monitor {
            cores: senders.into(),
        };
        (monitor, queues)
    }

    /// Every core's [`Health`], by core index.
    pub async fn health(&self) -> GroupHealth {
        GroupHealth {
            cores: self.ask(Query::Health).await,
        }
    }

    /// Every core's [`DispatcherStats`], by core index; `None` for a
    /// dispatcher that has stopped or whose thread ended.
    pub async fn stats(&self) -> Vec<Option<DispatcherStats>> {
        self.ask(Query::Stats).await
    }

    /// Sends the query to every core before awaiting any answer, so the
    /// cores answer side by side.
    ///
    /// An answer is awaited until its core's queue is gone as well: a
    /// query sent in the instant its core drops the queue can stay in the
    /// channel, neither answered nor dropped (tokio's send checks that the
    /// channel is open, then pushes), for as long as this monitor lives.
    async fn ask<T>(&self, query: fn(Reply<T>) -> Query) -> Vec<Option<T>> {
        let answers: Vec<_> = self
            .cores
            .iter()
            .map(|core| {
                let (reply, answer) = oneshot::channel();
                // A failed send drops the reply with the query: its
                // answer below reads as `None`.
                let _ = core.send(query(reply));
                (core, answer)
            })
            .collect();
        let mut results = Vec::with_capacity(answers.len());
        for (core, mut answer) in answers {
            let answered = tokio::select! {
                biased;
                answered = &mut answer => answered.ok(),
                () = core.closed() => answer.try_recv().ok(),
            };
            results.push(answered.flatten());
        }
        results
    }
}

/// The health of every dispatcher of a group, as [`Monitor::health`]
/// reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupHealth {
    /// Each dispatcher's health, by core index; `None` for a dispatcher
    /// that has stopped or whose thread ended.
    pub cores: Vec<Option<Health>>,
}

impl GroupHealth {
    /// Whether every dispatcher is there and alive (a liveness check; see
    /// [`Health::is_live`]).
    pub fn is_live(&self) -> bool {
        self.all(Health::is_live)
    }

    /// Whether every dispatcher is there and ready (a readiness check; see
    /// [`Health::is_ready`]).
    pub fn is_ready(&self) -> bool {
        self.all(Health::is_ready)
    }

    fn all(&self, check: fn(&Health) -> bool) -> bool {
        self.cores
            .iter()
            .all(|core| core.as_ref().is_some_and(check))
    }
}

/// Where a core sends its answer: `None` if its dispatcher is gone.
type Reply<T> = oneshot::Sender<Option<T>>;

/// A question for one core.
enum Query {
    Health(Reply<Health>),
    Stats(Reply<DispatcherStats>),
}

/// The queries one worker answers.
pub(super) struct Queries(mpsc::UnboundedReceiver<Query>);

impl Queries {
    /// Answers queries about `dispatcher` until every monitor is gone. The
    /// handle is weak, so this does not keep the dispatcher alive; the
    /// worker's `LocalSet` drops this task (and the queue with it) when the
    /// worker ends.
    pub(super) async fn answer(mut self, core: usize, dispatcher: CloseHandle) {
        while let Some(query) = self.0.recv().await {
            // A failed send means the asker stopped waiting (a timeout):
            // there is no one to tell.
            match query {
                Query::Health(reply) => {
                    let _ = reply.send(dispatcher.health());
                }
                Query::Stats(reply) => {
                    let _ = reply.send(dispatcher.stats());
                }
            }
        }
        debug!(core, "every monitor is gone; no more health queries");
    }
}
