//! Partitioned topics against a real Apache Pulsar broker, beyond the
//! plain/partitioned variants of the other suites: every subscription type,
//! short topic names, Key_Shared across two dispatchers, subscribing over
//! a backlog again and again without a hang, partitions added while the
//! dispatcher runs, one subscription across the partitions when the user
//! names none, and partitions unloaded (moved between brokers) while their
//! messages are being handled.

mod common;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use common::{
    add_partitions, close_and_join, create_partitioned_topic, fresh_topic, from_the_start,
    run_local, start, unique_name, wait_for_empty_backlog, wait_until, TopicKind,
};
use pulsar_dispatcher::{Dispatcher, Message, SubType, SubscribeOptions};
use tokio::sync::Notify;

const PARTITIONS: u32 = 3;

const EVERY_SUBSCRIPTION_TYPE: [SubType; 4] = [
    SubType::Exclusive,
    SubType::Failover,
    SubType::Shared,
    SubType::KeyShared,
];

#[test]
fn every_subscription_type_acks_on_a_partitioned_topic_named_by_its_short_name() {
    run_local(Duration::from_secs(120), async {
        for subscription_type in EVERY_SUBSCRIPTION_TYPE {
            let short_name = unique_name("short");
            create_partitioned_topic(&short_name, PARTITIONS);
            let subscription = unique_name("sub");
            common::publish(&short_name, common::keyed_messages(60, 7)).await;
            let dispatcher = common::dispatcher().await;
            let handled: Rc<RefCell<Vec<usize>>> = Rc::default();
            let record = handled.clone();
            dispatcher
                .subscribe(
                    &short_name,
                    async move |message: &Message| {
                        record.borrow_mut().push(common::payload_number(message));
                        Ok::<_, Infallible>(())
                    },
                    from_the_start(
                        SubscribeOptions::new()
                            .subscription(&subscription)
                            .subscription_type(subscription_type),
                    ),
                )
                .await
                .unwrap();
            let run = start(&dispatcher);
            wait_until("60 messages", Duration::from_secs(30), || {
                handled.borrow().len() >= 60
            })
            .await;
            let stats = wait_for_empty_backlog(&short_name, &subscription).await;
            let counted = dispatcher.stats().total();
            assert_eq!(
                (counted.acked, counted.acks_failed),
                (60, 0),
                "{subscription_type:?}: {counted:?}"
            );
            close_and_join(&dispatcher, run).await;
            assert_eq!(
                stats.msg_backlog, 0,
                "{subscription_type:?}: acks reached the broker"
            );
            let seen: BTreeSet<usize> = handled.borrow().iter().copied().collect();
            assert_eq!(seen, (0..60).collect(), "{subscription_type:?}");
            assert_eq!(
                handled.borrow().len(),
                60,
                "{subscription_type:?}: none twice"
            );
        }
    });
}

/// Partitions an operator adds while the dispatcher runs are subscribed at
/// the next partition refresh, on the same subscription and with the
/// default initial position: what is published to them afterwards is
/// handled and acknowledged like the rest, and the partitions subscribed
/// from the start keep working.
#[test]
fn partitions_added_while_running_are_consumed_and_acked() {
    run_local(Duration::from_secs(180), async {
        for subscription_type in EVERY_SUBSCRIPTION_TYPE {
            consume_partitions_added_while_running(subscription_type).await;
        }
    });
}

