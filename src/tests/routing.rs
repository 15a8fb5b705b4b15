//! Failure routing, replies, validation, topic families and retry-topic
//! checks, through the public API on the in-memory transport.

use std::rc::Rc;
use std::time::Duration;

use super::{dispatcher, refused_for, run_local, settle_down, spawn_run};
use crate::routing::{DEAD_LETTER_TOPIC, ORIGIN_MESSAGE_ID, REAL_TOPIC, RECONSUMETIMES};
use crate::transport::{Event, MemoryTransport, OutgoingMessage};
use crate::{
    priorities, DeadLetterPolicy, DeadLetterTargets, Dispatcher, Error, ErrorClass, Message,
    RetryTopicCheck, RetryTopicProblem, SubType, SubscribeOptions, TopicFamily,
};

#[derive(Debug, thiserror::Error)]
#[error("invalid order")]
struct InvalidOrder;

#[derive(Debug, thiserror::Error)]
#[error("service unavailable")]
struct ServiceUnavailable;

const ORDERS: &str = "persistent://public/default/orders";
const RETRY: &str = "persistent://public/default/orders-retry";
const DLQ: &str = "persistent://public/default/orders-orders-sub-DLQ";

fn routed_options() -> SubscribeOptions {
    SubscribeOptions::new()
        .subscription("orders-sub")
        .subscription_type(SubType::Shared)
        .negative_ack_redelivery_delay(Duration::ZERO)
        .fatal_errors(ErrorClass::of::<InvalidOrder>())
        .retry_errors(ErrorClass::of::<ServiceUnavailable>())
        .retry_topic("orders-retry")
}

/// Fails with the error its payload names.
async fn failing(message: &Message) -> Result<(), Box<dyn std::error::Error>> {
    match message.payload() {
        b"invalid" => Err(InvalidOrder.into()),
        b"unavailable" => Err(ServiceUnavailable.into()),
        b"other" => Err("something else".into()),
        b"panic" => panic!("handler bug"),
        _ => Ok(()),
    }
}

fn send(transport: &MemoryTransport, topic: &str, payload: &str) -> crate::MessageId {
    transport.send_message(
        topic,
        OutgoingMessage {
            payload: payload.as_bytes().to_vec(),
            properties: vec![("app".into(), "kept".into())],
            // "customer-7", given as bytes.
            partition_key: Some("Y3VzdG9tZXItNw==".into()),
            partition_key_b64_encoded: true,
            ordering_key: Some(b"ok".to_vec()),
            event_time: Some(42),
            deliver_at_time: None,
        },
    )
}

async fn run_until(
    dispatcher: Dispatcher<MemoryTransport>,
    until: impl AsyncFn(&MemoryTransport),
) -> MemoryTransport {
    let transport = dispatcher.transport().clone();
    let dispatcher = Rc::new(dispatcher);
    let run = spawn_run(&dispatcher);
    until(&transport).await;
    settle_down().await;
    dispatcher.close().await;
    run.await.unwrap().unwrap();
    transport
}

#[test]
fn a_fatal_error_dead_letters_the_message_with_its_content_and_origin() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        let id = send(&transport, "orders", "invalid");
        dispatcher
            .subscribe("orders", failing, routed_options())
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("orders", 1).await).await;
        let dead = transport.published(DLQ);
        assert_eq!(dead.len(), 1);
        let dead = &dead[0];
        assert_eq!(dead.payload, b"invalid");
        assert_eq!(dead.partition_key.as_deref(), Some("Y3VzdG9tZXItNw=="));
        assert!(dead.partition_key_b64_encoded, "still a key given as bytes");
        assert_eq!(dead.ordering_key.as_deref(), Some(&b"ok"[..]));
        assert_eq!(dead.event_time, Some(42));
        assert_eq!(dead.property("app"), Some("kept"));
        assert_eq!(dead.property(REAL_TOPIC), Some(ORDERS));
        assert_eq!(
            dead.property(ORIGIN_MESSAGE_ID),
            Some(id.to_string().as_str())
        );
        assert_eq!(dead.deliver_at_time, None);
        assert!(transport.nacked("orders").is_empty());
        // The dead letter is published before the original is acked.
        let events = transport.events();
        let published_at = events
            .iter()
            .position(|e| matches!(e, Event::Published { topic } if &**topic == DLQ))
            .unwrap();
        let acked_at = events
            .iter()
            .position(|e| matches!(e, Event::Acked { id: acked, .. } if *acked == id))
            .unwrap();
        assert!(published_at < acked_at);
    });
}

#[test]
fn a_dead_letter_policy_names_the_dead_letter_topic() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        send(&transport, "orders", "invalid");
        let options = routed_options().dead_letter_policy(DeadLetterPolicy {
            max_redeliver_count: 5,
            dead_letter_topic: "orders-graveyard".into(),
        });
        dispatcher
            .subscribe("orders", failing, options)
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("orders", 1).await).await;
        assert_eq!(transport.published("orders-graveyard").len(), 1);
        assert!(transport.published(DLQ).is_empty());
    });
}

