//! Scheduling beyond the original against a real Apache Pulsar broker:
//! subscriptions added and removed under load, per-key order across two
//! dispatchers on a Key_Shared subscription, per-subscription limits, and a
//! priority changed mid-run.

mod common;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    close_and_join, fresh_topic, pulsar_url, run_local, start, unique_name, wait_for_stats,
    wait_until, TopicKind,
};
use pulsar::consumer::InitialPosition;
use pulsar::ConsumerOptions;
use pulsar_dispatcher::per_core::PerCore;
use pulsar_dispatcher::{Dispatcher, Message, Ordering, SubType, SubscribeOptions};

fn shared(subscription: &str) -> SubscribeOptions {
    SubscribeOptions::new()
        .subscription(subscription)
        .subscription_type(SubType::Shared)
        .consumer_options(
            ConsumerOptions::default().with_initial_position(InitialPosition::Earliest),
        )
}

#[test]
fn a_subscription_added_and_removed_under_load_loses_nothing_and_others_flow() {
    run_local(Duration::from_secs(180), async {
        let steady = fresh_topic("steady", TopicKind::Partitioned(2));
        let visiting = fresh_topic("visiting", TopicKind::Plain);
        let (steady_sub, visiting_sub) = (unique_name("steady-sub"), unique_name("visiting-sub"));
        let total = 600;
        common::publish(&steady, common::keyed_messages(total, 7)).await;
        common::publish(&visiting, common::keyed_messages(total, 7)).await;
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(8)).await;
        let steady_seen: Rc<RefCell<Vec<usize>>> = Rc::default();
        let visiting_seen: Rc<RefCell<Vec<usize>>> = Rc::default();
        let slow_recorder = |seen: &Rc<RefCell<Vec<usize>>>| {
            let seen = seen.clone();
            async move |message: &Message| {
                tokio::time::sleep(Duration::from_millis(2)).await;
                seen.borrow_mut().push(common::payload_number(message));
                Ok::<_, Infallible>(())
            }
        };
        dispatcher
            .subscribe(&steady, slow_recorder(&steady_seen), shared(&steady_sub))
            .await
            .unwrap();
        let run = start(&dispatcher);
        wait_until("steady progress", Duration::from_secs(30), || {
            steady_seen.borrow().len() >= 50
        })
        .await;
        let visitor = dispatcher
            .subscribe(
                &visiting,
                slow_recorder(&visiting_seen),
                shared(&visiting_sub),
            )
            .await
            .unwrap();
        wait_until("the visitor's progress", Duration::from_secs(30), || {
            visiting_seen.borrow().len() >= 100
        })
        .await;
        let steady_before = steady_seen.borrow().len();
        dispatcher.unsubscribe(visitor).await.unwrap();
        let handled_by_visitor = visiting_seen.borrow().len();
        assert!(handled_by_visitor < total, "removed mid-way");
        wait_until("steady goes on", Duration::from_secs(60), || {
            steady_seen.borrow().len() >= total
        })
        .await;
        assert!(steady_seen.borrow().len() > steady_before);
        assert_eq!(
            visiting_seen.borrow().len(),
            handled_by_visitor,
            "nothing handled after unsubscribe returned"
        );
        let visiting_stats =
            wait_for_stats(&visiting, &visiting_sub, Duration::from_secs(10), |s| {
                s.consumers == 0
            })
            .await;
        assert_eq!(visiting_stats.consumers, 0, "its consumer is closed");
        assert_eq!(
            visiting_stats.msg_backlog as usize,
            total - handled_by_visitor,
            "every handled message acked, the rest left on the broker"
        );
        // The rest of the visiting topic, by a new subscription on the same
        // subscription name: nothing lost, nothing twice.
        dispatcher
            .subscribe(
                &visiting,
                slow_recorder(&visiting_seen),
                shared(&visiting_sub),
            )
            .await
            .unwrap();
        wait_until(
            "the visiting topic drained",
            Duration::from_secs(60),
            || visiting_seen.borrow().len() >= total,
        )
        .await;
        close_and_join(&dispatcher, run).await;
        for (name, seen) in [("steady", &steady_seen), ("visiting", &visiting_seen)] {
            let seen = seen.borrow();
            let distinct: BTreeSet<usize> = seen.iter().copied().collect();
            assert_eq!(distinct, (0..total).collect(), "{name}: every message");
            assert_eq!(seen.len(), total, "{name}: none twice");
        }
    });
}

