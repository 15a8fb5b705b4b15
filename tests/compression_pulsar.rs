//! Compressed and encrypted messages on a real broker: producers of other
//! clients (the Python original's, the JVM's) often compress, and a
//! consumer that cannot decompress a codec loses every such message. Every
//! codec Pulsar has from the `pulsar` crate, and every one the crate reads
//! from the official Python client, on plain and partitioned topics,
//! batched and not, on every subscription type; Snappy from the Python
//! client, which the crate cannot read, and an encrypted message, which it
//! cannot decrypt, reported and left for a consumer that can.

#![cfg(feature = "compression")]

mod common;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use common::{
    close_and_join, fresh_topic, run_local, start, unique_name, wait_for_empty_backlog, wait_until,
    TopicKind,
};
use pulsar::compression::{
    Compression, CompressionLz4, CompressionSnappy, CompressionZlib, CompressionZstd,
};
use pulsar_dispatcher::{Message, SubType, SubscribeOptions};

const MESSAGES: usize = 20;

/// Who publishes a case's messages, and with which codec.
#[derive(Clone, Debug)]
enum Producer {
    /// The official Python client, with a `pulsar.CompressionType` name.
    Python(&'static str),
    /// The `pulsar` crate.
    Crate(Compression),
}

/// One topic of the test: its producer, kind, batching and subscription
/// type.
#[derive(Debug)]
struct Case {
    producer: Producer,
    batched: bool,
    subscription_type: SubType,
    topic: String,
}

fn cases() -> Vec<Case> {
    let producers = [
        Producer::Python("LZ4"),
        Producer::Python("ZLib"),
        Producer::Python("ZSTD"),
        Producer::Crate(Compression::Lz4(CompressionLz4::default())),
        Producer::Crate(Compression::Zlib(CompressionZlib::default())),
        Producer::Crate(Compression::Zstd(CompressionZstd::default())),
        Producer::Crate(Compression::Snappy(CompressionSnappy::default())),
    ];
    let types = [
        SubType::Exclusive,
        SubType::Shared,
        SubType::Failover,
        SubType::KeyShared,
    ];
    let shapes = [
        ("compressed-plain", TopicKind::Plain, false),
        ("compressed-partitioned", TopicKind::Partitioned(3), true),
    ];
    let mut cases = Vec::new();
    for (n, producer) in producers.into_iter().enumerate() {
        for (m, (prefix, kind, batched)) in shapes.into_iter().enumerate() {
            cases.push(Case {
                producer: producer.clone(),
                batched,
                subscription_type: types[(n + m) % types.len()],
                topic: fresh_topic(prefix, kind),
            });
        }
    }
    cases
}

fn payload(n: usize) -> String {
    // Long and repetitive enough that every codec really shrinks it.
    format!("message {n} {}", "compressible ".repeat(40))
}

async fn produce(case: &Case) {
    match &case.producer {
        Producer::Python(codec) => {
            let request = serde_json::json!({
                "service_url": common::pulsar_url(),
                "topic": case.topic,
                "batching": case.batched,
                "compression": codec,
                "messages": (0..MESSAGES)
                    .map(|n| serde_json::json!({
                        "payload": payload(n),
                        "partition_key": format!("key-{}", n % 4),
                    }))
                    .collect::<Vec<_>>(),
            });
            common::run_interop("produce.py", request).await;
        }
        Producer::Crate(compression) => {
            let options = pulsar::ProducerOptions {
                compression: Some(compression.clone()),
                batch_size: case.batched.then_some(5),
                batch_timeout: case.batched.then_some(Duration::from_millis(20)),
                ..Default::default()
            };
            let messages = (0..MESSAGES).map(|n| pulsar::producer::Message {
                payload: payload(n).into_bytes(),
                partition_key: Some(format!("key-{}", n % 4)),
                ..Default::default()
            });
            common::publish_with(&case.topic, options, messages).await;
        }
    }
}

/// Every message of every case is handled once, with the payload it was
/// published with, and acked: the subscriptions' backlogs empty and the
/// dispatcher closes without an error.
#[test]
fn compressed_messages_of_every_codec_are_handled_and_acked() {
    run_local(Duration::from_secs(180), async {
        let cases = cases();
        let subscription = unique_name("compressed-sub");
        let dispatcher = common::dispatcher().await;
        let handled: Rc<RefCell<BTreeMap<String, Vec<String>>>> = Rc::default();
        for case in &cases {
            let handled = handled.clone();
            let topic = case.topic.clone();
            let handler = async move |message: &Message| {
                let payload = String::from_utf8_lossy(message.payload()).into_owned();
                handled
                    .borrow_mut()
                    .entry(topic.clone())
                    .or_default()
                    .push(payload);
                Ok::<(), std::convert::Infallible>(())
            };
            let options = SubscribeOptions::new()
                .subscription(&subscription)
                .subscription_type(case.subscription_type);
            dispatcher
                .subscribe(&case.topic, handler, options)
                .await
                .unwrap_or_else(|e| panic!("subscribing {case:?}: {e}"));
        }
        // Half the cases' messages wait as a backlog when the dispatcher
        // starts; the others arrive while it runs.
        let (before, after) = cases.split_at(cases.len() / 2);
        for case in before {
            produce(case).await;
        }
        let run = start(&dispatcher);
        for case in after {
            produce(case).await;
        }
        let total = || handled.borrow().values().map(Vec::len).sum::<usize>();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while total() < cases.len() * MESSAGES && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for case in &cases {
            let count = handled.borrow().get(&case.topic).map_or(0, Vec::len);
            assert!(count >= MESSAGES, "{case:?}: {count} of {MESSAGES} handled");
        }
        for case in &cases {
            let stats = wait_for_empty_backlog(&case.topic, &subscription).await;
            assert_eq!(stats.msg_backlog, 0, "{case:?}: every message acked");
        }
        close_and_join(&dispatcher, run).await;
        let handled = handled.borrow();
        let expected: Vec<String> = (0..MESSAGES).map(payload).collect();
        for case in &cases {
            let mut got = handled.get(&case.topic).cloned().unwrap_or_default();
            got.sort();
            let mut want = expected.clone();
            want.sort();
            assert_eq!(got, want, "{case:?}: each message once, as published");
        }
    });
}

/// The `pulsar` crate reads Snappy in its framed format, while Pulsar's
/// other clients write raw Snappy blocks: the crate hands such a message
/// over as a receive error that names no message, and keeps it (unacked)
/// on its consumer. The dispatcher counts and logs the error and goes on
/// with every other message; the message itself is not lost: once the
/// dispatcher closes, the broker gives it to a consumer that can read it,
/// as in a mixed fleet with the Python original.
#[test]
fn a_message_the_crate_cannot_read_is_counted_and_left_to_another_client() {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("unreadable", TopicKind::Partitioned(3));
        let subscription = unique_name("unreadable-sub");
        let partition = |index: u32| format!("{topic}-partition-{index}");
        let dispatcher = common::dispatcher().await;
        let handled: Rc<RefCell<Vec<String>>> = Rc::default();
        let handler = {
            let handled = handled.clone();
            async move |message: &Message| {
                handled.borrow_mut().push(message.topic().to_owned());
                Ok::<(), std::convert::Infallible>(())
            }
        };
        let options = SubscribeOptions::new()
            .subscription(&subscription)
            .subscription_type(SubType::Shared);
        dispatcher
            .subscribe(&topic, handler, options)
            .await
            .unwrap();
        let unreadable = serde_json::json!({
            "service_url": common::pulsar_url(),
            "topic": partition(0),
            "compression": "SNAPPY",
            "messages": [{ "payload": payload(0) }],
        });
        common::run_interop("produce.py", unreadable).await;
        let readable = |index: u32| {
            (0..3).map(move |n| pulsar::producer::Message {
                payload: format!("{index}-{n}").into_bytes(),
                ..Default::default()
            })
        };
        common::publish(&partition(0), readable(0)).await;
        let run = start(&dispatcher);
        common::publish(&partition(1), readable(1)).await;
        common::publish(&partition(2), readable(2)).await;
        let from_others = || {
            let handled = handled.borrow();
            handled.iter().filter(|t| **t != partition(0)).count()
        };
        wait_until(
            "the other partitions' messages",
            Duration::from_secs(30),
            || from_others() == 6 && dispatcher.stats().total().receive_errors >= 1,
        )
        .await;
        // The readable messages behind the unreadable one on its partition
        // are not held up by it.
        wait_until(
            "partition 0's readable messages",
            Duration::from_secs(30),
            || handled.borrow().len() == 9,
        )
        .await;
        assert!(!run.is_finished(), "the dispatcher goes on");
        for index in 1..3 {
            let stats = wait_for_empty_backlog(&partition(index), &subscription).await;
            assert_eq!(stats.msg_backlog, 0, "partition {index}");
        }
        close_and_join(&dispatcher, run).await;
        let stats = dispatcher.stats().total();
        assert_eq!((stats.received, stats.acked), (9, 9), "{stats:?}");
        let left = left_for_python(&topic, &subscription, serde_json::Value::Null).await;
        assert_eq!(left, payload(0));
    });
}

