//! Failure routing against a real Apache Pulsar broker: dead letters,
//! delayed retries and their limit, replies, topic families, and the
//! retry-letter properties as another client reads them.

mod common;

on_plain_and_partitioned_topics!(
    a_fatal_error_lands_in_the_dead_letter_topic_intact,
    retries_wait_their_delay_count_up_and_end_in_the_original_dead_letter_topic,
    a_reply_is_published_and_the_original_acked,
    a_burst_of_replies_larger_than_the_clients_send_queue_is_all_published,
    a_topic_family_subscribes_the_documented_topics_and_priorities,
    a_retried_message_carries_the_java_retry_letter_properties_for_python,
    retries_and_dead_letters_stay_in_a_topics_own_tenant_and_namespace,
    a_reply_larger_than_the_broker_takes_is_not_sent_and_its_original_comes_back,
);

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{
    base_topic, client, close_and_join, create_partitioned_topic, ensure_namespace, fresh_topic,
    is_topic_or_partition, pulsar_url, run_interop, run_local, start, topic_stats, unique_name,
    wait_for_empty_backlog, wait_until, TopicKind,
};
use futures::StreamExt;
use pulsar::consumer::InitialPosition;
use pulsar::{Consumer, ConsumerOptions, TokioExecutor};
use pulsar_dispatcher::{
    priorities, Dispatcher, ErrorClass, Message, RetryTopicCheck, SubType, SubscribeOptions,
    TopicFamily,
};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
#[error("invalid order")]
struct InvalidOrder;

#[derive(Debug, thiserror::Error)]
#[error("service unavailable")]
struct ServiceUnavailable;

async fn fail_as_told(message: &Message) -> Result<(), Box<dyn std::error::Error>> {
    match message.payload() {
        b"invalid" => Err(InvalidOrder.into()),
        b"unavailable" => Err(ServiceUnavailable.into()),
        _ => Ok(()),
    }
}

/// Subscribes each of `topics` at its priority with `options`, with a
/// handler that hands each message to `record` and then fails as told.
async fn subscribe_failing_as_told(
    dispatcher: &Dispatcher,
    topics: &[(&str, i64)],
    options: &SubscribeOptions,
    record: impl Fn(&Message) + Clone + 'static,
) {
    for &(topic, priority) in topics {
        let record = record.clone();
        let handler = async move |message: &Message| {
            record(message);
            fail_as_told(message).await
        };
        dispatcher
            .subscribe(topic, handler, options.clone().priority(priority))
            .await
            .unwrap();
    }
}

