//! Smoke tests of the ground the library stands on: the real Apache Pulsar
//! broker and the `pulsar` crate, used directly on a `current_thread` tokio
//! runtime inside a `LocalSet`, plus interop with the official Python client.
//!
//! Run with `cargo xtask test` (or `cargo xtask broker start` and then
//! `cargo test --test smoke_pulsar` with PULSAR_DISPATCHER_PYTHON set).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures::TryStreamExt;
use pulsar::{producer, Consumer, TokioExecutor};
use serde_json::{json, Value};

use common::{
    client, now_millis, pulsar_url, run_interop, run_local, shared_consumer, subscription_stats,
    unique_name, unique_topic, wait_for_empty_backlog, wait_for_stats,
};

type Msg = pulsar::consumer::Message<Vec<u8>>;

const TEST_LIMIT: Duration = Duration::from_secs(60);
const RECEIVE_LIMIT: Duration = Duration::from_secs(10);

/// The next message, or `None` if none arrives within `limit`.
async fn receive_within(
    consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
    limit: Duration,
) -> Option<Msg> {
    match tokio::time::timeout(limit, consumer.try_next()).await {
        Ok(Ok(Some(msg))) => Some(msg),
        Ok(Ok(None)) => panic!("consumer stream ended"),
        Ok(Err(e)) => panic!("consumer error: {e}"),
        Err(_) => None,
    }
}

async fn receive(consumer: &mut Consumer<Vec<u8>, TokioExecutor>, what: &str) -> Msg {
    receive_within(consumer, RECEIVE_LIMIT)
        .await
        .unwrap_or_else(|| panic!("no message within {RECEIVE_LIMIT:?} ({what})"))
}

fn text(msg: &Msg) -> String {
    String::from_utf8(msg.payload.data.clone()).expect("UTF-8 payload")
}

fn properties(msg: &Msg) -> BTreeMap<String, String> {
    msg.payload
        .metadata
        .properties
        .iter()
        .map(|kv| (kv.key.clone(), kv.value.clone()))
        .collect()
}

/// Sends and waits for the broker's receipt.
async fn send(producer: &mut producer::Producer<TokioExecutor>, message: producer::Message) {
    producer
        .send_non_blocking(message)
        .await
        .expect("queueing a message")
        .await
        .expect("broker receipt");
}

fn plain(payload: &str) -> producer::Message {
    producer::Message {
        payload: payload.as_bytes().to_vec(),
        ..Default::default()
    }
}

/// Shared subscription, receiver queue of one: messages arrive in order, an
/// acked message is gone, a nacked one comes back within the receive limit
/// (the crate sends RedeliverUnacknowledgedMessages at once; it has no nack
/// delay, which would be a minute by the other clients' default), and
/// once everything is acked the broker's backlog is empty.
#[test]
fn shared_subscription_ack_and_nack_with_receiver_queue_of_one() {
    run_local(TEST_LIMIT, async {
        let client = client().await;
        let topic = unique_topic("smoke-ack-nack");
        let sub = unique_name("sub");
        let mut consumer = shared_consumer(&client, &topic, &sub, 1).await;
        let mut producer = client.producer().with_topic(&topic).build().await.unwrap();
        for i in 0..3 {
            send(&mut producer, plain(&format!("m{i}"))).await;
        }

        let first = receive(&mut consumer, "m0").await;
        assert_eq!(text(&first), "m0");
        consumer.ack(&first).await.unwrap();

        let second = receive(&mut consumer, "m1").await;
        assert_eq!(text(&second), "m1");
        let nacked_id = second.message_id.id.clone();
        consumer.nack(&second).await.unwrap();

        // m2 may already sit in the crate's queue, so it can come before the
        // redelivered m1.
        let mut seen = Vec::new();
        while seen.len() < 2 {
            let msg = receive(&mut consumer, "the redelivered m1 and m2").await;
            let payload = text(&msg);
            if payload == "m1" {
                assert_eq!(
                    (msg.message_id.id.ledger_id, msg.message_id.id.entry_id),
                    (nacked_id.ledger_id, nacked_id.entry_id),
                    "the redelivered m1 must be the same message"
                );
            }
            consumer.ack(&msg).await.unwrap();
            seen.push(payload);
        }
        seen.sort();
        assert_eq!(
            seen,
            ["m1", "m2"],
            "after the nack: m1 again and m2, once each"
        );

        // Nothing else is delivered.
        assert!(
            receive_within(&mut consumer, Duration::from_millis(500))
                .await
                .is_none(),
            "no more messages expected"
        );

        let stats = wait_for_stats(&topic, &sub, Duration::from_secs(10), |s| {
            s.msg_backlog == 0 && s.unacked_messages == 0
        })
        .await;
        assert_eq!(stats.msg_backlog, 0, "backlog after acking all: {stats:?}");
        assert_eq!(
            stats.unacked_messages, 0,
            "unacked after acking all: {stats:?}"
        );
        assert!(
            stats.msg_out_counter >= 4,
            "3 messages + 1 redelivery dispatched, broker says {}",
            stats.msg_out_counter
        );
        assert_eq!(stats.consumers, 1);
        consumer.close().await.unwrap();
    });
}

