//! The dispatcher against a real Apache Pulsar broker: delivery, redelivery,
//! backpressure down to the broker, shutdown under load and batches, each
//! on a plain topic and on a partitioned one.

mod common;

on_plain_and_partitioned_topics!(
    every_message_of_several_prioritised_topics_is_processed_and_acked_once,
    a_failed_message_is_redelivered_after_the_negative_ack_delay,
    after_a_nack_an_idle_exclusive_or_failover_consumer_asks_for_one_more_rewind,
    a_nack_over_a_backlog_leaves_nothing_behind_on_exclusive_or_failover,
    a_rewind_does_not_run_messages_still_being_handled_twice,
    with_a_slow_handler_the_backlog_stays_on_the_broker,
    shutdown_under_load_loses_nothing,
    a_batch_is_acked_only_once_every_message_in_it_succeeded,
    a_nacked_batch_runs_again_only_its_failed_members,
    an_unload_runs_no_settled_member_of_a_pending_batch_again,
    the_ack_timeout_leaves_an_acked_batch_alone,
);

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use common::{
    close_and_join, fresh_topic, is_topic_or_partition, run_local, start, unique_name,
    wait_for_empty_backlog, wait_for_stats, wait_until, TopicKind,
};
use pulsar_dispatcher::{Dispatcher, Message, SubType, SubscribeOptions};
use tokio::sync::Notify;

async fn produce(topic: &str, payloads: impl IntoIterator<Item = String>) {
    let messages = payloads
        .into_iter()
        .map(|payload| pulsar::producer::Message {
            payload: payload.into_bytes(),
            ..Default::default()
        });
    common::publish(topic, messages).await;
}

fn shared(subscription: &str, priority: i64) -> SubscribeOptions {
    SubscribeOptions::new()
        .priority(priority)
        .subscription(subscription)
        .subscription_type(SubType::Shared)
        .negative_ack_redelivery_delay(Duration::from_millis(200))
}

type Seen = Rc<RefCell<Vec<(String, String)>>>;

fn recording(seen: &Seen) -> impl AsyncFn(&Message) -> Result<(), Infallible> {
    let seen = seen.clone();
    async move |message: &Message| {
        seen.borrow_mut().push((
            message.topic().to_owned(),
            String::from_utf8(message.payload().to_vec()).unwrap(),
        ));
        Ok(())
    }
}

/// Records each message handled, (id, payload), and holds the one whose
/// payload it is told until released, noting when it began to hold it.
#[derive(Default)]
struct Holding {
    handled: Seen,
    held_since: Rc<std::cell::Cell<Option<tokio::time::Instant>>>,
    released: Rc<std::cell::Cell<bool>>,
    release: Rc<Notify>,
}

impl Holding {
    fn handler(&self, held: &'static str) -> impl AsyncFn(&Message) -> Result<(), Infallible> {
        let (release, released) = (self.release.clone(), self.released.clone());
        let (record, held_since) = (self.handled.clone(), self.held_since.clone());
        async move |message: &Message| {
            let payload = String::from_utf8_lossy(message.payload()).into_owned();
            if payload == held && held_since.get().is_none() {
                held_since.set(Some(tokio::time::Instant::now()));
            }
            while payload == held && !released.get() {
                release.notified().await;
            }
            record
                .borrow_mut()
                .push((message.id().to_string(), payload));
            Ok(())
        }
    }

    fn release(&self) {
        self.released.set(true);
        self.release.notify_waiters();
    }
}

/// Publishes `payloads` to `topic` with the official Python client,
/// batched or not.
async fn produce_with_python(topic: &str, payloads: &[&str], batching: bool) {
    let messages: Vec<_> = payloads
        .iter()
        .map(|payload| serde_json::json!({ "payload": payload }))
        .collect();
    common::produce_with_python(topic, messages, batching).await;
}