fn shared(subscription: &str) -> SubscribeOptions {
    SubscribeOptions::new()
        .subscription(subscription)
        .subscription_type(SubType::Shared)
        .fatal_errors(ErrorClass::of::<InvalidOrder>())
        .consumer_options(
            ConsumerOptions::default().with_initial_position(InitialPosition::Earliest),
        )
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

async fn next_message(
    consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
    what: &str,
) -> pulsar::consumer::Message<Vec<u8>> {
    let message = tokio::time::timeout(Duration::from_secs(30), consumer.next())
        .await
        .unwrap_or_else(|_| panic!("no {what} within 30 s"))
        .expect("stream open")
        .expect("a message");
    consumer.ack(&message).await.expect("ack");
    message
}

fn properties(message: &pulsar::consumer::Message<Vec<u8>>) -> BTreeMap<String, String> {
    message
        .metadata()
        .properties
        .iter()
        .map(|p| (p.key.clone(), p.value.clone()))
        .collect()
}

/// Order 17 of customer 3, with every field a republish must keep.
fn order(payload: &str) -> pulsar::producer::Message {
    pulsar::producer::Message {
        payload: payload.as_bytes().to_vec(),
        properties: [("order".to_string(), "17".to_string())].into(),
        partition_key: Some("customer-3".into()),
        ordering_key: Some(b"order-17".to_vec()),
        event_time: Some(1_700_000_000_000),
        ..Default::default()
    }
}

async fn publish_order(topic: &str, payload: &str) {
    common::publish(topic, [order(payload)]).await;
}

/// The partition index Pulsar's clients print in message ids: `-1` for a
/// topic that is not partitioned.
fn partition_index(topic: &str) -> String {
    match topic.rsplit_once("-partition-") {
        Some((_, index)) => index.to_owned(),
        None => "-1".to_owned(),
    }
}

/// REAL_TOPIC names the topic, or for a partitioned topic the partition,
/// the message was consumed from (as Pulsar's Java client does), and
/// ORIGIN_MESSAGE_ID is `ledger:entry:partition` with that partition.
fn assert_origin(props: &BTreeMap<String, String>, topic: &str, kind: TopicKind) {
    let real_topic = &props["REAL_TOPIC"];
    assert!(
        is_topic_or_partition(real_topic, topic, kind),
        "REAL_TOPIC {real_topic} is not {topic} or one of its partitions"
    );
    let origin: Vec<&str> = props["ORIGIN_MESSAGE_ID"].split(':').collect();
    assert_eq!(origin.len(), 3, "ledger:entry:partition, got {origin:?}");
    assert!(origin.iter().all(|part| part.parse::<i64>().is_ok()));
    assert_eq!(origin[2], partition_index(real_topic), "{origin:?}");
}

fn a_fatal_error_lands_in_the_dead_letter_topic_intact(kind: TopicKind) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("fatal", kind);
        let subscription = unique_name("orders-sub");
        let dead_letter_topic = format!("{topic}-{subscription}-DLQ");
        let mut dead_letters = reader(&dead_letter_topic).await;
        let dispatcher = common::dispatcher().await;
        dispatcher
            .subscribe(&topic, fail_as_told, shared(&subscription))
            .await
            .unwrap();
        let run = start(&dispatcher);
        // The key given as bytes: the dead letter keeps it so.
        let keyed_by_bytes = pulsar::producer::Message {
            partition_key: Some("Y3VzdG9tZXItMw==".into()),
            partition_key_b64_encoded: Some(true),
            ..order("invalid")
        };
        common::publish(&topic, [keyed_by_bytes]).await;

        let dead = next_message(&mut dead_letters, "dead letter").await;
        assert_eq!(dead.payload.data, b"invalid");
        assert_eq!(
            dead.metadata().partition_key.as_deref(),
            Some("Y3VzdG9tZXItMw==")
        );
        assert_eq!(dead.metadata().partition_key_b64_encoded, Some(true));
        assert_eq!(
            dead.metadata().ordering_key.as_deref(),
            Some(&b"order-17"[..])
        );
        assert_eq!(dead.metadata().event_time, Some(1_700_000_000_000));
        let props = properties(&dead);
        assert_eq!(props["order"], "17");
        assert_origin(&props, &topic, kind);
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        assert_eq!(stats.msg_backlog, 0, "the original was acked");
        close_and_join(&dispatcher, run).await;
    });
}

