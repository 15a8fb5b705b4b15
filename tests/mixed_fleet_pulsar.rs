//! A mixed fleet against a real Apache Pulsar broker: the Python original
//! (`pulsar-dispatcher` 0.1.0, run by `tests/interop/python_dispatcher.py`)
//! and this library share one retry chain, in both directions, with topic
//! names written short (`orders-…`, as users of both libraries write them)
//! and in full (`persistent://public/default/orders-…`).
//!
//! Every chain must count RECONSUMETIMES up across the hand-over and end in
//! the dead letter topic of the subscription that first retried the message
//! (the one its DEAD_LETTER_TOPIC property names), and nothing may land in
//! the dead letter topic of the subscription that consumed the retry topic.
//!
//! What the Python original does with the properties (pulsar_dispatcher
//! 0.1.0, `dispatcher.py`), which these tests rely on and pin down:
//!
//! - it stamps DEAD_LETTER_TOPIC with `f"{topic}-{subscription_name}-DLQ"`,
//!   the topic exactly as its user passed it, so a short name stays short;
//! - it dead-letters to whatever DEAD_LETTER_TOPIC names, unchecked and
//!   unexpanded; its client expands short names, so both forms work;
//! - it never sets DELAY_TIME, so after one of our retries a later Python
//!   retry leaves our (stale) DELAY_TIME in place;
//! - its ORIGIN_MESSAGE_ID is `str(MessageId)`, `(ledger,entry,partition,batch)`,
//!   not the Java client's `ledger:entry:partition` this library writes; each
//!   side keeps the other's value (only the first republish sets it).

mod common;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use common::{
    client, close_and_join, pulsar_url, run_interop, run_local, start, topic_stats, unique_name,
    wait_for_stats, wait_until,
};
use futures::StreamExt;
use pulsar::consumer::{DeadLetterPolicy, InitialPosition};
use pulsar::{Consumer, ConsumerOptions, TokioExecutor};
use pulsar_dispatcher::{
    full_topic_name, DeadLetterTargets, Dispatcher, ErrorClass, Message, RetryTopicCheck, SubType,
    SubscribeOptions,
};
use serde_json::{json, Value};

/// Runs each named test body (a `fn(Names)`) with short and with full topic
/// names, as `<name>::short_names` and `<name>::full_names`.
macro_rules! with_short_and_full_names {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn short_names() {
                    super::$name(super::Names::Short)
                }
                #[test]
                fn full_names() {
                    super::$name(super::Names::Full)
                }
            }
        )*
    };
}

with_short_and_full_names!(
    python_retries_then_this_library_dead_letters_to_the_python_subscriptions_dlq,
    this_library_retries_then_python_dead_letters_to_our_subscriptions_dlq,
);

/// How the topic names handed to both dispatchers are written.
#[derive(Clone, Copy, Debug)]
enum Names {
    /// `orders-…`, in public/default.
    Short,
    /// `persistent://public/default/orders-…`.
    Full,
}

impl Names {
    fn topic(self, name: &str) -> String {
        match self {
            Names::Short => name.to_owned(),
            Names::Full => format!("persistent://public/default/{name}"),
        }
    }
}

fn full(topic: &str) -> String {
    full_topic_name(topic).unwrap_or_else(|e| panic!("{topic}: {e}"))
}

/// The retry topics and subscriptions of one chain, written as `names` says.
struct Chain {
    /// The original topic, as both dispatchers are given it.
    topic: String,
    /// The retry topic, as both dispatchers are given it.
    retry_topic: String,
    /// The subscription to `topic`, which retries first.
    original_subscription: String,
    /// The subscription to `retry_topic`, on the other side of the fleet.
    retry_subscription: String,
}

impl Chain {
    fn new(names: Names) -> Self {
        let base = unique_name("orders");
        Chain {
            topic: names.topic(&base),
            retry_topic: names.topic(&format!("{base}-retry")),
            original_subscription: unique_name("orders-sub"),
            retry_subscription: unique_name("retry-sub"),
        }
    }

    /// Pulsar's default dead letter topic of the original subscription, as
    /// a dispatcher given `topic` as written names it.
    fn original_dlq_as_written(&self) -> String {
        format!("{}-{}-DLQ", self.topic, self.original_subscription)
    }

    /// The dead letter topic every failure of the chain must end in.
    fn original_dlq(&self) -> String {
        full(&self.original_dlq_as_written())
    }

