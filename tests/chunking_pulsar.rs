//! Chunked messages on a real broker: a message its producer (here Pulsar's
//! Java client) split into chunks, each a broker entry of its own, reaches
//! its handler whole, once, and every chunk is acked with it; a chunked
//! message that fails is delivered again and put together again, and one
//! retried and dead-lettered is published whole. On plain and partitioned
//! topics, every subscription type, chunked and whole messages mixed, as a
//! backlog at subscribe and live.

mod common;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use common::{
    close_and_join, fresh_topic, run_local, start, unique_name, wait_for_empty_backlog, TopicKind,
};
use pulsar_dispatcher::{Message, MessageId, SubType, SubscribeOptions};

/// The producer's chunk size: every message above it is chunked.
const CHUNK_BYTES: usize = 1000;

/// The payloads sent to each topic: three chunked (4, 3 and 2 chunks) and
/// two whole, each starting with its own name.
fn payloads() -> Vec<String> {
    let sized = |name: &str, size: usize| format!("{name}-{}", "x".repeat(size - name.len() - 1));
    vec![
        sized("big", 3500),
        "small".to_owned(),
        sized("middle", 2500),
        sized("just-over", CHUNK_BYTES + 1),
        "tiny".to_owned(),
    ]
}

/// The payload's name, before its padding.
fn name_of(payload: &str) -> &str {
    payload.split('-').next().unwrap_or(payload)
}

struct Case {
    topic: String,
    kind: TopicKind,
    subscription_type: SubType,
}

#[test]
fn chunked_messages_reach_their_handler_whole_and_all_their_chunks_are_acked() {
    run_local(Duration::from_secs(180), async {
        let mut cases = Vec::new();
        for kind in [TopicKind::Plain, TopicKind::Partitioned(3)] {
            for subscription_type in [
                SubType::Exclusive,
                SubType::Failover,
                SubType::Shared,
                SubType::KeyShared,
            ] {
                cases.push(Case {
                    topic: fresh_topic("chunked", kind),
                    kind,
                    subscription_type,
                });
            }
        }
        let subscription = unique_name("chunked-sub");
        let dispatcher = common::dispatcher().await;
        // Per topic, the payload lengths and names handled, in order.
        let handled: Rc<RefCell<BTreeMap<String, Vec<String>>>> = Rc::default();
        for case in &cases {
            let handled = handled.clone();
            let handler = async move |message: &Message| {
                let payload = String::from_utf8_lossy(message.payload()).into_owned();
                let mut handled = handled.borrow_mut();
                let runs = handled.entry(message.topic().to_owned()).or_default();
                let first_run_of_big =
                    name_of(&payload) == "big" && !runs.iter().any(|seen| name_of(seen) == "big");
                runs.push(payload);
                if first_run_of_big {
                    return Err("fails its first run");
                }
                Ok(())
            };
            let options = SubscribeOptions::new()
                .subscription(&subscription)
                .subscription_type(case.subscription_type)
                .negative_ack_redelivery_delay(Duration::from_millis(200));
            dispatcher
                .subscribe(&case.topic, handler, options)
                .await
                .unwrap();
        }
        let messages = |cases: &[Case]| {
            let mut messages = Vec::new();
            for case in cases {
                for (n, payload) in payloads().into_iter().enumerate() {
                    let key = format!("key-{n}");
                    messages.push((case.topic.clone(), payload, Some(key)));
                }
            }
            messages
        };
        // Half the topics have their messages waiting when the dispatcher
        // starts; the others' arrive while it runs.
        let (before, after) = cases.split_at(cases.len() / 2);
        common::produce_chunked_with_java(CHUNK_BYTES, messages(before)).await;
        let run = start(&dispatcher);
        common::produce_chunked_with_java(CHUNK_BYTES, messages(after)).await;
        for case in &cases {
            let stats = wait_for_empty_backlog(&case.topic, &subscription).await;
            let runs: Vec<(String, usize)> = handled
                .borrow()
                .iter()
                .filter(|(topic, _)| common::is_topic_or_partition(topic, &case.topic, case.kind))
                .flat_map(|(_, runs)| runs.iter().map(|run| (name_of(run).to_owned(), run.len())))
                .collect();
            assert_eq!(
                stats.msg_backlog, 0,
                "{} ({:?}): every chunk acked; handled {runs:?}",
                case.topic, case.subscription_type
            );
        }
        close_and_join(&dispatcher, run).await;
        let handled = handled.borrow();
        let expected = payloads();
        for case in &cases {
            let what = format!("{} ({:?})", case.topic, case.subscription_type);
            let runs: Vec<String> = handled
                .iter()
                .filter(|(topic, _)| common::is_topic_or_partition(topic, &case.topic, case.kind))
                .flat_map(|(_, runs)| runs.iter().cloned())
                .collect();
            for payload in &expected {
                let count = runs.iter().filter(|run| *run == payload).count();
                let want = if name_of(payload) == "big" { 2 } else { 1 };
                assert_eq!(
                    count,
                    want,
                    "{what}: {} handled whole {count} times",
                    name_of(payload)
                );
            }
            assert_eq!(
                runs.len(),
                expected.len() + 1,
                "{what}: nothing but whole messages: {:?}",
                runs.iter()
                    .map(|run| (name_of(run), run.len()))
                    .collect::<Vec<_>>()
            );
        }
    });
}

