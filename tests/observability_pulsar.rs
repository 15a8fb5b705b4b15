//! Metrics as Prometheus scrapes them, against a real Apache Pulsar broker:
//! messages with mixed outcomes (successes, dead letters, retries that end
//! in success or in the dead letter topic, panics), then the counters read
//! back from `/metrics` over a real HTTP request, served by the same
//! responder as `examples/observability.rs`, and `/health` before and after
//! close.
//!
//! `install_recorder` sets the process-wide recorder, which can happen once
//! per process: hence one test in a file of its own.

mod common;
#[path = "../examples/observability/http.rs"]
mod http;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{close_and_join, run_local, start, unique_name, unique_topic, wait_for_stats};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use pulsar_dispatcher::{Dispatcher, ErrorClass, Message, SubType, SubscribeOptions};
use tokio::net::TcpListener;

#[derive(Debug, thiserror::Error)]
#[error("invalid")]
struct Invalid;

#[derive(Debug, thiserror::Error)]
#[error("busy")]
struct Busy;

/// How many messages of each kind are published.
const OK: u64 = 12;
const INVALID: u64 = 4; // dead-lettered at once
const BUSY: u64 = 3; // fails every time: two retries, then the dead letter topic
const BUSY_ONCE: u64 = 3; // succeeds on its first retry
const CRASH: u64 = 2; // panics once (nacked), succeeds when redelivered
const TOTAL: u64 = OK + INVALID + BUSY + BUSY_ONCE + CRASH;

async fn by_kind(
    crashed: &RefCell<HashSet<Vec<u8>>>,
    message: &Message,
) -> Result<(), Box<dyn std::error::Error>> {
    let payload = message.payload();
    let kind = payload.split(|&b| b == b':').nth(1).unwrap_or_default();
    let retried = message.property("RECONSUMETIMES").is_some();
    match kind {
        b"invalid" => Err(Invalid.into()),
        b"busy" => Err(Busy.into()),
        b"busy-once" if !retried => Err(Busy.into()),
        b"crash" if crashed.borrow_mut().insert(payload.to_vec()) => panic!("crash, as told"),
        _ => Ok(()),
    }
}

/// One sample of a scrape: metric name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the samples of Prometheus's text exposition format (comments
/// skipped; label values unescaped).
fn parse_scrape(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let name_end = line.find(['{', ' ']).expect("a metric name");
        let name = line[..name_end].to_string();
        let mut labels = BTreeMap::new();
        let mut rest = &line[name_end..];
        if let Some(mut inner) = rest.strip_prefix('{') {
            while !inner.starts_with('}') {
                let (key, after) = inner.split_once("=\"").expect("label=\"value\"");
                let mut value = String::new();
                let mut chars = after.char_indices();
                let end = loop {
                    match chars.next().expect("a closing quote") {
                        (_, '\\') => match chars.next().expect("an escaped character").1 {
                            'n' => value.push('\n'),
                            other => value.push(other),
                        },
                        (at, '"') => break at,
                        (_, c) => value.push(c),
                    }
                };
                labels.insert(key.trim_start_matches(',').to_string(), value);
                inner = &after[end + 1..];
            }
            rest = &inner[1..];
        }
        let value = rest.trim().split(' ').next().expect("a value");
        samples.push(Sample {
            name,
            labels,
            value: value
                .parse()
                .unwrap_or_else(|_| panic!("a number in {line:?}")),
        });
    }
    samples
}

/// `GET http://{address}{path}` with a real HTTP client, on the blocking
/// pool (the responder runs on this thread); returns status, content type
/// and body.
async fn get(address: SocketAddr, path: &str) -> (u16, String, String) {
    let url = format!("http://{address}{path}");
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        let mut response = agent
            .get(&url)
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let body = response.body_mut().read_to_string().expect("a text body");
        (response.status().as_u16(), content_type, body)
    })
    .await
    .expect("the HTTP client thread")
}

/// What each subscription must have counted, by counter name: the topic,
/// where every message arrives, and the retry topic.
const EXPECTED_TOPIC: [(&str, u64); 9] = [
    ("received", TOTAL + CRASH),
    ("dispatched", TOTAL + CRASH),
    ("succeeded", OK + CRASH),
    ("failed", INVALID + BUSY + BUSY_ONCE),
    ("panicked", CRASH),
    ("retried", BUSY + BUSY_ONCE),
    ("dead_lettered", INVALID),
    ("acked", TOTAL),
    ("nacked", CRASH),
];
const EXPECTED_RETRY_TOPIC: [(&str, u64); 9] = [
    ("received", 2 * BUSY + BUSY_ONCE),
    ("dispatched", 2 * BUSY + BUSY_ONCE),
    ("succeeded", BUSY_ONCE),
    ("failed", 2 * BUSY),
    ("panicked", 0),
    ("retried", BUSY),
    ("dead_lettered", BUSY),
    ("acked", 2 * BUSY + BUSY_ONCE),
    ("nacked", 0),
];