async fn consume_partitions_added_while_running(subscription_type: SubType) {
    let topic = fresh_topic("grows", TopicKind::Partitioned(2));
    let subscription = unique_name("sub");
    let dispatcher = common::dispatcher().await;
    let handled: Rc<RefCell<Vec<(String, usize)>>> = Rc::default();
    let record = handled.clone();
    dispatcher
        .subscribe(
            &topic,
            async move |message: &Message| {
                let number = common::payload_number(message);
                record
                    .borrow_mut()
                    .push((message.topic().to_owned(), number));
                Ok::<_, Infallible>(())
            },
            SubscribeOptions::new()
                .subscription(&subscription)
                .subscription_type(subscription_type)
                .partition_refresh_interval(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    let run = start(&dispatcher);
    add_partitions(&topic, 4);
    let partition = |index: u32| format!("{topic}-partition-{index}");
    let mut numbered = common::keyed_messages(30, 3);
    for index in [2, 3, 0] {
        common::publish(&partition(index), numbered.by_ref().take(10)).await;
    }
    wait_until("30 messages", Duration::from_secs(30), || {
        handled.borrow().len() >= 30
    })
    .await;
    for index in [0, 2, 3] {
        let stats = wait_for_empty_backlog(&partition(index), &subscription).await;
        assert_eq!(
            stats.msg_backlog, 0,
            "{subscription_type:?}: acks reached partition {index}"
        );
    }
    close_and_join(&dispatcher, run).await;
    let by_partition: BTreeMap<String, BTreeSet<usize>> =
        handled
            .borrow()
            .iter()
            .fold(BTreeMap::new(), |mut seen, (name, number)| {
                seen.entry(name.clone()).or_default().insert(*number);
                seen
            });
    let expected: BTreeMap<String, BTreeSet<usize>> = [
        (partition(2), (0..10).collect()),
        (partition(3), (10..20).collect()),
        (partition(0), (20..30).collect()),
    ]
    .into_iter()
    .collect();
    assert_eq!(by_partition, expected, "{subscription_type:?}");
    assert_eq!(
        handled.borrow().len(),
        30,
        "{subscription_type:?}: none twice"
    );
    assert_eq!(dispatcher.stats().total().acked, 30);
}

/// Two dispatchers on one Key_Shared subscription of a partitioned topic:
/// every message is handled once, each key by one dispatcher only, and the
/// messages of a key in the order they were published.
#[test]
fn key_shared_on_a_partitioned_topic_keeps_each_key_on_one_dispatcher_in_order() {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("key-shared", TopicKind::Partitioned(PARTITIONS));
        let subscription = unique_name("sub");
        let (messages, keys) = (300, 30);
        // (dispatcher, payload) in handling order.
        let handled: Rc<RefCell<Vec<(usize, usize)>>> = Rc::default();
        let mut dispatchers = Vec::new();
        let mut runs = Vec::new();
        for index in 0..2 {
            // Concurrency 1: handling order is receive order.
            let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(1)).await;
            let record = handled.clone();
            dispatcher
                .subscribe(
                    &topic,
                    async move |message: &Message| {
                        record
                            .borrow_mut()
                            .push((index, common::payload_number(message)));
                        Ok::<_, Infallible>(())
                    },
                    SubscribeOptions::new()
                        .subscription(&subscription)
                        .subscription_type(SubType::KeyShared),
                )
                .await
                .unwrap();
            runs.push(start(&dispatcher));
            dispatchers.push(dispatcher);
        }
        common::publish(&topic, common::keyed_messages(messages, keys)).await;
        wait_until("every message", Duration::from_secs(60), || {
            handled.borrow().len() >= messages
        })
        .await;
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        for dispatcher in &dispatchers {
            dispatcher.close().await;
        }
        for run in runs {
            run.await.unwrap().unwrap();
        }
        assert_eq!(stats.msg_backlog, 0);
        let handled = handled.borrow();
        let payloads: BTreeSet<usize> = handled.iter().map(|(_, n)| *n).collect();
        assert_eq!(payloads, (0..messages).collect());
        assert_eq!(handled.len(), messages, "none twice");
        let mut by_key: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        for &(dispatcher, n) in handled.iter() {
            by_key.entry(n % keys).or_default().push((dispatcher, n));
        }
        for (key, seen) in &by_key {
            let owners: BTreeSet<usize> = seen.iter().map(|(d, _)| *d).collect();
            assert_eq!(owners.len(), 1, "key-{key} went to {owners:?}");
            let order: Vec<usize> = seen.iter().map(|(_, n)| *n).collect();
            assert!(
                order.windows(2).all(|pair| pair[0] < pair[1]),
                "key-{key} out of order: {order:?}"
            );
        }
        let owners: BTreeSet<usize> = handled.iter().map(|(d, _)| *d).collect();
        assert_eq!(owners.len(), 2, "both dispatchers got keys");
    });
}