    /// The retry subscription's own dead letter topic: the wrong place.
    fn retry_subscriptions_own_dlq(&self) -> String {
        full(&format!(
            "{}-{}-DLQ",
            self.retry_topic, self.retry_subscription
        ))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("service unavailable")]
struct ServiceUnavailable;

/// RECONSUMETIMES of every message the handler was given, in order.
type Seen = Rc<RefCell<Vec<Option<String>>>>;

/// A handler that records RECONSUMETIMES and always fails retryably.
fn always_unavailable(
    seen: &Seen,
) -> impl AsyncFn(&Message) -> Result<(), ServiceUnavailable> + 'static {
    let seen = seen.clone();
    async move |message: &Message| {
        seen.borrow_mut()
            .push(message.property("RECONSUMETIMES").map(str::to_owned));
        Err(ServiceUnavailable)
    }
}

/// Retries of `chain.retry_topic` after one second, as the Python side is
/// configured too, dead-lettered after `max_retries` retries.
fn retrying(subscription: &str, retry_topic: &str, max_retries: u32) -> SubscribeOptions {
    common::from_the_start(SubscribeOptions::new())
        .subscription(subscription)
        .subscription_type(SubType::Shared)
        .retry_errors(ErrorClass::of::<ServiceUnavailable>())
        .retry_topic(retry_topic)
        .retry_backoff(|_| Duration::from_secs(1))
        .max_retries(max_retries)
}

/// Runs the Python original on `topic` (retrying to `retry_topic`, one
/// second apart, dead-lettering after `max_retries`) until its handler has
/// been called `stop_after` times; returns what the handler was given.
async fn python_dispatcher(
    topic: &str,
    subscription: &str,
    retry_topic: &str,
    max_retries: u32,
    stop_after: usize,
) -> Vec<Value> {
    run_python_dispatcher(json!({
        "service_url": pulsar_url(),
        "subscriptions": [{
            "topic": topic,
            "subscription": subscription,
            "retry_topic": retry_topic,
            "max_retries": max_retries,
            "backoff_seconds": 1,
        }],
        "stop_after": stop_after,
        "timeout_ms": 90_000,
    }))
    .await
}

/// Runs `tests/interop/python_dispatcher.py` with `request` (its fields are
/// in the script's docstring); returns what its handler was given.
async fn run_python_dispatcher(request: Value) -> Vec<Value> {
    let result = run_interop("python_dispatcher.py", request).await;
    assert_eq!(
        result["version"], "0.1.0",
        "the test virtualenv must have the Python original pulsar-dispatcher 0.1.0"
    );
    result["handled"].as_array().expect("handled").clone()
}

/// A plain consumer that reads `topic` from its start.
async fn reader(topic: &str) -> Consumer<Vec<u8>, TokioExecutor> {
    client()
        .await
        .consumer()
        .with_topic(topic)
        .with_subscription(unique_name("reader"))
        .with_subscription_type(SubType::Shared)
        .with_options(ConsumerOptions::default().with_initial_position(InitialPosition::Earliest))
        .build()
        .await
        .expect("reader consumer")
}

type Received = pulsar::consumer::Message<Vec<u8>>;

/// The next message of `consumer` within `limit`, acked; `None` if none came.
async fn next_within(
    consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
    limit: Duration,
) -> Option<Received> {
    let message = tokio::time::timeout(limit, consumer.next())
        .await
        .ok()?
        .expect("stream open")
        .expect("a message");
    consumer.ack(&message).await.expect("ack");
    Some(message)
}

/// Where a dead letter was found.
#[derive(Debug, PartialEq, Eq)]
enum Landed {
    /// In the original subscription's dead letter topic.
    OriginalDlq,
    /// In the retry subscription's own dead letter topic.
    RetrySubscriptionsOwnDlq,
}

/// Waits for the first dead letter on either topic, however long the chain
/// takes (within a generous limit), and says where it landed.
async fn first_dead_letter(
    original: &mut Consumer<Vec<u8>, TokioExecutor>,
    own: &mut Consumer<Vec<u8>, TokioExecutor>,
) -> (Landed, Received) {
    let (landed, message) = tokio::time::timeout(Duration::from_secs(120), async {
        tokio::select! {
            message = original.next() => (Landed::OriginalDlq, message),
            message = own.next() => (Landed::RetrySubscriptionsOwnDlq, message),
        }
    })
    .await
    .expect("no dead letter in either dead letter topic within 120 s");
    let message = message.expect("stream open").expect("a message");
    match landed {
        Landed::OriginalDlq => original.ack(&message).await.expect("ack"),
        Landed::RetrySubscriptionsOwnDlq => own.ack(&message).await.expect("ack"),
    }
    (landed, message)
}