#[test]
fn a_dead_letter_policy_without_a_topic_uses_pulsars_default() {
    let unnamed = DeadLetterPolicy {
        max_redeliver_count: 5,
        dead_letter_topic: String::new(),
    };
    // The consumer's policy is filled in too: the crate moves a message
    // past max_redeliver_count to the policy's topic itself.
    let spec = routed_options()
        .dead_letter_policy(unnamed.clone())
        .resolve("orders")
        .unwrap();
    let policy = spec.consumer.dead_letter_policy.unwrap();
    assert_eq!(policy.dead_letter_topic, DLQ);
    assert_eq!(policy.max_redeliver_count, 5);
    let refused = SubscribeOptions::new()
        .dead_letter_policy(unnamed.clone())
        .resolve("orders");
    assert!(refused_for(&refused, "dead_letter_policy"), "{refused:?}");
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        send(&transport, "orders", "invalid");
        let options = routed_options().dead_letter_policy(unnamed);
        dispatcher
            .subscribe("orders", failing, options)
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("orders", 1).await).await;
        assert_eq!(transport.published(DLQ).len(), 1);
    });
}

/// A subscription's retry, dead letter and reply producers go when it is
/// unsubscribed, unless another subscription publishes there too: a
/// service that subscribes and unsubscribes for its whole life keeps no
/// producers of subscriptions long gone.
#[test]
fn unsubscribing_closes_the_producers_no_other_subscription_uses() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        let stays = dispatcher
            .subscribe("stays", failing, routed_options())
            .await
            .unwrap();
        assert_eq!(
            transport.open_producers(),
            2,
            "its retry and dead letter producers"
        );
        for cycle in 0..20 {
            let topic = format!("family-{cycle}");
            let options = routed_options()
                .retry_topic(format!("{topic}-retry"))
                .reply_topic(format!("{topic}-replies"));
            let handle = dispatcher
                .subscribe(&topic, failing, options)
                .await
                .unwrap();
            assert_eq!(transport.open_producers(), 5);
            dispatcher.unsubscribe(handle).await.unwrap();
            assert_eq!(transport.open_producers(), 2, "cycle {cycle}");
        }
        // Sharing the retry topic of `stays`: its producer stays open for
        // `stays` when the other one goes.
        let sharing = dispatcher
            .subscribe("sharing", failing, routed_options())
            .await
            .unwrap();
        assert_eq!(
            transport.open_producers(),
            3,
            "one more dead letter producer, the retry one shared"
        );
        dispatcher.unsubscribe(sharing).await.unwrap();
        assert_eq!(transport.open_producers(), 2);
        send(&transport, "stays", "unavailable");
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("stays", 1).await;
        assert_eq!(transport.published("orders-retry").len(), 1);
        drop(stays);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert_eq!(transport.open_producers(), 0);
    });
}

#[test]
fn fatal_beats_retry_and_panics_are_only_ever_nacked() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        send(&transport, "orders", "invalid");
        let panicking = send(&transport, "orders", "panic");
        let everything = ErrorClass::matching(|_| true);
        let options = routed_options()
            .fatal_errors(everything.clone())
            .retry_errors(everything);
        // The panicking message would loop forever; let it be redelivered
        // once and then succeed.
        let handler = async |message: &Message| match message.payload() {
            b"panic" if message.redelivery_count() == Some(0) => panic!("handler bug"),
            b"panic" => Ok(()),
            _ => failing(message).await,
        };
        dispatcher
            .subscribe("orders", handler, options)
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("orders", 2).await).await;
        assert_eq!(transport.published(DLQ).len(), 1, "the fatal one only");
        assert!(transport.published(RETRY).is_empty());
        assert_eq!(transport.nacked("orders"), [panicking]);
    });
}

#[test]
fn retries_count_up_and_end_in_the_original_dead_letter_topic() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        send(&transport, "orders", "unavailable");
        let options = routed_options().max_retries(2);
        dispatcher
            .subscribe("orders", failing, options.clone().priority(10))
            .await
            .unwrap();
        // The retry topic's own subscription has a different dead letter
        // topic; exhausted retries must still land in the original one.
        dispatcher
            .subscribe(
                "orders-retry",
                failing,
                options.subscription("retry-sub").priority(20),
            )
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("orders-retry", 2).await).await;
        let retries = transport.published(RETRY);
        assert_eq!(retries.len(), 2);
        assert_eq!(retries[0].property(RECONSUMETIMES), Some("1"));
        assert_eq!(retries[1].property(RECONSUMETIMES), Some("2"));
        for retry in &retries {
            assert_eq!(retry.property(REAL_TOPIC), Some(ORDERS));
            assert_eq!(retry.property(DEAD_LETTER_TOPIC), Some(DLQ));
            assert!(retry.deliver_at_time.is_some());
        }
        let dead = transport.published(DLQ);
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].property(RECONSUMETIMES), Some("2"));
        assert_eq!(dead[0].property(REAL_TOPIC), Some(ORDERS));
        assert!(transport
            .published("persistent://public/default/orders-retry-retry-sub-DLQ")
            .is_empty());
    });
}