/// The topics and the subscription name of one run.
struct Names {
    topic: String,
    retry_topic: String,
    subscription: String,
}

impl Names {
    fn new() -> Names {
        Names {
            topic: unique_topic("observability"),
            retry_topic: unique_topic("observability-retry"),
            subscription: unique_name("observability-sub"),
        }
    }

    /// Each topic with what it must have counted and its priority label.
    fn expected(&self) -> [Expected<'_>; 2] {
        [
            Expected {
                topic: &self.topic,
                counters: &EXPECTED_TOPIC,
                priority: "10",
            },
            Expected {
                topic: &self.retry_topic,
                counters: &EXPECTED_RETRY_TOPIC,
                priority: "20",
            },
        ]
    }
}

/// What one topic's samples must show.
struct Expected<'a> {
    topic: &'a str,
    counters: &'static [(&'static str, u64)],
    priority: &'static str,
}

fn counter_metric(counter: &str) -> String {
    format!("pulsar_dispatcher_messages_{counter}_total")
}

/// The value of metric `name` for `topic` and `subscription`.
fn value_of(samples: &[Sample], name: &str, topic: &str, subscription: &str) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && s.labels.get("topic").map(String::as_str) == Some(topic)
                && s.labels.get("subscription").map(String::as_str) == Some(subscription)
        })
        .map(|s| s.value)
}

/// Whether every counter of both topics has its expected value.
fn all_counted(samples: &[Sample], names: &Names) -> bool {
    names.expected().iter().all(|expected| {
        expected.counters.iter().all(|(counter, want)| {
            let metric = counter_metric(counter);
            value_of(samples, &metric, expected.topic, &names.subscription) == Some(*want as f64)
        })
    })
}

/// Subscribes the topic and its retry topic (priorities 10 and 20) with
/// handlers that act by the message's kind.
async fn subscribe_both(dispatcher: &Dispatcher, names: &Names) {
    let crashed: Rc<RefCell<HashSet<Vec<u8>>>> = Rc::default();
    for (subscribed, priority) in [(&names.topic, 10), (&names.retry_topic, 20)] {
        let crashed = crashed.clone();
        let options = SubscribeOptions::new()
            .priority(priority)
            .subscription(&names.subscription)
            .subscription_type(SubType::Shared)
            .negative_ack_redelivery_delay(Duration::from_millis(200))
            .fatal_errors(ErrorClass::of::<Invalid>())
            .retry_errors(ErrorClass::of::<Busy>())
            .retry_topic(&names.retry_topic)
            .retry_backoff(|_| Duration::from_millis(300))
            .max_retries(2);
        dispatcher
            .subscribe(
                subscribed,
                async move |message: &Message| by_kind(&crashed, message).await,
                options,
            )
            .await
            .expect("subscribe");
    }
}

/// Serves `/metrics` and `/health` on a free local port, as the example
/// does; returns the address.
async fn serve(prometheus: PrometheusHandle, dispatcher: &Dispatcher) -> SocketAddr {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("a port");
    let address = listener.local_addr().expect("its address");
    let health = dispatcher.close_handle();
    tokio::task::spawn_local(http::serve(listener, move |path| match path {
        "/metrics" => http::Page {
            status: 200,
            content_type: http::PROMETHEUS_TEXT,
            body: prometheus.render(),
        },
        "/health" => http::health_page(health.health()),
        _ => http::Page::text(404, "not found\n"),
    }));
    address
}

/// Publishes every kind of message to the topic and waits until both
/// subscriptions have settled everything on the broker (a retry is
/// published before its original is acked, so the retry topic has it by
/// the time the first backlog is empty).
async fn publish_and_settle(names: &Names) {
    let kinds = [
        ("ok", OK),
        ("invalid", INVALID),
        ("busy", BUSY),
        ("busy-once", BUSY_ONCE),
        ("crash", CRASH),
    ];
    let messages = kinds.iter().flat_map(|&(kind, count)| {
        (0..count).map(move |n| pulsar::producer::Message {
            payload: format!("{n}:{kind}").into_bytes(),
            ..Default::default()
        })
    });
    common::publish(&names.topic, messages).await;
    let settled = |s: &common::SubscriptionStats| s.msg_backlog == 0 && s.unacked_messages == 0;
    for (settling, what) in [
        (&names.topic, "the topic"),
        (&names.retry_topic, "the retry topic"),
    ] {
        let stats = wait_for_stats(
            settling,
            &names.subscription,
            Duration::from_secs(120),
            settled,
        )
        .await;
        assert!(settled(&stats), "{what} did not settle: {:?}", stats.raw);
    }
}