fn every_message_of_several_prioritised_topics_is_processed_and_acked_once(kind: TopicKind) {
    run_local(Duration::from_secs(90), async {
        let subscription = unique_name("sub");
        let topics: Vec<String> = (0..3)
            .map(|i| fresh_topic(&format!("prio{i}"), kind))
            .collect();
        for topic in &topics {
            produce(topic, (0..20).map(|n| n.to_string())).await;
        }
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(4)).await;
        let seen = Seen::default();
        for (priority, topic) in topics.iter().enumerate() {
            let options = common::from_the_start(shared(&subscription, priority as i64 * 10));
            dispatcher
                .subscribe(topic, recording(&seen), options)
                .await
                .unwrap();
        }
        let run = start(&dispatcher);
        wait_until("60 messages", Duration::from_secs(30), || {
            seen.borrow().len() >= 60
        })
        .await;
        for topic in &topics {
            let stats = wait_for_empty_backlog(topic, &subscription).await;
            assert_eq!(stats.msg_backlog, 0, "{topic} left unacked messages");
        }
        close_and_join(&dispatcher, run).await;

        let mut per_topic: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for (topic, payload) in seen.borrow().iter() {
            let topic = topics
                .iter()
                .find(|t| is_topic_or_partition(topic, t, kind))
                .unwrap_or_else(|| panic!("{topic} is none of the subscribed topics"));
            per_topic
                .entry(topic)
                .or_default()
                .push(payload.parse().unwrap());
        }
        for topic in &topics {
            let mut payloads = per_topic.remove(topic.as_str()).unwrap_or_default();
            payloads.sort_unstable();
            assert_eq!(
                payloads,
                (0..20).collect::<Vec<_>>(),
                "{topic}: each exactly once"
            );
        }
    });
}