/// `failing`, with anyhow's error type and context.
#[cfg(feature = "anyhow")]
async fn failing_with_anyhow(message: &Message) -> anyhow::Result<()> {
    use anyhow::Context;
    // Each fails once: a message nacked where it should be retried or
    // dead-lettered comes back, succeeds and is missing from those topics.
    if message.redelivery_count() != Some(0) {
        return Ok(());
    }
    match message.payload() {
        b"invalid" => Err(InvalidOrder.into()),
        b"unavailable" => Err(ServiceUnavailable).context("reserving stock"),
        b"other" => Err(anyhow::anyhow!("something else")),
        _ => Ok(()),
    }
}

#[cfg(feature = "anyhow")]
#[test]
fn anyhow_errors_are_routed_by_the_error_they_were_made_from() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        let invalid = send(&transport, "orders", "invalid");
        let unavailable = send(&transport, "orders", "unavailable");
        let other = send(&transport, "orders", "other");
        dispatcher
            .subscribe("orders", failing_with_anyhow, routed_options())
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("orders", 3).await).await;
        let dead = transport.published(DLQ);
        assert_eq!(dead.len(), 1);
        assert_eq!(
            dead[0].property(ORIGIN_MESSAGE_ID),
            Some(invalid.to_string().as_str())
        );
        let retries = transport.published(RETRY);
        assert_eq!(retries.len(), 1);
        assert_eq!(
            retries[0].property(ORIGIN_MESSAGE_ID),
            Some(unavailable.to_string().as_str())
        );
        assert_eq!(transport.nacked("orders"), vec![other]);
    });
}

#[test]
fn an_untrusted_dead_letter_topic_property_is_ignored() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        transport.send_message(
            "orders",
            OutgoingMessage {
                payload: b"invalid".to_vec(),
                properties: vec![(
                    DEAD_LETTER_TOPIC.into(),
                    "persistent://public/default/attacker".into(),
                )],
                ..Default::default()
            },
        );
        dispatcher
            .subscribe("orders", failing, routed_options())
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("orders", 1).await).await;
        assert!(transport.published("attacker").is_empty());
        assert_eq!(transport.published(DLQ).len(), 1);
    });
}

/// A subscription that reads a dead letter topic and dead-letters in turn
/// does not publish its failures back to the topic they came from, though
/// their DEAD_LETTER_TOPIC names it (a message retried before it was
/// dead-lettered does): that would loop for ever. Nor does it follow a
/// non-persistent one, even when it trusts any.
#[test]
fn dead_letters_never_go_back_to_their_own_topic_or_to_a_non_persistent_one() {
    for targets in [DeadLetterTargets::known(), DeadLetterTargets::any()] {
        run_local(async {
            let transport = MemoryTransport::new();
            let dispatcher = Dispatcher::builder()
                .dead_letter_targets(targets.clone())
                .build(transport.clone())
                .unwrap();
            dispatcher
                .subscribe("orders", failing, routed_options())
                .await
                .unwrap();
            let back_to_itself =
                OutgoingMessage::new("invalid").with_property(DEAD_LETTER_TOPIC, DLQ);
            transport.send_message(DLQ, back_to_itself);
            let non_persistent = "non-persistent://public/default/dlq";
            let to_non_persistent =
                OutgoingMessage::new("invalid").with_property(DEAD_LETTER_TOPIC, non_persistent);
            transport.send_message(DLQ, to_non_persistent);
            let reprocess = SubscribeOptions::new()
                .subscription("reprocessor")
                .subscription_type(SubType::Shared)
                .fatal_errors(ErrorClass::of::<InvalidOrder>());
            dispatcher.subscribe(DLQ, failing, reprocess).await.unwrap();
            run_until(dispatcher, async |t| t.wait_acked(DLQ, 2).await).await;
            assert_eq!(transport.published(DLQ).len(), 0, "{targets:?}");
            assert!(transport.published(non_persistent).is_empty());
            let own = format!("{DLQ}-reprocessor-DLQ");
            assert_eq!(transport.published(&own).len(), 2, "{targets:?}");
        });
    }
}

#[test]
fn a_non_persistent_dead_letter_target_is_refused() {
    let refused = DeadLetterTargets::known().allow("non-persistent://public/default/dlq");
    assert!(refused_for(&refused, "dead_letter_targets"), "{refused:?}");
    assert!(DeadLetterTargets::known().allow("elsewhere-dlq").is_ok());
}

/// With `DeadLetterTargets::any()`, whoever publishes to a topic names the
/// dead letter topics: each name gets its dead letter, and at most
/// `UNUSED_PRODUCERS` (16) producers for such names stay open, however many
/// names come, one at a time or many at once (a producer still being made
/// or sent with is not the one closed); and every one is closed at the end.
#[test]
fn producers_for_dead_letter_topics_named_by_messages_are_bounded() {
    for concurrency in [2, 64] {
        producers_named_by_messages(concurrency);
    }
}

fn producers_named_by_messages(concurrency: usize) {
    run_local(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder()
            .concurrency(concurrency)
            .dead_letter_targets(crate::DeadLetterTargets::any())
            .build(transport.clone())
            .unwrap();
        for name in 0..50 {
            transport.send_message(
                "orders",
                OutgoingMessage {
                    payload: b"invalid".to_vec(),
                    properties: vec![(DEAD_LETTER_TOPIC.into(), format!("graveyard-{name}"))],
                    ..Default::default()
                },
            );
        }
        let options = routed_options().max_in_flight(concurrency);
        dispatcher
            .subscribe("orders", failing, options)
            .await
            .unwrap();
        let transport = run_until(dispatcher, async |t| {
            t.wait_acked("orders", 50).await;
            let open = t.open_producers();
            assert!(open <= 2 + 16, "{open} producers open");
        })
        .await;
        assert_eq!(transport.open_producers(), 0, "after close");
        for name in 0..50 {
            assert_eq!(transport.published(&format!("graveyard-{name}")).len(), 1);
        }
    });
}

