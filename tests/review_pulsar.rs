//! Review probes against a real Apache Pulsar broker: a Failover hand-over
//! at a graceful close, the stall check that keeps a hand-over from
//! stranding a backlog, priorities changed while messages are held, topic
//! names that overlap, an unsubscribe next to another dispatcher, and a
//! shutdown deadline with handlers that block the thread.

mod common;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::rc::Rc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use common::{
    close_and_join, fresh_topic, from_the_start, run_local, start, unique_name,
    wait_for_empty_backlog, wait_until, TopicKind,
};
use pulsar_dispatcher::{
    Dispatcher, Error, Message, SubType, SubscribeOptions, SubscriptionHandle,
};

type Log = Rc<RefCell<Vec<(char, usize)>>>;

/// A handler that records (tag, payload number) when it starts, then
/// sleeps `pause`.
fn recording(
    log: &Log,
    tag: char,
    pause: Duration,
) -> impl AsyncFn(&Message) -> Result<(), Infallible> {
    let log = log.clone();
    async move |message: &Message| {
        log.borrow_mut()
            .push((tag, common::payload_number(message)));
        tokio::time::sleep(pause).await;
        Ok(())
    }
}

/// Two dispatchers, tagged 'a' and 'b' in `log`, each subscribed to
/// `topic` with `options()` and a handler that pauses `pause`; returns
/// them, and the first one's handle.
async fn two_recording_dispatchers(
    topic: &str,
    options: impl Fn() -> SubscribeOptions,
    log: &Log,
    pause: Duration,
) -> (Rc<Dispatcher>, Rc<Dispatcher>, SubscriptionHandle) {
    let first = common::dispatcher_with(Dispatcher::builder().concurrency(4)).await;
    let second = common::dispatcher_with(Dispatcher::builder().concurrency(4)).await;
    let first_handle = first
        .subscribe(topic, recording(log, 'a', pause), options())
        .await
        .unwrap();
    second
        .subscribe(topic, recording(log, 'b', pause), options())
        .await
        .unwrap();
    (first, second, first_handle)
}

/// The messages (by payload number) handled more than once, with the tags
/// of the dispatchers that handled them.
fn handled_twice(log: &Log) -> Vec<(usize, Vec<char>)> {
    let mut runs: BTreeMap<usize, Vec<char>> = BTreeMap::new();
    for (tag, n) in log.borrow().iter() {
        runs.entry(*n).or_default().push(*tag);
    }
    runs.into_iter()
        .filter(|(_, tags)| tags.len() > 1)
        .collect()
}

/// How many handlers the dispatcher tagged `tag` started.
fn handled_by(log: &Log, tag: char) -> usize {
    log.borrow().iter().filter(|(by, _)| *by == tag).count()
}

/// Two dispatchers on one Failover subscription; the active one is closed
/// gracefully mid-backlog: the other handles the rest, nothing twice.
#[test]
fn a_graceful_close_hands_a_failover_backlog_over_without_duplicates() {
    failover_hand_over(TopicKind::Plain)
}

/// The same on a partitioned topic. The broker's rewind when it makes the
/// remaining consumer active can meet a read it has in flight for the one
/// closing; the partition's cursor then waits for new entries while its
/// backlog stays undelivered (no nack is involved). The stall check of
/// `transport::rewind` finds such a backlog standing still and asks for it
/// again; without the check this failed in most runs.
#[test]
fn a_graceful_close_hands_a_partitioned_failover_backlog_over() {
    failover_hand_over(TopicKind::Partitioned(3))
}