/// A message encrypted by its producer (Pulsar's end-to-end encryption,
/// which the `pulsar` crate does not implement) never reaches a handler
/// as ciphertext: it is reported as a receive error naming it, counted,
/// and left unacked, while the messages around it are handled. Once the
/// dispatcher closes, a Python consumer holding the key reads it.
#[test]
fn an_encrypted_message_is_reported_and_left_to_a_consumer_with_the_key() {
    run_local(Duration::from_secs(120), async {
        let keys = test_key_pair();
        let topic = fresh_topic("encrypted", TopicKind::Partitioned(2));
        let subscription = unique_name("encrypted-sub");
        let partition = |index: u32| format!("{topic}-partition-{index}");
        let dispatcher = common::dispatcher().await;
        let handled: Rc<RefCell<Vec<String>>> = Rc::default();
        let handler = {
            let handled = handled.clone();
            async move |message: &Message| {
                let payload = String::from_utf8_lossy(message.payload()).into_owned();
                handled.borrow_mut().push(payload);
                Ok::<(), std::convert::Infallible>(())
            }
        };
        let options = SubscribeOptions::new()
            .subscription(&subscription)
            .subscription_type(SubType::Failover);
        dispatcher
            .subscribe(&topic, handler, options)
            .await
            .unwrap();
        let send = |index: u32, payload: &'static str, encrypted: bool| {
            let encryption = encrypted.then(|| keys.clone());
            produce_one_with_python(partition(index), payload, encryption)
        };
        send(0, "before", false).await;
        send(0, "secret", true).await;
        send(0, "after", false).await;
        let run = start(&dispatcher);
        send(1, "elsewhere", false).await;
        wait_until("the readable messages", Duration::from_secs(30), || {
            handled.borrow().len() == 3 && dispatcher.stats().total().receive_errors >= 1
        })
        .await;
        assert!(!run.is_finished(), "the dispatcher goes on");
        close_and_join(&dispatcher, run).await;
        let mut handled = handled.borrow().clone();
        handled.sort();
        assert_eq!(handled, ["after", "before", "elsewhere"]);
        assert_eq!(left_for_python(&topic, &subscription, keys).await, "secret");
    });
}