/// With receiver queue size 1, a consumer that is not polled holds only a
/// few messages: the broker keeps the rest in the backlog. (The bound is
/// larger than 1: the crate's queue channel holds 2 and its engine a third.)
#[test]
fn receiver_queue_of_one_bounds_what_an_idle_consumer_takes() {
    run_local(TEST_LIMIT, async {
        let client = client().await;
        let topic = unique_topic("smoke-prefetch");
        let sub = unique_name("sub");
        let mut consumer = shared_consumer(&client, &topic, &sub, 1).await;
        // A control with room for everything, idle too.
        let control = unique_name("control");
        let _control = shared_consumer(&client, &topic, &control, 100).await;
        let mut producer = client.producer().with_topic(&topic).build().await.unwrap();
        for i in 0..20 {
            send(&mut producer, plain(&format!("m{i}"))).await;
        }
        // Let the consumers' tasks run (and take what they will) without
        // polling either stream, until the control has taken everything:
        // the broker has then pushed whatever each consumer asked for.
        let taken = wait_for_stats(&topic, &control, Duration::from_secs(10), |stats| {
            stats.msg_out_counter == 20
        })
        .await;
        assert_eq!(taken.msg_out_counter, 20, "the control took the backlog");
        // And time for a chain of one-message flow requests to show.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let stats = subscription_stats(&topic, &sub);
        eprintln!(
            "idle consumer, queue 1: broker dispatched {} of 20 (unacked {})",
            stats.msg_out_counter, stats.unacked_messages
        );
        assert!(
            stats.msg_out_counter >= 1 && stats.msg_out_counter <= 4,
            "an idle consumer with receiver queue 1 took {} of 20 messages",
            stats.msg_out_counter
        );
        assert_eq!(stats.msg_backlog, 20);

        // Draining works and every message arrives once, in order.
        for i in 0..20 {
            let msg = receive(&mut consumer, "drain").await;
            assert_eq!(text(&msg), format!("m{i}"));
            consumer.ack(&msg).await.unwrap();
        }
        let stats = wait_for_empty_backlog(&topic, &sub).await;
        assert_eq!(stats.msg_backlog, 0, "{stats:?}");
        consumer.close().await.unwrap();
    });
}

