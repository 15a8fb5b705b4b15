//! Observability on the in-memory transport: timings in the stats, metrics
//! through the `metrics` facade, health, and the per-message span.

use std::cell::Cell;
use std::io::Write;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;

use super::{
    dispatcher, gated, hangs_on_request, options, run_local, settle_down, spawn_run, Gate,
};
use crate::per_core::PerCore;
use crate::transport::MemoryTransport;
use crate::{Dispatcher, ErrorClass, HealthPhase, Message, SubType, SubscribeOptions};

async fn outcome_by_payload(message: &Message) -> Result<(), &'static str> {
    match message.payload() {
        b"fail" => Err("failed"),
        _ => Ok(()),
    }
}

#[test]
fn with_timings_the_stats_summarise_slot_waits_and_handler_durations() {
    run_local(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder()
            .concurrency(1)
            .timings(true)
            .build(transport.clone())
            .unwrap();
        for _ in 0..20 {
            transport.send("jobs", "x");
        }
        dispatcher
            .subscribe(
                "jobs",
                async |_: &Message| {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    Ok::<_, std::convert::Infallible>(())
                },
                options(1),
            )
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("jobs", 20).await;
        let stats = dispatcher.stats().subscriptions.remove(0);
        let ran = stats.handler_duration.expect("timings are on");
        let waited = stats.slot_wait.expect("timings are on");
        assert_eq!((ran.count, waited.count), (20, 20));
        assert!(ran.p50 >= Duration::from_millis(1), "{ran:?}");
        assert!(ran.p50 <= ran.p99 && ran.p99 <= ran.max, "{ran:?}");
        // With one permit, a message waits in its slot while the one before
        // it runs.
        assert!(waited.p99 >= Duration::from_micros(500), "{waited:?}");
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn without_timings_nothing_is_measured() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        transport.send("jobs", "x");
        dispatcher
            .subscribe("jobs", outcome_by_payload, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("jobs", 1).await;
        let stats = dispatcher.stats().subscriptions.remove(0);
        assert_eq!((stats.slot_wait, stats.handler_duration), (None, None));
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn counters_and_gauges_reach_the_metrics_recorder_with_their_labels() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Registered at subscribe: the recorder must be in place by then.
    let _local = metrics::set_default_local_recorder(&recorder);
    run_local(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder()
            .concurrency(2)
            .timings(true)
            .metrics_interval(Some(Duration::from_millis(10)))
            .build(transport.clone())
            .unwrap();
        for payload in ["ok", "ok", "ok", "fail"] {
            transport.send("orders", payload);
        }
        dispatcher
            .subscribe(
                "orders",
                outcome_by_payload,
                SubscribeOptions::new()
                    .subscription("orders-sub")
                    .priority(7)
                    .negative_ack_redelivery_delay(Duration::from_secs(60)),
            )
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("orders", 3).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
    let mut metrics: Vec<_> = snapshotter.snapshot().into_vec();
    let mut value = |kind: MetricKind, name: &str| {
        let at = metrics
            .iter()
            .position(|(key, ..)| key.kind() == kind && key.key().name() == name)
            .unwrap_or_else(|| panic!("no {name}"));
        let (key, _, _, value) = metrics.swap_remove(at);
        (key.key().labels().cloned().collect::<Vec<_>>(), value)
    };
    let (labels, succeeded) = value(
        MetricKind::Counter,
        "pulsar_dispatcher_messages_succeeded_total",
    );
    assert_eq!(succeeded, DebugValue::Counter(3));
    let labels: Vec<(String, String)> = labels
        .iter()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect();
    assert!(labels.contains(&("topic".into(), "persistent://public/default/orders".into())));
    assert!(labels.contains(&("subscription".into(), "orders-sub".into())));
    assert!(labels.contains(&("priority".into(), "7".into())));
    let (_, failed) = value(
        MetricKind::Counter,
        "pulsar_dispatcher_messages_failed_total",
    );
    assert_eq!(failed, DebugValue::Counter(1));
    let (_, acked) = value(
        MetricKind::Counter,
        "pulsar_dispatcher_messages_acked_total",
    );
    assert_eq!(acked, DebugValue::Counter(3));
    let (_, in_flight) = value(MetricKind::Gauge, "pulsar_dispatcher_in_flight");
    assert_eq!(
        in_flight,
        DebugValue::Gauge(0.0.into()),
        "published at close"
    );
    let (_, permits) = value(MetricKind::Gauge, "pulsar_dispatcher_permits_available");
    assert_eq!(permits, DebugValue::Gauge(2.0.into()));
    let (_, waits) = value(MetricKind::Histogram, "pulsar_dispatcher_slot_wait_seconds");
    let DebugValue::Histogram(waits) = waits else {
        panic!("a histogram")
    };
    assert_eq!(waits.len(), 4, "one per message handled");
}

#[test]
fn health_follows_the_lifecycle_and_each_subscriptions_consumer() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        let gate = Gate::default();
        dispatcher
            .subscribe("healthy", gated(&gate), options(1))
            .await
            .unwrap();
        dispatcher
            .subscribe("broken", gated(&gate), options(1))
            .await
            .unwrap();
        let before = dispatcher.health();
        assert_eq!(before.phase, HealthPhase::Idle);
        assert!(before.is_live() && !before.is_ready());
        assert_eq!(before.subscriptions[0].last_received, None);
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.send("healthy", "x");
        settle_down().await;
        let running = dispatcher.health();
        assert_eq!(running.phase, HealthPhase::Running);
        assert!(running.is_ready(), "{running:?}");
        assert!(running.subscriptions[0].last_received.is_some());
        assert_eq!(running.subscriptions[1].last_received, None);
        assert_eq!(running.in_flight, 1);
        transport.fail_receives("broken", usize::MAX);
        settle_down().await;
        let failing = dispatcher.health();
        assert!(!failing.subscriptions[1].receiving);
        assert!(failing.subscriptions[0].receiving);
        assert!(!failing.is_ready() && failing.is_live());
        let closing = {
            let dispatcher = dispatcher.clone();
            tokio::task::spawn_local(async move { dispatcher.close().await })
        };
        settle_down().await;
        assert_eq!(dispatcher.health().phase, HealthPhase::Draining);
        gate.open();
        closing.await.unwrap();
        run.await.unwrap().unwrap();
        let closed = dispatcher.close_handle().health().unwrap();
        assert_eq!(closed.phase, HealthPhase::Closed);
        assert!(!closed.is_live());
    });
}