fn a_failed_message_is_redelivered_after_the_negative_ack_delay(kind: TopicKind) {
    run_local(Duration::from_secs(60), async {
        let topic = fresh_topic("redeliver", kind);
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let attempts: Rc<RefCell<Vec<(String, std::time::Instant)>>> = Rc::default();
        let record = attempts.clone();
        dispatcher
            .subscribe(
                &topic,
                async move |message: &Message| {
                    let payload = String::from_utf8(message.payload().to_vec()).unwrap();
                    let first = !record.borrow().iter().any(|(p, _)| *p == payload);
                    record
                        .borrow_mut()
                        .push((payload, std::time::Instant::now()));
                    if first {
                        Err("first attempt fails")
                    } else {
                        Ok(())
                    }
                },
                shared(&subscription, 1),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        produce(&topic, ["a".to_owned(), "b".to_owned()]).await;
        wait_until("two attempts each", Duration::from_secs(20), || {
            attempts.borrow().len() >= 4
        })
        .await;
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(stats.msg_backlog, 0);
        for payload in ["a", "b"] {
            let times: Vec<_> = attempts
                .borrow()
                .iter()
                .filter(|(p, _)| p == payload)
                .map(|(_, t)| *t)
                .collect();
            assert_eq!(times.len(), 2, "{payload}: failed once, then succeeded");
            assert!(
                times[1] - times[0] >= Duration::from_millis(200),
                "{payload} came back before the negative-ack delay"
            );
        }
    });
}

/// On Exclusive and Failover subscriptions a nack rewinds the whole
/// subscription, and the broker can lose part of a rewind that meets a read
/// in flight; so once idle after a nack the consumer asks for one more
/// rewind, once per nack. The other types redeliver the nacked message
/// alone and never ask.
fn after_a_nack_an_idle_exclusive_or_failover_consumer_asks_for_one_more_rewind(kind: TopicKind) {
    for subscription_type in [
        SubType::Exclusive,
        SubType::Failover,
        SubType::Shared,
        SubType::KeyShared,
    ] {
        repeated_rewinds(kind, subscription_type);
    }
}

fn repeated_rewinds(kind: TopicKind, subscription_type: SubType) {
    run_local(Duration::from_secs(60), async {
        let topic = fresh_topic("rewind", kind);
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let attempts: Rc<RefCell<Vec<String>>> = Rc::default();
        let record = attempts.clone();
        dispatcher
            .subscribe(
                &topic,
                async move |message: &Message| {
                    let payload = String::from_utf8(message.payload().to_vec()).unwrap();
                    let first = !record.borrow().contains(&payload);
                    record.borrow_mut().push(payload.clone());
                    if first && payload == "fails once" {
                        Err("first attempt fails")
                    } else {
                        Ok(())
                    }
                },
                shared(&subscription, 1).subscription_type(subscription_type),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        produce(&topic, ["fails once", "succeeds"].map(str::to_owned)).await;
        let repeated = || dispatcher.stats().total().rewinds_repeated;
        let asks = matches!(subscription_type, SubType::Exclusive | SubType::Failover);
        if asks {
            wait_until("one more rewind", Duration::from_secs(20), || {
                repeated() >= 1
            })
            .await;
        } else {
            wait_until("handled", Duration::from_secs(20), || {
                attempts.borrow().len() >= 3
            })
            .await;
        }
        // Idle for longer than the wait before a rewind is asked for again.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        assert_eq!(
            repeated(),
            u64::from(asks),
            "{subscription_type:?}: once per nack, only where a nack rewinds"
        );
        close_and_join(&dispatcher, run).await;
        assert_eq!(stats.msg_backlog, 0, "{subscription_type:?}");
        let handled: BTreeSet<String> = attempts.borrow().iter().cloned().collect();
        assert_eq!(
            handled,
            ["fails once", "succeeds"].map(str::to_owned).into(),
            "{subscription_type:?}"
        );
    });
}

/// The broker, rewinding for a nack while it reads a backlog, skips the
/// entry its read in flight had fetched; only another rewind brings that
/// entry back. Without the consumer's repeated rewind, one message of the
/// backlog would wait for the next nack or reconnection.
fn a_nack_over_a_backlog_leaves_nothing_behind_on_exclusive_or_failover(kind: TopicKind) {
    for subscription_type in [SubType::Exclusive, SubType::Failover] {
        nothing_left_behind(kind, subscription_type);
    }
}

fn nothing_left_behind(kind: TopicKind, subscription_type: SubType) {
    run_local(Duration::from_secs(60), async {
        let topic = fresh_topic("left-behind", kind);
        let subscription = unique_name("sub");
        let total = 40;
        produce(&topic, (0..total).map(|n| n.to_string())).await;
        let dispatcher = common::dispatcher().await;
        let attempts: Rc<RefCell<Vec<u32>>> = Rc::default();
        let record = attempts.clone();
        dispatcher
            .subscribe(
                &topic,
                async move |message: &Message| {
                    let n: u32 = String::from_utf8_lossy(message.payload()).parse().unwrap();
                    let first = !record.borrow().contains(&n);
                    record.borrow_mut().push(n);
                    if first && n == 10 {
                        Err("the eleventh message fails once")
                    } else {
                        Ok(())
                    }
                },
                common::from_the_start(
                    shared(&subscription, 1)
                        .subscription_type(subscription_type)
                        .negative_ack_redelivery_delay(Duration::ZERO),
                ),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        let handled = || attempts.borrow().iter().collect::<BTreeSet<_>>().len();
        wait_until("every message", Duration::from_secs(30), || {
            handled() >= total as usize
        })
        .await;
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(stats.msg_backlog, 0, "{subscription_type:?}");
    });
}

/// A nack on an Exclusive or Failover subscription makes the broker deliver
/// again every unacked message, those still being handled included: the
/// second copies are dropped, not handled again.
fn a_rewind_does_not_run_messages_still_being_handled_twice(kind: TopicKind) {
    for subscription_type in [SubType::Exclusive, SubType::Failover] {
        no_second_run_while_handled(kind, subscription_type);
    }
}

fn no_second_run_while_handled(kind: TopicKind, subscription_type: SubType) {
    run_local(Duration::from_secs(60), async {
        let topic = fresh_topic("in-flight", kind);
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(10)).await;
        // (payload, the topic or partition it came from), per attempt.
        let attempts: Rc<RefCell<Vec<(String, String)>>> = Rc::default();
        let (record, gate) = (attempts.clone(), Rc::new(Notify::new()));
        let open = Rc::new(std::cell::Cell::new(false));
        let (wait, is_open) = (gate.clone(), open.clone());
        dispatcher
            .subscribe(
                &topic,
                async move |message: &Message| {
                    let payload = String::from_utf8(message.payload().to_vec()).unwrap();
                    let first = !record.borrow().iter().any(|(p, _)| *p == payload);
                    record
                        .borrow_mut()
                        .push((payload.clone(), message.topic().to_owned()));
                    if payload == "fails once" {
                        return if first { Err("fails once") } else { Ok(()) };
                    }
                    while !is_open.get() {
                        wait.notified().await;
                    }
                    Ok(())
                },
                shared(&subscription, 1)
                    .subscription_type(subscription_type)
                    .receiver_queue_size(10)
                    .negative_ack_redelivery_delay(Duration::ZERO),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        // The one that fails comes last, so on its partition (the producer
        // takes turns among partitions) the others are running when it fails.
        let slow: Vec<String> = (0..5).map(|n| format!("slow-{n}")).collect();
        produce(&topic, slow.iter().cloned().chain(["fails once".into()])).await;
        let runs_of = |payload: &str| {
            attempts
                .borrow()
                .iter()
                .filter(|(p, _)| p == payload)
                .count()
        };
        wait_until("the failed one again", Duration::from_secs(20), || {
            runs_of("fails once") == 2
        })
        .await;
        // Its second copy came after those of the slow ones before it on its
        // partition, which the rewind delivered again too.
        let rewound = attempts
            .borrow()
            .iter()
            .find(|(p, _)| p == "fails once")
            .map(|(_, partition)| partition.clone())
            .unwrap();
        let running_there = attempts
            .borrow()
            .iter()
            .filter(|(p, partition)| p.starts_with("slow") && *partition == rewound)
            .count();
        assert!(
            running_there >= 1,
            "{subscription_type:?}: {:?}",
            attempts.borrow()
        );
        assert_eq!(
            dispatcher.stats().total().dropped_in_flight,
            running_there as u64,
            "{subscription_type:?}: each second copy of a running message dropped"
        );
        open.set(true);
        gate.notify_waiters();
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(stats.msg_backlog, 0, "{subscription_type:?}");
        for payload in &slow {
            assert_eq!(
                runs_of(payload),
                1,
                "{subscription_type:?}: {payload} ran once"
            );
        }
    });
}

fn with_a_slow_handler_the_backlog_stays_on_the_broker(kind: TopicKind) {
    run_local(Duration::from_secs(60), async {
        let topic = fresh_topic("backpressure", kind);
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(1)).await;
        let release = Rc::new(Notify::new());
        let released = Rc::new(std::cell::Cell::new(false));
        let handled = Rc::new(std::cell::Cell::new(0usize));
        let (gate, open, count) = (release.clone(), released.clone(), handled.clone());
        dispatcher
            .subscribe(
                &topic,
                async move |_: &Message| {
                    while !open.get() {
                        gate.notified().await;
                    }
                    count.set(count.get() + 1);
                    Ok::<_, Infallible>(())
                },
                shared(&subscription, 1),
            )
            .await
            .unwrap();
        // A control with room for everything, never read.
        let control = unique_name("control");
        let _control =
            common::shared_consumer(&common::client().await, &topic, &control, 100).await;
        let run = start(&dispatcher);
        produce(&topic, (0..50).map(|n| n.to_string())).await;
        // Once the control has taken the whole backlog, the broker has
        // pushed whatever each consumer asked for; then look at ours.
        let taken = wait_for_stats(&topic, &control, Duration::from_secs(10), |stats| {
            stats.msg_out_counter == 50
        })
        .await;
        assert_eq!(taken.msg_out_counter, 50, "the control took the backlog");
        // And time for a chain of one-message flow requests to show.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let stats = wait_for_stats(&topic, &subscription, Duration::ZERO, |_| true).await;
        assert_eq!(stats.msg_backlog, 50, "nothing acked yet");
        // Each partition has its own consumer, and so its own receiver queue.
        let consumers = u64::from(kind.partitions().max(1));
        assert!(
            stats.msg_out_counter <= 6 * consumers,
            "the broker dispatched {} of 50 messages to {consumers} consumer(s) whose handler is stuck",
            stats.msg_out_counter
        );
        released.set(true);
        release.notify_waiters();
        wait_until("all handled", Duration::from_secs(30), || {
            handled.get() >= 50
        })
        .await;
        close_and_join(&dispatcher, run).await;
    });
}

fn shutdown_under_load_loses_nothing(kind: TopicKind) {
    for subscription_type in [SubType::Shared, SubType::Exclusive] {
        shutdown_under_load(kind, subscription_type);
    }
}

fn shutdown_under_load(kind: TopicKind, subscription_type: SubType) {
    run_local(Duration::from_secs(120), async {
        let topic = fresh_topic("shutdown", kind);
        let subscription = unique_name("sub");
        let total = 200;
        produce(&topic, (0..total).map(|n| n.to_string())).await;
        let processed: Rc<RefCell<Vec<u32>>> = Rc::default();
        let options = || {
            common::from_the_start(
                shared(&subscription, 1)
                    .subscription_type(subscription_type)
                    .receiver_queue_size(20),
            )
        };
        let slow_recorder = || {
            let processed = processed.clone();
            async move |message: &Message| {
                tokio::time::sleep(Duration::from_millis(5)).await;
                let n = String::from_utf8_lossy(message.payload()).parse().unwrap();
                processed.borrow_mut().push(n);
                Ok::<_, Infallible>(())
            }
        };

        let first = common::dispatcher_with(Dispatcher::builder().concurrency(8)).await;
        first
            .subscribe(&topic, slow_recorder(), options())
            .await
            .unwrap();
        let run = start(&first);
        wait_until("some progress", Duration::from_secs(30), || {
            processed.borrow().len() >= 40
        })
        .await;
        close_and_join(&first, run).await;
        let by_first = processed.borrow().len();
        assert!(
            by_first < total as usize,
            "the first dispatcher was stopped mid-way"
        );

        let second = common::dispatcher().await;
        second
            .subscribe(&topic, slow_recorder(), options())
            .await
            .unwrap();
        let run = start(&second);
        wait_until("the rest", Duration::from_secs(60), || {
            processed.borrow().iter().collect::<BTreeSet<_>>().len() >= total as usize
        })
        .await;
        let stats = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&second, run).await;

        let all: BTreeSet<u32> = processed.borrow().iter().copied().collect();
        assert_eq!(
            all,
            (0..total).collect(),
            "{subscription_type:?}: every message was processed"
        );
        assert_eq!(stats.msg_backlog, 0, "{subscription_type:?}");
        assert_eq!(
            processed.borrow().len(),
            total as usize,
            "{subscription_type:?}: a message acked before shutdown came back: {:?}",
            processed.borrow()
        );
    });
}