/// Two subscribes that share a retry topic make its producer at the same
/// time, and the first try fails: the one whose try failed is refused, the
/// other makes the producer and counts as its user, so that its
/// unsubscribe closes it.
#[test]
fn a_shared_producer_whose_first_creation_failed_is_still_counted() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        transport.fail_producer_creation(RETRY, 1);
        let first = dispatcher.subscribe("a", failing, routed_options().subscription("a"));
        let second = dispatcher.subscribe("b", failing, routed_options().subscription("b"));
        let (first, second) = futures::join!(first, second);
        assert!(first.is_err() != second.is_err(), "{first:?} {second:?}");
        let subscribed = first.or(second).unwrap();
        dispatcher.unsubscribe(subscribed).await.unwrap();
        assert_eq!(
            transport.open_producers(),
            0,
            "{:?}",
            transport.producers_created()
        );
    });
}

#[test]
fn a_failed_republish_nacks_the_original() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        transport.fail_publishes(DLQ, 1);
        let id = send(&transport, "orders", "invalid");
        let orders = dispatcher
            .subscribe("orders", failing, routed_options())
            .await
            .unwrap();
        // Nacked, redelivered, and dead-lettered on the second attempt once
        // the publish goes through.
        run_until(dispatcher, async |t| {
            t.wait_acked("orders", 1).await;
            let stats = orders.stats().unwrap();
            assert_eq!((stats.publishes_failed, stats.dead_lettered), (1, 1));
        })
        .await;
        assert_eq!(transport.nacked("orders"), std::slice::from_ref(&id));
        assert_eq!(transport.acked("orders"), [id]);
        assert_eq!(transport.published(DLQ).len(), 1);
    });
}

#[test]
fn replies_are_published_before_the_ack_and_only_when_returned() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        let with_reply = transport.send("images", "cat");
        let without = transport.send("images", "skip");
        dispatcher
            .subscribe(
                "images",
                async |message: &Message| {
                    Ok::<_, std::convert::Infallible>(if message.payload() == b"skip" {
                        None
                    } else {
                        Some([b"thumb-", message.payload()].concat())
                    })
                },
                SubscribeOptions::new().reply_topic("thumbnails"),
            )
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("images", 2).await).await;
        assert_eq!(
            transport.published("thumbnails"),
            [OutgoingMessage::new("thumb-cat")]
        );
        let events = transport.events();
        let reply_at = events
            .iter()
            .position(|e| matches!(e, Event::Published { .. }))
            .unwrap();
        let ack_at = events
            .iter()
            .position(|e| matches!(e, Event::Acked { id, .. } if *id == with_reply))
            .unwrap();
        assert!(reply_at < ack_at);
        assert!(transport.acked("images").contains(&without));
    });
}

#[test]
fn reply_bytes_without_a_reply_topic_are_dropped_and_the_message_acked() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        let id = transport.send("images", "cat");
        dispatcher
            .subscribe(
                "images",
                async |message: &Message| {
                    Ok::<_, std::convert::Infallible>([b"thumb-", message.payload()].concat())
                },
                SubscribeOptions::new(),
            )
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("images", 1).await).await;
        assert_eq!(transport.acked("images"), [id]);
        assert!(transport.producers_created().is_empty());
        let published = transport
            .events()
            .iter()
            .filter(|e| matches!(e, Event::Published { .. }))
            .count();
        assert_eq!(published, 0);
    });
}

#[test]
fn a_failed_reply_nacks_so_the_handler_runs_again() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        transport.fail_publishes("thumbnails", 1);
        let id = transport.send("images", "cat");
        dispatcher
            .subscribe(
                "images",
                async |_: &Message| Ok::<_, std::convert::Infallible>(b"thumb".to_vec()),
                SubscribeOptions::new()
                    .reply_topic("thumbnails")
                    .negative_ack_redelivery_delay(Duration::ZERO),
            )
            .await
            .unwrap();
        run_until(dispatcher, async |t| t.wait_acked("images", 1).await).await;
        assert_eq!(transport.nacked("images"), [id]);
        assert_eq!(transport.published("thumbnails").len(), 1);
    });
}