#[derive(Debug, thiserror::Error)]
#[error("busy, try later")]
struct Busy;

/// A chunked message that keeps failing with a retryable error is
/// retried through the retry topic and then dead-lettered, whole each
/// time: the copies carry the payload put together, not a chunk.
#[test]
fn a_chunked_message_is_retried_and_dead_lettered_whole() {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("chunked-retry", TopicKind::Partitioned(2));
        let retry_topic = common::unique_topic("chunked-retry-r");
        let subscription = unique_name("chunked-retry-sub");
        let dead_letters = format!("{topic}-{subscription}-DLQ");
        let dispatcher = common::dispatcher().await;
        let runs: Rc<RefCell<Vec<(String, usize)>>> = Rc::default();
        let failing = {
            let runs = runs.clone();
            Rc::new(async move |message: &Message| {
                let run = (message.topic().to_owned(), message.payload().len());
                runs.borrow_mut().push(run);
                Err::<(), _>(Busy)
            })
        };
        let options = SubscribeOptions::new()
            .subscription(&subscription)
            .subscription_type(SubType::Shared)
            .retry_errors(pulsar_dispatcher::ErrorClass::of::<Busy>())
            .retry_topic(&retry_topic)
            .retry_backoff(|_| Duration::from_millis(100))
            .max_retries(1);
        for subscribed in [&topic, &retry_topic] {
            let failing = failing.clone();
            let handler = async move |message: &Message| failing(message).await;
            dispatcher
                .subscribe(subscribed, handler, options.clone())
                .await
                .unwrap();
        }
        let dead: Rc<RefCell<Vec<usize>>> = Rc::default();
        let recorder = {
            let dead = dead.clone();
            async move |message: &Message| {
                dead.borrow_mut().push(message.payload().len());
                Ok::<(), std::convert::Infallible>(())
            }
        };
        let reader = SubscribeOptions::new()
            .subscription(unique_name("dlq-reader"))
            .subscription_type(SubType::Shared);
        dispatcher
            .subscribe(&dead_letters, recorder, reader)
            .await
            .unwrap();
        let run = start(&dispatcher);
        let payload = format!("big-{}", "y".repeat(3496));
        common::produce_chunked_with_java(CHUNK_BYTES, vec![(topic.clone(), payload, None)]).await;
        common::wait_until("the dead letter", Duration::from_secs(30), || {
            !dead.borrow().is_empty()
        })
        .await;
        for drained in [&topic, &retry_topic] {
            let stats = wait_for_empty_backlog(drained, &subscription).await;
            assert_eq!(stats.msg_backlog, 0, "{drained}");
        }
        close_and_join(&dispatcher, run).await;
        let runs = runs.borrow();
        assert_eq!(runs.len(), 2, "{runs:?}");
        assert!(runs[0].0.starts_with(&topic), "{runs:?}");
        assert_eq!(runs[1].0, retry_topic, "{runs:?}");
        assert!(runs.iter().all(|(_, len)| *len == 3500), "{runs:?}");
        assert_eq!(*dead.borrow(), [3500]);
    });
}