/// A writer the test can read back.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the library logs on this thread, at `filter`, while it lives.
struct LogCapture {
    captured: Captured,
    _second: tracing::Dispatch,
    _default: tracing::subscriber::DefaultGuard,
}

impl LogCapture {
    fn start(filter: &str) -> Self {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        // With a single registered dispatcher, tracing-core computes a new
        // callsite's interest from the registering thread's default alone,
        // so a test on another thread that meets a callsite first would
        // cache "never" for everyone. A second, silent dispatcher makes
        // every registration ask all live dispatchers, this test's included.
        let second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
        let default = tracing::subscriber::set_default(subscriber);
        // Callsites other threads registered before this point cached "never".
        tracing::callsite::rebuild_interest_cache();
        LogCapture {
            captured,
            _second: second,
            _default: default,
        }
    }

    fn output(&self) -> String {
        String::from_utf8(self.captured.0.lock().unwrap().clone()).unwrap()
    }
}

#[test]
fn retry_topic_problems_are_warned_about_unless_ignored() {
    use crate::RetryTopicCheck;
    let retried = || {
        SubscribeOptions::new()
            .subscription("s")
            .subscription_type(SubType::Shared)
            .retry_errors(ErrorClass::matching(|_| true))
            .retry_topic("orders-retry")
    };
    // Nothing consumes orders-retry: warned at start, and for a
    // subscription added while running, with the same problem.
    let problem = "persistent://public/default/orders-retry";
    for check in [RetryTopicCheck::Warn, RetryTopicCheck::Ignore] {
        let logs = LogCapture::start("pulsar_dispatcher=warn");
        run_local(async {
            let dispatcher = Dispatcher::builder()
                .retry_topic_check(check)
                .build(MemoryTransport::new())
                .unwrap();
            dispatcher
                .subscribe("orders", async |_: &Message| Ok::<_, &str>(()), retried())
                .await
                .unwrap();
            let dispatcher = Rc::new(dispatcher);
            let run = spawn_run(&dispatcher);
            settle_down().await;
            dispatcher
                .subscribe("refunds", async |_: &Message| Ok::<_, &str>(()), retried())
                .await
                .unwrap();
            dispatcher.close().await;
            run.await.unwrap().unwrap();
        });
        let output = logs.output();
        let warnings = output
            .lines()
            .filter(|line| line.contains("retry topic check") && line.contains(problem))
            .count();
        match check {
            // Once at start for orders, then for both once refunds joins.
            RetryTopicCheck::Warn => assert_eq!(warnings, 3, "{output}"),
            _ => assert_eq!(warnings, 0, "{output}"),
        }
    }
}