#[test]
fn subscribe_creates_the_producers_it_publishes_with_and_fails_if_one_cannot_be() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        dispatcher
            .subscribe(
                "orders",
                failing,
                routed_options().reply_topic("confirmations"),
            )
            .await
            .unwrap();
        let mut created = transport.producers_created();
        created.sort();
        assert_eq!(
            created,
            [
                "persistent://public/default/confirmations",
                DLQ,
                "persistent://public/default/orders-retry",
            ],
            "retry, dead letter and reply producers, before any message"
        );
        transport.fail_producer_creation("forbidden-dlq", 1);
        let refused = dispatcher
            .subscribe(
                "payments",
                failing,
                SubscribeOptions::new()
                    .fatal_errors(ErrorClass::of::<InvalidOrder>())
                    .dead_letter_policy(DeadLetterPolicy {
                        max_redeliver_count: 5,
                        dead_letter_topic: "forbidden-dlq".into(),
                    }),
            )
            .await;
        assert!(
            matches!(&refused, Err(Error::Producer { topic, .. }) if topic.ends_with("/forbidden-dlq")),
            "{refused:?}"
        );
        assert_eq!(dispatcher.subscriptions().len(), 1, "nothing registered");
        assert_eq!(
            transport.open_consumers(),
            1,
            "the refused consumer is closed"
        );
    });
}

/// A subscribe that fails on a producer (here the reply topic's) closes
/// the producers it made before (here the retry topic's), as it closes its
/// consumer: a failed subscribe leaves nothing behind. A dead letter
/// policy that allows no redelivery is refused by name.
#[test]
fn a_failed_subscribe_closes_the_producers_it_made() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        transport.fail_producer_creation("replies", 1);
        let options = routed_options().reply_topic("replies");
        let refused = dispatcher.subscribe("orders", failing, options).await;
        assert!(
            matches!(&refused, Err(Error::Producer { topic, .. }) if topic.ends_with("/replies")),
            "{refused:?}"
        );
        let mut made = transport.producers_created();
        let mut closed = transport.producers_closed();
        made.sort();
        closed.sort();
        assert!(!made.is_empty());
        assert_eq!(made, closed, "every producer made was closed again");
        assert_eq!(transport.open_consumers(), 0);
        let none = routed_options().dead_letter_policy(DeadLetterPolicy {
            max_redeliver_count: 0,
            dead_letter_topic: "graveyard".into(),
        });
        let refused = dispatcher.subscribe("orders", failing, none).await;
        assert!(refused_for(&refused, "dead_letter_policy"), "{refused:?}");
    });
}

/// A subscription that can never dead-letter (no fatal errors, no retry
/// limit) makes no dead letter producer, though its retries name its dead
/// letter topic: a broker that refuses that topic does not fail it, and
/// the retry still carries the name for whoever ends the chain.
#[test]
fn a_subscription_that_never_dead_letters_makes_no_dead_letter_producer() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        transport.fail_producer_creation("orders-orders-sub-DLQ", 1);
        let retries_only = SubscribeOptions::new()
            .subscription("orders-sub")
            .subscription_type(SubType::Shared)
            .retry_errors(ErrorClass::of::<ServiceUnavailable>())
            .retry_topic("orders-retry");
        dispatcher
            .subscribe("orders", failing, retries_only)
            .await
            .unwrap();
        assert_eq!(
            transport.producers_created(),
            ["persistent://public/default/orders-retry"]
        );
        send(&transport, "orders", "unavailable");
        run_until(dispatcher, async |t| t.wait_acked("orders", 1).await).await;
        let retried = transport.published("orders-retry");
        assert_eq!(retried.len(), 1);
        assert_eq!(retried[0].property(DEAD_LETTER_TOPIC), Some(DLQ));
    });
}

fn dead_letters_to(topic: &str) -> SubscribeOptions {
    routed_options().dead_letter_policy(DeadLetterPolicy {
        max_redeliver_count: 3,
        dead_letter_topic: topic.into(),
    })
}

#[test]
fn inconsistent_options_are_refused_by_name_before_anything_is_created() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        let any = || ErrorClass::matching(|_| true);
        let cases: Vec<(&str, SubscribeOptions)> = vec![
            ("retry_errors", SubscribeOptions::new().retry_errors(any())),
            ("retry_topic", SubscribeOptions::new().retry_topic("r")),
            (
                "retry_backoff",
                SubscribeOptions::new().retry_backoff(|_| Duration::ZERO),
            ),
            ("max_retries", SubscribeOptions::new().max_retries(3)),
            (
                "max_retries",
                SubscribeOptions::new()
                    .subscription("s")
                    .retry_errors(any())
                    .retry_topic("r")
                    .max_retries(0),
            ),
            (
                "max_retries",
                SubscribeOptions::new()
                    .retry_errors(any())
                    .retry_topic("r")
                    .max_retries(2),
            ),
            ("fatal_errors", SubscribeOptions::new().fatal_errors(any())),
            // The broker refuses it, after the whole subscribe timeout.
            ("subscription", routed_options().subscription("")),
            ("subscription", routed_options().subscription("  ")),
            // Malformed topics of options are refused with the option.
            ("reply_topic", routed_options().reply_topic("bad//name")),
            ("retry_topic", routed_options().retry_topic("orders//retry")),
            ("dead_letter_policy", dead_letters_to("orders//dlq")),
            // Dead letters sent back to the handler that failed them.
            (
                "dead_letter_policy",
                dead_letters_to("persistent://public/default/orders"),
            ),
            // ... or to a partition of it.
            ("dead_letter_policy", dead_letters_to("orders-partition-0")),
            // The broker reads it as an int, and drops the connection.
            (
                "receiver_queue_size",
                routed_options().receiver_queue_size(i32::MAX as u32 + 1),
            ),
            // Topics that keep nothing for a subscriber not connected,
            // where the original is acked once published.
            (
                "dead_letter_policy",
                dead_letters_to("non-persistent://public/default/orders-dlq"),
            ),
            (
                "retry_topic",
                routed_options().retry_topic("non-persistent://public/default/orders-retry"),
            ),
        ];
        for (option, options) in cases {
            let refused = dispatcher.subscribe("orders", failing, options).await;
            assert!(
                refused_for(&refused, option),
                "expected {option} to be named: {refused:?}"
            );
        }
        assert_eq!(transport.open_consumers(), 0);
        assert!(dispatcher.subscriptions().is_empty());
        let largest_queue = routed_options().receiver_queue_size(i32::MAX as u32);
        assert!(largest_queue.resolve("orders").is_ok(), "the largest int");
        // A partition whose dead letters would go to its partitioned topic.
        let refused = dispatcher
            .subscribe("orders-partition-0", failing, dead_letters_to("orders"))
            .await;
        assert!(refused_for(&refused, "dead_letter_policy"), "{refused:?}");
        // A dead letter policy is as good as a subscription name.
        let with_policy = SubscribeOptions::new()
            .fatal_errors(any())
            .dead_letter_policy(DeadLetterPolicy {
                max_redeliver_count: 3,
                dead_letter_topic: "dlq".into(),
            });
        dispatcher
            .subscribe("orders", failing, with_policy)
            .await
            .unwrap();
    });
}