/// The broker delivers again, on their own, the last chunks of a chunked
/// message acked moments before, as it does when the tail of the message's
/// acks was lost with a connection (here a reset of the cursor to its
/// next-to-last chunk, which also drops the consumer's connection): they
/// are acked again, not given up and nacked for ever, and nothing is
/// handled twice. On plain and partitioned topics, Exclusive and Failover
/// (where each nack rewinds the whole subscription) and Key_Shared. Not on
/// Shared: there the broker (4.2.4) stalls the subscription on a chunk whose
/// first chunk is acked and delivers nothing more (apache/pulsar#26395).
#[test]
fn chunks_of_an_acked_message_delivered_again_alone_are_acked_again() {
    run_local(Duration::from_secs(180), async {
        let dispatcher = common::dispatcher().await;
        let subscription = unique_name("orphan-chunks-sub");
        let mut cases = Vec::new();
        for kind in [TopicKind::Plain, TopicKind::Partitioned(2)] {
            for subscription_type in [SubType::Exclusive, SubType::Failover, SubType::KeyShared] {
                cases.push(Case {
                    topic: fresh_topic("orphan-chunks", kind),
                    kind,
                    subscription_type,
                });
            }
        }
        // Per delivered topic (a partition's own name), each payload's name
        // and its message id.
        let handled: Rc<RefCell<Vec<(String, String, MessageId)>>> = Rc::default();
        for case in &cases {
            let handled = handled.clone();
            let handler = async move |message: &Message| {
                let payload = String::from_utf8_lossy(message.payload());
                handled.borrow_mut().push((
                    message.topic().to_owned(),
                    name_of(&payload).to_owned(),
                    message.id().clone(),
                ));
                Ok::<_, std::convert::Infallible>(())
            };
            let options = SubscribeOptions::new()
                .subscription(&subscription)
                .subscription_type(case.subscription_type)
                .negative_ack_redelivery_delay(Duration::from_millis(100));
            dispatcher
                .subscribe(&case.topic, handler, options)
                .await
                .unwrap();
        }
        let run = start(&dispatcher);
        // A chunked message of four chunks, then a whole one with the same
        // key (the same partition), after it.
        let big = format!("big-{}", "z".repeat(3996));
        let messages = cases
            .iter()
            .flat_map(|case| {
                let key = Some("one-key".to_owned());
                [
                    (case.topic.clone(), big.clone(), key.clone()),
                    (case.topic.clone(), "after".to_owned(), key),
                ]
            })
            .collect();
        common::produce_chunked_with_java(CHUNK_BYTES, messages).await;
        common::wait_until("both messages handled", Duration::from_secs(30), || {
            handled.borrow().len() == 2 * cases.len()
        })
        .await;
        let all_handled = std::time::Instant::now();
        for case in &cases {
            let stats = wait_for_empty_backlog(&case.topic, &subscription).await;
            assert_eq!(stats.msg_backlog, 0, "{}", case.topic);
        }
        // Within the consumer's window for acks lost with a connection (10
        // s): back to the next-to-last chunk of each big message.
        let resets: Vec<(String, MessageId)> = handled
            .borrow()
            .iter()
            .filter(|(_, name, _)| name == "big")
            .map(|(delivered, _, id)| (delivered.clone(), id.clone()))
            .collect();
        for (delivered, id) in resets {
            let subscription = subscription.clone();
            tokio::task::spawn_blocking(move || {
                common::reset_cursor_to_entry(
                    &delivered,
                    &subscription,
                    id.ledger_id(),
                    id.entry_id() - 1,
                )
            })
            .await
            .unwrap();
        }
        // The test's premise, stated rather than assumed: otherwise the
        // redeliveries count as a replay, and the failure below would
        // blame the consumer.
        let reset_after = all_handled.elapsed();
        assert!(
            reset_after < Duration::from_secs(9),
            "the cursors were reset {reset_after:?} after the acks, too close to the \
             consumer's 10 s window for lost acks (a loaded machine): nothing to conclude"
        );
        // Long enough for the broker to deliver them again and for a nack
        // of them to come back a few times.
        tokio::time::sleep(Duration::from_secs(3)).await;
        for case in &cases {
            let stats = wait_for_empty_backlog(&case.topic, &subscription).await;
            assert_eq!(
                stats.msg_backlog, 0,
                "{}: every chunk acked again",
                case.topic
            );
        }
        close_and_join(&dispatcher, run).await;
        let handled = handled.borrow();
        for case in &cases {
            let names: Vec<&str> = handled
                .iter()
                .filter(|(delivered, ..)| {
                    common::is_topic_or_partition(delivered, &case.topic, case.kind)
                })
                .map(|(_, name, _)| name.as_str())
                .collect();
            assert_eq!(
                names,
                ["big", "after"],
                "{} ({:?}): each once",
                case.topic,
                case.subscription_type
            );
        }
    });
}