/// On an idle Failover subscription the backlog of an encrypted message
/// stands still: the stall check counts it as held, not stalled, and asks
/// for no rewind (each rewind used to deliver it again, a receive error each
/// time, and once those had gone on for the receive failure limit the
/// dispatcher stopped with `ConsumerFailing`). The dispatcher stays healthy
/// past the limit.
#[test]
fn an_encrypted_message_on_an_idle_failover_subscription_does_not_stop_the_dispatcher() {
    run_local(Duration::from_secs(120), async {
        let keys = test_key_pair();
        let topic = fresh_topic("encrypted-idle", TopicKind::Plain);
        let subscription = unique_name("encrypted-idle-sub");
        let dispatcher = common::dispatcher().await;
        let options = SubscribeOptions::new()
            .subscription(&subscription)
            .subscription_type(SubType::Failover)
            .stall_check(Some(Duration::from_secs(1)))
            .receive_failure_limit(Duration::from_secs(5));
        dispatcher
            .subscribe(
                &topic,
                async |_: &Message| Ok::<(), std::convert::Infallible>(()),
                options,
            )
            .await
            .unwrap();
        produce_one_with_python(topic.clone(), "secret", Some(keys.clone())).await;
        let run = start(&dispatcher);
        wait_until("the encrypted message", Duration::from_secs(30), || {
            dispatcher.stats().total().receive_errors > 0
        })
        .await;
        // Seven stall checks, and past the failure limit.
        tokio::time::sleep(Duration::from_secs(7)).await;
        let total = dispatcher.stats().total();
        assert_eq!(
            (total.receive_errors, total.stalls_rewound),
            (1, 0),
            "delivered once, no rewind: {total:?}"
        );
        assert!(!run.is_finished(), "the dispatcher stopped");
        assert!(dispatcher.health().is_ready(), "{:?}", dispatcher.health());
        close_and_join(&dispatcher, run).await;
        assert_eq!(left_for_python(&topic, &subscription, keys).await, "secret");
    });
}