/// Waits up to 30 s until every one of `total` numbered messages has been
/// handled (a stalled backlog moves again within about two stall checks,
/// 10 s); otherwise fails naming those missing and, per partition, where
/// the broker's cursor stands.
async fn wait_for_every_message(log: &Log, total: usize, topic: &str, kind: TopicKind) {
    let begun = Instant::now();
    loop {
        let mut seen: Vec<usize> = log.borrow().iter().map(|(_, n)| *n).collect();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() >= total {
            return;
        }
        if begun.elapsed() > Duration::from_secs(30) {
            let missing: Vec<usize> = (0..total)
                .filter(|n| seen.binary_search(n).is_err())
                .collect();
            let names: Vec<String> = match kind {
                TopicKind::Plain => vec![topic.to_owned()],
                TopicKind::Partitioned(n) => (0..n)
                    .map(|index| format!("{topic}-partition-{index}"))
                    .collect(),
            };
            let cursors: Vec<String> = names
                .iter()
                .map(|name| {
                    let path = format!(
                        "/admin/v2/persistent/{}/internalStats",
                        name.trim_start_matches("persistent://")
                    );
                    let (_, body) = common::http_get(&path).unwrap();
                    let stats: serde_json::Value = serde_json::from_str(&body).unwrap();
                    format!("{name}: {}", stats["cursors"])
                })
                .collect();
            panic!("never handled: {missing:?}; cursors: {cursors:#?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn failover_hand_over(kind: TopicKind) {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("failover", kind);
        let subscription = unique_name("sub");
        let total = 120;
        let options = || {
            from_the_start(
                SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(SubType::Failover)
                    .receiver_queue_size(10),
            )
        };
        let log: Log = Rc::default();
        // Both subscribed before anything is published, so that no
        // consumer joining later moves a partition mid-backlog.
        let (first, second, _) =
            two_recording_dispatchers(&topic, options, &log, Duration::from_millis(30)).await;
        common::publish(&topic, common::keyed_messages(total, 10)).await;
        let run_first = start(&first);
        let run_second = start(&second);
        wait_until("some of the backlog", Duration::from_secs(30), || {
            handled_by(&log, 'a') >= 10 || handled_by(&log, 'b') >= 10
        })
        .await;
        // Close whichever has handled more: the active one.
        let a_count = handled_by(&log, 'a');
        let b_count = log.borrow().len() - a_count;
        let (closing, closing_run, staying, staying_run) = if a_count >= b_count {
            (&first, run_first, &second, run_second)
        } else {
            (&second, run_second, &first, run_first)
        };
        close_and_join(closing, closing_run).await;
        wait_for_every_message(&log, total, &topic, kind).await;
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(staying, staying_run).await;
        let twice = handled_twice(&log);
        assert!(
            twice.is_empty(),
            "handled twice after a graceful close: {twice:?}"
        );
        assert_eq!(stats.msg_backlog, 0, "backlog left: {stats:?}");
    });
}

/// The stall check on a Failover subscription of a plain topic. Two
/// dispatchers (concurrency 1) hold every message they get in a handler
/// that waits until released; the one the broker makes active holds its
/// first message there and the next in its slot, so the backlog stands
/// still. The standby dispatcher, idle, reads the same backlog twice and
/// asks for a rewind, which the broker ignores (it is not active; nothing
/// reaches it), while the active one, which holds unsettled messages, asks
/// nothing. Once the handlers are released and the backlog drains, readings
/// differ and then find it empty: no rewind more on either side.
#[test]
fn a_failover_backlog_standing_still_is_asked_for_again_by_an_idle_consumer_only() {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("stall", TopicKind::Plain);
        let subscription = unique_name("sub");
        let total = 60;
        let options = || {
            from_the_start(
                SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(SubType::Failover)
                    // Longer than the broker's wait (1 s) before the
                    // first delivery to a new active consumer.
                    .stall_check(Some(Duration::from_millis(1500))),
            )
        };
        common::publish(&topic, common::keyed_messages(total, 10)).await;
        let log: Log = Rc::default();
        let release = Rc::new(Notify::new());
        let released = Rc::new(Cell::new(false));
        let held_until_released = |tag: char| {
            let (log, release, released) = (log.clone(), release.clone(), released.clone());
            async move |message: &Message| {
                log.borrow_mut()
                    .push((tag, common::payload_number(message)));
                if !released.get() {
                    release.notified().await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<_, Infallible>(())
            }
        };
        let mut dispatchers = Vec::new();
        for tag in ['a', 'b'] {
            let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(1)).await;
            dispatcher
                .subscribe(&topic, held_until_released(tag), options())
                .await
                .unwrap();
            let run = start(&dispatcher);
            dispatchers.push((tag, dispatcher, run));
        }
        wait_until("a first message", Duration::from_secs(30), || {
            !log.borrow().is_empty()
        })
        .await;
        let active_tag = log.borrow()[0].0;
        let [(first_tag, first, first_run), (_, second, second_run)] =
            <[_; 2]>::try_from(dispatchers).ok().unwrap();
        let (active, standby) = if first_tag == active_tag {
            (&first, &second)
        } else {
            (&second, &first)
        };
        let stalls = |dispatcher: &Dispatcher| dispatcher.stats().total().stalls_rewound;
        wait_until(
            "the standby to find the backlog stalled",
            Duration::from_secs(30),
            || stalls(standby) >= 2,
        )
        .await;
        assert_eq!(stalls(active), 0, "it holds unsettled messages");
        assert_eq!(
            log.borrow().len(),
            1,
            "the broker ignored the standby's requests: {:?}",
            log.borrow()
        );
        released.set(true);
        release.notify_waiters();
        let at_release = stalls(standby);
        wait_until("every message", Duration::from_secs(30), || {
            log.borrow().len() >= total
        })
        .await;
        tokio::time::sleep(Duration::from_secs(4)).await;
        // The standby may read the same backlog once more just after the
        // release; from then on it reads a backlog that moves (for about
        // 6 s, some 4 readings), then an empty one.
        assert!(
            stalls(standby) <= at_release + 1,
            "{} rewinds since the release",
            stalls(standby) - at_release
        );
        assert_eq!(stalls(active), 0);
        assert!(
            log.borrow().iter().all(|(tag, _)| *tag == active_tag),
            "{:?}",
            log.borrow()
        );
        assert!(handled_twice(&log).is_empty(), "{:?}", handled_twice(&log));
        close_and_join(&first, first_run).await;
        close_and_join(&second, second_run).await;
    });
}