#[test]
fn a_non_persistent_topic_needs_a_persistent_dead_letter_topic_named() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        let topic = "non-persistent://public/default/ticks";
        let any = || ErrorClass::matching(|_| true);
        let named = SubscribeOptions::new().subscription("s");
        // Each would dead-letter to non-persistent://...-s-DLQ, which keeps
        // nothing for a subscriber that is not connected, and ack the
        // original once published there.
        let cases: Vec<(&str, SubscribeOptions)> = vec![
            ("fatal_errors", named.clone().fatal_errors(any())),
            (
                "max_retries",
                named
                    .clone()
                    .retry_errors(any())
                    .retry_topic("ticks-retry")
                    .max_retries(2),
            ),
            (
                "dead_letter_policy",
                named.clone().dead_letter_policy(DeadLetterPolicy {
                    max_redeliver_count: 3,
                    dead_letter_topic: String::new(),
                }),
            ),
        ];
        for (option, options) in cases {
            let refused = dispatcher.subscribe(topic, failing, options).await;
            let Err(Error::InvalidOption {
                option: named,
                reason,
            }) = &refused
            else {
                panic!("expected {option} to be refused: {refused:?}");
            };
            assert_eq!(*named, option);
            assert!(
                reason.contains("non-persistent://public/default/ticks-s-DLQ"),
                "the reason names the default topic: {reason}"
            );
        }
        assert_eq!(transport.open_consumers(), 0);
        // Without dead letters, or with a persistent one named, it is fine.
        dispatcher
            .subscribe(topic, failing, named.clone())
            .await
            .unwrap();
        let to_persistent = SubscribeOptions::new()
            .subscription("t")
            .fatal_errors(any())
            .dead_letter_policy(DeadLetterPolicy {
                max_redeliver_count: 3,
                dead_letter_topic: "ticks-dlq".into(),
            });
        dispatcher
            .subscribe(topic, failing, to_persistent)
            .await
            .unwrap();
        assert_eq!(dispatcher.subscriptions().len(), 2);
        // Retried without a dead letter topic of its own: the retry names
        // none, rather than the non-persistent default.
        let retried = SubscribeOptions::new()
            .subscription("r")
            .negative_ack_redelivery_delay(Duration::ZERO)
            .retry_errors(ErrorClass::of::<ServiceUnavailable>())
            .retry_topic("ticks-retry");
        dispatcher
            .subscribe(
                "non-persistent://public/default/other-ticks",
                failing,
                retried,
            )
            .await
            .unwrap();
        transport.send("non-persistent://public/default/other-ticks", "unavailable");
        run_until(dispatcher, async |t| {
            t.wait_acked("non-persistent://public/default/other-ticks", 1)
                .await
        })
        .await;
        let retries = transport.published("ticks-retry");
        assert_eq!(retries.len(), 1);
        assert_eq!(retries[0].property(DEAD_LETTER_TOPIC), None);
    });
}

priorities! {
    enum Level { Live = 100, Batch = 200 }
}
priorities! {
    enum Lane { High = 10, Low = 20, Retry = 50 }
}

