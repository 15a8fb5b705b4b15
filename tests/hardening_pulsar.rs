//! Failure handling against a real Apache Pulsar broker: a subscription
//! another consumer holds, a topic the broker refuses to publish to, a
//! handler that never returns, and a topic terminated, or deleted and
//! created again, while consumed.

mod common;

use std::cell::RefCell;
use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use common::{
    admin_request, base_topic, client, close_and_join, consumers_per_partition,
    create_partitioned_topic, delete_topic, fresh_topic, keyed_messages, payload_number,
    pulsar_url, run_local, start, unique_name, unique_topic, wait_for_empty_backlog,
    wait_for_stats, wait_until, HeldBacklog, TopicKind,
};
use pulsar_dispatcher::{Dispatcher, Error, Message, SubType, SubscribeOptions};

#[test]
fn an_exclusive_subscription_held_elsewhere_fails_subscribe_with_a_typed_error() {
    run_local(Duration::from_secs(60), async {
        let topic = unique_topic("held");
        let subscription = unique_name("sub");
        let _holder: pulsar::Consumer<Vec<u8>, _> = client()
            .await
            .consumer()
            .with_topic(&topic)
            .with_subscription(&subscription)
            .with_subscription_type(SubType::Exclusive)
            .build()
            .await
            .expect("the first consumer");
        let dispatcher = Dispatcher::connect(&pulsar_url()).await.unwrap();
        let refused = dispatcher
            .subscribe(
                &topic,
                async |_: &Message| Ok::<_, Infallible>(()),
                SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(SubType::Exclusive)
                    .subscribe_timeout(Duration::from_secs(3)),
            )
            .await;
        match refused {
            Err(Error::SubscribeTimeout {
                topic: named,
                subscription: held,
                ..
            }) => {
                assert_eq!(named, topic);
                assert_eq!(held.as_deref(), Some(subscription.as_str()));
            }
            other => panic!("expected a subscribe timeout, got {other:?}"),
        }
        assert!(dispatcher.subscriptions().is_empty());
        dispatcher.close().await;
    });
}

#[test]
fn a_reply_topic_the_broker_refuses_fails_subscribe_and_leaves_no_consumer() {
    run_local(Duration::from_secs(60), async {
        let topic = unique_topic("refused");
        let subscription = unique_name("sub");
        let dispatcher = Dispatcher::connect(&pulsar_url()).await.unwrap();
        let refused = dispatcher
            .subscribe(
                &topic,
                async |_: &Message| Ok::<_, Infallible>(b"reply".to_vec()),
                SubscribeOptions::new()
                    .subscription(&subscription)
                    .reply_topic("no-such-tenant/no-such-namespace/replies")
                    .subscribe_timeout(Duration::from_secs(20)),
            )
            .await;
        assert!(
            matches!(
                &refused,
                Err(Error::Producer { topic, .. })
                    if topic == "persistent://no-such-tenant/no-such-namespace/replies"
            ),
            "{refused:?}"
        );
        assert!(dispatcher.subscriptions().is_empty());
        let stats = wait_for_stats(&topic, &subscription, Duration::from_secs(10), |s| {
            s.consumers == 0
        })
        .await;
        assert_eq!(stats.consumers, 0, "the consumer it created is closed");
        dispatcher.close().await;
    });
}