/// Publishes one message to `topic` with the Python client, encrypted with
/// `encryption` (a key pair, see [`test_key_pair`]) if given.
async fn produce_one_with_python(
    topic: String,
    payload: &str,
    encryption: Option<serde_json::Value>,
) {
    let request = serde_json::json!({
        "service_url": common::pulsar_url(),
        "topic": topic,
        "encryption": encryption,
        "messages": [{ "payload": payload }],
    });
    common::run_interop("produce.py", request).await;
}

/// The payload of the one message the dispatcher left on `subscription`,
/// as a Python consumer (with `crypto`, a key pair, or null) reads it.
async fn left_for_python(topic: &str, subscription: &str, crypto: serde_json::Value) -> String {
    let request = serde_json::json!({
        "service_url": common::pulsar_url(),
        "topic": topic,
        "subscription": subscription,
        "count": 1,
        "timeout_ms": 30000,
        "crypto": crypto,
    });
    let consumed = common::run_interop("consume.py", request).await;
    let messages = consumed["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 1, "{consumed}");
    messages[0]["payload"]
        .as_str()
        .unwrap_or_else(|| panic!("a text payload: {consumed}"))
        .to_owned()
}

/// A fresh RSA key pair in PEM files under `target/tmp`, made with
/// `openssl`, as the Python client's `CryptoKeyReader` reads them.
fn test_key_pair() -> serde_json::Value {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique_name("keys"));
    std::fs::create_dir_all(&dir).unwrap();
    let private = dir.join("private.pem");
    let public = dir.join("public.pem");
    let openssl = |args: &[&std::ffi::OsStr]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .expect("running openssl");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    openssl(&[
        "genrsa".as_ref(),
        "-out".as_ref(),
        private.as_os_str(),
        "2048".as_ref(),
    ]);
    openssl(&[
        "rsa".as_ref(),
        "-in".as_ref(),
        private.as_os_str(),
        "-pubout".as_ref(),
        "-out".as_ref(),
        public.as_os_str(),
    ]);
    serde_json::json!({ "public_key": public, "private_key": private })
}
