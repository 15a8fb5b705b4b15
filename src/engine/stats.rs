//! What the engine counts for every subscription, the snapshot
//! [`Dispatcher::stats`](crate::Dispatcher::stats) returns, and the latency
//! histograms kept when timings are on.
//!
//! Each counter is a `Cell` bumped where the event happens (a plain add on
//! one thread); reading them copies them into plain structs. The counters
//! are listed in `counters!` (and named again, in memory order, in its
//! `layout`), which makes the live counters, their fields in
//! [`SubscriptionStats`], their sum, and their metric names.

use std::cell::Cell;
use std::time::Duration;

use crate::transport::Repairs;

/// Makes, from one list of counters: the `Counters` of live cells, the
/// matching fields of [`SubscriptionStats`] (after its other fields), how
/// to copy and sum them, and the metric name of each. `layout` names the
/// same counters again, in the order of the live cells in memory; a name
/// missing from it does not compile (its cell cannot be copied), and one
/// too many is a cell never read, a dead-code warning that `cargo xtask
/// lint` refuses.
macro_rules! counters {
    (
        $(#[$stats_meta:meta])*
        pub struct SubscriptionStats { $($(#[$head_meta:meta])* pub $head:ident: $head_type:ty,)* }
        counters { $($(#[doc = $doc:literal])* $name:ident => $metric:literal,)* }
        layout { $($cell:ident,)* }
    ) => {
        $(#[$stats_meta])*
        pub struct SubscriptionStats {
            $($(#[$head_meta])* pub $head: $head_type,)*
            $($(#[doc = $doc])* pub $name: u64,)*
        }

        /// The live counters of one subscription.
        #[derive(Default)]
        #[repr(C)]
        pub(crate) struct Counters {
            $(pub(crate) $cell: Cell<u64>,)*
        }

        impl Counters {
            /// Copies the counters into `stats`.
            pub(crate) fn copy_into(&self, stats: &mut SubscriptionStats) {
                $(stats.$name = self.$name.get();)*
            }
        }

        impl SubscriptionStats {
            fn add_counts(&mut self, other: &SubscriptionStats) {
                $(self.$name += other.$name;)*
            }

            /// Every counter with its metric name.
            pub(crate) fn counter_values(&self) -> impl Iterator<Item = (&'static str, u64)> {
                [$(($metric, self.$name),)*].into_iter()
            }
        }
    };
}

counters! {
    /// What one subscription has done since it was registered, and what it
    /// holds now.
    #[derive(Clone, Debug, Default, PartialEq, Eq)]
    #[non_exhaustive]
    pub struct SubscriptionStats {
        /// The full topic name.
        pub topic: String,
        /// The subscription name, if one was given.
        pub subscription: Option<String>,
        /// The scheduling priority.
        pub priority: i64,
        /// Its handlers running now.
        pub in_flight: usize,
        /// Messages it holds, waiting for a permit (or for their key).
        pub waiting: usize,
        /// From a message's arrival in its slot to its handler's start
        /// (with timings on).
        pub slot_wait: Option<Latency>,
        /// How long handlers ran (with timings on).
        pub handler_duration: Option<Latency>,
    }
    counters {
        /// Messages taken from the consumer.
        received => "pulsar_dispatcher_messages_received_total",
        /// Messages handed to the handler.
        dispatched => "pulsar_dispatcher_messages_dispatched_total",
        /// Handler calls that returned `Ok`.
        succeeded => "pulsar_dispatcher_messages_succeeded_total",
        /// Handler calls that returned `Err`.
        failed => "pulsar_dispatcher_messages_failed_total",
        /// Handler calls that panicked.
        panicked => "pulsar_dispatcher_messages_panicked_total",
        /// Handler calls dropped at their processing deadline.
        deadline_exceeded => "pulsar_dispatcher_messages_deadline_exceeded_total",
        /// Messages republished to the retry topic.
        retried => "pulsar_dispatcher_messages_retried_total",
        /// Messages published to a dead letter topic.
        dead_lettered => "pulsar_dispatcher_messages_dead_lettered_total",
        /// Replies published.
        replied => "pulsar_dispatcher_replies_published_total",
        /// Replies, retries and dead letters whose publish failed: each
        /// original is nacked instead (logged at most once every 10 s, with
        /// the count held back).
        publishes_failed => "pulsar_dispatcher_publishes_failed_total",
        /// Acknowledgements handed to the transport. A member of a producer
        /// batch counts when its own ack is handed over; the Pulsar
        /// transport sends the batch's ack once every member is settled,
        /// and a batch left partly settled by a close is delivered again
        /// whole.
        acked => "pulsar_dispatcher_messages_acked_total",
        /// Negative acknowledgements handed to the transport (held ones once
        /// their delay has passed).
        nacked => "pulsar_dispatcher_messages_nacked_total",
        /// Acknowledgements the transport refused (logged at most once every
        /// 10 s, with the count held back).
        acks_failed => "pulsar_dispatcher_acks_failed_total",
        /// Negative acknowledgements the transport refused (logged like
        /// refused acknowledgements).
        nacks_failed => "pulsar_dispatcher_nacks_failed_total",
        /// Errors the consumer returned instead of a message.
        receive_errors => "pulsar_dispatcher_receive_errors_total",
        /// Messages the broker delivered again after they had been acked (the
        /// ack was lost with a connection): acked again, not handled again.
        redelivered_after_ack => "pulsar_dispatcher_messages_redelivered_after_ack_total",
        /// Rewinds asked for again on an Exclusive or Failover subscription,
        /// idle after a nack, in case the broker lost part of the nack's own
        /// rewind (one per partition).
        rewinds_repeated => "pulsar_dispatcher_rewinds_repeated_total",
        /// Rewinds asked for on a Failover subscription for a partition
        /// whose backlog the broker had stopped delivering: idle, with a
        /// backlog that stood still over two stall checks (one per stall).
        stalls_rewound => "pulsar_dispatcher_stalls_rewound_total",
        /// Second copies of messages still being handled, which the broker
        /// delivered again (after a reconnection, on any subscription type;
        /// after a nack's rewind on Exclusive and Failover): dropped, since
        /// the copy being handled settles the message. Also second copies of
        /// producer batch members settled while batch-mates are handled.
        dropped_in_flight => "pulsar_dispatcher_messages_dropped_in_flight_total",
        /// Members of a producer batch that came back with their batch,
        /// nacked for a batch-mate, after they had succeeded: settled as
        /// succeeded again, not handled again.
        redelivered_after_success => "pulsar_dispatcher_messages_redelivered_after_success_total",
    }
    // The four counters every message bumps come first, side by side: with
    // many subscriptions each message finds its subscription out of the
    // cache, and these then share a line with the subscription's other
    // per-message fields (see `Subscription`) instead of spreading over two
    // more. The stats and metrics keep the order above.
    layout {
        received,
        dispatched,
        succeeded,
        acked,
        failed,
        panicked,
        deadline_exceeded,
        retried,
        dead_lettered,
        replied,
        publishes_failed,
        nacked,
        acks_failed,
        nacks_failed,
        receive_errors,
        redelivered_after_ack,
        rewinds_repeated,
        stalls_rewound,
        dropped_in_flight,
        redelivered_after_success,
    }
}

impl Counters {
    /// Takes over what the consumer counts itself.
    pub(crate) fn copy_repairs(&self, repairs: Repairs) {
        self.redelivered_after_ack
            .set(repairs.redelivered_after_ack);
        self.rewinds_repeated.set(repairs.rewinds_repeated);
        self.stalls_rewound.set(repairs.stalls_rewound);
        self.dropped_in_flight.set(repairs.dropped_in_flight);
        self.redelivered_after_success
            .set(repairs.redelivered_after_success);
    }
}

/// A snapshot of a dispatcher's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DispatcherStats {
    /// Per subscription, in the order they were registered.
    pub subscriptions: Vec<SubscriptionStats>,
    /// Handlers running now.
    pub in_flight: usize,
    /// Messages held in subscriptions, waiting for a permit (or for their
    /// key).
    pub waiting: usize,
    /// The concurrency limit.
    pub concurrency: usize,
}

impl DispatcherStats {
    /// The sum of every subscription's counters (topic and subscription
    /// left empty, priority 0, no latencies).
    pub fn total(&self) -> SubscriptionStats {
        let mut total = SubscriptionStats::default();
        for subscription in &self.subscriptions {
            total.add_counts(subscription);
            total.in_flight += subscription.in_flight;
            total.waiting += subscription.waiting;
        }
        total
    }
}

/// Adds one to a counter.
pub(crate) fn bump(counter: &Cell<u64>) {
    counter.set(counter.get() + 1);
}

/// A summary of a latency histogram.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Latency {
    /// How many were recorded.
    pub count: u64,
    /// The median, to within the histogram's resolution (about 6%).
    pub p50: Duration,
    /// The 99th percentile, to within the histogram's resolution.
    pub p99: Duration,
    /// The largest recorded.
    pub max: Duration,
}

/// Sub-buckets per power of two: a resolution of 1/16 (about 6%).
const SUB_BUCKETS: usize = 16;
/// Powers of two covered: the first 16 ns one bucket per nanosecond, then
/// up to 2^43 ns, about 2.4 hours.
const OCTAVES: usize = 40;

/// A latency histogram in fixed buckets (log-linear, from 1 ns to about 2.4
/// hours at about 6% resolution): recording is an index computation and
/// an add, without allocation.
pub(crate) struct LatencyHistogram {
    buckets: Box<[Cell<u64>]>,
    count: Cell<u64>,
    max: Cell<u64>,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: (0..OCTAVES * SUB_BUCKETS).map(|_| Cell::new(0)).collect(),
            count: Cell::new(0),
            max: Cell::new(0),
        }
    }
}

impl LatencyHistogram {
    pub(crate) fn record(&self, latency: Duration) {
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX).max(1);
        let bucket = bucket_of(nanos).min(self.buckets.len() - 1);
        bump(&self.buckets[bucket]);
        bump(&self.count);
        self.max.set(self.max.get().max(nanos));
    }

    pub(crate) fn summary(&self) -> Latency {
        Latency {
            count: self.count.get(),
            p50: self.percentile(0.50),
            p99: self.percentile(0.99),
            max: Duration::from_nanos(self.max.get()),
        }
    }

    /// The upper bound of the bucket holding the `quantile`, capped at the
    /// largest value recorded.
    fn percentile(&self, quantile: f64) -> Duration {
        let count = self.count.get();
        if count == 0 {
            return Duration::ZERO;
        }
        let rank = ((count as f64) * quantile).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (bucket, recorded) in self.buckets.iter().enumerate() {
            seen += recorded.get();
            if seen >= rank {
                return Duration::from_nanos(upper_bound(bucket).min(self.max.get()));
            }
        }
        Duration::from_nanos(self.max.get())
    }
}

/// The bucket of a value: its power of two, then which sixteenth of it.
fn bucket_of(nanos: u64) -> usize {
    let octave = 63 - nanos.leading_zeros() as usize;
    if octave < 4 {
        return nanos as usize;
    }
    let fraction = (nanos >> (octave - 4)) as usize & (SUB_BUCKETS - 1);
    (octave - 3) * SUB_BUCKETS + fraction
}

/// The largest value in a bucket.
fn upper_bound(bucket: usize) -> u64 {
    if bucket < SUB_BUCKETS {
        return bucket as u64;
    }
    let octave = bucket / SUB_BUCKETS + 3;
    let fraction = (bucket % SUB_BUCKETS) as u64;
    ((SUB_BUCKETS as u64 + fraction + 1) << (octave - 4)) - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_values_within_their_resolution() {
        for nanos in [1, 5, 15, 16, 17, 31, 32, 1000, 123_456, 9_999_999, 1 << 39] {
            let bucket = bucket_of(nanos);
            let upper = upper_bound(bucket);
            assert!(upper >= nanos, "{nanos} in bucket {bucket} up to {upper}");
            assert!(
                (upper - nanos) as f64 <= nanos as f64 / 16.0 + 1.0,
                "{nanos}: bucket up to {upper} is too wide"
            );
            if bucket > 0 {
                assert!(upper_bound(bucket - 1) < nanos, "{nanos}: bucket {bucket}");
            }
        }
    }

    #[test]
    fn percentiles_come_from_the_recorded_values() {
        let histogram = LatencyHistogram::default();
        for micros in 1..=100 {
            histogram.record(Duration::from_micros(micros));
        }
        let latency = histogram.summary();
        assert_eq!(latency.count, 100);
        let near = |got: Duration, want: u64| {
            let want = Duration::from_micros(want);
            got >= want && got <= want + want / 15
        };
        assert!(near(latency.p50, 50), "{latency:?}");
        assert!(near(latency.p99, 99), "{latency:?}");
        assert_eq!(latency.max, Duration::from_micros(100));
        assert_eq!(LatencyHistogram::default().summary(), Latency::default());
    }

    #[test]
    fn a_latency_past_the_last_bucket_is_counted_in_it() {
        let histogram = LatencyHistogram::default();
        let three_hours = Duration::from_secs(3 * 3600);
        histogram.record(three_hours);
        histogram.record(Duration::MAX);
        let latency = histogram.summary();
        assert_eq!(latency.count, 2);
        assert_eq!(latency.max, Duration::from_nanos(u64::MAX));
        // Reported at the last bucket's bound, about 2.4 hours.
        let last_bound = Duration::from_nanos(upper_bound(OCTAVES * SUB_BUCKETS - 1));
        assert_eq!((latency.p50, latency.p99), (last_bound, last_bound));
        assert!(last_bound > Duration::from_secs(2 * 3600));
    }

    #[test]
    fn what_the_consumer_counts_itself_is_taken_over_field_by_field() {
        let repairs = Repairs {
            redelivered_after_ack: 1,
            rewinds_repeated: 2,
            stalls_rewound: 3,
            dropped_in_flight: 4,
            redelivered_after_success: 5,
        };
        let counters = Counters::default();
        counters.copy_repairs(repairs);
        let mut stats = SubscriptionStats::default();
        counters.copy_into(&mut stats);
        assert_eq!(
            [
                stats.redelivered_after_ack,
                stats.rewinds_repeated,
                stats.stalls_rewound,
                stats.dropped_in_flight,
                stats.redelivered_after_success,
            ],
            [1, 2, 3, 4, 5]
        );
    }

    #[test]
    fn the_total_sums_the_counters_and_what_each_holds() {
        let of = |received, in_flight, waiting| SubscriptionStats {
            received,
            in_flight,
            waiting,
            priority: 7,
            ..SubscriptionStats::default()
        };
        let stats = DispatcherStats {
            subscriptions: vec![of(10, 2, 1), of(5, 3, 4)],
            in_flight: 5,
            waiting: 5,
            concurrency: 8,
        };
        let total = stats.total();
        assert_eq!((total.received, total.in_flight, total.waiting), (15, 5, 5));
        assert_eq!(total.priority, 0);
    }
}