/// Nothing more arrives on either dead letter topic, and the broker has
/// never taken a message for `wrong_dlq`.
async fn assert_nothing_else_dead_lettered(
    original: &mut Consumer<Vec<u8>, TokioExecutor>,
    own: &mut Consumer<Vec<u8>, TokioExecutor>,
    wrong_dlq: &str,
) {
    let quiet = Duration::from_secs(3);
    if let Some(extra) = next_within(original, quiet).await {
        panic!(
            "a second dead letter in the original dead letter topic: {:?} {:?}",
            String::from_utf8_lossy(&extra.payload.data),
            properties(&extra)
        );
    }
    if let Some(extra) = next_within(own, quiet).await {
        panic!(
            "a dead letter in {wrong_dlq}: {:?} {:?}",
            String::from_utf8_lossy(&extra.payload.data),
            properties(&extra)
        );
    }
    let stats = topic_stats(wrong_dlq);
    assert_eq!(
        stats["msgInCounter"].as_u64(),
        Some(0),
        "the broker took messages for {wrong_dlq}: {stats}"
    );
}

fn properties(message: &Received) -> BTreeMap<String, String> {
    message
        .metadata()
        .properties
        .iter()
        .map(|p| (p.key.clone(), p.value.clone()))
        .collect()
}

const PAYLOAD: &str = "order 17: warehouse unavailable";

/// Publishes the order that starts the chain, with a property, a partition
/// key and an event time that every republish must keep.
async fn publish_order(topic: &str) {
    let client = client().await;
    let mut producer = client
        .producer()
        .with_topic(full(topic))
        .build()
        .await
        .expect("producer");
    let message = pulsar::producer::Message {
        payload: PAYLOAD.as_bytes().to_vec(),
        properties: [("order".to_string(), "17".to_string())].into(),
        partition_key: Some("customer-3".into()),
        event_time: Some(1_700_000_000_000),
        ..Default::default()
    };
    producer
        .send_non_blocking(message)
        .await
        .expect("send")
        .await
        .expect("receipt");
    producer.close().await.expect("closing the producer");
}

/// The dead letter is the order, intact.
fn assert_is_the_order(dead: &Received) {
    assert_eq!(String::from_utf8_lossy(&dead.payload.data), PAYLOAD);
    assert_eq!(dead.metadata().partition_key.as_deref(), Some("customer-3"));
    assert_eq!(dead.metadata().event_time, Some(1_700_000_000_000));
    assert_eq!(
        properties(dead).get("order").map(String::as_str),
        Some("17")
    );
}

fn python_property<'a>(handled: &'a Value, key: &str) -> Option<&'a str> {
    handled["properties"][key].as_str()
}

