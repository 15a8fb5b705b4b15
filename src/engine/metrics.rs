//! The engine's numbers through the `metrics` facade.
//!
//! Counters and gauges are not touched per message: the engine publishes
//! its own `Cell` counters (the same that [`stats`](crate::Dispatcher::stats)
//! reads) every publishing interval, as what they grew by since the last
//! publish, so a recorder adds nothing to the data path and no recorder
//! costs nothing. Only the two histograms are recorded per message, and
//! only when timings are on. Handles are registered when a subscription is
//! made (or changes priority), and the permits gauge when the dispatcher is
//! built, so a recorder must be installed before that; with metrics off
//! nothing is registered.
//!
//! A series is named by its labels (topic, subscription name, priority),
//! and more than one subscription can feed it over time: a priority change
//! moves a subscription to the series of its new priority (and back), a
//! subscription made again after an unsubscribe takes up the series of the
//! one before. Publishing increments, never absolute values, makes every
//! series the sum of what was counted under its labels, whoever counted it;
//! gauges too (each publish moves a gauge by how much its value changed),
//! so that the dispatchers of `per_core`, which share a recorder and label
//! a subscription made on every core alike, add up instead of overwriting
//! one another.

use std::cell::Cell;

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
    /// The subscription's counts when they were last published: what the
    /// next publish adds is what they grew by since.
    published: Vec<u64>,
    in_flight: SummedGauge,
    slot_occupied: SummedGauge,
    pub(crate) slot_wait: Histogram,
    pub(crate) handler_duration: Histogram,
}

impl SubscriptionMetrics {
    /// Registers the metrics of a new subscription, labelled with its
    /// topic, subscription name and priority.
    pub(crate) fn register(topic: &str, subscription: Option<&str>, priority: i64) -> Self {
        let published = vec![0; SubscriptionStats::default().counter_values().count()];
        Self::labelled(topic, subscription, priority, published)
    }

    /// Registers the series of the subscription's new `priority`, after
    /// publishing `stats` (taken before the change) to the old ones and
    /// zeroing their gauges: from here on its counts go to the new series.
    pub(crate) fn relabel(
        &mut self,
        topic: &str,
        subscription: Option<&str>,
        priority: i64,
        stats: &SubscriptionStats,
    ) {
        self.publish(stats);
        self.in_flight.show(0);
        self.slot_occupied.show(0);
        let published = std::mem::take(&mut self.published);
        *self = Self::labelled(topic, subscription, priority, published);
    }

    fn labelled(
        topic: &str,
        subscription: Option<&str>,
        priority: i64,
        published: Vec<u64>,
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
            published,
            in_flight: SummedGauge::new(metrics::gauge!(IN_FLIGHT, labels.iter())),
            slot_occupied: SummedGauge::new(metrics::gauge!(SLOT_OCCUPIED, labels.iter())),
            slot_wait: metrics::histogram!(SLOT_WAIT, labels.iter()),
            handler_duration: metrics::histogram!(HANDLER_DURATION, labels.iter()),
        }
    }

    /// Publishes a snapshot of the subscription: its counters by what they
    /// grew, its gauges by what they changed.
    pub(crate) fn publish(&mut self, stats: &SubscriptionStats) {
        let counts = stats.counter_values().zip(&mut self.published);
        for (counter, ((_, value), published)) in self.counters.iter().zip(counts) {
            let grown = value.saturating_sub(*published);
            if grown > 0 {
                counter.increment(grown);
                *published = value;
            }
        }
        self.in_flight.show(stats.in_flight);
        self.slot_occupied.show(stats.waiting);
    }
}

/// A gauge this dispatcher moves by how much its own value changed, so
/// that every dispatcher feeding the series adds its share.
pub(crate) struct SummedGauge {
    gauge: Gauge,
    shown: Cell<usize>,
}

impl SummedGauge {
    fn new(gauge: Gauge) -> Self {
        SummedGauge {
            gauge,
            shown: Cell::new(0),
        }
    }

    /// Makes this dispatcher's share of the gauge `value`.
    pub(crate) fn show(&self, value: usize) {
        let shown = self.shown.replace(value);
        if value > shown {
            self.gauge.increment((value - shown) as f64);
        } else if value < shown {
            self.gauge.decrement((shown - value) as f64);
        }
    }
}

/// The dispatcher-wide gauge.
pub(crate) fn permits_available() -> SummedGauge {
    SummedGauge::new(metrics::gauge!(PERMITS_AVAILABLE))
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

#[cfg(test)]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::{SubscriptionMetrics, SubscriptionStats, SummedGauge};

    #[test]
    fn each_share_moves_the_gauge_by_how_much_it_changed() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let gauge = || {
            let value = snapshotter.snapshot().into_vec().into_iter().next();
            match value.map(|(.., value)| value) {
                Some(DebugValue::Gauge(gauge)) => gauge.0,
                other => panic!("not a gauge: {other:?}"),
            }
        };
        metrics::with_local_recorder(&recorder, || {
            // Two dispatchers' shares of one series, as `per_core` has them.
            let one = SummedGauge::new(metrics::gauge!("shared"));
            let other = SummedGauge::new(metrics::gauge!("shared"));
            one.show(2);
            other.show(3);
            assert_eq!(gauge(), 5.0);
            one.show(6);
            assert_eq!(gauge(), 9.0, "up from a share that was not zero");
            one.show(1);
            other.show(3);
            assert_eq!(gauge(), 4.0);
            other.show(0);
            assert_eq!(gauge(), 1.0);
        });
    }

    #[test]
    fn every_metric_has_its_help_text_and_the_timings_their_unit() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            super::describe();
            let _subscription = SubscriptionMetrics::register("orders", Some("billing"), 3);
            let _permits = super::permits_available();
        });
        let described: Vec<_> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, unit, help, _)| (key.key().name().to_owned(), unit, help))
            .collect();
        // The counters, both gauges, both histograms, the permits gauge.
        let counters = SubscriptionStats::default().counter_values().count();
        assert_eq!(described.len(), counters + 5, "{described:?}");
        for (name, unit, help) in &described {
            assert!(help.as_ref().is_some_and(|help| !help.is_empty()), "{name}");
            let timing = [super::SLOT_WAIT, super::HANDLER_DURATION].contains(&name.as_str());
            assert_eq!(unit.is_some(), timing, "{name}");
        }
        let units: Vec<_> = described.iter().filter_map(|(_, unit, _)| *unit).collect();
        assert_eq!(units, [metrics::Unit::Seconds; 2]);
    }
}