#[test]
fn handlers_and_settlement_run_inside_a_span_per_message() {
    let logs = LogCapture::start("pulsar_dispatcher=debug");
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let id = transport.send("jobs", "fail");
        // With a processing deadline the handler runs inside the span too.
        let timed_id = transport.send("timed", "ok");
        let subscriptions = [
            (
                "jobs",
                options(3).negative_ack_redelivery_delay(Duration::from_secs(60)),
            ),
            (
                "timed",
                options(2).processing_timeout(Duration::from_secs(60)),
            ),
        ];
        for (topic, options) in subscriptions {
            let handler = async |message: &Message| {
                tracing::info!("the handler says hello");
                match message.payload() {
                    b"ok" => Ok(()),
                    _ => Err("no"),
                }
            };
            dispatcher.subscribe(topic, handler, options).await.unwrap();
        }
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        let output = logs.output();
        let lines_in_span = |topic: &str, id: &crate::MessageId, priority: i64| -> Vec<&str> {
            let span = format!(
                "message{{topic=persistent://public/default/{topic} message_id={id} priority={priority}"
            );
            output.lines().filter(|l| l.contains(&span)).collect()
        };
        let said_hello =
            |lines: &[&str]| lines.iter().any(|l| l.contains("the handler says hello"));
        assert!(
            said_hello(&lines_in_span("timed", &timed_id, 2)),
            "{output}"
        );
        let jobs_lines = lines_in_span("jobs", &id, 3);
        assert!(said_hello(&jobs_lines), "{output}");
        assert!(
            jobs_lines
                .iter()
                .any(|l| l.contains("handler failed; nacking")),
            "the engine's events use the span too: {output}"
        );
    });
}

#[derive(Debug, thiserror::Error)]
#[error("warehouse busy")]
struct WarehouseBusy(#[source] std::io::Error);

/// A handler's error is logged with its causes: the usual error types keep
/// the cause out of their own text, and a log line without it says what
/// failed but not why. A handler that ran out of time is logged with the
/// deadline it missed.
#[test]
fn a_handler_error_is_logged_with_its_causes() {
    let logs = LogCapture::start("pulsar_dispatcher=warn");
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        transport.send("jobs", "1");
        transport.send("slow", "hang");
        let busy = async |_: &Message| {
            Err::<(), _>(WarehouseBusy(std::io::Error::other("refused by wms-3")))
        };
        dispatcher
            .subscribe("jobs", busy, options(1))
            .await
            .unwrap();
        let deadline = options(1).processing_timeout(Duration::from_millis(20));
        dispatcher
            .subscribe("slow", hangs_on_request, deadline)
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        let output = logs.output();
        assert!(
            output.contains("error=warehouse busy: refused by wms-3"),
            "{output}"
        );
        assert!(
            output.contains("error=still running after its processing deadline of 20ms"),
            "{output}"
        );
    });
}