/// A message with `deliver_at_time` five seconds ahead is held back by the
/// broker on a Shared subscription (while a plain message sent after it
/// arrives at once), and is delivered no earlier than its due time.
#[test]
fn deliver_at_time_holds_a_message_until_it_is_due() {
    run_local(TEST_LIMIT, async {
        let client = client().await;
        let topic = unique_topic("smoke-deliver-at");
        let sub = unique_name("sub");
        let mut consumer = shared_consumer(&client, &topic, &sub, 1).await;
        let mut producer = client.producer().with_topic(&topic).build().await.unwrap();

        let sent_at = now_millis();
        // Far enough ahead that the sends and the plain message's delivery
        // fit before it on a loaded machine.
        let deliver_at = sent_at + 5_000;
        send(
            &mut producer,
            producer::Message {
                deliver_at_time: Some(deliver_at as i64),
                ..plain("delayed")
            },
        )
        .await;
        send(&mut producer, plain("immediate")).await;

        // During the first 4 s the delayed message must not arrive.
        let window_end = sent_at + 4_000;
        let mut got_immediate = false;
        loop {
            let now = now_millis();
            if now >= window_end {
                break;
            }
            if let Some(msg) =
                receive_within(&mut consumer, Duration::from_millis(window_end - now)).await
            {
                let at = now_millis();
                assert_eq!(
                    text(&msg),
                    "immediate",
                    "the delayed message arrived {} ms before it was due",
                    deliver_at as i64 - at as i64
                );
                got_immediate = true;
                consumer.ack(&msg).await.unwrap();
            }
        }
        // The plain message, sent after the delayed one, overtakes it
        // (normally well within the window; on a loaded machine maybe later).
        if !got_immediate {
            let msg = receive(&mut consumer, "the plain message").await;
            assert_eq!(
                text(&msg),
                "immediate",
                "the delayed message arrived before the plain one sent after it"
            );
            consumer.ack(&msg).await.unwrap();
        }

        let msg = receive(&mut consumer, "the delayed message").await;
        let received_at = now_millis();
        assert_eq!(text(&msg), "delayed");
        assert!(
            received_at >= deliver_at,
            "delivered {} ms early",
            deliver_at - received_at
        );
        eprintln!(
            "delayed message: due at +{} ms, received at +{} ms",
            deliver_at - sent_at,
            received_at - sent_at
        );
        consumer.ack(&msg).await.unwrap();
        consumer.close().await.unwrap();
    });
}

/// What the interop tests send: varied properties, keys and event times,
/// plus one message with none of them.
fn interop_messages(tag: &str) -> Vec<Value> {
    let base_time = 1_700_000_000_000u64;
    let mut messages: Vec<Value> = (0..4)
        .map(|i| {
            json!({
                "payload": format!("{tag}-{i} ünïcödé"),
                "properties": {"index": i.to_string(), "origin": tag, "empty": ""},
                "partition_key": format!("pk-{}", i % 2),
                "ordering_key": format!("ok-{i}"),
                "event_timestamp": base_time + i,
            })
        })
        .collect();
    messages.push(json!({"payload": format!("{tag}-bare")}));
    messages
}

fn expected_properties(spec: &Value) -> BTreeMap<String, String> {
    spec.get("properties")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect()
        })
        .unwrap_or_default()
}

async fn python_to_rust(batching: bool) {
    let client = client().await;
    let topic = unique_topic(if batching {
        "interop-py-batched"
    } else {
        "interop-py"
    });
    let sub = unique_name("sub");
    let mut consumer = shared_consumer(&client, &topic, &sub, 10).await;
    let specs = interop_messages(if batching { "pyb" } else { "py" });
    let result = common::produce_with_python(&topic, specs.clone(), batching).await;
    assert_eq!(result["sent"], specs.len());

    let mut by_payload: HashMap<String, Msg> = HashMap::new();
    for _ in 0..specs.len() {
        let msg = receive(&mut consumer, "a message from Python").await;
        consumer.ack(&msg).await.unwrap();
        by_payload.insert(text(&msg), msg);
    }
    for spec in &specs {
        let payload = spec["payload"].as_str().unwrap();
        let msg = by_payload
            .get(payload)
            .unwrap_or_else(|| panic!("{payload:?} not received"));
        let meta = &msg.payload.metadata;
        assert_eq!(
            properties(msg),
            expected_properties(spec),
            "properties of {payload:?}"
        );
        assert_eq!(
            meta.partition_key.as_deref(),
            spec["partition_key"].as_str(),
            "partition key of {payload:?}"
        );
        assert_eq!(
            meta.ordering_key.as_deref(),
            spec["ordering_key"].as_str().map(str::as_bytes),
            "ordering key of {payload:?}"
        );
        assert_eq!(
            meta.event_time,
            spec["event_timestamp"].as_u64(),
            "event time of {payload:?}"
        );
        if batching {
            assert!(
                meta.num_messages_in_batch.is_some(),
                "{payload:?} should have come in a batch"
            );
        }
    }
    let stats = wait_for_empty_backlog(&topic, &sub).await;
    assert_eq!(stats.msg_backlog, 0, "{stats:?}");
    consumer.close().await.unwrap();
}