/// Pulsar acknowledges a batch as one entry: acking any of its messages
/// would ack them all. Messages of a batch whose batch-mate is still being
/// handled must stay unacknowledged on the broker.
fn a_batch_is_acked_only_once_every_message_in_it_succeeded(kind: TopicKind) {
    for subscription_type in [SubType::Shared, SubType::Exclusive] {
        batch_acked_once_all_succeeded(kind, subscription_type);
    }
}

fn batch_acked_once_all_succeeded(kind: TopicKind, subscription_type: SubType) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("batch", kind);
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let holding = Holding::default();
        let handled = holding.handled.clone();
        dispatcher
            .subscribe(
                &topic,
                holding.handler("slow"),
                shared(&subscription, 1)
                    .subscription_type(subscription_type)
                    .receiver_queue_size(10),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        produce_with_python(&topic, &["a", "b", "slow", "c", "d"], true).await;
        wait_until("the fast four", Duration::from_secs(20), || {
            handled.borrow().len() >= 4
        })
        .await;
        let batch_ids: BTreeSet<String> = handled
            .borrow()
            .iter()
            .map(|(id, _)| id.rsplit_once(':').unwrap().0.to_owned())
            .collect();
        assert_eq!(
            batch_ids.len(),
            1,
            "the producer sent one batch: {handled:?}"
        );
        let waiting = wait_for_stats(&topic, &subscription, Duration::from_secs(1), |s| {
            s.msg_backlog == 0
        })
        .await;
        assert_eq!(
            waiting.msg_backlog, 1,
            "{subscription_type:?}: the batch was acked while one of its messages was still being handled"
        );
        holding.release();
        let done = wait_for_empty_backlog(&topic, &subscription).await;
        assert_eq!(
            done.msg_backlog, 0,
            "{subscription_type:?}: acked once the whole batch succeeded"
        );
        close_and_join(&dispatcher, run).await;
        assert_eq!(handled.borrow().len(), 5);
    });
}