/// A retry topic that refuses every publish fails each message that fails
/// its handler: each is counted and nacked, and logged once an interval,
/// not once a message; so are the acks a broken consumer refuses.
#[test]
fn failures_repeated_per_message_are_counted_each_and_logged_once_an_interval() {
    let logs = LogCapture::start("pulsar_dispatcher=warn");
    run_local(async {
        let (dispatcher, transport) = dispatcher(8);
        transport.fail_publishes("jobs-retry", usize::MAX);
        for _ in 0..50 {
            transport.send("jobs", "retry");
            transport.send("acks", "ok");
        }
        let retrying = SubscribeOptions::new()
            .subscription_type(SubType::Shared)
            .negative_ack_redelivery_delay(Duration::from_secs(600))
            .retry_errors(ErrorClass::matching(|_| true))
            .retry_topic("jobs-retry");
        let failing = async |_: &Message| Err::<(), _>("downstream unavailable");
        let jobs = dispatcher
            .subscribe("jobs", failing, retrying)
            .await
            .unwrap();
        transport.fail_settlements("acks");
        let acks = dispatcher
            .subscribe("acks", outcome_by_payload, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        while jobs.stats().unwrap().publishes_failed < 50 || acks.stats().unwrap().acks_failed < 50
        {
            tokio::task::yield_now().await;
        }
        assert_eq!(jobs.stats().unwrap().retried, 0);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
    let output = logs.output();
    let count = |text: &str| output.lines().filter(|l| l.contains(text)).count();
    assert_eq!(count("publishing the retry failed"), 1, "{output}");
    assert_eq!(count("settling a message failed"), 1, "{output}");
}

/// A handler that returns reply bytes on a subscription without a reply
/// topic has its messages acked and the replies dropped, and is told so
/// once, not once a message.
#[test]
fn replies_without_a_reply_topic_are_warned_about_once() {
    let logs = LogCapture::start("pulsar_dispatcher=warn");
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        let ids: Vec<_> = (0..20).map(|_| transport.send("images", "cat")).collect();
        let replying =
            async |message: &Message| Ok::<_, std::convert::Infallible>(message.payload().to_vec());
        dispatcher
            .subscribe("images", replying, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("images", ids.len()).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        let mut acked = transport.acked("images");
        acked.sort_by_key(|id| id.entry_id());
        assert_eq!(acked, ids);
    });
    let output = logs.output();
    let warned = output
        .lines()
        .filter(|l| l.contains("no reply_topic"))
        .count();
    assert_eq!(warned, 1, "{output}");
}

/// A priority change starts new series that count from zero; back at an
/// earlier priority, its series count on from what they show, so summing
/// over priorities still gives the totals (2 at priority 1, 3 at priority
/// 5, then 1 more at priority 1: 3 and 3, not 2 and 3).
#[test]
fn a_priority_change_starts_new_series_and_a_return_counts_on() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let succeeded_at = |priority: &str| {
        let succeeded = by_priority(&snapshotter, "pulsar_dispatcher_messages_succeeded_total");
        succeeded
            .iter()
            .find_map(|(p, value)| match value {
                DebugValue::Counter(count) if p == priority => Some(*count),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no series at priority {priority}: {succeeded:?}"))
    };
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let jobs = dispatcher
            .subscribe("jobs", outcome_by_payload, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        let handle = async |count: usize, acked: usize| {
            for _ in 0..count {
                transport.send("jobs", "ok");
            }
            transport.wait_acked("jobs", acked).await;
        };
        handle(2, 2).await;
        jobs.set_priority(5).unwrap();
        handle(3, 5).await;
        jobs.set_priority(1).unwrap();
        assert_eq!(succeeded_at("1"), 2);
        assert_eq!(succeeded_at("5"), 3);
        handle(1, 6).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
    assert_eq!(succeeded_at("1"), 3);
    assert_eq!(succeeded_at("5"), 3);
}

/// The values of metric `name`, each with its priority label.
fn by_priority(
    snapshotter: &metrics_util::debugging::Snapshotter,
    name: &str,
) -> Vec<(String, DebugValue)> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == name)
        .map(|(key, _, _, value)| {
            let priority = key
                .key()
                .labels()
                .find(|label| label.key() == "priority")
                .map(|label| label.value().to_owned())
                .unwrap_or_default();
            (priority, value)
        })
        .collect()
}

/// The sum of a gauge's series.
fn gauge_sum(series: &[(String, DebugValue)]) -> f64 {
    series
        .iter()
        .map(|(_, value)| match value {
            DebugValue::Gauge(gauge) => gauge.0,
            _ => 0.0,
        })
        .sum()
}

/// Dispatchers sharing a recorder (one per core) add up on a gauge whose
/// series they share: two handlers running on one dispatcher and none on
/// the other show 2 running, and the free permits of both (before, the
/// last dispatcher to publish overwrote the other's value).
#[test]
fn dispatchers_sharing_a_recorder_add_up_on_gauges() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    // On a paused clock, so that the 50 ms below hold ten publications
    // however loaded the machine is.
    super::run_paused(async {
        let gate = Gate::default();
        let mut running = Vec::new();
        for busy in [true, false] {
            let transport = MemoryTransport::new();
            let dispatcher = Rc::new(
                Dispatcher::builder()
                    .concurrency(4)
                    .metrics_interval(Some(Duration::from_millis(5)))
                    .build(transport.clone())
                    .unwrap(),
            );
            dispatcher
                .subscribe("jobs", gated(&gate), options(1).subscription("s"))
                .await
                .unwrap();
            if busy {
                transport.send("jobs", "1");
                transport.send("jobs", "2");
            }
            running.push((spawn_run(&dispatcher), dispatcher, transport));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let in_flight = by_priority(&snapshotter, "pulsar_dispatcher_in_flight");
        let permits = by_priority(&snapshotter, "pulsar_dispatcher_permits_available");
        assert_eq!(gauge_sum(&in_flight), 2.0, "{in_flight:?}");
        assert_eq!(gauge_sum(&permits), 6.0, "{permits:?}");
        gate.open();
        for (run, dispatcher, _transport) in running {
            dispatcher.close().await;
            run.await.unwrap().unwrap();
        }
    });
}

/// After a priority change, the gauges under the old priority are zeroed:
/// what runs and waits counts under the new one, and summing a gauge over
/// priorities stays true.
#[test]
fn a_priority_change_zeroes_the_old_series_gauges() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let gate = Gate::default();
        let jobs = dispatcher
            .subscribe("jobs", gated(&gate), options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.send("jobs", "running");
        transport.send("jobs", "waiting");
        settle_down().await;
        jobs.set_priority(5).unwrap();
        gate.open();
        transport.wait_acked("jobs", 2).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
    let in_flight = by_priority(&snapshotter, "pulsar_dispatcher_in_flight");
    let waiting = by_priority(&snapshotter, "pulsar_dispatcher_slot_occupied");
    assert_eq!(in_flight.len(), 2, "{in_flight:?}");
    assert_eq!(
        (gauge_sum(&in_flight), gauge_sum(&waiting)),
        (0.0, 0.0),
        "nothing runs or waits after close: {in_flight:?} {waiting:?}"
    );
}

/// An unsubscribed subscription's last numbers reach the recorder, though
/// the next metrics tick would have come long after it was gone.
/// An unsubscribed subscription's last counts reach the recorder (the
/// publishing interval is an hour), and a subscription made again with the
/// same labels counts on in the series the first one left (3 + 2, not the
/// first's 3 until the second's count passes it).
#[test]
fn an_unsubscribed_subscriptions_numbers_stay_and_count_on_when_it_returns() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let succeeded = || by_priority(&snapshotter, "pulsar_dispatcher_messages_succeeded_total");
    run_local(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder()
            .concurrency(1)
            .metrics_interval(Some(Duration::from_secs(3600)))
            .build(transport.clone())
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        for (sent, acked) in [(3, 3), (2, 5)] {
            let jobs = dispatcher
                .subscribe("jobs", outcome_by_payload, options(1))
                .await
                .unwrap();
            for _ in 0..sent {
                transport.send("jobs", "ok");
            }
            transport.wait_acked("jobs", acked).await;
            dispatcher.unsubscribe(jobs).await.unwrap();
            let acked = acked as u64;
            assert_eq!(succeeded(), [("1".to_owned(), DebugValue::Counter(acked))]);
        }
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// The handlers running, as stats and health report them, are the
/// subscriptions' in-flight handlers: not the permits a worker keeps while
/// it steps aside for the runtime between two messages. A monitor task
/// compares the three at every turn while 200 quick handlers run.
#[test]
fn handlers_running_leave_out_permits_kept_between_messages() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        for _ in 0..200 {
            transport.send("jobs", "ok");
        }
        dispatcher
            .subscribe("jobs", outcome_by_payload, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let disagreed = Rc::new(std::cell::RefCell::new(Vec::new()));
        let monitor = {
            let (dispatcher, disagreed) = (dispatcher.clone(), disagreed.clone());
            tokio::task::spawn_local(async move {
                for _ in 0..2000 {
                    let stats = dispatcher.stats();
                    let health = dispatcher.health();
                    let by_subscription = stats.total().in_flight;
                    if stats.in_flight != by_subscription || health.in_flight != by_subscription {
                        let seen = (stats.in_flight, health.in_flight, by_subscription);
                        disagreed.borrow_mut().push(seen);
                    }
                    tokio::task::yield_now().await;
                }
            })
        };
        let run = spawn_run(&dispatcher);
        transport.wait_acked("jobs", 200).await;
        monitor.await.unwrap();
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert_eq!(
            *disagreed.borrow(),
            [],
            "(stats, health, sum over subscriptions)"
        );
    });
}

/// A worker that takes the runtime's turn after its share of messages
/// keeps its ended job, so that the next message may follow on in it; the
/// permit it keeps meanwhile is no running handler. With one permit and
/// handlers that never wait, no handler runs whenever another task does,
/// once the first has run (the first may wait handed over to the worker
/// being spawned): a monitor task sees none running at any of its turns,
/// in the stats, the health or the subscriptions' sum, while 200 messages
/// pass and the worker takes six turns.
#[test]
fn a_worker_taking_a_turn_between_messages_runs_no_handler() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        for _ in 0..200 {
            transport.send("jobs", "ok");
        }
        let handled = Rc::new(Cell::new(0usize));
        let counter = handled.clone();
        let handler = async move |_: &Message| {
            counter.set(counter.get() + 1);
            Ok::<(), std::convert::Infallible>(())
        };
        dispatcher
            .subscribe("jobs", handler, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let monitor = {
            let dispatcher = dispatcher.clone();
            tokio::task::spawn_local(async move {
                let (mut turns_mid_backlog, mut seen_running) = (0, Vec::new());
                while handled.get() < 200 {
                    if (1..200).contains(&handled.get()) {
                        turns_mid_backlog += 1;
                        let stats = dispatcher.stats();
                        let running = (
                            stats.in_flight,
                            dispatcher.health().in_flight,
                            stats.total().in_flight,
                        );
                        if running != (0, 0, 0) {
                            seen_running.push((handled.get(), running));
                        }
                    }
                    tokio::task::yield_now().await;
                }
                (turns_mid_backlog, seen_running)
            })
        };
        let run = spawn_run(&dispatcher);
        let (turns, seen_running) = monitor.await.unwrap();
        transport.wait_acked("jobs", 200).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        // Mid-backlog, the monitor runs only while the worker takes a turn.
        assert!(turns > 0, "the monitor never ran mid-backlog");
        assert_eq!(
            seen_running,
            [],
            "(handled, (stats, health, subscription stats)) while no handler ran"
        );
    });
}