/// Python → Rust: the Python original consumes the original topic and
/// retries to the retry topic, stamping DEAD_LETTER_TOPIC with its
/// subscription's dead letter topic as its user wrote the topic. This
/// library consumes the retry topic, retries on until `max_retries`, and
/// dead-letters into the topic the Python side stamped, which it trusts
/// because it is allowed, by the name as the Python side's user wrote it.
fn python_retries_then_this_library_dead_letters_to_the_python_subscriptions_dlq(names: Names) {
    run_local(Duration::from_secs(240), async {
        let chain = Chain::new(names);
        let stamped = chain.original_dlq_as_written();
        let mut original_dlq = reader(&chain.original_dlq()).await;
        let mut own_dlq = reader(&chain.retry_subscriptions_own_dlq()).await;
        let dispatcher = common::dispatcher_with(
            Dispatcher::builder()
                .dead_letter_targets(DeadLetterTargets::known().allow(&stamped).unwrap()),
        )
        .await;
        let seen = Seen::default();
        dispatcher
            .subscribe(
                &chain.retry_topic,
                always_unavailable(&seen),
                retrying(&chain.retry_subscription, &chain.retry_topic, 3),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        publish_order(&chain.topic).await;

        // The Python original handles the order once and retries it.
        let handled = python_dispatcher(
            &chain.topic,
            &chain.original_subscription,
            &chain.retry_topic,
            3,
            1,
        )
        .await;
        assert_eq!(handled.len(), 1, "the Python side handled {handled:?}");
        let first = &handled[0];
        assert_eq!(first["payload"], PAYLOAD);
        assert_eq!(first["topic"], full(&chain.topic).as_str());
        assert_eq!(python_property(first, "RECONSUMETIMES"), None);
        let python_message_id = first["message_id"].as_str().unwrap().to_owned();
        let original = wait_for_stats(
            &full(&chain.topic),
            &chain.original_subscription,
            Duration::from_secs(30),
            |s| s.msg_backlog == 0,
        )
        .await;
        assert_eq!(
            original.msg_backlog, 0,
            "the Python side acked the original after retrying it"
        );

        // This library counts on from the Python side's first retry.
        let (landed, dead) = first_dead_letter(&mut original_dlq, &mut own_dlq).await;
        let props = properties(&dead);
        assert_eq!(
            landed,
            Landed::OriginalDlq,
            "the chain must end in {} (DEAD_LETTER_TOPIC {:?}), not in the retry \
             subscription's own {}; dead letter properties: {props:?}",
            chain.original_dlq(),
            stamped,
            chain.retry_subscriptions_own_dlq(),
        );
        assert_is_the_order(&dead);
        assert_eq!(props["RECONSUMETIMES"], "3");
        // The property as the Python original stamped it (a short name stays
        // short), carried unchanged through this library's retries.
        assert_eq!(props["DEAD_LETTER_TOPIC"], stamped);
        assert_eq!(props["REAL_TOPIC"], full(&chain.topic));
        // The Python original's own id format, kept by this library.
        assert_eq!(props["ORIGIN_MESSAGE_ID"], python_message_id);
        assert!(
            python_message_id.starts_with('(') && python_message_id.ends_with(')'),
            "the Python client prints ids as (ledger,entry,partition,batch): {python_message_id}"
        );
        assert_eq!(
            *seen.borrow(),
            [Some("1".into()), Some("2".into()), Some("3".into())],
            "this library's handler saw RECONSUMETIMES count on from the Python retry"
        );
        wait_until(
            "the dead letter to be counted",
            Duration::from_secs(30),
            || dispatcher.stats().total().dead_lettered == 1,
        )
        .await;
        let stats = dispatcher.stats().total();
        assert_eq!((stats.retried, stats.dead_lettered), (2, 1), "{stats:?}");

        assert_nothing_else_dead_lettered(
            &mut original_dlq,
            &mut own_dlq,
            &chain.retry_subscriptions_own_dlq(),
        )
        .await;
        let retries = wait_for_stats(
            &full(&chain.retry_topic),
            &chain.retry_subscription,
            Duration::from_secs(30),
            |s| s.msg_backlog == 0,
        )
        .await;
        assert_eq!(retries.msg_backlog, 0, "every retry was acked");
        close_and_join(&dispatcher, run).await;
    });
}

/// Rust → Python: this library consumes the original topic and retries,
/// stamping DEAD_LETTER_TOPIC with its subscription's dead letter topic in
/// full (it expands every name, short or not). The Python original consumes
/// the retry topic, counts on, and at its max_retries dead-letters to the
/// topic the property names. It honours any property without a check, and
/// its client expands names, so a full name works as well as a short one.
fn this_library_retries_then_python_dead_letters_to_our_subscriptions_dlq(names: Names) {
    run_local(Duration::from_secs(240), async {
        let chain = Chain::new(names);
        let mut original_dlq = reader(&chain.original_dlq()).await;
        let mut own_dlq = reader(&chain.retry_subscriptions_own_dlq()).await;
        // The Python side consumes the retry topic.
        let dispatcher = common::dispatcher_with(
            Dispatcher::builder().retry_topic_check(RetryTopicCheck::Ignore),
        )
        .await;
        let seen = Seen::default();
        dispatcher
            .subscribe(
                &chain.topic,
                always_unavailable(&seen),
                retrying(&chain.original_subscription, &chain.retry_topic, 3),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        publish_order(&chain.topic).await;

        // Retries 1 (ours), 2 and 3 (Python's); the third failure on the
        // Python side is past its max_retries and dead-letters.
        let handled = python_dispatcher(
            &chain.retry_topic,
            &chain.retry_subscription,
            &chain.retry_topic,
            3,
            3,
        )
        .await;
        let counts: Vec<Option<&str>> = handled
            .iter()
            .map(|h| python_property(h, "RECONSUMETIMES"))
            .collect();
        assert_eq!(
            counts,
            [Some("1"), Some("2"), Some("3")],
            "the Python side counted on from this library's retry: {handled:?}"
        );
        for message in &handled {
            assert_eq!(message["payload"], PAYLOAD);
            assert_eq!(message["topic"], full(&chain.retry_topic).as_str());
            // Always the full name, whatever the user wrote: this library
            // expands names before stamping them.
            assert_eq!(
                python_property(message, "DEAD_LETTER_TOPIC"),
                Some(chain.original_dlq().as_str())
            );
        }
        assert_eq!(
            *seen.borrow(),
            [None],
            "this library handled the original once"
        );
        wait_until("the retry to be counted", Duration::from_secs(30), || {
            dispatcher.stats().total().retried == 1
        })
        .await;
        let stats = dispatcher.stats().total();
        assert_eq!((stats.retried, stats.dead_lettered), (1, 0), "{stats:?}");

        let (landed, dead) = first_dead_letter(&mut original_dlq, &mut own_dlq).await;
        let props = properties(&dead);
        assert_eq!(
            landed,
            Landed::OriginalDlq,
            "the Python original must dead-letter to {} as DEAD_LETTER_TOPIC says, not to \
             its own {}; dead letter properties: {props:?}",
            chain.original_dlq(),
            chain.retry_subscriptions_own_dlq(),
        );
        assert_is_the_order(&dead);
        assert_eq!(props["RECONSUMETIMES"], "3");
        assert_eq!(props["DEAD_LETTER_TOPIC"], chain.original_dlq());
        assert_eq!(props["REAL_TOPIC"], full(&chain.topic));
        // This library's `ledger:entry:partition`, kept by the Python side.
        let origin: Vec<&str> = props["ORIGIN_MESSAGE_ID"].split(':').collect();
        assert_eq!(origin.len(), 3, "{props:?}");
        assert_eq!(origin[2], "-1", "{props:?}");
        // The Python original never sets DELAY_TIME: the dead letter still
        // carries the delay of this library's retry, the only one that set it.
        assert_eq!(props["DELAY_TIME"], "1000");

        assert_nothing_else_dead_lettered(
            &mut original_dlq,
            &mut own_dlq,
            &chain.retry_subscriptions_own_dlq(),
        )
        .await;
        let retries = wait_for_stats(
            &full(&chain.retry_topic),
            &chain.retry_subscription,
            Duration::from_secs(30),
            |s| s.msg_backlog == 0,
        )
        .await;
        assert_eq!(
            retries.msg_backlog, 0,
            "the Python side acked every retry it handled"
        );
        let original = wait_for_stats(
            &full(&chain.topic),
            &chain.original_subscription,
            Duration::from_secs(30),
            |s| s.msg_backlog == 0,
        )
        .await;
        assert_eq!(original.msg_backlog, 0, "this library acked the original");
        close_and_join(&dispatcher, run).await;
    });
}

/// The trust check still holds in a mixed fleet: without
/// `DeadLetterTargets::allow`, a DEAD_LETTER_TOPIC stamped by the Python
/// original names no dead letter topic of this dispatcher's subscriptions,
/// so the message goes to the receiving subscription's own.
#[test]
fn a_python_dead_letter_topic_that_is_not_allowed_is_not_trusted() {
    run_local(Duration::from_secs(240), async {
        let chain = Chain::new(Names::Short);
        let mut original_dlq = reader(&chain.original_dlq()).await;
        let mut own_dlq = reader(&chain.retry_subscriptions_own_dlq()).await;
        let dispatcher = common::dispatcher().await;
        let seen = Seen::default();
        dispatcher
            .subscribe(
                &chain.retry_topic,
                always_unavailable(&seen),
                retrying(&chain.retry_subscription, &chain.retry_topic, 1),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        publish_order(&chain.topic).await;
        let handled = python_dispatcher(
            &chain.topic,
            &chain.original_subscription,
            &chain.retry_topic,
            3,
            1,
        )
        .await;
        assert_eq!(handled.len(), 1, "the Python side handled {handled:?}");

        let (landed, dead) = first_dead_letter(&mut original_dlq, &mut own_dlq).await;
        let props = properties(&dead);
        assert_eq!(
            landed,
            Landed::RetrySubscriptionsOwnDlq,
            "an untrusted DEAD_LETTER_TOPIC was honoured; dead letter properties: {props:?}, \
             this library's handler saw RECONSUMETIMES {:?}, its stats: {:?}",
            seen.borrow(),
            dispatcher.stats().total(),
        );
        assert_is_the_order(&dead);
        assert_eq!(props["RECONSUMETIMES"], "1");
        assert_eq!(props["DEAD_LETTER_TOPIC"], chain.original_dlq_as_written());
        assert_eq!(*seen.borrow(), [Some("1".into())]);
        if let Some(extra) = next_within(&mut own_dlq, Duration::from_secs(3)).await {
            panic!("a second dead letter: {:?}", properties(&extra));
        }
        let stats = topic_stats(&chain.original_dlq());
        assert_eq!(
            stats["msgInCounter"].as_u64(),
            Some(0),
            "nothing may reach the untrusted {}: {stats}",
            chain.original_dlq()
        );
        close_and_join(&dispatcher, run).await;
    });
}

/// A dead letter policy gives a failing message as many tries on this
/// library as on the Python original, whose client (Pulsar's C++ client)
/// hands it over `max_redeliver_count + 1` times and then dead-letters it:
/// otherwise a mixed fleet would give a message more or fewer tries
/// depending on which side received its last redelivery. Each side runs
/// alone on its own topic, configured the same (no retry topic, so every
/// failure is a nack).
#[test]
fn a_dead_letter_policy_gives_as_many_tries_as_the_python_original() {
    run_local(Duration::from_secs(180), async {
        const MAX_REDELIVER: usize = 2;
        let tries: Vec<u64> = (0..=MAX_REDELIVER as u64).collect();

        let python_topic = unique_name("orders-py");
        let python_dlq = full(&format!("{python_topic}-DLQ"));
        let mut python_dead_letters = reader(&python_dlq).await;
        publish_order(&python_topic).await;
        let handled = run_python_dispatcher(json!({
            "service_url": pulsar_url(),
            "subscriptions": [{
                "topic": python_topic,
                "subscription": "orders-sub",
                "nack_delay_ms": 200,
                "dead_letter_policy": {
                    "max_redeliver_count": MAX_REDELIVER,
                    "dead_letter_topic": python_dlq,
                },
            }],
            "stop_after": tries.len(),
            "linger_ms": 3_000,
            "timeout_ms": 60_000,
        }))
        .await;
        let python_tries: Vec<u64> = handled
            .iter()
            .map(|handled| handled["redelivery_count"].as_u64().expect("a count"))
            .collect();
        assert_eq!(python_tries, tries, "redelivery counts the Python side saw");
        let dead = next_within(&mut python_dead_letters, Duration::from_secs(10))
            .await
            .expect("the Python side's client dead-lettered the order");
        assert_eq!(String::from_utf8_lossy(&dead.payload.data), PAYLOAD);

        let topic = unique_name("orders-rs");
        let dlq = full(&format!("{topic}-DLQ"));
        let mut dead_letters = reader(&dlq).await;
        let dispatcher = common::dispatcher().await;
        let seen = Seen::default();
        let options = common::from_the_start(SubscribeOptions::new())
            .subscription("orders-sub")
            .subscription_type(SubType::Shared)
            .negative_ack_redelivery_delay(Duration::from_millis(200))
            .dead_letter_policy(DeadLetterPolicy {
                max_redeliver_count: MAX_REDELIVER,
                dead_letter_topic: dlq.clone(),
            });
        dispatcher
            .subscribe(&topic, always_unavailable(&seen), options)
            .await
            .unwrap();
        let run = start(&dispatcher);
        publish_order(&topic).await;
        let dead = next_within(&mut dead_letters, Duration::from_secs(30))
            .await
            .expect("this library's consumer dead-lettered the order");
        assert_eq!(String::from_utf8_lossy(&dead.payload.data), PAYLOAD);
        // A hand-over after the dead letter would show within a few nack
        // delays.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            seen.borrow().len(),
            tries.len(),
            "tries this library's handler was given, against the Python original's {tries:?}"
        );
        close_and_join(&dispatcher, run).await;
    });
}