fn retries_wait_their_delay_count_up_and_end_in_the_original_dead_letter_topic(kind: TopicKind) {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("orders", kind);
        let retry_topic = format!("{topic}-retry");
        let subscription = unique_name("orders-sub");
        let dead_letter_topic = format!("{topic}-{subscription}-DLQ");
        let mut dead_letters = reader(&dead_letter_topic).await;
        let dispatcher = common::dispatcher().await;
        // (when, topic, RECONSUMETIMES) of every handler call.
        type Attempts = Rc<RefCell<Vec<(Instant, String, Option<String>)>>>;
        let attempts: Attempts = Rc::default();
        let options = shared(&subscription)
            .retry_errors(ErrorClass::of::<ServiceUnavailable>())
            .retry_topic(&retry_topic)
            .retry_backoff(|retry| Duration::from_secs(u64::from(retry)))
            .max_retries(2);
        let record = {
            let attempts = attempts.clone();
            move |message: &Message| {
                attempts.borrow_mut().push((
                    Instant::now(),
                    base_topic(message.topic()).to_owned(),
                    message.property("RECONSUMETIMES").map(str::to_owned),
                ))
            }
        };
        let topics = [(topic.as_str(), 10), (retry_topic.as_str(), 20)];
        subscribe_failing_as_told(&dispatcher, &topics, &options, record).await;
        let run = start(&dispatcher);
        publish_order(&topic, "unavailable").await;

        let dead = next_message(&mut dead_letters, "dead letter after two retries").await;
        let props = properties(&dead);
        assert_eq!(props["RECONSUMETIMES"], "2");
        assert_origin(&props, &topic, kind);
        assert_eq!(props["DEAD_LETTER_TOPIC"], dead_letter_topic);
        assert_eq!(dead.payload.data, b"unavailable");

        let attempts = attempts.borrow().clone();
        let seen: Vec<(&str, Option<&str>)> = attempts
            .iter()
            .map(|(_, t, r)| (t.as_str(), r.as_deref()))
            .collect();
        assert_eq!(
            seen,
            [
                (topic.as_str(), None),
                (retry_topic.as_str(), Some("1")),
                (retry_topic.as_str(), Some("2")),
            ]
        );
        // The broker held each retry for at least its delay (1 s, then 2 s);
        // a little slack for clock granularity between publish and delivery.
        let slack = Duration::from_millis(50);
        assert!(attempts[1].0 - attempts[0].0 + slack >= Duration::from_secs(1));
        assert!(attempts[2].0 - attempts[1].0 + slack >= Duration::from_secs(2));
        close_and_join(&dispatcher, run).await;
    });
}

/// A handler's returned bytes reach the reply topic and the message is
/// acked, on the broker. That the publish completes before the ack is
/// sent is shown on the in-memory transport, which logs publishes and acks
/// in order
/// (`tests::routing::replies_are_published_before_the_ack_and_only_when_returned`).
fn a_reply_is_published_and_the_original_acked(kind: TopicKind) {
    run_local(Duration::from_secs(60), async {
        let topic = fresh_topic("images", kind);
        let reply_topic = fresh_topic("thumbnails", kind);
        let subscription = unique_name("resizer");
        let mut replies = reader(&reply_topic).await;
        let dispatcher = common::dispatcher().await;
        dispatcher
            .subscribe(
                &topic,
                async |message: &Message| {
                    Ok::<_, std::convert::Infallible>([b"thumb:", message.payload()].concat())
                },
                shared(&subscription).reply_topic(&reply_topic),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        publish_order(&topic, "cat.png").await;
        let reply = next_message(&mut replies, "reply").await;
        assert_eq!(reply.payload.data, b"thumb:cat.png");
        let acked = wait_for_empty_backlog(&topic, &subscription).await;
        assert_eq!(acked.msg_backlog, 0);
        close_and_join(&dispatcher, run).await;
    });
}

/// The `pulsar` crate queues at most 100 sends per connection and, unless
/// told to wait, fails the next one at once. Three hundred handlers
/// replying in the same turn of the thread must all be published, none
/// failed and nacked.
fn a_burst_of_replies_larger_than_the_clients_send_queue_is_all_published(kind: TopicKind) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("burst", kind);
        let reply_topic = fresh_topic("burst-replies", kind);
        let subscription = unique_name("burst");
        let total = 300;
        let mut replies = reader(&reply_topic).await;
        common::publish(
            &topic,
            (0..total).map(|n| pulsar::producer::Message {
                payload: n.to_string().into_bytes(),
                ..Default::default()
            }),
        )
        .await;
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(total)).await;
        dispatcher
            .subscribe(
                &topic,
                async |message: &Message| {
                    Ok::<_, std::convert::Infallible>(message.payload().to_vec())
                },
                shared(&subscription)
                    .reply_topic(&reply_topic)
                    .receiver_queue_size(total as u32),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        let mut replied = std::collections::BTreeSet::new();
        while replied.len() < total {
            let reply = next_message(&mut replies, "reply").await;
            replied.insert(String::from_utf8(reply.payload.data).unwrap());
        }
        assert_eq!(replied, (0..total).map(|n| n.to_string()).collect());
        let drained = wait_for_empty_backlog(&topic, &subscription).await;
        assert_eq!(drained.msg_backlog, 0, "every message acked: {drained:?}");
        let stats = dispatcher.stats().total();
        assert_eq!(
            (stats.replied, stats.acked, stats.nacked),
            (total as u64, total as u64, 0),
            "{stats:?}"
        );
        close_and_join(&dispatcher, run).await;
    });
}