/// Subscribing with a receiver queue of 1 over a backlog used to hang when
/// the crate's partition consumers filled their channels before anything
/// read them; closing such a dispatcher without running it took 10 s.
/// Twenty rounds, alternately closed without running and run for a while;
/// nothing is lost and everything is acked in the end.
#[test]
fn subscribing_over_a_backlog_never_hangs_twenty_times_in_a_row() {
    run_local(Duration::from_secs(240), async {
        let topic = fresh_topic("backlog", TopicKind::Partitioned(PARTITIONS));
        let subscription = unique_name("sub");
        let total = 1000;
        common::publish(&topic, common::keyed_messages(total, 17)).await;
        let handled: Rc<RefCell<Vec<usize>>> = Rc::default();
        let options = || {
            from_the_start(
                SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(SubType::Shared),
            )
        };
        let handler = || {
            let record = handled.clone();
            async move |message: &Message| {
                record.borrow_mut().push(common::payload_number(message));
                Ok::<_, Infallible>(())
            }
        };
        for round in 0..20 {
            let dispatcher = common::dispatcher().await;
            tokio::time::timeout(
                Duration::from_secs(10),
                dispatcher.subscribe(&topic, handler(), options()),
            )
            .await
            .unwrap_or_else(|_| panic!("round {round}: subscribe hung"))
            .unwrap();
            if round % 2 == 0 {
                tokio::time::timeout(Duration::from_secs(10), dispatcher.close())
                    .await
                    .unwrap_or_else(|_| panic!("round {round}: close without run hung"));
                continue;
            }
            let run = start(&dispatcher);
            let before = handled.borrow().len();
            wait_until("a few messages", Duration::from_secs(20), || {
                let handled = handled.borrow();
                handled.len() >= before + 5
                    || handled.iter().collect::<BTreeSet<_>>().len() == total
            })
            .await;
            tokio::time::timeout(Duration::from_secs(10), dispatcher.close())
                .await
                .unwrap_or_else(|_| panic!("round {round}: close hung"));
            run.await.unwrap().unwrap();
        }
        // The rest, by one more dispatcher.
        let dispatcher = common::dispatcher().await;
        dispatcher
            .subscribe(&topic, handler(), options())
            .await
            .unwrap();
        let run = start(&dispatcher);
        wait_until("every message", Duration::from_secs(60), || {
            handled.borrow().iter().collect::<BTreeSet<_>>().len() >= total
        })
        .await;
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(stats.msg_backlog, 0);
        let seen: BTreeSet<usize> = handled.borrow().iter().copied().collect();
        assert_eq!(seen, (0..total).collect());
        assert_eq!(
            handled.borrow().len(),
            total,
            "a message acked by an earlier round came back"
        );
    });
}

/// Without a subscription name, the transport makes one up for the whole
/// subscribe: every partition joins that one subscription (the crate,
/// left to itself, makes up a new name for each partition's consumer).
/// The subscription holds the backlog of every partition and acks it all.
#[test]
fn an_unnamed_subscription_is_one_subscription_across_the_partitions() {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("unnamed", TopicKind::Partitioned(PARTITIONS));
        let dispatcher = common::dispatcher().await;
        let handled: Rc<RefCell<Vec<usize>>> = Rc::default();
        let record = handled.clone();
        dispatcher
            .subscribe(
                &topic,
                async move |message: &Message| {
                    record.borrow_mut().push(common::payload_number(message));
                    Ok::<_, Infallible>(())
                },
                SubscribeOptions::new(),
            )
            .await
            .unwrap();
        let per_partition = common::topic_stats(&topic)["partitions"].clone();
        let names: BTreeMap<String, BTreeSet<String>> = per_partition
            .as_object()
            .expect("per-partition stats")
            .iter()
            .map(|(partition, stats)| {
                let subscriptions = stats["subscriptions"].as_object().expect("subscriptions");
                (partition.clone(), subscriptions.keys().cloned().collect())
            })
            .collect();
        assert_eq!(names.len(), PARTITIONS as usize, "{names:?}");
        let all: BTreeSet<&String> = names.values().flatten().collect();
        assert_eq!(
            all.len(),
            1,
            "one subscription on every partition: {names:?}"
        );
        let subscription = all.into_iter().next().unwrap().clone();

        let run = start(&dispatcher);
        common::publish(&topic, common::keyed_messages(30, 7)).await;
        wait_until("30 messages", Duration::from_secs(30), || {
            handled.borrow().len() >= 30
        })
        .await;
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(stats.msg_backlog, 0, "acked on the one subscription");
        let seen: BTreeSet<usize> = handled.borrow().iter().copied().collect();
        assert_eq!(seen, (0..30).collect());
    });
}