/// A text of `len` characters that compresses poorly: hexadecimal digits
/// of a simple generator.
fn incompressible(len: usize) -> String {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from_digit(((state >> 60) & 0xf) as u32, 16).unwrap()
        })
        .collect()
}

/// A chunked message its Java producer compressed (LZ4) cannot be read: the
/// Java client compresses the whole payload and then splits it, and the
/// `pulsar` crate decompresses each chunk on its own, which fails. It is
/// reported (a receive error per chunk, no failure of receiving), never
/// reaches a handler, and stays unacked with the broker; the messages after
/// it are handled. If the crate learns to put chunks together before it
/// decompresses, this test fails: the README's limitation goes then.
#[test]
fn a_compressed_chunked_message_cannot_be_read_and_stays_with_the_broker() {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("compressed-chunks", TopicKind::Plain);
        let subscription = unique_name("compressed-chunks-sub");
        let dispatcher = common::dispatcher().await;
        let handled: Rc<RefCell<Vec<String>>> = Rc::default();
        let handler = {
            let handled = handled.clone();
            async move |message: &Message| {
                let payload = String::from_utf8_lossy(message.payload());
                handled.borrow_mut().push(name_of(&payload).to_owned());
                Ok::<_, std::convert::Infallible>(())
            }
        };
        let options = SubscribeOptions::new().subscription(&subscription);
        dispatcher
            .subscribe(&topic, handler, options)
            .await
            .unwrap();
        let run = start(&dispatcher);
        // About 4,500 bytes once compressed: 5 chunks.
        let messages = vec![
            (topic.clone(), format!("big-{}", incompressible(8000)), None),
            (topic.clone(), "small".to_owned(), None),
        ];
        common::produce_chunked_and_compressed_with_java(CHUNK_BYTES, "LZ4", messages).await;
        common::wait_until("the small message", Duration::from_secs(30), || {
            !handled.borrow().is_empty()
        })
        .await;
        let stats = dispatcher.stats().total();
        assert!(stats.receive_errors >= 2, "{stats:?}");
        assert!(dispatcher.health().is_ready(), "{:?}", dispatcher.health());
        let (t, s) = (topic.clone(), subscription.clone());
        let backlog = tokio::task::spawn_blocking(move || common::subscription_stats(&t, &s))
            .await
            .unwrap()
            .msg_backlog;
        assert!(backlog >= 2, "the chunks stay: {backlog}");
        close_and_join(&dispatcher, run).await;
        assert_eq!(*handled.borrow(), ["small"]);
    });
}