/// Messages published by the official Python client (one per entry) reach
/// the Rust consumer with payload, properties, partition key, ordering key
/// and event time intact.
#[test]
fn python_producer_to_rust_consumer_keeps_metadata() {
    run_local(TEST_LIMIT, python_to_rust(false));
}

/// The same through Python's batching producer: the crate splits the batch
/// and gives each message its own metadata.
#[test]
fn python_batching_producer_to_rust_consumer_keeps_metadata() {
    run_local(TEST_LIMIT, python_to_rust(true));
}

/// Messages published by the `pulsar` crate reach the official Python client
/// with payload, properties, partition key, ordering key and event time intact.
#[test]
fn rust_producer_to_python_consumer_keeps_metadata() {
    run_local(TEST_LIMIT, async {
        let client = client().await;
        let topic = unique_topic("interop-rs");
        let specs = interop_messages("rs");
        let mut producer = client.producer().with_topic(&topic).build().await.unwrap();
        for spec in &specs {
            let message = producer::Message {
                payload: spec["payload"].as_str().unwrap().as_bytes().to_vec(),
                properties: expected_properties(spec).into_iter().collect(),
                partition_key: spec["partition_key"].as_str().map(str::to_string),
                ordering_key: spec["ordering_key"].as_str().map(|k| k.as_bytes().to_vec()),
                event_time: spec["event_timestamp"].as_u64(),
                ..Default::default()
            };
            send(&mut producer, message).await;
        }

        let sub = unique_name("py-sub");
        let result = run_interop(
            "consume.py",
            json!({
                "service_url": pulsar_url(),
                "topic": topic,
                "subscription": sub,
                "count": specs.len(),
                "timeout_ms": 20_000,
            }),
        )
        .await;
        let received = result["messages"].as_array().expect("messages array");
        assert_eq!(received.len(), specs.len());
        for (spec, got) in specs.iter().zip(received) {
            let payload = spec["payload"].as_str().unwrap();
            assert_eq!(got["payload"], spec["payload"], "payload (in order)");
            let props: BTreeMap<String, String> =
                serde_json::from_value(got["properties"].clone()).unwrap();
            assert_eq!(
                props,
                expected_properties(spec),
                "properties of {payload:?}"
            );
            assert_eq!(
                got["partition_key"], spec["partition_key"],
                "partition key of {payload:?}"
            );
            assert_eq!(
                got["ordering_key"], spec["ordering_key"],
                "ordering key of {payload:?}"
            );
            // The Python client reports 0 for "no event time".
            assert_eq!(
                got["event_timestamp"].as_u64().unwrap(),
                spec["event_timestamp"].as_u64().unwrap_or(0),
                "event time of {payload:?}"
            );
            assert_eq!(got["redelivery_count"], 0);
            assert_eq!(got["topic"].as_str(), Some(topic.as_str()));
        }
        let stats = wait_for_empty_backlog(&topic, &sub).await;
        assert_eq!(stats.msg_backlog, 0, "Python acked everything: {stats:?}");
    });
}