#[test]
fn close_within_returns_with_a_hung_handler_and_its_message_comes_back() {
    run_local(Duration::from_secs(60), async {
        let topic = unique_topic("hung");
        let subscription = unique_name("sub");
        let options = || {
            SubscribeOptions::new()
                .subscription(&subscription)
                .subscription_type(SubType::Shared)
        };
        let dispatcher = common::dispatcher().await;
        let started = Rc::new(std::cell::Cell::new(false));
        let flag = started.clone();
        dispatcher
            .subscribe(
                &topic,
                async move |_: &Message| {
                    flag.set(true);
                    std::future::pending::<()>().await;
                    Ok::<_, Infallible>(())
                },
                options(),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        let mut producer = client()
            .await
            .producer()
            .with_topic(&topic)
            .build()
            .await
            .unwrap();
        producer
            .send_non_blocking(b"stuck".to_vec())
            .await
            .unwrap()
            .await
            .unwrap();
        common::wait_until("the handler to start", Duration::from_secs(20), || {
            started.get()
        })
        .await;
        let cancelled = dispatcher.close_within(Duration::from_millis(200)).await;
        assert_eq!(cancelled, 1);
        assert!(matches!(
            run.await.unwrap(),
            Err(Error::HandlersCancelled { cancelled: 1 })
        ));
        // Nacked, not acked: another consumer gets it.
        let second = common::dispatcher().await;
        let redelivered = Rc::new(std::cell::Cell::new(false));
        let flag = redelivered.clone();
        second
            .subscribe(
                &topic,
                async move |message: &Message| {
                    flag.set(message.payload() == b"stuck");
                    Ok::<_, Infallible>(())
                },
                options(),
            )
            .await
            .unwrap();
        let run = start(&second);
        common::wait_until("the redelivery", Duration::from_secs(30), || {
            redelivered.get()
        })
        .await;
        close_and_join(&second, run).await;
    });
}

/// An operator terminates a topic (`pulsar-admin topics terminate`, as when
/// a stream is retired): its backlog is still handled, the end of the topic
/// ends its consumers' streams, which are subscribed again, and the
/// dispatcher goes on, healthy, with its other subscriptions; plain and
/// partitioned topics.
#[test]
fn a_terminated_topic_is_drained_and_the_dispatcher_goes_on() {
    run_local(Duration::from_secs(120), async {
        for kind in [TopicKind::Plain, TopicKind::Partitioned(3)] {
            let retired = fresh_topic("retired", kind);
            let live = fresh_topic("live", kind);
            let subscription = unique_name("sub");
            let dispatcher = common::dispatcher().await;
            let handled: Rc<RefCell<Vec<(String, usize)>>> = Rc::default();
            for topic in [&retired, &live] {
                let handled = handled.clone();
                let handler = async move |message: &Message| {
                    let topic = base_topic(message.topic()).to_owned();
                    handled.borrow_mut().push((topic, payload_number(message)));
                    Ok::<_, Infallible>(())
                };
                let options = SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(SubType::Shared);
                dispatcher.subscribe(topic, handler, options).await.unwrap();
            }
            let run = start(&dispatcher);
            let handled_on = |topic: &str| {
                let handled = handled.borrow();
                handled.iter().filter(|(on, _)| on == topic).count()
            };
            common::publish(&retired, keyed_messages(10, 3)).await;
            {
                let retired = retired.clone();
                tokio::task::spawn_blocking(move || terminate(&retired, kind))
                    .await
                    .unwrap();
            }
            wait_until(
                "the retired topic's messages",
                Duration::from_secs(20),
                || handled_on(&retired) == 10,
            )
            .await;
            common::publish(&live, keyed_messages(10, 3)).await;
            wait_until("the live topic's messages", Duration::from_secs(20), || {
                handled_on(&live) == 10
            })
            .await;
            // The end of the topic ends the consumers' streams, each a
            // receive error while it is subscribed again.
            wait_until(
                "the end of the retired topic",
                Duration::from_secs(20),
                || dispatcher.stats().total().receive_errors > 0,
            )
            .await;
            wait_until("a healthy dispatcher", Duration::from_secs(20), || {
                dispatcher.health().is_ready()
            })
            .await;
            assert!(!run.is_finished(), "{kind:?}: the dispatcher stopped");
            let drained = wait_for_empty_backlog(&retired, &subscription).await;
            assert_eq!(drained.msg_backlog, 0, "every message acked: {drained:?}");
            close_and_join(&dispatcher, run).await;
            assert_eq!(handled_on(&retired), 10, "{kind:?}: each handled once");
        }
    });
}

/// An operator terminates a topic while the dispatcher holds its messages:
/// one in a handler, one waiting in the subscription's slot, the rest in
/// the consumer's queue. The broker reports the end of the topic (which
/// ends the `pulsar` crate's consumer) only once the backlog is acked, so
/// every held message is handled once and acked through the consumer that
/// delivered it, no ack fails, and the backlog empties; plain and
/// partitioned topics, Exclusive and Shared.
#[test]
fn a_topic_terminated_while_its_messages_are_held_acks_each_once() {
    run_local(Duration::from_secs(180), async {
        for (kind, subscription_type) in [
            (TopicKind::Plain, SubType::Exclusive),
            (TopicKind::Plain, SubType::Shared),
            (TopicKind::Partitioned(3), SubType::Exclusive),
            (TopicKind::Partitioned(3), SubType::Shared),
        ] {
            let case = format!("{kind:?}, {subscription_type:?}");
            // The consumer's queue takes the whole backlog, so the broker
            // delivers it all and then reports the end of the topic.
            let held = HeldBacklog::start("terminated", kind, subscription_type).await;
            let HeldBacklog {
                topic,
                subscription,
                dispatcher,
                handled,
                ..
            } = &held;
            {
                let topic = topic.clone();
                tokio::task::spawn_blocking(move || terminate(&topic, kind))
                    .await
                    .unwrap();
            }
            // Time for the termination to reach the consumers.
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert_eq!(handled.borrow().len(), 1, "{case}: one handler at a time");
            held.release();
            let stats = wait_for_empty_backlog(topic, subscription).await;
            assert_eq!(stats.msg_backlog, 0, "{case}: every message acked");
            // Time for a message whose ack was lost to come back.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let acks_failed = dispatcher.stats().total().acks_failed;
            held.close_each_handled_once(&case).await;
            assert_eq!(acks_failed, 0, "{case}: no ack failed");
        }
    });
}

/// The broker closes a consumer (an unload) and refuses its subscribe
/// again (an operator now allows only another subscription type on the
/// topic) while the dispatcher holds the messages it delivered: one in a
/// handler, one in the slot, the rest in the consumer's queue. The `pulsar`
/// crate's consumer goes on handing out what it had queued, then an error,
/// but sends nothing more to the broker, so the acks of those messages are
/// lost. The dispatcher subscribes again until the topic takes its type
/// again; the broker then delivers those messages again, and each is
/// recognised as acked (`redelivered_after_ack`) and acked again instead of
/// being handled twice. Plain and partitioned topics, Exclusive and Shared.
#[test]
fn acks_lost_while_a_consumer_is_refused_are_recognised_when_it_is_back() {
    run_local(Duration::from_secs(240), async {
        let unload = async |topic: String, kind| {
            tokio::task::spawn_blocking(move || common::unload(&topic, kind))
                .await
                .unwrap();
            // Time for the refused subscribe to reach the crate's consumers.
            tokio::time::sleep(Duration::from_secs(2)).await;
        };
        for (case, totals) in HeldBacklog::through_a_refusal("refused", unload).await {
            assert!(
                totals.receive_errors > 0 && totals.redelivered_after_ack > 0,
                "{case}: the refusal reached the dispatcher and lost acks: {totals:?}"
            );
        }
    });
}

/// Terminates `topic` (every partition of a partitioned one) through the
/// admin API. Blocks; call it from `spawn_blocking`.
fn terminate(topic: &str, kind: TopicKind) {
    let name = topic.trim_start_matches("persistent://");
    let path = match kind {
        TopicKind::Plain => format!("/admin/v2/persistent/{name}/terminate"),
        TopicKind::Partitioned(_) => format!("/admin/v2/persistent/{name}/terminate/partitions"),
    };
    let (status, body) = admin_request("POST", &path, None).unwrap();
    assert!(
        (200..300).contains(&status),
        "POST {path}: HTTP {status}: {body}"
    );
}

/// An operator deletes a topic while it is consumed (`pulsar-admin topics
/// delete --force`) and creates it again: the broker closes the consumers,
/// which cannot subscribe again while the topic is gone (the broker creates
/// a plain topic again on a subscribe, but not the partitions of a deleted
/// partitioned one). Once it is back, the dispatcher is subscribed again,
/// healthy, and handles what is published to it; plain and partitioned
/// topics, every subscription type.
fn a_deleted_topic_is_subscribed_again_once_it_is_back(kind: TopicKind) {
    run_local(Duration::from_secs(180), async {
        for subscription_type in [
            SubType::Exclusive,
            SubType::Shared,
            SubType::Failover,
            SubType::KeyShared,
        ] {
            let topic = fresh_topic("deleted", kind);
            let subscription = unique_name("sub");
            let dispatcher = common::dispatcher().await;
            let handled: Rc<RefCell<Vec<usize>>> = Rc::default();
            let handler = {
                let handled = handled.clone();
                async move |message: &Message| {
                    handled.borrow_mut().push(payload_number(message));
                    Ok::<_, Infallible>(())
                }
            };
            let options = SubscribeOptions::new()
                .subscription(&subscription)
                .subscription_type(subscription_type);
            dispatcher
                .subscribe(&topic, handler, options)
                .await
                .unwrap();
            let run = start(&dispatcher);
            let case = format!("{kind:?}, {subscription_type:?}");
            common::publish(&topic, keyed_messages(5, 3)).await;
            wait_until(
                &format!("{case}: the first messages"),
                Duration::from_secs(20),
                || handled.borrow().len() == 5,
            )
            .await;
            {
                let topic = topic.clone();
                tokio::task::spawn_blocking(move || {
                    delete_topic(&topic, kind);
                    if let TopicKind::Partitioned(partitions) = kind {
                        create_partitioned_topic(&topic, partitions);
                    }
                })
                .await
                .unwrap();
            }
            // A subscription created again starts at the end of the topic
            // (the default initial position): what is published before the
            // consumers are back is not theirs to receive.
            let every_partition_subscribed = || {
                let (topic, subscription) = (topic.clone(), subscription.clone());
                async move {
                    tokio::task::spawn_blocking(move || {
                        consumers_per_partition(&topic, kind, &subscription)
                    })
                    .await
                    .unwrap()
                    .iter()
                    .all(|&consumers| consumers > 0)
                }
            };
            let begun = std::time::Instant::now();
            while !every_partition_subscribed().await {
                assert!(
                    begun.elapsed() < Duration::from_secs(30),
                    "{case}: not subscribed again after the topic came back"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            common::publish(
                &topic,
                keyed_messages(5, 3).map(|mut message| {
                    let number = 5 + String::from_utf8_lossy(&message.payload)
                        .parse::<usize>()
                        .unwrap();
                    message.payload = number.to_string().into_bytes();
                    message
                }),
            )
            .await;
            wait_until(
                &format!("{case}: the messages published after"),
                Duration::from_secs(20),
                || handled.borrow().len() == 10,
            )
            .await;
            wait_until(
                &format!("{case}: a healthy dispatcher"),
                Duration::from_secs(20),
                || dispatcher.health().is_ready(),
            )
            .await;
            let drained = wait_for_empty_backlog(&topic, &subscription).await;
            assert_eq!(drained.msg_backlog, 0, "every message acked: {drained:?}");
            close_and_join(&dispatcher, run).await;
            let mut numbers = handled.borrow().clone();
            numbers.sort_unstable();
            assert_eq!(
                numbers,
                (0..10).collect::<Vec<_>>(),
                "{case}: each handled once"
            );
        }
    });
}

on_plain_and_partitioned_topics!(a_deleted_topic_is_subscribed_again_once_it_is_back);
