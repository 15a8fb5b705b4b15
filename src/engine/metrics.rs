//! The engine's numbers through the `metrics` facade.
//!
//! Counters and gauges are not touched per message: the engine publishes
//! its own `Cell` counters (the same that [`stats`](crate::Dispatcher::stats)
//! reads) every publishing interval, as absolute values, so a recorder adds
//! nothing to the data path and no recorder costs nothing. Only the two
//! histograms are recorded per message, and only when timings are on.
//! Handles are registered when a subscription is made (or changes
//! priority), and the permits gauge when the dispatcher is built, so a
//! recorder must be installed before that; with metrics off nothing is
//! registered.
//!
//! A priority change starts new series (the priority is a label): the old
//! ones keep what happened at the old priority, and the new ones count from
//! zero (or, back at an earlier priority, on from what its series show),
//! so that summing over priorities gives the subscription's totals.

use metrics::{Counter, Gauge, Histogram, Label};

use super::stats::SubscriptionStats;

/// Metric names that are not counters.
pub(crate) const IN_FLIGHT: &str = "pulsar_dispatcher_in_flight";
pub(crate) const SLOT_OCCUPIED: &str = "pulsar_dispatcher_slot_occupied";
pub(crate) const PERMITS_AVAILABLE: &str = "pulsar_dispatcher_permits_available";
pub(crate) const SLOT_WAIT: &str = "pulsar_dispatcher_slot_wait_seconds";
pub(crate) const HANDLER_DURATION: &str = "pulsar_dispatcher_handler_duration_seconds";

/// The handles of one subscription's metrics.
pub(crate) struct SubscriptionMetrics {
    counters: Vec<Counter>,
    /// The counts when these series started (non-zero after a priority
    /// change).
    baseline: Vec<u64>,
    in_flight: Gauge,
    slot_occupied: Gauge,
    pub(crate) slot_wait: Histogram,
    pub(crate) handler_duration: Histogram,
    priority: i64,
    /// What the series of each priority left behind show, for a return to
    /// one of them.
    shown_before: Vec<(i64, Vec<u64>)>,
}

impl SubscriptionMetrics {
    /// Registers the metrics of a subscription, labelled with its topic,
    /// subscription name and priority.
    pub(crate) fn register(topic: &str, subscription: Option<&str>, priority: i64) -> Self {
        let baseline = vec![0; SubscriptionStats::default().counter_values().count()];
        Self::with_baseline(topic, subscription, priority, baseline)
    }

    /// Registers the series of the subscription's new `priority`, after
    /// publishing `stats` (taken before the change) to the old ones: they
    /// count from what they showed before, or from zero.
    pub(crate) fn relabel(
        &mut self,
        topic: &str,
        subscription: Option<&str>,
        priority: i64,
        stats: &SubscriptionStats,
    ) {
        self.retire(stats);
        let counts: Vec<u64> = stats.counter_values().map(|(_, value)| value).collect();
        let shown = counts
            .iter()
            .zip(&self.baseline)
            .map(|(count, base)| count.saturating_sub(*base))
            .collect();
        let mut shown_before = std::mem::take(&mut self.shown_before);
        shown_before.retain(|(earlier, _)| *earlier != self.priority);
        shown_before.push((self.priority, shown));
        let baseline = match shown_before
            .iter()
            .find(|(earlier, _)| *earlier == priority)
        {
            Some((_, shown)) => counts
                .iter()
                .zip(shown)
                .map(|(count, shown)| count.saturating_sub(*shown))
                .collect(),
            None => counts,
        };
        *self = Self::with_baseline(topic, subscription, priority, baseline);
        self.shown_before = shown_before;
    }

    fn with_baseline(
        topic: &str,
        subscription: Option<&str>,
        priority: i64,
        baseline: Vec<u64>,
    ) -> Self {
        let labels = [
            Label::new("topic", topic.to_owned()),
            Label::new("subscription", subscription.unwrap_or("").to_owned()),
            Label::new("priority", priority.to_string()),
        ];
        let counters = SubscriptionStats::default()
            .counter_values()
            .map(|(name, _)| metrics::counter!(name, labels.iter()))
            .collect();
        SubscriptionMetrics {
            counters,
            baseline,
            in_flight: metrics::gauge!(IN_FLIGHT, labels.iter()),
            slot_occupied: metrics::gauge!(SLOT_OCCUPIED, labels.iter()),
            slot_wait: metrics::histogram!(SLOT_WAIT, labels.iter()),
            handler_duration: metrics::histogram!(HANDLER_DURATION, labels.iter()),
            priority,
            shown_before: Vec::new(),
        }
    }

    /// Publishes a snapshot of the subscription.
    pub(crate) fn publish(&self, stats: &SubscriptionStats) {
        let counts = stats.counter_values().zip(&self.baseline);
        for (counter, ((_, value), base)) in self.counters.iter().zip(counts) {
            counter.absolute(value.saturating_sub(*base));
        }
        self.in_flight.set(stats.in_flight as f64);
        self.slot_occupied.set(stats.waiting as f64);
    }

    /// Publishes the counters a last time under these labels and zeroes
    /// the gauges, whose values now count under the new labels.
    fn retire(&self, stats: &SubscriptionStats) {
        self.publish(stats);
        self.in_flight.set(0.0);
        self.slot_occupied.set(0.0);
    }
}

/// The dispatcher-wide gauge.
pub(crate) fn permits_available() -> Gauge {
    metrics::gauge!(PERMITS_AVAILABLE)
}

/// Describes every metric to the recorder (units and help texts).
pub(crate) fn describe() {
    for (name, _) in SubscriptionStats::default().counter_values() {
        metrics::describe_counter!(name, "see pulsar_dispatcher::SubscriptionStats");
    }
    metrics::describe_gauge!(IN_FLIGHT, "handlers of the subscription running now");
    metrics::describe_gauge!(
        SLOT_OCCUPIED,
        "messages the subscription holds, waiting to run"
    );
    metrics::describe_gauge!(PERMITS_AVAILABLE, "free permits of the concurrency limit");
    metrics::describe_histogram!(
        SLOT_WAIT,
        metrics::Unit::Seconds,
        "from a message's arrival in its slot to its handler's start"
    );
    metrics::describe_histogram!(
        HANDLER_DURATION,
        metrics::Unit::Seconds,
        "how long handlers ran"
    );
}
