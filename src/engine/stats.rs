//! Counters the engine keeps for every subscription, and the snapshot
//! [`Dispatcher::stats`](crate::Dispatcher::stats) returns.
//!
//! Each counter is a `Cell` bumped where the event happens (a plain add on
//! one thread, nothing recorded elsewhere); reading them copies them into a
//! plain struct.

use std::cell::Cell;

/// Counters of one subscription since it was registered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriptionStats {
    /// The full topic name.
    pub topic: String,
    /// The subscription name, if one was given.
    pub subscription: Option<String>,
    /// The scheduling priority.
    pub priority: i64,
    /// Messages taken from the consumer.
    pub received: u64,
    /// Messages handed to the handler.
    pub dispatched: u64,
    /// Handler calls that returned `Ok`.
    pub succeeded: u64,
    /// Handler calls that returned `Err`.
    pub failed: u64,
    /// Handler calls that panicked.
    pub panicked: u64,
    /// Handler calls dropped at their processing deadline.
    pub deadline_exceeded: u64,
    /// Messages republished to the retry topic.
    pub retried: u64,
    /// Messages published to a dead letter topic.
    pub dead_lettered: u64,
    /// Replies published.
    pub replied: u64,
    /// Acknowledgements handed to the transport.
    pub acked: u64,
    /// Negative acknowledgements handed to the transport (held ones once
    /// their delay has passed).
    pub nacked: u64,
    /// Acknowledgements the transport refused; each is logged too.
    pub acks_failed: u64,
    /// Negative acknowledgements the transport refused; each is logged too.
    pub nacks_failed: u64,
    /// Errors the consumer returned instead of a message.
    pub receive_errors: u64,
    /// Messages the broker delivered again after they had been acked (the
    /// ack was lost with a connection): acked again, not handled again.
    pub redelivered_after_ack: u64,
}

/// A snapshot of a dispatcher's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DispatcherStats {
    /// Per subscription, in the order they were registered.
    pub subscriptions: Vec<SubscriptionStats>,
    /// Handlers running now.
    pub in_flight: usize,
    /// Messages waiting in slots for a permit.
    pub waiting: usize,
    /// The concurrency limit.
    pub concurrency: usize,
}

impl DispatcherStats {
    /// The sum of every subscription's counters (topic and subscription
    /// left empty).
    pub fn total(&self) -> SubscriptionStats {
        let mut total = SubscriptionStats::default();
        for s in &self.subscriptions {
            total.received += s.received;
            total.dispatched += s.dispatched;
            total.succeeded += s.succeeded;
            total.failed += s.failed;
            total.panicked += s.panicked;
            total.deadline_exceeded += s.deadline_exceeded;
            total.retried += s.retried;
            total.dead_lettered += s.dead_lettered;
            total.replied += s.replied;
            total.acked += s.acked;
            total.nacked += s.nacked;
            total.acks_failed += s.acks_failed;
            total.nacks_failed += s.nacks_failed;
            total.receive_errors += s.receive_errors;
            total.redelivered_after_ack += s.redelivered_after_ack;
        }
        total
    }
}

/// The live counters of one subscription.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) received: Cell<u64>,
    pub(crate) dispatched: Cell<u64>,
    pub(crate) succeeded: Cell<u64>,
    pub(crate) failed: Cell<u64>,
    pub(crate) panicked: Cell<u64>,
    pub(crate) deadline_exceeded: Cell<u64>,
    pub(crate) retried: Cell<u64>,
    pub(crate) dead_lettered: Cell<u64>,
    pub(crate) replied: Cell<u64>,
    pub(crate) acked: Cell<u64>,
    pub(crate) nacked: Cell<u64>,
    pub(crate) acks_failed: Cell<u64>,
    pub(crate) nacks_failed: Cell<u64>,
    pub(crate) receive_errors: Cell<u64>,
    /// Read from the consumer when it closes (live from it before).
    pub(crate) redelivered_after_ack: Cell<u64>,
}

/// Adds one to a counter.
pub(crate) fn bump(counter: &Cell<u64>) {
    counter.set(counter.get() + 1);
}

impl Counters {
    /// The counters as plain numbers, labelled with their subscription.
    pub(crate) fn snapshot(
        &self,
        topic: &str,
        subscription: Option<&str>,
        priority: i64,
    ) -> SubscriptionStats {
        SubscriptionStats {
            topic: topic.to_owned(),
            subscription: subscription.map(str::to_owned),
            priority,
            received: self.received.get(),
            dispatched: self.dispatched.get(),
            succeeded: self.succeeded.get(),
            failed: self.failed.get(),
            panicked: self.panicked.get(),
            deadline_exceeded: self.deadline_exceeded.get(),
            retried: self.retried.get(),
            dead_lettered: self.dead_lettered.get(),
            replied: self.replied.get(),
            acked: self.acked.get(),
            nacked: self.nacked.get(),
            acks_failed: self.acks_failed.get(),
            nacks_failed: self.nacks_failed.get(),
            receive_errors: self.receive_errors.get(),
            redelivered_after_ack: self.redelivered_after_ack.get(),
        }
    }
}