/// A topic unload (the broker's load balancer moving a bundle, routine in
/// production) reconnects every partition's consumer, and the broker then
/// delivers again every message not yet acked, those being handled
/// included. On every subscription type the second copy of a message still
/// being handled is dropped: no handler runs twice, and never two at once
/// for one message (on Shared and Key_Shared both happened before: 3 and 4
/// messages of 200, Key_Shared running two handlers of one key at once).
#[test]
fn an_unload_while_messages_are_handled_runs_no_handler_twice() {
    for subscription_type in EVERY_SUBSCRIPTION_TYPE {
        run_local(
            Duration::from_secs(120),
            handle_through_an_unload(subscription_type),
        );
    }
}

async fn handle_through_an_unload(subscription_type: SubType) {
    const MESSAGES: usize = 400;
    let topic = fresh_topic("unloaded", TopicKind::Partitioned(PARTITIONS));
    let subscription = unique_name("unloaded-sub");
    common::publish(&topic, common::keyed_messages(MESSAGES, 7)).await;
    let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(8)).await;
    let handled: Rc<RefCell<BTreeMap<usize, usize>>> = Rc::default();
    let running: Rc<RefCell<BTreeSet<usize>>> = Rc::default();
    let at_once: Rc<RefCell<BTreeSet<usize>>> = Rc::default();
    let (counts, now, twice_at_once) = (handled.clone(), running.clone(), at_once.clone());
    // Closed around the unload, so that it lands while messages are in
    // flight: the handlers then running finish only once it is done.
    let gate_closed: Rc<Cell<bool>> = Rc::default();
    let gate_opened: Rc<Notify> = Rc::default();
    let (closed, opened) = (gate_closed.clone(), gate_opened.clone());
    dispatcher
        .subscribe(
            &topic,
            async move |message: &Message| {
                let n = common::payload_number(message);
                if !now.borrow_mut().insert(n) {
                    twice_at_once.borrow_mut().insert(n);
                }
                tokio::time::sleep(Duration::from_millis(20 + (n as u64 % 4) * 10)).await;
                while closed.get() {
                    opened.notified().await;
                }
                now.borrow_mut().remove(&n);
                *counts.borrow_mut().entry(n).or_default() += 1;
                Ok::<_, Infallible>(())
            },
            from_the_start(
                SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(subscription_type)
                    .receiver_queue_size(4),
            ),
        )
        .await
        .unwrap();
    let run = start(&dispatcher);
    wait_until("50 handled", Duration::from_secs(30), || {
        handled.borrow().len() >= 50
    })
    .await;
    gate_closed.set(true);
    let unloaded = topic.clone();
    tokio::task::spawn_blocking(move || {
        common::unload(&unloaded, TopicKind::Partitioned(PARTITIONS))
    })
    .await
    .unwrap();
    gate_closed.set(false);
    gate_opened.notify_waiters();
    wait_until("every message handled", Duration::from_secs(60), || {
        handled.borrow().len() >= MESSAGES
    })
    .await;
    let drained = wait_for_empty_backlog(&topic, &subscription).await;
    assert_eq!(drained.msg_backlog, 0, "every message acked: {drained:?}");
    close_and_join(&dispatcher, run).await;
    let totals = dispatcher.stats().total();
    assert!(
        totals.dropped_in_flight + totals.redelivered_after_ack > 0,
        "{subscription_type:?}: the unload delivered nothing again: {totals:?}"
    );
    let twice: Vec<(usize, usize)> = handled
        .borrow()
        .iter()
        .filter(|(_, count)| **count > 1)
        .map(|(n, count)| (*n, *count))
        .collect();
    assert!(
        at_once.borrow().is_empty() && twice.is_empty(),
        "{subscription_type:?}: handled twice {twice:?}, of which at once {:?}; {:?}",
        at_once.borrow(),
        dispatcher.stats().total()
    );
}