/// Two dispatchers, each on its own thread and connection, on one
/// Key_Shared subscription of a partitioned topic, with key ordering and
/// several handlers at once: per key, messages start in publish order and
/// never overlap.
#[test]
fn key_ordering_holds_per_key_across_two_dispatchers_on_key_shared() {
    let topic = common::fresh_topic("keyed", TopicKind::Partitioned(2));
    let subscription = unique_name("keyed-sub");
    let (messages, keys) = (3000, 40);
    // Per key: (dispatcher, number, started) and what is running now.
    type Log = Arc<Mutex<(Vec<(usize, usize, usize)>, BTreeMap<usize, usize>)>>;
    let log: Log = Arc::default();
    let factory = {
        let (url, topic, subscription, log) = (
            pulsar_url(),
            topic.clone(),
            subscription.clone(),
            log.clone(),
        );
        move |core: usize| {
            let (url, topic, subscription, log) = (
                url.clone(),
                topic.clone(),
                subscription.clone(),
                log.clone(),
            );
            async move {
                let dispatcher = Dispatcher::builder().concurrency(8).connect(&url).await?;
                let handler = async move |message: &Message| {
                    let n = common::payload_number(message);
                    let key = n % keys;
                    {
                        let mut log = log.lock().unwrap();
                        let running = log.1.entry(key).or_default();
                        *running += 1;
                        let overlap = *running;
                        log.0.push((core, n, overlap));
                    }
                    tokio::time::sleep(Duration::from_micros(300)).await;
                    *log.lock().unwrap().1.get_mut(&key).unwrap() -= 1;
                    Ok::<_, Infallible>(())
                };
                dispatcher
                    .subscribe(
                        &topic,
                        handler,
                        SubscribeOptions::new()
                            .subscription(&subscription)
                            .subscription_type(SubType::KeyShared)
                            .receiver_queue_size(50)
                            .ordering(Ordering::Key),
                    )
                    .await?;
                Ok(dispatcher)
            }
        }
    };
    let group = PerCore::start(2, factory).expect("both dispatchers start");
    run_local(
        Duration::from_secs(60),
        common::publish(&topic, common::keyed_messages(messages, keys)),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while log.lock().unwrap().0.len() < messages && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    group.shutdown_handle().shutdown();
    for result in group.join() {
        result.expect("a clean shutdown");
    }
    let (started, _) = &*log.lock().unwrap();
    let numbers: BTreeSet<usize> = started.iter().map(|(_, n, _)| *n).collect();
    assert_eq!(numbers, (0..messages).collect(), "every message");
    assert_eq!(started.len(), messages, "none twice");
    let mut per_key: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for &(_, n, overlap) in started {
        assert_eq!(overlap, 1, "two messages of key-{} ran at once", n % keys);
        per_key.entry(n % keys).or_default().push(n);
    }
    for (key, order) in &per_key {
        assert!(
            order.windows(2).all(|pair| pair[0] < pair[1]),
            "key-{key} out of order: {order:?}"
        );
    }
    let cores: BTreeSet<usize> = started.iter().map(|(core, _, _)| *core).collect();
    assert_eq!(cores.len(), 2, "both dispatchers took part");
}

#[test]
fn max_in_flight_is_honoured_on_the_broker() {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("capped", TopicKind::Partitioned(2));
        let subscription = unique_name("sub");
        common::publish(&topic, common::keyed_messages(200, 10)).await;
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(20)).await;
        let running = Rc::new(Cell::new(0usize));
        let most = Rc::new(Cell::new(0usize));
        let handled = Rc::new(Cell::new(0usize));
        let (now, peak, count) = (running.clone(), most.clone(), handled.clone());
        dispatcher
            .subscribe(
                &topic,
                async move |_: &Message| {
                    now.set(now.get() + 1);
                    peak.set(peak.get().max(now.get()));
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    now.set(now.get() - 1);
                    count.set(count.get() + 1);
                    Ok::<_, Infallible>(())
                },
                shared(&subscription)
                    .receiver_queue_size(20)
                    .max_in_flight(3),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        wait_until("every message", Duration::from_secs(60), || {
            handled.get() >= 200
        })
        .await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(most.get(), 3, "reached, never exceeded");
    });
}

#[test]
fn a_priority_changed_mid_run_reorders_the_work_that_follows() {
    run_local(Duration::from_secs(90), async {
        let first = fresh_topic("first", TopicKind::Plain);
        let second = fresh_topic("second", TopicKind::Plain);
        let subscription = unique_name("sub");
        common::publish(&first, common::keyed_messages(30, 1)).await;
        common::publish(&second, common::keyed_messages(30, 1)).await;
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(1)).await;
        let order: Rc<RefCell<Vec<char>>> = Rc::default();
        let recorder = |tag: char| {
            let order = order.clone();
            async move |_: &Message| {
                order.borrow_mut().push(tag);
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok::<_, Infallible>(())
            }
        };
        // Prefetching, so that a subscription's next message is there when
        // its slot empties: the pick compares messages that wait.
        let options = |priority| {
            shared(&subscription)
                .priority(priority)
                .receiver_queue_size(40)
        };
        dispatcher
            .subscribe(&first, recorder('f'), options(1))
            .await
            .unwrap();
        let second_handle = dispatcher
            .subscribe(&second, recorder('s'), options(2))
            .await
            .unwrap();
        let run = start(&dispatcher);
        wait_until("a few of the first", Duration::from_secs(30), || {
            order.borrow().len() >= 5
        })
        .await;
        second_handle.set_priority(0).unwrap();
        let switched_at = order.borrow().len();
        wait_until("all of them", Duration::from_secs(60), || {
            order.borrow().len() >= 60
        })
        .await;
        close_and_join(&dispatcher, run).await;
        let order = order.borrow();
        assert!(
            order[..switched_at].iter().all(|&tag| tag == 'f'),
            "first went first: {order:?}"
        );
        // One message of the first may have been picked already; after it,
        // the second goes first until it runs out.
        let after: String = order[switched_at..].iter().collect();
        let seconds_end = after.rfind('s').unwrap();
        assert!(
            after[..=seconds_end].chars().filter(|&c| c == 'f').count() <= 1,
            "second went first once its priority changed: {after}"
        );
    });
}