/// A batch with a failed member is nacked whole, and the broker delivers
/// it whole again (on Exclusive by rewinding the subscription): the members
/// that succeeded are not handled a second time, only the failed one is.
fn a_nacked_batch_runs_again_only_its_failed_members(kind: TopicKind) {
    for subscription_type in [SubType::Shared, SubType::Exclusive] {
        nacked_batch_runs_only_failed_members(kind, subscription_type);
    }
}

fn nacked_batch_runs_only_failed_members(kind: TopicKind, subscription_type: SubType) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("nacked-batch", kind);
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let attempts: Rc<RefCell<BTreeMap<String, u32>>> = Rc::default();
        let handler = {
            let attempts = attempts.clone();
            async move |message: &Message| {
                let payload = String::from_utf8_lossy(message.payload()).into_owned();
                let attempt = {
                    let mut attempts = attempts.borrow_mut();
                    let attempt = attempts.entry(payload.clone()).or_default();
                    *attempt += 1;
                    *attempt
                };
                if payload == "flaky" && attempt == 1 {
                    return Err(std::io::Error::other("fails the first time"));
                }
                Ok(())
            }
        };
        let options = shared(&subscription, 1)
            .subscription_type(subscription_type)
            .receiver_queue_size(10);
        dispatcher
            .subscribe(&topic, handler, options)
            .await
            .unwrap();
        let run = start(&dispatcher);
        produce_with_python(&topic, &["a", "b", "flaky", "c", "d"], true).await;
        wait_until(
            "the flaky member's second run",
            Duration::from_secs(30),
            || attempts.borrow().get("flaky") == Some(&2),
        )
        .await;
        let done = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(
            done.msg_backlog, 0,
            "{subscription_type:?}: the batch is acked"
        );
        let total = dispatcher.stats().total();
        assert!(
            total.redelivered_after_success >= 4,
            "{subscription_type:?}: the four that succeeded came back and were counted: {total:?}"
        );
        let expected: BTreeMap<String, u32> =
            [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("flaky", 2)]
                .into_iter()
                .map(|(payload, runs)| (payload.to_owned(), runs))
                .collect();
        assert_eq!(
            *attempts.borrow(),
            expected,
            "{subscription_type:?}: only the failed member runs again"
        );
    });
}

