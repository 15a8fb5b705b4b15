//! Health: where a dispatcher is in its life and whether each subscription
//! is receiving, for liveness and readiness checks.

use std::time::Duration;

use tokio::time::Instant;

use super::Engine;
use crate::transport::Transport;

/// Where a dispatcher is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Phase {
    /// Built, `run()` not called yet.
    Idle,
    /// Receiving and dispatching.
    Running,
    /// Shutting down: no longer receiving, finishing what it holds.
    Draining,
    /// Closed.
    Closed,
}

/// A dispatcher's health, as [`Dispatcher::health`](crate::Dispatcher::health)
/// reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// Where the dispatcher is in its life.
    pub phase: Phase,
    /// Per subscription, in the order they were registered.
    pub subscriptions: Vec<SubscriptionHealth>,
    /// Handlers running now.
    pub in_flight: usize,
}

impl Health {
    /// Whether the dispatcher is alive: not closed (a liveness check).
    pub fn is_live(&self) -> bool {
        self.phase != Phase::Closed
    }

    /// Whether it is running and every subscription is receiving (a
    /// readiness check).
    pub fn is_ready(&self) -> bool {
        self.phase == Phase::Running && self.subscriptions.iter().all(|s| s.receiving)
    }

    /// Handlers running past their processing deadline, in total.
    pub fn overdue_handlers(&self) -> usize {
        self.subscriptions.iter().map(|s| s.overdue_handlers).sum()
    }
}

/// One subscription's health.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriptionHealth {
    /// The full topic name.
    pub topic: String,
    /// The subscription name, if one was given.
    pub subscription: Option<String>,
    /// Whether its consumer is open and delivering: not closed, its stream
    /// not ended, no receive errors in a row, not being removed.
    pub receiving: bool,
    /// How long ago it last received a message (to within the metrics
    /// publishing interval; with metrics off, to within the time since the
    /// previous `health()` call); `None` if it never has.
    pub last_received: Option<Duration>,
    /// Its handlers still running past their processing deadline (a handler
    /// is dropped at its next `.await` after the deadline, so this stays 0
    /// unless a handler blocks the thread).
    pub overdue_handlers: usize,
}

impl<T: Transport> Engine<T> {
    pub(crate) fn health(&self) -> Health {
        let now = Instant::now();
        let phase = match self.phase() {
            super::Phase::Idle => Phase::Idle,
            super::Phase::Running => Phase::Running,
            super::Phase::Stopping | super::Phase::Drained => Phase::Draining,
            super::Phase::Closed => Phase::Closed,
        };
        Health {
            phase,
            subscriptions: self
                .all_subscriptions()
                .iter()
                .map(|subscription| subscription.health(now))
                .collect(),
            in_flight: self.running(),
        }
    }
}