/// `/health` as JSON, with its status.
async fn health(address: SocketAddr) -> (u16, serde_json::Value, String) {
    let (status, _, body) = get(address, "/health").await;
    let json = serde_json::from_str(&body).expect("health JSON");
    (status, json, body)
}

/// Scrapes `/metrics` until every counter has reached the recorder (they
/// are published every 100 ms) or a generous limit passes; returns the
/// last scrape's status, content type and body.
async fn scrape_once_counted(address: SocketAddr, names: &Names) -> (u16, String, String) {
    let begun = Instant::now();
    loop {
        let scraped = get(address, "/metrics").await;
        if all_counted(&parse_scrape(&scraped.2), names)
            || begun.elapsed() > Duration::from_secs(20)
        {
            return scraped;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Checks one topic's samples: every counter, the priority label, one
/// handler duration per dispatch (timings are on), and nothing in flight.
fn assert_topic_counted(samples: &[Sample], body: &str, subscription: &str, expected: &Expected) {
    let topic = expected.topic;
    let its_lines = || -> String {
        body.lines()
            .filter(|l| l.contains(&format!("topic=\"{topic}\"")))
            .collect::<Vec<_>>()
            .join("\n")
    };
    for (counter, want) in expected.counters {
        let metric = counter_metric(counter);
        assert_eq!(
            value_of(samples, &metric, topic, subscription),
            Some(*want as f64),
            "{metric} of {topic}; its samples:\n{}",
            its_lines()
        );
    }
    let sample = samples
        .iter()
        .find(|s| s.labels.get("topic").map(String::as_str) == Some(topic))
        .expect("a sample of the subscription");
    assert_eq!(
        sample.labels.get("priority").map(String::as_str),
        Some(expected.priority)
    );
    let durations = value_of(
        samples,
        "pulsar_dispatcher_handler_duration_seconds_count",
        topic,
        subscription,
    );
    let dispatched = expected
        .counters
        .iter()
        .find(|(c, _)| *c == "dispatched")
        .unwrap()
        .1;
    assert_eq!(durations, Some(dispatched as f64), "{}", its_lines());
    assert_eq!(
        value_of(samples, "pulsar_dispatcher_in_flight", topic, subscription),
        Some(0.0)
    );
}

#[test]
fn scraped_counters_match_the_outcomes_of_every_message() {
    // Before the dispatcher exists: metrics are registered at subscribe.
    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .expect("the process's one recorder");
    run_local(Duration::from_secs(240), async move {
        let names = Names::new();
        let dispatcher = common::dispatcher_with(
            Dispatcher::builder()
                .concurrency(4)
                .timings(true)
                .metrics_interval(Some(Duration::from_millis(100))),
        )
        .await;
        subscribe_both(&dispatcher, &names).await;
        let run = start(&dispatcher);
        let address = serve(prometheus, &dispatcher).await;
        publish_and_settle(&names).await;

        let (status, running, body) = health(address).await;
        assert_eq!(status, 200, "ready while running: {body}");
        assert_eq!(running["ready"], true, "{body}");
        assert_eq!(running["phase"], "Running", "{body}");
        assert_eq!(
            running["subscriptions"].as_array().map(Vec::len),
            Some(2),
            "{body}"
        );
        let stats = dispatcher.stats();
        assert_eq!(stats.subscriptions[0].acked, TOTAL, "{stats:?}");

        let (status, content_type, body) = scrape_once_counted(address, &names).await;
        assert_eq!(status, 200);
        assert_eq!(content_type, http::PROMETHEUS_TEXT);
        let samples = parse_scrape(&body);
        for expected in &names.expected() {
            assert_topic_counted(&samples, &body, &names.subscription, expected);
        }
        let permits = samples
            .iter()
            .find(|s| s.name == "pulsar_dispatcher_permits_available")
            .map(|s| s.value);
        assert_eq!(permits, Some(4.0), "every permit back once all is settled");

        close_and_join(&dispatcher, run).await;
        let (status, closed, body) = health(address).await;
        assert_eq!(status, 503, "not ready once closed: {body}");
        assert_eq!(closed["phase"], "Closed", "{body}");
        assert_eq!(closed["live"], false, "{body}");
    });
}