/// With strict priority and one permit, a priority changed while the
/// subscription holds a message (and while one of its handlers runs) decides
/// the very next pick, on partitioned topics.
#[test]
fn a_priority_changed_while_messages_are_held_decides_the_next_pick_on_partitions() {
    run_local(Duration::from_secs(90), async {
        let kind = TopicKind::Partitioned(3);
        let (x_topic, y_topic) = (fresh_topic("x", kind), fresh_topic("y", kind));
        let subscription = unique_name("sub");
        common::publish(&x_topic, common::keyed_messages(40, 5)).await;
        common::publish(&y_topic, common::keyed_messages(40, 5)).await;
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(1)).await;
        let order: Rc<RefCell<Vec<char>>> = Rc::default();
        let y_handle = Rc::new(RefCell::new(None));
        let marks: Rc<RefCell<Vec<usize>>> = Rc::default();
        let x_handler = {
            let (order, y_handle, marks) = (order.clone(), y_handle.clone(), marks.clone());
            async move |_: &Message| {
                order.borrow_mut().push('x');
                let xs = order.borrow().iter().filter(|&&c| c == 'x').count();
                tokio::time::sleep(Duration::from_millis(20)).await;
                if xs == 5 {
                    // Y holds a message: it goes next.
                    let handle: &Option<SubscriptionHandle> = &y_handle.borrow();
                    handle.as_ref().unwrap().set_priority(0).unwrap();
                    marks.borrow_mut().push(order.borrow().len());
                }
                Ok::<_, Infallible>(())
            }
        };
        let y_handler = {
            let (order, y_handle, marks) = (order.clone(), y_handle.clone(), marks.clone());
            async move |_: &Message| {
                order.borrow_mut().push('y');
                let ys = order.borrow().iter().filter(|&&c| c == 'y').count();
                tokio::time::sleep(Duration::from_millis(20)).await;
                if ys == 3 {
                    // Its own handler runs: back behind X, whose held
                    // message goes next.
                    let handle: &Option<SubscriptionHandle> = &y_handle.borrow();
                    handle.as_ref().unwrap().set_priority(50).unwrap();
                    marks.borrow_mut().push(order.borrow().len());
                }
                Ok::<_, Infallible>(())
            }
        };
        let options = |priority| {
            from_the_start(
                SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(SubType::Shared)
                    .priority(priority),
            )
        };
        dispatcher
            .subscribe(&x_topic, x_handler, options(10))
            .await
            .unwrap();
        *y_handle.borrow_mut() = Some(
            dispatcher
                .subscribe(&y_topic, y_handler, options(20))
                .await
                .unwrap(),
        );
        let run = start(&dispatcher);
        wait_until("both changes", Duration::from_secs(30), || {
            marks.borrow().len() >= 2 && order.borrow().len() > marks.borrow()[1]
        })
        .await;
        close_and_join(&dispatcher, run).await;
        let order: String = order.borrow().iter().collect();
        let marks = marks.borrow();
        assert_eq!(&order[..5], "xxxxx", "{order}");
        assert_eq!(
            order.as_bytes()[marks[0]],
            b'y',
            "Y held a message when it became the best: {order}"
        );
        assert_eq!(
            order.as_bytes()[marks[1]],
            b'x',
            "X held a message when Y fell behind it: {order}"
        );
    });
}

/// A partition of a partitioned topic consumed with a subscription name,
/// and the partitioned topic of a partition consumed with one, are refused
/// with that name like the topic itself however it is written: a second
/// consumer of the partition would wait out the subscribe timeout on
/// Exclusive, and take turns with the first at another priority on Shared.
#[test]
fn a_partition_and_its_partitioned_topic_count_as_one_topic_for_already_subscribed() {
    run_local(Duration::from_secs(60), async {
        let (whole, parted) = (
            fresh_topic("whole", TopicKind::Partitioned(2)),
            fresh_topic("parted", TopicKind::Partitioned(2)),
        );
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let options = |subscription_type| {
            SubscribeOptions::new()
                .subscription(&subscription)
                .subscription_type(subscription_type)
                .subscribe_timeout(Duration::from_secs(5))
        };
        let nothing = async |_: &Message| Ok::<_, Infallible>(());
        dispatcher
            .subscribe(&whole, nothing, options(SubType::Shared))
            .await
            .unwrap();
        dispatcher
            .subscribe(
                &format!("{parted}-partition-0"),
                nothing,
                options(SubType::Exclusive),
            )
            .await
            .unwrap();
        let overlapping = [
            (
                whole.trim_start_matches("persistent://").to_owned(),
                SubType::Shared,
            ),
            (format!("{whole}-partition-1"), SubType::Shared),
            (parted.clone(), SubType::Exclusive),
        ];
        for (topic, subscription_type) in overlapping {
            let again = dispatcher
                .subscribe(&topic, nothing, options(subscription_type))
                .await;
            assert!(
                matches!(again, Err(Error::AlreadySubscribed { .. })),
                "{topic}: {again:?}"
            );
        }
        // Another partition is another topic.
        dispatcher
            .subscribe(
                &format!("{parted}-partition-1"),
                nothing,
                options(SubType::Exclusive),
            )
            .await
            .unwrap();
        dispatcher.close().await;
    });
}