priorities! {
    enum Level { Live = 100, Batch = 200 }
}
priorities! {
    enum Lane { High = 10, Low = 20, Retry = 50 }
}

fn a_topic_family_subscribes_the_documented_topics_and_priorities(kind: TopicKind) {
    run_local(Duration::from_secs(90), async {
        let prefix = unique_name("orders").replace('-', "");
        let subscription = unique_name("orders-sub");
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(1)).await;
        let handled: Rc<RefCell<Vec<String>>> = Rc::default();
        let record = handled.clone();
        let family = TopicFamily::<Level, Lane>::new(&prefix).retry_sublevel(Lane::Retry);
        if let TopicKind::Partitioned(partitions) = kind {
            for member in family.topics().unwrap() {
                create_partitioned_topic(&member.name, partitions);
            }
        }
        dispatcher
            .subscribe_family(
                &family,
                async move |message: &Message| {
                    record.borrow_mut().push(message.topic().to_owned());
                    fail_as_told(message).await
                },
                shared(&subscription).retry_errors(ErrorClass::of::<ServiceUnavailable>()),
            )
            .await
            .unwrap();
        let names = [
            ("live_high", 110),
            ("live_low", 120),
            ("live_retry", 150),
            ("batch_high", 210),
            ("batch_low", 220),
            ("batch_retry", 250),
        ];
        let registered: Vec<(String, i64)> = dispatcher
            .subscriptions()
            .into_iter()
            .map(|s| (s.topic, s.priority))
            .collect();
        let expected: Vec<(String, i64)> = names
            .iter()
            .map(|(name, p)| (format!("persistent://public/default/{prefix}_{name}"), *p))
            .collect();
        assert_eq!(registered, expected);
        for (topic, _) in &expected {
            let stats = topic_stats(topic);
            assert!(
                stats["subscriptions"].get(&subscription).is_some(),
                "{topic} has no subscription {subscription} on the broker"
            );
        }
        // Every member topic delivers to the one handler.
        for (topic, _) in expected.iter().rev() {
            publish_order(topic, "ok").await;
        }
        let run = start(&dispatcher);
        wait_until("one message per topic", Duration::from_secs(30), || {
            handled.borrow().len() >= 6
        })
        .await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(handled.borrow().len(), 6);
    });
}