/// A per-core group's monitor, awaited on a runtime of its own: every core
/// reports running and ready, and counts the messages it handled; once the
/// group is joined, every core reads as gone, at once.
#[test]
fn a_per_core_monitor_reports_every_core_until_the_group_ends() {
    const SENT: [u64; 2] = [3, 5];
    let group = PerCore::start(2, |core| async move {
        let transport = MemoryTransport::new();
        for index in 0..SENT[core] {
            transport.send("jobs", format!("{core}-{index}"));
        }
        let dispatcher = Dispatcher::builder().build(transport)?;
        let handler = async |_: &Message| Ok::<(), std::convert::Infallible>(());
        dispatcher
            .subscribe("jobs", handler, SubscribeOptions::new())
            .await?;
        Ok(dispatcher)
    })
    .unwrap();
    let monitor = group.monitor();
    portable(&monitor);
    let probe = monitor.clone();
    // Readiness and the counts come a moment after the start.
    let (health, handled) = on_another_runtime(async move {
        loop {
            let (health, handled) = (probe.health().await, succeeded(&probe.stats().await));
            if health.is_ready() && handled.iter().sum::<u64>() == SENT.iter().sum() {
                break (health, handled);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    assert_eq!(handled, SENT, "by core");
    let phases: Vec<_> = health
        .cores
        .iter()
        .map(|h| h.as_ref().map(|h| h.phase))
        .collect();
    assert_eq!(phases, [Some(HealthPhase::Running); 2]);

    group.shutdown_handle().shutdown();
    for result in group.join() {
        result.unwrap();
    }
    let (health, stats) =
        on_another_runtime(async move { (monitor.health().await, monitor.stats().await) });
    assert_eq!(health.cores, [None, None]);
    assert!(!health.is_live());
    assert_eq!(stats, [None, None]);
}

/// What a probe running elsewhere needs of the monitor.
fn portable<T: Send + Sync + Clone + std::fmt::Debug + 'static>(_: &T) {}

/// Each core's handled messages; 0 for a core that did not answer.
fn succeeded(stats: &[Option<crate::DispatcherStats>]) -> Vec<u64> {
    let handled =
        |stats: &Option<crate::DispatcherStats>| stats.as_ref().map_or(0, |s| s.total().succeeded);
    stats.iter().map(handled).collect()
}

/// Runs `probe` as a task (so its future must be `Send`) on a
/// multi-threaded runtime of its own, failing after 30 s instead of hanging.
fn on_another_runtime<F>(probe: F) -> F::Output
where
    F: std::future::Future + Send + 'static,
    F::Output: Send,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let probe = async { tokio::time::timeout(Duration::from_secs(30), probe).await };
    runtime
        .block_on(async { tokio::spawn(probe).await })
        .unwrap()
        .expect("the monitor answered within 30 s")
}

/// One receive error, retried 10 ms later on a consumer that answers with
/// nothing to deliver (an idle topic): the subscription is receiving again
/// at once, though no message comes to show it. Another error within the
/// spell makes it not ready again.
#[test]
fn an_idle_subscription_is_ready_again_once_its_consumer_answers_after_an_error() {
    super::run_paused(async {
        let (dispatcher, transport) = dispatcher(1);
        let idle = async |_: &Message| Ok::<_, std::convert::Infallible>(());
        dispatcher
            .subscribe("idle", idle, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        assert!(dispatcher.health().is_ready());
        transport.fail_receives("idle", 1);
        settle_down().await;
        assert_eq!(dispatcher.stats().subscriptions[0].receive_errors, 1);
        assert!(!dispatcher.health().is_ready(), "the error is seen");
        // The retry is due after 10 ms.
        tokio::time::sleep(Duration::from_millis(50)).await;
        settle_down().await;
        assert!(dispatcher.health().is_ready(), "{:?}", dispatcher.health());
        transport.fail_receives("idle", 1);
        settle_down().await;
        assert!(!dispatcher.health().is_ready(), "a second error");
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// A reply whose publish outlasts the shutdown deadline and its grace is
/// cancelled, and its original nacked: it counts as a failed publish.
#[test]
fn a_publish_cancelled_at_the_shutdown_deadline_counts_as_failed() {
    run_local(async {
        let transport = super::hooked::Hooked::default().publishes_take(Duration::from_secs(5));
        let memory = transport.inner.clone();
        let dispatcher = Rc::new(Dispatcher::builder().build(transport).unwrap());
        let replying =
            async |message: &Message| Ok::<_, std::convert::Infallible>(message.payload().to_vec());
        dispatcher
            .subscribe("jobs", replying, options(1).reply_topic("replies"))
            .await
            .unwrap();
        let run = spawn_run(&dispatcher);
        memory.send("jobs", "1");
        settle_down().await;
        dispatcher.close_within(Duration::from_millis(100)).await;
        let _ = run.await.unwrap();
        let stats = dispatcher.stats().total();
        assert_eq!(
            (
                stats.succeeded,
                stats.replied,
                stats.publishes_failed,
                stats.nacked
            ),
            (1, 0, 1, 1),
            "{stats:?}"
        );
    });
}
