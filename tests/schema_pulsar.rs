//! Topics with a schema against a real Apache Pulsar broker: producers of
//! other clients (here the official Python client) register a String or
//! JSON schema on the topic, as most of them do, and the dispatcher, which
//! reads bytes, subscribes to such a topic with a backlog present and
//! handles every message, on every subscription type, on plain and
//! partitioned topics, batched or not.

mod common;

on_plain_and_partitioned_topics!(messages_of_a_topic_with_a_schema_are_handled_as_their_bytes);

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use common::{
    close_and_join, fresh_topic, run_interop, run_local, start, unique_name,
    wait_for_empty_backlog, wait_until, TopicKind,
};
use pulsar_dispatcher::pulsar::consumer::InitialPosition;
use pulsar_dispatcher::pulsar::ConsumerOptions;
use pulsar_dispatcher::{Message, SubType, SubscribeOptions};

const SUBSCRIPTION_TYPES: [SubType; 4] = [
    SubType::Shared,
    SubType::KeyShared,
    SubType::Exclusive,
    SubType::Failover,
];

/// Payloads `from..to` published by the Python client with `schema`.
async fn produce_with_schema(topic: &str, schema: &str, batched: bool, from: usize, to: usize) {
    let request = serde_json::json!({
        "service_url": common::pulsar_url(),
        "topic": topic,
        "schema": schema,
        "batching": batched,
        "messages": (from..to)
            .map(|n| serde_json::json!({
                "payload": format!("message {n}"),
                "partition_key": format!("key-{}", n % 3),
            }))
            .collect::<Vec<_>>(),
    });
    run_interop("produce.py", request).await;
}

/// The text a message carries: its bytes for a String schema, the `text`
/// field of its JSON for a JSON one.
fn text_of(schema: &str, payload: &[u8]) -> String {
    let bytes = String::from_utf8(payload.to_vec()).expect("UTF-8 payload");
    match schema {
        "string" => bytes,
        _ => {
            let record: serde_json::Value = serde_json::from_str(&bytes)
                .unwrap_or_else(|e| panic!("a JSON record, not {bytes:?}: {e}"));
            record["text"].as_str().expect("a text field").to_owned()
        }
    }
}

fn messages_of_a_topic_with_a_schema_are_handled_as_their_bytes(kind: TopicKind) {
    run_local(Duration::from_secs(150), async {
        const BACKLOG: usize = 10;
        const TOTAL: usize = 20;
        for schema in ["string", "json"] {
            let topic = fresh_topic(&format!("{schema}-schema"), kind);
            // The backlog, batched: the schema is on the topic before the
            // dispatcher subscribes.
            produce_with_schema(&topic, schema, true, 0, BACKLOG).await;
            let dispatcher = common::dispatcher().await;
            let handled: Rc<RefCell<Vec<BTreeSet<String>>>> = Rc::new(RefCell::new(vec![
                    BTreeSet::new();
                    SUBSCRIPTION_TYPES.len()
                ]));
            let mut subscriptions = Vec::new();
            for (index, subscription_type) in SUBSCRIPTION_TYPES.into_iter().enumerate() {
                let subscription = unique_name(&format!("{subscription_type:?}"));
                let handled = handled.clone();
                let handler = async move |message: &Message| {
                    let text = text_of(schema, message.payload());
                    handled.borrow_mut()[index].insert(text);
                    Ok::<_, Infallible>(())
                };
                let options = SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(subscription_type)
                    .consumer_options(
                        ConsumerOptions::default().with_initial_position(InitialPosition::Earliest),
                    );
                dispatcher
                    .subscribe(&topic, handler, options)
                    .await
                    .unwrap_or_else(|e| panic!("{schema} schema, {subscription_type:?}: {e}"));
                subscriptions.push(subscription);
            }
            let run = start(&dispatcher);
            produce_with_schema(&topic, schema, false, BACKLOG, TOTAL).await;
            let expected: BTreeSet<String> = (0..TOTAL).map(|n| format!("message {n}")).collect();
            wait_until(
                &format!("every message of the {schema} schema topic handled"),
                Duration::from_secs(30),
                || handled.borrow().iter().all(|texts| *texts == expected),
            )
            .await;
            for subscription in &subscriptions {
                let drained = wait_for_empty_backlog(&topic, subscription).await;
                assert_eq!(drained.msg_backlog, 0, "every message acked: {drained:?}");
            }
            assert_eq!(dispatcher.stats().total().receive_errors, 0);
            close_and_join(&dispatcher, run).await;
        }
    });
}