#[test]
fn a_topic_family_subscribes_six_topics_with_their_priorities_and_retry_topics() {
    run_local(async {
        let (dispatcher, _transport) = dispatcher(4);
        let family = TopicFamily::<Level, Lane>::new("orders").retry_sublevel(Lane::Retry);
        let options = SubscribeOptions::new()
            .subscription("orders-sub")
            .subscription_type(SubType::Shared)
            .retry_errors(ErrorClass::of::<ServiceUnavailable>());
        dispatcher
            .subscribe_family(&family, failing, options)
            .await
            .unwrap();
        let table: Vec<(String, i64, Option<String>)> = dispatcher
            .subscriptions()
            .into_iter()
            .map(|s| (s.topic, s.priority, s.retry_topic))
            .collect();
        let full = |name: &str| format!("persistent://public/default/{name}");
        let expected: Vec<(String, i64, Option<String>)> = [
            ("orders_live_high", 110, "orders_live_retry"),
            ("orders_live_low", 120, "orders_live_retry"),
            ("orders_live_retry", 150, "orders_live_retry"),
            ("orders_batch_high", 210, "orders_batch_retry"),
            ("orders_batch_low", 220, "orders_batch_retry"),
            ("orders_batch_retry", 250, "orders_batch_retry"),
        ]
        .into_iter()
        .map(|(topic, priority, retry)| (full(topic), priority, Some(full(retry))))
        .collect();
        assert_eq!(table, expected);
    });
}

#[test]
fn an_invalid_or_failing_family_leaves_the_dispatcher_unchanged() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        let family = TopicFamily::<Level, Lane>::new("orders").retry_sublevel(Lane::Retry);
        let both = SubscribeOptions::new()
            .retry_errors(ErrorClass::of::<ServiceUnavailable>())
            .retry_topic("elsewhere");
        let refused = dispatcher.subscribe_family(&family, failing, both).await;
        assert!(refused_for(&refused, "retry_topic"));
        // A retry sublevel without the errors that retry names what is
        // missing, not the retry topic the user never set.
        let refused = dispatcher
            .subscribe_family(&family, failing, SubscribeOptions::new())
            .await;
        assert!(refused_for(&refused, "retry_errors"), "{refused:?}");

        priorities! { enum Wide { A = 100, B = 140 } }
        let too_wide = TopicFamily::<Wide, Lane>::new("orders");
        let refused = dispatcher
            .subscribe_family(&too_wide, failing, SubscribeOptions::new())
            .await;
        assert!(refused_for(&refused, "sublevels"));

        // The broker refuses the fifth topic: the four consumers already
        // created are closed and nothing is registered.
        transport.fail_subscribe("orders_batch_low");
        let refused = dispatcher
            .subscribe_family(
                &family,
                failing,
                SubscribeOptions::new().retry_errors(ErrorClass::of::<ServiceUnavailable>()),
            )
            .await;
        assert!(
            matches!(refused, Err(Error::Subscribe { .. })),
            "{refused:?}"
        );
        assert!(dispatcher.subscriptions().is_empty());
        assert_eq!(transport.open_consumers(), 0);
    });
}

#[test]
fn run_checks_retry_topics_as_configured() {
    run_local(async {
        let make = |check| {
            Dispatcher::builder()
                .retry_topic_check(check)
                .build(MemoryTransport::new())
                .unwrap()
        };
        let exclusive_retry_consumer = SubscribeOptions::new()
            .subscription("retry-sub")
            .subscription_type(SubType::Exclusive);

        let refusing = make(RetryTopicCheck::Refuse);
        refusing
            .subscribe("orders", failing, routed_options())
            .await
            .unwrap();
        refusing
            .subscribe(
                "payments",
                failing,
                routed_options().retry_topic("payments-retry"),
            )
            .await
            .unwrap();
        refusing
            .subscribe("orders-retry", failing, exclusive_retry_consumer.clone())
            .await
            .unwrap();
        match refusing.run().await {
            Err(Error::RetryTopics(problems)) => assert_eq!(
                problems,
                [
                    RetryTopicProblem::DelaysIgnored {
                        retry_topic: RETRY.into(),
                        subscription_type: SubType::Exclusive,
                    },
                    RetryTopicProblem::NotConsumed {
                        retry_topic: "persistent://public/default/payments-retry".into(),
                        topic: "persistent://public/default/payments".into(),
                    },
                ]
            ),
            other => panic!("expected a refusal, got {other:?}"),
        }
        refusing.close().await;

        for check in [RetryTopicCheck::Warn, RetryTopicCheck::Ignore] {
            let starting = Rc::new(make(check));
            starting
                .subscribe("orders", failing, routed_options())
                .await
                .unwrap();
            let run = spawn_run(&starting);
            settle_down().await;
            assert!(!run.is_finished(), "{check:?} starts anyway");
            starting.close().await;
            run.await.unwrap().unwrap();
        }
    });
}

/// A producer the broker makes only after `close()` has closed the others
/// (the `pulsar` crate's answer can come that late): the subscribe that
/// asked for it fails with a typed error, and the late producer is closed
/// (before, `acquire` panicked on the emptied map and the producer stayed
/// open). Both a dispatcher never run and a running one.
#[test]
fn a_producer_answered_after_close_fails_its_subscribe_and_is_closed() {
    for running in [false, true] {
        run_local(async move {
            let transport = super::hooked::Hooked::default().hold_producers("orders-retry");
            let dispatcher = Rc::new(Dispatcher::builder().build(transport.clone()).unwrap());
            let run = running.then(|| spawn_run(&dispatcher));
            let subscriber = dispatcher.clone();
            let subscribing = tokio::task::spawn_local(async move {
                subscriber
                    .subscribe("orders", failing, routed_options())
                    .await
            });
            while transport.producers_held() == 0 {
                tokio::task::yield_now().await;
            }
            dispatcher.close().await;
            if let Some(run) = run {
                run.await.unwrap().unwrap();
            }
            transport.release_producers();
            let refused = subscribing.await.expect("the subscribe does not panic");
            assert!(
                matches!(refused, Err(Error::SubscribeNotAllowed { .. })),
                "running {running}: {refused:?}"
            );
            assert_eq!(transport.inner.open_consumers(), 0);
            assert_eq!(transport.inner.open_producers(), 0, "running {running}");
        });
    }
}