/// An unload (or any reconnection) delivers again every message not yet
/// acknowledged, and a batch is acknowledged only once all its members
/// are settled: the members already handled while a batch-mate still runs
/// come back, and are dropped as second copies, like the one still running.
fn an_unload_runs_no_settled_member_of_a_pending_batch_again(kind: TopicKind) {
    for subscription_type in [SubType::Shared, SubType::Exclusive] {
        no_settled_member_runs_again(kind, subscription_type);
    }
}

fn no_settled_member_runs_again(kind: TopicKind, subscription_type: SubType) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("pending-batch", kind);
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let holding = Holding::default();
        let handled = holding.handled.clone();
        let options = shared(&subscription, 1)
            .subscription_type(subscription_type)
            .receiver_queue_size(10);
        dispatcher
            .subscribe(&topic, holding.handler("slow"), options)
            .await
            .unwrap();
        let run = start(&dispatcher);
        produce_with_python(&topic, &["a", "b", "slow", "c"], true).await;
        wait_until("the three fast ones", Duration::from_secs(20), || {
            handled.borrow().len() >= 3
        })
        .await;
        let unloaded = topic.clone();
        tokio::task::spawn_blocking(move || common::unload(&unloaded, kind))
            .await
            .unwrap();
        // The whole batch comes back: the running member's copy and the
        // three settled members' copies are all dropped (or, if a settled
        // member's copy is handled, the assertion below says which).
        wait_until("the batch's second copies", Duration::from_secs(30), || {
            dispatcher.stats().total().dropped_in_flight >= 4 || handled.borrow().len() > 3
        })
        .await;
        holding.release();
        let done = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(
            done.msg_backlog, 0,
            "{subscription_type:?}: the batch is acked"
        );
        let mut payloads: Vec<String> = handled.borrow().iter().map(|(_, p)| p.clone()).collect();
        payloads.sort();
        assert_eq!(
            payloads,
            ["a", "b", "c", "slow"],
            "{subscription_type:?}: each member handled once"
        );
    });
}

