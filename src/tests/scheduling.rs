//! Scheduling beyond the original, through the public API on the in-memory
//! transport: subscriptions added and removed while running, priorities
//! changed at run time, per-subscription limits, ordering modes, weighted
//! shares and reserved permits.

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use super::{
    dispatcher, gated, options, recorder, refused_for, run_local, settle_down, spawn_run, Gate, Log,
};
use crate::transport::{MemoryTransport, OutgoingMessage};
use crate::{
    priorities, Dispatcher, Error, Message, Ordering, SchedulingPolicy, SubscribeOptions,
    TopicFamily, Weights,
};

#[test]
fn subscriptions_come_and_go_while_the_others_keep_flowing() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        let log = Log::default();
        let first = dispatcher
            .subscribe("first", recorder(&log, "first"), options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.send("first", "1");
        transport.wait_acked("first", 1).await;

        let second = dispatcher
            .subscribe("second", recorder(&log, "second"), options(1))
            .await
            .unwrap();
        assert_eq!(transport.open_consumers(), 2);
        transport.send("second", "1");
        transport.wait_acked("second", 1).await;

        let stale = first.clone();
        dispatcher.unsubscribe(first.clone()).await.unwrap();
        assert_eq!(transport.open_consumers(), 1, "its consumer is closed");
        assert_eq!(dispatcher.subscriptions().len(), 1);
        assert!(first.info().is_none());
        assert!(matches!(
            first.set_priority(5),
            Err(Error::UnknownSubscription { .. })
        ));
        assert!(matches!(
            dispatcher.unsubscribe(first).await,
            Err(Error::UnknownSubscription { .. })
        ));
        transport.send("first", "2");
        transport.send("second", "2");
        transport.wait_acked("second", 2).await;
        settle_down().await;
        assert!(
            !log.borrow().contains(&"first:2".to_owned()),
            "an unsubscribed topic is not consumed: {:?}",
            log.borrow()
        );

        // Its place is reused by the next subscription.
        let third = dispatcher
            .subscribe("third", recorder(&log, "third"), options(1))
            .await
            .unwrap();
        assert_eq!(third.info().unwrap().priority, 1);
        assert!(second.info().is_some());
        // A handle to the subscription that had the place before does not
        // reach the one that has it now.
        assert!(stale.info().is_none());
        assert!(matches!(
            stale.set_priority(5),
            Err(Error::UnknownSubscription { .. })
        ));
        let topics: Vec<_> = dispatcher
            .subscriptions()
            .into_iter()
            .map(|info| info.topic)
            .collect();
        let made = [second.info().unwrap().topic, third.info().unwrap().topic];
        assert_eq!(topics, made, "listed in the order they were made");
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// Removing a subscription leaves the others' timers alone: a nack another
/// subscription holds back for its delay is still sent when it is due.
#[test]
fn a_removal_leaves_the_nacks_other_subscriptions_hold_due() {
    super::run_paused(async {
        let (dispatcher, transport) = dispatcher(2);
        let failed = transport.send("failing", "1");
        let held_a_minute = options(1).negative_ack_redelivery_delay(Duration::from_secs(60));
        dispatcher
            .subscribe(
                "failing",
                async |_: &Message| Err::<(), _>("always fails"),
                held_a_minute,
            )
            .await
            .unwrap();
        let other = dispatcher
            .subscribe("other", recorder(&Log::default(), "other"), options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        assert!(transport.nacked("failing").is_empty(), "held back");
        dispatcher.unsubscribe(other).await.unwrap();
        tokio::time::sleep(Duration::from_secs(61)).await;
        assert_eq!(transport.nacked("failing"), [failed]);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// Unsubscribing waits for the running handlers, and hands back at once
/// the message waiting in the slot: it has not started, and under strict
/// priority it could wait for every better backlog.
#[test]
fn unsubscribing_lets_running_handlers_finish_and_hands_back_the_waiting_message() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let gate = Gate::default();
        let ids: Vec<_> = (0..3)
            .map(|n| transport.send("jobs", format!("{n}")))
            .collect();
        let jobs = dispatcher
            .subscribe("jobs", gated(&gate), options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        // One message runs, one waits in the slot, one is left on the broker.
        assert_eq!(jobs.stats().unwrap().dispatched, 1);
        let removing = {
            let dispatcher = dispatcher.clone();
            tokio::task::spawn_local(async move { dispatcher.unsubscribe(jobs).await })
        };
        settle_down().await;
        assert!(!removing.is_finished(), "waits for its handler");
        gate.open();
        removing.await.unwrap().unwrap();
        assert_eq!(transport.acked("jobs"), ids[..1], "the running one");
        assert_eq!(transport.nacked("jobs"), ids[1..2], "the waiting one");
        assert_eq!(transport.open_consumers(), 0);
        assert_eq!(
            transport.backlog_len("jobs"),
            2,
            "the waiting one and the third are with the broker"
        );
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn a_priority_changed_at_run_time_reorders_the_work_that_follows() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let log = Log::default();
        for n in 0..3 {
            transport.send("a", format!("{n}"));
            transport.send("b", format!("{n}"));
        }
        let gate = Gate::default();
        let (a_log, a_gate) = (log.clone(), gate.clone());
        dispatcher
            .subscribe(
                "a",
                async move |message: &Message| {
                    a_gate.wait().await;
                    a_log
                        .borrow_mut()
                        .push(format!("a:{}", String::from_utf8_lossy(message.payload())));
                    Ok::<_, Infallible>(())
                },
                options(1),
            )
            .await
            .unwrap();
        let b = dispatcher
            .subscribe("b", recorder(&log, "b"), options(2))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        // a:0 runs; b now goes first.
        b.set_priority(0).unwrap();
        assert_eq!(b.info().unwrap().priority, 0);
        gate.open();
        transport.wait_acked("b", 3).await;
        transport.wait_acked("a", 3).await;
        assert_eq!(*log.borrow(), ["a:0", "b:0", "b:1", "b:2", "a:1", "a:2"]);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn max_in_flight_caps_one_subscription_without_holding_up_the_others() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(10);
        let gate = Gate::default();
        for n in 0..5 {
            transport.send("capped", format!("{n}"));
            transport.send("free", format!("{n}"));
        }
        dispatcher
            .subscribe("capped", gated(&gate), options(1).max_in_flight(2))
            .await
            .unwrap();
        dispatcher
            .subscribe("free", gated(&gate), options(2))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        let stats = dispatcher.stats();
        assert_eq!(stats.subscriptions[0].dispatched, 2, "capped at 2");
        assert_eq!(
            stats.subscriptions[1].dispatched, 5,
            "the rest of the limit"
        );
        gate.open();
        transport.wait_acked("capped", 5).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// Runs a subscription with `ordering`'s options (concurrency 10) over
/// `messages`, its handler yielding a few times, until every message is
/// acked. Returns when each started and ended (`start <payload>`, `end
/// <payload>`, in order) and the most handlers that ran at once.
async fn ordered_timeline(
    messages: Vec<OutgoingMessage>,
    ordering: SubscribeOptions,
) -> (Vec<String>, usize) {
    let (dispatcher, transport) = dispatcher(10);
    let count = messages.len();
    for message in messages {
        transport.send_message("orders", message);
    }
    let timeline: Rc<RefCell<Vec<String>>> = Rc::default();
    let running = Rc::new(Cell::new(0usize));
    let most = Rc::new(Cell::new(0usize));
    let (record, now, peak) = (timeline.clone(), running.clone(), most.clone());
    dispatcher
        .subscribe(
            "orders",
            async move |message: &Message| {
                let name = String::from_utf8_lossy(message.payload()).into_owned();
                now.set(now.get() + 1);
                peak.set(peak.get().max(now.get()));
                record.borrow_mut().push(format!("start {name}"));
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                record.borrow_mut().push(format!("end {name}"));
                now.set(now.get() - 1);
                Ok::<_, Infallible>(())
            },
            ordering,
        )
        .await
        .unwrap();
    let dispatcher = Rc::new(dispatcher);
    let run = spawn_run(&dispatcher);
    transport.wait_acked("orders", count).await;
    dispatcher.close().await;
    run.await.unwrap().unwrap();
    let timeline = timeline.take();
    (timeline, most.get())
}

/// Where `event` stands in `timeline`.
fn at(timeline: &[String], event: &str) -> usize {
    timeline
        .iter()
        .position(|e| e == event)
        .unwrap_or_else(|| panic!("no {event} in {timeline:?}"))
}

#[test]
fn key_ordering_serialises_a_key_and_runs_keys_side_by_side() {
    run_local(async {
        let messages = ["a", "a", "b", "a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(n, key)| OutgoingMessage::new(format!("{key}{n}")).with_partition_key(*key))
            .collect();
        let (timeline, most) =
            ordered_timeline(messages, options(1).ordering(Ordering::Key).key_buffer(4)).await;
        let at = |event| at(&timeline, event);
        assert!(at("end a0") < at("start a1") && at("end a1") < at("start a3"));
        assert!(at("end b2") < at("start b4"));
        assert!(most >= 2, "different keys ran side by side");
    });
}

/// The key is the ordering key when a message has one, as a Key_Shared
/// broker reads it, else the partition key: two messages of one account
/// (partition key) but of different orders (ordering keys) run side by
/// side; two of one order with different partition keys do not.
#[test]
fn the_ordering_key_goes_before_the_partition_key() {
    run_local(async {
        let messages = [
            ("p1", "account-1", "order-1"),
            ("p2", "account-1", "order-2"),
            ("o1", "account-2", "order-3"),
            ("o2", "account-3", "order-3"),
        ]
        .map(|(payload, partition_key, ordering_key)| {
            OutgoingMessage::new(payload)
                .with_partition_key(partition_key)
                .with_ordering_key(ordering_key)
        })
        .into();
        let (timeline, _) =
            ordered_timeline(messages, options(1).ordering(Ordering::Key).key_buffer(4)).await;
        let at = |event| at(&timeline, event);
        assert!(
            at("start p2") < at("end p1"),
            "one account, two orders: {timeline:?}"
        );
        assert!(at("end o1") < at("start o2"), "one order: {timeline:?}");
    });
}

/// Key `a`'s handlers wait for a gate; `b` and `c`, received after `a`'s
/// three messages, run meanwhile: from a backlog at subscribe (no new
/// arrival wakes the subscription; the pick's refill takes them) and when
/// they arrive in one go while `a0` runs (the woken subscription's refill
/// takes past the parked `a1` and `a2`).
#[test]
fn a_busy_key_does_not_hold_back_the_keys_received_after_it() {
    for backlog_at_subscribe in [true, false] {
        run_local(busy_key_with_others_behind(backlog_at_subscribe));
    }
}

async fn busy_key_with_others_behind(backlog_at_subscribe: bool) {
    let (dispatcher, transport) = dispatcher(10);
    let mut messages: Vec<_> = ["a", "a", "a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(n, key)| OutgoingMessage::new(format!("{key}{n}")).with_partition_key(*key))
        .collect();
    let later = if backlog_at_subscribe {
        Vec::new()
    } else {
        messages.split_off(1)
    };
    let mut sent: Vec<_> = messages
        .into_iter()
        .map(|message| transport.send_message("orders", message))
        .collect();
    let gate = Gate::default();
    let log = Log::default();
    let (wait, record) = (gate.clone(), log.clone());
    dispatcher
        .subscribe(
            "orders",
            async move |message: &Message| {
                if message.partition_key() == Some("a") {
                    wait.wait().await;
                }
                let name = String::from_utf8_lossy(message.payload()).into_owned();
                record.borrow_mut().push(name);
                Ok::<_, Infallible>(())
            },
            options(1).ordering(Ordering::Key).key_buffer(4),
        )
        .await
        .unwrap();
    let dispatcher = Rc::new(dispatcher);
    let run = spawn_run(&dispatcher);
    if !later.is_empty() {
        settle_down().await;
        assert_eq!(dispatcher.stats().in_flight, 1, "a0 runs");
        for message in later {
            sent.push(transport.send_message("orders", message));
        }
    }
    // A guard against a hang, not a timing goal.
    let others =
        tokio::time::timeout(Duration::from_secs(30), transport.wait_acked("orders", 2)).await;
    assert!(others.is_ok(), "b and c waited behind the busy key a");
    assert_eq!(transport.acked("orders"), sent[3..]);
    gate.open();
    transport.wait_acked("orders", 5).await;
    assert_eq!(*log.borrow(), ["b3", "c4", "a0", "a1", "a2"]);
    dispatcher.close().await;
    run.await.unwrap().unwrap();
}

#[test]
fn subscription_ordering_runs_one_at_a_time_in_order() {
    run_local(async {
        let messages = (0..4)
            .map(|n| OutgoingMessage::new(n.to_string()))
            .collect();
        let ordered = options(1).ordering(Ordering::Subscription);
        let (timeline, most) = ordered_timeline(messages, ordered).await;
        assert_eq!(most, 1, "one at a time: {timeline:?}");
        let expected: Vec<String> = (0..4)
            .flat_map(|n| [format!("start {n}"), format!("end {n}")])
            .collect();
        assert_eq!(timeline, expected);
    });
}

#[test]
fn ordering_options_are_checked_by_name() {
    run_local(async {
        let (dispatcher, _) = dispatcher(4);
        for (name, options) in [
            ("max_in_flight", SubscribeOptions::new().max_in_flight(0)),
            (
                "max_in_flight",
                SubscribeOptions::new()
                    .ordering(Ordering::Subscription)
                    .max_in_flight(3),
            ),
            ("key_buffer", SubscribeOptions::new().key_buffer(4)),
            (
                "key_buffer",
                SubscribeOptions::new()
                    .ordering(Ordering::Key)
                    .key_buffer(0),
            ),
        ] {
            let refused = dispatcher
                .subscribe("x", recorder(&Log::default(), "x"), options)
                .await;
            assert!(refused_for(&refused, name), "{name}: {refused:?}");
        }
        let one_at_a_time = SubscribeOptions::new()
            .ordering(Ordering::Subscription)
            .max_in_flight(1);
        assert!(
            one_at_a_time.resolve("x").is_ok(),
            "a limit it keeps anyway"
        );
        let refused = Dispatcher::builder()
            .concurrency(2)
            .reserve(1, 2)
            .reserve(5, 1)
            .build(MemoryTransport::new());
        assert!(refused_for(&refused, "reserve"));
    });
}

#[test]
fn weighted_scheduling_gives_a_busy_lower_level_its_share() {
    run_local(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder()
            .concurrency(1)
            .scheduling(SchedulingPolicy::Weighted(Weights::new().level(1, 3)))
            .build(transport.clone())
            .unwrap();
        for n in 0..12 {
            transport.send("high", format!("{n}"));
            transport.send("low", format!("{n}"));
        }
        let log = Log::default();
        dispatcher
            .subscribe("high", recorder(&log, "h"), options(1))
            .await
            .unwrap();
        dispatcher
            .subscribe("low", recorder(&log, "l"), options(2))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("high", 12).await;
        let first_16: Vec<char> = log
            .borrow()
            .iter()
            .take(16)
            .map(|entry| entry.chars().next().unwrap())
            .collect();
        let lows = first_16.iter().filter(|&&c| c == 'l').count();
        assert_eq!(lows, 4, "3 to 1 while both have work: {first_16:?}");
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn reserved_permits_wait_for_the_level_they_are_kept_for() {
    run_local(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder()
            .concurrency(3)
            .reserve(1, 1)
            .build(transport.clone())
            .unwrap();
        let gate = Gate::default();
        for n in 0..5 {
            transport.send("bulk", format!("{n}"));
        }
        dispatcher
            .subscribe("bulk", gated(&gate), options(9))
            .await
            .unwrap();
        let log = Log::default();
        dispatcher
            .subscribe("urgent", recorder(&log, "u"), options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        assert_eq!(dispatcher.stats().in_flight, 2, "one permit kept free");
        transport.send("urgent", "now");
        transport.wait_acked("urgent", 1).await;
        assert_eq!(*log.borrow(), ["u:now"], "ran while bulk work waited");
        gate.open();
        transport.wait_acked("bulk", 5).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

priorities! { enum Level { Live = 10, Batch = 20 } }

#[test]
fn a_topic_family_is_added_and_removed_as_a_unit_while_running() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        let log = Log::default();
        let family = dispatcher
            .subscribe_family(
                &TopicFamily::<Level>::new("orders"),
                recorder(&log, "o"),
                SubscribeOptions::new(),
            )
            .await
            .unwrap();
        let topics: Vec<&str> = family.members().iter().map(|m| m.topic()).collect();
        assert_eq!(
            topics,
            [
                "persistent://public/default/orders_live",
                "persistent://public/default/orders_batch"
            ]
        );
        transport.send("orders_batch", "b");
        transport.wait_acked("orders_batch", 1).await;
        dispatcher.unsubscribe_family(family).await.unwrap();
        assert!(dispatcher.subscriptions().is_empty());
        assert_eq!(transport.open_consumers(), 0);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// The aging policy reads the runtime's clock, as nack delays and
/// deadlines do: with tokio's clock paused (as tests of services pause it),
/// a message that waits still ages (before, it read the system's clock and
/// the worse message ran after all 100 better ones).
#[test]
fn aging_follows_the_runtimes_clock() {
    super::run_paused(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder()
            .concurrency(1)
            .scheduling(SchedulingPolicy::Aging(crate::Aging::new(10.0, 100)))
            .build(transport.clone())
            .unwrap();
        for n in 0..100 {
            transport.send("better", format!("{n}"));
        }
        transport.send("worse", "w");
        let order = Log::default();
        let log = order.clone();
        let slow = async move |message: &Message| {
            tokio::time::sleep(Duration::from_millis(100)).await;
            log.borrow_mut()
                .push(String::from_utf8_lossy(message.payload()).into_owned());
            Ok::<_, Infallible>(())
        };
        dispatcher
            .subscribe("better", slow.clone(), options(1))
            .await
            .unwrap();
        dispatcher
            .subscribe("worse", slow, options(11))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("worse", 1).await;
        let before = order.borrow().iter().position(|m| m == "w").unwrap();
        // 10 points a second: 1 s of waiting (10 handlers) makes up the
        // 10 priorities between them.
        assert!(
            (9..=13).contains(&before),
            "ran after {before}: {:?}",
            order.borrow()
        );
        dispatcher.close_within(Duration::ZERO).await;
        let _ = run.await.unwrap();
    });
}

/// Under strict priority a worse subscription's waiting message would run
/// only once every better backlog is gone: its unsubscribe does not wait
/// for that (before, it returned after all 100 better messages).
#[test]
fn unsubscribe_does_not_wait_for_better_backlogs() {
    super::run_paused(async {
        let (dispatcher, transport) = dispatcher(1);
        for n in 0..100 {
            transport.send("better", format!("{n}"));
        }
        let worse_id = transport.send("worse", "w");
        let handled = Rc::new(Cell::new(0));
        let count = handled.clone();
        let slow = async move |_: &Message| {
            tokio::time::sleep(Duration::from_millis(10)).await;
            count.set(count.get() + 1);
            Ok::<_, Infallible>(())
        };
        dispatcher
            .subscribe("better", slow.clone(), options(1))
            .await
            .unwrap();
        let worse = dispatcher
            .subscribe("worse", slow, options(9))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        dispatcher.unsubscribe(worse).await.unwrap();
        assert!(
            handled.get() < 5,
            "waited for {} better ones",
            handled.get()
        );
        assert_eq!(
            transport.nacked("worse"),
            [worse_id],
            "handed back unstarted"
        );
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}