/// A subscribe its caller gives up on (a timeout around the call) while
/// its reply producer is being made gives back the retry producer it had
/// taken: the next subscription that publishes there, once it goes, takes
/// that producer with it.
#[test]
fn a_subscribe_dropped_by_its_caller_gives_back_the_producers_it_took() {
    run_local(async {
        let transport = super::hooked::Hooked::default().hold_producers("replies");
        let dispatcher = Dispatcher::builder().build(transport.clone()).unwrap();
        let given_up = tokio::time::timeout(
            Duration::from_millis(50),
            dispatcher.subscribe("orders", failing, routed_options().reply_topic("replies")),
        )
        .await;
        assert!(
            given_up.is_err(),
            "the subscribe waits for its reply producer"
        );
        assert!(dispatcher.subscriptions().is_empty());
        let other = dispatcher
            .subscribe("payments", failing, routed_options())
            .await
            .unwrap();
        dispatcher.unsubscribe(other).await.unwrap();
        let (mut created, mut closed) = (
            transport.inner.producers_created(),
            transport.inner.producers_closed(),
        );
        // The reply producer's creation was dropped with the subscribe,
        // before it was answered (the crate's producer closes on drop).
        created.retain(|topic| topic != "persistent://public/default/replies");
        created.sort();
        closed.sort();
        assert_eq!(closed, created, "each producer made is closed once");
        assert_eq!(created.iter().filter(|made| *made == RETRY).count(), 2);
        dispatcher.close().await;
    });
}

/// A topic this dispatcher already consumes with the same subscription
/// name is refused, however the topic is written and whether it came
/// alone or in a family: a second Exclusive consumer would wait out the
/// subscribe timeout, a second Shared one take turns with the first at
/// another priority. Unsubscribed, the name is free again.
#[test]
fn the_same_topic_and_subscription_twice_is_refused() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        let exclusive = || SubscribeOptions::new().subscription("s");
        let first = dispatcher
            .subscribe("orders", failing, exclusive())
            .await
            .unwrap();
        let again = dispatcher.subscribe(ORDERS, failing, exclusive()).await;
        assert!(
            matches!(
                &again,
                Err(Error::AlreadySubscribed { topic, subscription })
                    if topic == ORDERS && subscription == "s"
            ),
            "{again:?}"
        );
        // So is one of its partitions, had it any.
        let partition = dispatcher
            .subscribe("orders-partition-0", failing, exclusive())
            .await;
        assert!(
            matches!(&partition, Err(Error::AlreadySubscribed { .. })),
            "{partition:?}"
        );
        // Another subscription name, or none, is another subscription.
        dispatcher
            .subscribe("orders", failing, SubscribeOptions::new().subscription("t"))
            .await
            .unwrap();
        dispatcher
            .subscribe("orders", failing, SubscribeOptions::new())
            .await
            .unwrap();
        let shared = SubscribeOptions::new()
            .subscription("s")
            .subscription_type(SubType::Shared);
        let family = TopicFamily::<Level>::new("orders");
        dispatcher
            .subscribe_family(&family, failing, shared.clone())
            .await
            .unwrap();
        let overlapping = dispatcher
            .subscribe("orders_live", failing, shared.clone().priority(5))
            .await;
        assert!(
            matches!(overlapping, Err(Error::AlreadySubscribed { .. })),
            "{overlapping:?}"
        );
        assert_eq!(dispatcher.subscriptions().len(), 5);
        assert_eq!(transport.open_consumers(), 5);
        dispatcher.unsubscribe(first).await.unwrap();
        dispatcher
            .subscribe("orders", failing, exclusive())
            .await
            .unwrap();
        dispatcher.close().await;
    });
}

/// A subscribe that times out waiting for one of its producers names that
/// producer's topic, and leaves nothing behind: the same subscription is
/// made once the broker answers again.
#[test]
fn a_producer_that_is_not_answered_in_time_is_named() {
    run_local(async {
        let transport = super::hooked::Hooked::default().hold_producers("replies");
        let dispatcher = Dispatcher::builder().build(transport.clone()).unwrap();
        let options = || {
            routed_options()
                .reply_topic("replies")
                .subscribe_timeout(Duration::from_millis(50))
        };
        let refused = dispatcher.subscribe("orders", failing, options()).await;
        assert!(
            matches!(
                &refused,
                Err(Error::ProducerTimeout { topic, subscribed, .. })
                    if topic == "persistent://public/default/replies" && subscribed == ORDERS
            ),
            "{refused:?}"
        );
        assert!(dispatcher.subscriptions().is_empty());
        assert_eq!(transport.inner.open_consumers(), 0);
        transport.release_producers();
        dispatcher
            .subscribe("orders", failing, options())
            .await
            .unwrap();
        dispatcher.close().await;
    });
}