/// With the crate's ack timeout on (`unacked_message_resend_delay`), the
/// crate asks the broker to redeliver every message it handed out and saw
/// no ack for within the delay; on an Exclusive subscription that request
/// rewinds the subscription, delivering again whatever is unacked. Acking
/// a batch must therefore clear every member the crate handed out, or,
/// one delay after a batch was handled and acked, the crate rewinds the
/// subscription under the message then being handled. Timeline (the delay
/// is 8 s, the crate checks every 0.5 s): the batch is handled at 0 s, a
/// lone message is published at 4 s and must be held before 8 s; it is
/// held until 10 s, before its own delay ends (12 s at the earliest); a
/// stale batch member would fire between 8 and 8.5 s, while it is held.
/// The margins (4 s to publish, 1.5 s after the stale member's check, 2 s
/// before the held message's own) leave room for a loaded machine.
fn the_ack_timeout_leaves_an_acked_batch_alone(kind: TopicKind) {
    const DELAY: Duration = Duration::from_secs(8);
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("ack-timeout", kind);
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let holding = Holding::default();
        let handled = holding.handled.clone();
        let options = shared(&subscription, 1)
            .subscription_type(SubType::Exclusive)
            .unacked_message_resend_delay(DELAY);
        dispatcher
            .subscribe(&topic, holding.handler("held"), options)
            .await
            .unwrap();
        let run = start(&dispatcher);
        produce_with_python(&topic, &["a", "b", "c", "d"], true).await;
        wait_until("the batch", Duration::from_secs(20), || {
            handled.borrow().len() >= 4
        })
        .await;
        let batch_handled = tokio::time::Instant::now();
        tokio::time::sleep_until(batch_handled + DELAY / 2).await;
        // To the batch's own partition, the one its stale member rewinds.
        let batch_partition: i32 = {
            let handled = handled.borrow();
            let id = &handled[0].0;
            id.split(':').nth(2).unwrap().parse().unwrap()
        };
        let held_on = match kind {
            TopicKind::Plain => topic.clone(),
            TopicKind::Partitioned(_) => format!("{topic}-partition-{batch_partition}"),
        };
        let held = pulsar::producer::Message {
            payload: b"held".to_vec(),
            ..Default::default()
        };
        common::publish(&held_on, [held]).await;
        tokio::time::sleep_until(batch_handled + DELAY + Duration::from_secs(2)).await;
        // Held before a stale batch member would fire, or the test shows
        // nothing.
        let held_since = holding.held_since.get().expect("the held message arrived");
        assert!(
            held_since < batch_handled + DELAY,
            "held only {:?} after the batch",
            held_since - batch_handled
        );
        holding.release();
        let done = wait_for_empty_backlog(&topic, &subscription).await;
        close_and_join(&dispatcher, run).await;
        assert_eq!(done.msg_backlog, 0);
        let payloads: Vec<String> = handled.borrow().iter().map(|(_, p)| p.clone()).collect();
        assert_eq!(payloads.len(), 5, "each handled once: {payloads:?}");
        let stats = dispatcher.stats().total();
        assert_eq!(
            stats.dropped_in_flight, 0,
            "no rewind delivered the held message again: {stats:?}"
        );
    });
}