/// Unsubscribing one of two dispatchers sharing a Shared subscription of a
/// partitioned topic, under load: the other handles the rest, nothing is
/// lost and the backlog empties.
#[test]
fn an_unsubscribe_next_to_another_shared_consumer_loses_nothing() {
    unsubscribe_next_to_another(SubType::Shared)
}

/// The same on Failover, where the unsubscribe makes the broker move the
/// partitions to the other dispatcher, as in
/// `a_graceful_close_hands_a_partitioned_failover_backlog_over` (without
/// the stall check this failed in some runs).
#[test]
fn an_unsubscribe_next_to_another_failover_consumer_loses_nothing() {
    unsubscribe_next_to_another(SubType::Failover)
}

fn unsubscribe_next_to_another(subscription_type: SubType) {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("shared", TopicKind::Partitioned(3));
        let subscription = unique_name("sub");
        let total = 300;
        let options = || {
            from_the_start(
                SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(subscription_type)
                    .receiver_queue_size(5),
            )
        };
        common::publish(&topic, common::keyed_messages(total, 10)).await;
        let log: Log = Rc::default();
        let (first, second, leaving) =
            two_recording_dispatchers(&topic, options, &log, Duration::from_millis(10)).await;
        let run_first = start(&first);
        let run_second = start(&second);
        wait_until("some of the backlog", Duration::from_secs(30), || {
            handled_by(&log, 'a') >= 30 || handled_by(&log, 'b') >= 30
        })
        .await;
        first.unsubscribe(leaving).await.unwrap();
        let handled_by_a = handled_by(&log, 'a');
        wait_for_every_message(&log, total, &topic, TopicKind::Partitioned(3)).await;
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&first, run_first).await;
        close_and_join(&second, run_second).await;
        assert_eq!(
            handled_by(&log, 'a'),
            handled_by_a,
            "nothing ran on the unsubscribed one after it returned"
        );
        let twice = handled_twice(&log);
        assert!(twice.is_empty(), "handled twice: {twice:?}");
        assert_eq!(stats.msg_backlog, 0, "backlog left: {stats:?}");
    });
}

/// `close_within(d)` with handlers that block the thread for 200 ms at a
/// time, then await for 30 s: the close cancels them at its deadline
/// rather than wait for them to end.
#[test]
fn close_within_cancels_handlers_that_block_the_thread() {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("blocking", TopicKind::Partitioned(3));
        let subscription = unique_name("sub");
        common::publish(&topic, common::keyed_messages(200, 10)).await;
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(4)).await;
        let started = Rc::new(Cell::new(0usize));
        let counter = started.clone();
        dispatcher
            .subscribe(
                &topic,
                async move |_: &Message| {
                    counter.set(counter.get() + 1);
                    std::thread::sleep(Duration::from_millis(200));
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    std::thread::sleep(Duration::from_millis(200));
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    Ok::<_, Infallible>(())
                },
                from_the_start(
                    SubscribeOptions::new()
                        .subscription(&subscription)
                        .subscription_type(SubType::Shared)
                        .receiver_queue_size(10),
                ),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        wait_until("handlers to start", Duration::from_secs(30), || {
            started.get() >= 4
        })
        .await;
        let limit = Duration::from_secs(1);
        let begun = Instant::now();
        let cancelled = dispatcher.close_within(limit).await;
        let took = begun.elapsed();
        let result = run.await.unwrap();
        assert!(
            matches!(result, Err(Error::HandlersCancelled { cancelled: n }) if n == cancelled)
                && cancelled >= 1,
            "cancelled {cancelled}: {result:?}"
        );
        // A close that waited for the handlers would take their 30 s; the
        // rest of the margin is for a loaded machine, not a timing goal
        // (the chaos suite measures how close to d the close returns).
        assert!(
            took < limit + Duration::from_secs(10),
            "close_within({limit:?}) took {took:?}"
        );
    });
}