fn a_retried_message_carries_the_java_retry_letter_properties_for_python(kind: TopicKind) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("interop-retry", kind);
        let retry_topic = format!("{topic}-retry");
        let subscription = unique_name("orders-sub");
        // Another service (here, Python) consumes the retry topic.
        let dispatcher = common::dispatcher_with(
            Dispatcher::builder().retry_topic_check(RetryTopicCheck::Ignore),
        )
        .await;
        dispatcher
            .subscribe(
                &topic,
                fail_as_told,
                shared(&subscription)
                    .retry_errors(ErrorClass::of::<ServiceUnavailable>())
                    .retry_topic(&retry_topic),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        // Create the Python side's subscription first so it sees the retry.
        let python = run_interop(
            "consume.py",
            json!({
                "service_url": pulsar_url(),
                "topic": retry_topic,
                "subscription": unique_name("python"),
                "count": 1,
                "timeout_ms": 30000,
            }),
        );
        let publish = async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            publish_order(&topic, "unavailable").await;
        };
        let (result, ()) = tokio::join!(python, publish);
        close_and_join(&dispatcher, run).await;

        let message = &result["messages"][0];
        assert_eq!(message["payload"], "unavailable");
        assert_eq!(message["partition_key"], "customer-3");
        let props = &message["properties"];
        assert_eq!(props["RECONSUMETIMES"], "1");
        assert!(
            is_topic_or_partition(props["REAL_TOPIC"].as_str().unwrap(), &topic, kind),
            "REAL_TOPIC {} is not {topic} or one of its partitions",
            props["REAL_TOPIC"]
        );
        assert_eq!(props["DELAY_TIME"], "1000");
        assert_eq!(props["order"], "17");
        assert_eq!(
            props["DEAD_LETTER_TOPIC"],
            format!("{topic}-{subscription}-DLQ").as_str()
        );
        let origin = props["ORIGIN_MESSAGE_ID"].as_str().unwrap();
        assert_eq!(origin.split(':').count(), 3, "{origin}");
        assert_eq!(
            origin.rsplit(':').next(),
            Some(partition_index(props["REAL_TOPIC"].as_str().unwrap()).as_str()),
            "ORIGIN_MESSAGE_ID {origin} names the partition the message came from"
        );
    });
}

/// A topic outside `public/default`, named by its three-part short name
/// (`tenant/namespace/topic`, as most services name theirs): its retry topic
/// named the same way, the default dead letter topic, and every republish
/// stay in the topic's own tenant and namespace.
fn retries_and_dead_letters_stay_in_a_topics_own_tenant_and_namespace(kind: TopicKind) {
    const NAMESPACE: &str = "acme/orders";
    ensure_namespace(NAMESPACE);
    let name = unique_name("payments");
    let topic = format!("{NAMESPACE}/{name}");
    let full_topic = format!("persistent://{topic}");
    if let TopicKind::Partitioned(partitions) = kind {
        create_partitioned_topic(&full_topic, partitions);
    }
    run_local(Duration::from_secs(90), async {
        let retry_topic = format!("{topic}-retry");
        let subscription = unique_name("payments-sub");
        let dead_letter_topic = format!("{full_topic}-{subscription}-DLQ");
        let mut dead_letters = reader(&dead_letter_topic).await;
        let dispatcher = common::dispatcher().await;
        let handled: Rc<RefCell<Vec<(String, String)>>> = Rc::default();
        let options = shared(&subscription)
            .retry_errors(ErrorClass::of::<ServiceUnavailable>())
            .retry_topic(&retry_topic)
            .retry_backoff(|_| Duration::from_millis(200))
            .max_retries(1);
        let record = {
            let handled = handled.clone();
            move |message: &Message| {
                handled.borrow_mut().push((
                    base_topic(message.topic()).to_owned(),
                    String::from_utf8_lossy(message.payload()).into_owned(),
                ))
            }
        };
        let topics = [(topic.as_str(), 10), (retry_topic.as_str(), 20)];
        subscribe_failing_as_told(&dispatcher, &topics, &options, record).await;
        let run = start(&dispatcher);
        for payload in ["fine", "invalid", "unavailable"] {
            publish_order(&full_topic, payload).await;
        }
        let mut dead: Vec<(String, BTreeMap<String, String>)> = Vec::new();
        for _ in 0..2 {
            let message = next_message(&mut dead_letters, "a dead letter").await;
            let payload = String::from_utf8(message.payload.data.clone()).unwrap();
            dead.push((payload, properties(&message)));
        }
        dead.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(dead[0].0, "invalid", "dead-lettered at once");
        assert_eq!(dead[1].0, "unavailable", "dead-lettered after its retry");
        for (_, props) in &dead {
            assert_origin(props, &full_topic, kind);
        }
        assert_eq!(dead[1].1["RECONSUMETIMES"], "1");
        assert_eq!(dead[1].1["DEAD_LETTER_TOPIC"], dead_letter_topic);
        let full_retry_topic = format!("persistent://{retry_topic}");
        wait_until("the handler calls", Duration::from_secs(10), || {
            handled.borrow().len() == 4
        })
        .await;
        let mut calls = handled.borrow().clone();
        calls.sort();
        let expected = |topic: &str, payload: &str| (topic.to_owned(), payload.to_owned());
        assert_eq!(
            calls,
            [
                expected(&full_topic, "fine"),
                expected(&full_topic, "invalid"),
                expected(&full_topic, "unavailable"),
                expected(&full_retry_topic, "unavailable"),
            ]
        );
        for subscribed in [&full_topic, &full_retry_topic] {
            let drained = wait_for_empty_backlog(subscribed, &subscription).await;
            assert_eq!(drained.msg_backlog, 0, "every message acked: {drained:?}");
        }
        close_and_join(&dispatcher, run).await;
    });
}