/// A non-persistent topic gives every message of a partition the id `0:0`
/// (its broker stores nothing): no message may be taken for a redelivery or
/// a second copy because of that, on any subscription type, plain or
/// partitioned, batched or not.
#[test]
fn every_message_of_a_non_persistent_topic_is_handled() {
    run_local(Duration::from_secs(240), async {
        let mut failures = Vec::new();
        for subscription_type in [
            SubType::Shared,
            SubType::KeyShared,
            SubType::Exclusive,
            SubType::Failover,
        ] {
            for partitions in [0, 3] {
                let name = unique_name("non-persistent");
                let topic = format!("non-persistent://public/default/{name}");
                let kind = match partitions {
                    0 => TopicKind::Plain,
                    partitions => {
                        common::create_partitioned_topic(&topic, partitions);
                        TopicKind::Partitioned(partitions)
                    }
                };
                let dispatcher = common::dispatcher().await;
                let seen = Seen::default();
                let subscription = unique_name("sub");
                let options = SubscribeOptions::new()
                    .subscription(&subscription)
                    .subscription_type(subscription_type)
                    // The broker drops what a non-persistent consumer has
                    // no room for: room for all of them.
                    .receiver_queue_size(100);
                dispatcher
                    .subscribe(&topic, recording(&seen), options)
                    .await
                    .unwrap();
                let run = start(&dispatcher);
                // Non-persistent messages go only to consumers already
                // there, with room: the broker must list a consumer with
                // permits on every partition.
                wait_until(
                    "the consumers, with permits",
                    Duration::from_secs(10),
                    || {
                        dispatcher.health().is_ready()
                            && common::consumers_by_partition(&topic, kind, &subscription)
                                .iter()
                                .all(|consumers| {
                                    !consumers.is_empty()
                                        && consumers
                                            .iter()
                                            .all(|c| c["availablePermits"].as_i64() > Some(0))
                                })
                    },
                )
                .await;
                let messages = || common::keyed_messages(50, 7);
                common::publish(&topic, messages().take(25)).await;
                common::publish_batched(&topic, 5, messages().skip(25)).await;
                let begun = std::time::Instant::now();
                while seen.borrow().len() < 50 && begun.elapsed() < Duration::from_secs(10) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let total = dispatcher.stats().total();
                close_and_join(&dispatcher, run).await;
                let handled: BTreeSet<String> = seen
                    .borrow()
                    .iter()
                    .map(|(_, payload)| payload.clone())
                    .collect();
                if handled.len() != 50 {
                    failures.push(format!(
                        "{subscription_type:?}, {partitions} partitions: {} of 50 handled \
                         (taken for acked redeliveries {}, for second copies {})",
                        handled.len(),
                        total.redelivered_after_ack,
                        total.dropped_in_flight
                    ));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    });
}