/// When each consumer of `subscription` on `topic` (each partition's, on a
/// partitioned topic) connected, as the broker reports it.
fn connected_since(topic: &str, subscription: &str, kind: TopicKind) -> Vec<String> {
    let names: Vec<String> = match kind {
        TopicKind::Plain => vec![topic.to_owned()],
        TopicKind::Partitioned(partitions) => (0..partitions)
            .map(|index| format!("{topic}-partition-{index}"))
            .collect(),
    };
    names
        .iter()
        .flat_map(|name| {
            let stats = common::subscription_stats(name, subscription);
            let consumers = stats.raw["consumers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            consumers
                .into_iter()
                .map(|consumer| consumer["connectedSince"].to_string())
        })
        .collect()
}

/// A broker drops the connection a frame larger than its maximum message
/// size arrives on, with every consumer and producer on it, and the
/// `pulsar` crate sends the frame again on each reconnection until its
/// operation timeout (30 s). A reply that large is not sent: the publish
/// fails at once, the original is nacked and handled again, and no
/// consumer loses its connection.
fn a_reply_larger_than_the_broker_takes_is_not_sent_and_its_original_comes_back(kind: TopicKind) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("large-replies", kind);
        let reply_topic = fresh_topic("large-replies-out", kind);
        let subscription = unique_name("large");
        let mut replies = reader(&reply_topic).await;
        let dispatcher = common::dispatcher().await;
        let calls = Rc::new(std::cell::Cell::new(0));
        let handler = {
            let calls = calls.clone();
            async move |_: &Message| {
                calls.set(calls.get() + 1);
                // Far above the limit, so that a broker sent it drops the
                // connection: a little above, it takes the message and its
                // bookie refuses it, and the broker retries for ever.
                let size = if calls.get() == 1 {
                    pulsar_dispatcher::transport::DEFAULT_MAX_MESSAGE_SIZE + (1 << 20)
                } else {
                    5
                };
                Ok::<_, std::convert::Infallible>(vec![b'r'; size])
            }
        };
        let options = shared(&subscription)
            .reply_topic(&reply_topic)
            .negative_ack_redelivery_delay(Duration::from_millis(200));
        dispatcher
            .subscribe(&topic, handler, options)
            .await
            .unwrap();
        let run = start(&dispatcher);
        let connected = {
            let (topic, subscription) = (topic.clone(), subscription.clone());
            move || connected_since(&topic, &subscription, kind)
        };
        let before = tokio::task::spawn_blocking(connected.clone())
            .await
            .unwrap();
        publish_order(&topic, "make it large").await;
        let reply = next_message(&mut replies, "the second, small reply").await;
        assert_eq!(reply.payload.data, b"rrrrr", "the large reply was sent");
        let drained = wait_for_empty_backlog(&topic, &subscription).await;
        assert_eq!(drained.msg_backlog, 0, "every message acked: {drained:?}");
        let stats = dispatcher.stats().total();
        assert_eq!((stats.publishes_failed, stats.nacked), (1, 1), "{stats:?}");
        assert_eq!(calls.get(), 2);
        let after = tokio::task::spawn_blocking(connected).await.unwrap();
        assert_eq!(before, after, "a consumer reconnected");
        close_and_join(&dispatcher, run).await;
    });
}
