//! Producer batches meeting the other features on a real broker: retries,
//! replies and a dead letter policy's dead letters of batch members, and
//! key ordering on Key_Shared subscriptions inside a batch of several keys.

mod common;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use common::{
    close_and_join, fresh_topic, run_local, start, unique_name, unique_topic,
    wait_for_empty_backlog, wait_until, TopicKind,
};
use pulsar_dispatcher::{Dispatcher, ErrorClass, HandlerError, Message, SubType, SubscribeOptions};

/// Publishes `(payload, partition key)` pairs with the official Python
/// client, batched.
async fn produce_batched(topic: &str, messages: &[(&str, &str)]) {
    let messages: Vec<_> = messages
        .iter()
        .map(|(payload, key)| serde_json::json!({ "payload": payload, "partition_key": key }))
        .collect();
    common::produce_with_python(topic, messages, true).await;
}

#[derive(Debug, thiserror::Error)]
#[error("busy, try later")]
struct Busy;

/// One handling: the topic it came from, its id, payload and properties.
#[derive(Clone, Debug)]
struct Handled {
    topic: String,
    id: String,
    payload: String,
    properties: BTreeMap<String, String>,
}

type Log = Rc<RefCell<Vec<Handled>>>;

fn record(log: &Log, message: &Message) -> String {
    let payload = String::from_utf8_lossy(message.payload()).into_owned();
    log.borrow_mut().push(Handled {
        topic: message.topic().to_owned(),
        id: message.id().to_string(),
        payload: payload.clone(),
        properties: message
            .properties()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    });
    payload
}

/// The options every batch test starts from: `subscription` of
/// `subscription_type`, room for a whole batch, and nacks redelivered
/// quickly.
fn batch_options(subscription: &str, subscription_type: SubType) -> SubscribeOptions {
    SubscribeOptions::new()
        .subscription(subscription)
        .subscription_type(subscription_type)
        .receiver_queue_size(10)
        .negative_ack_redelivery_delay(Duration::from_millis(200))
}

/// Subscribes `subscription` (Shared) to `topic` with a handler that only
/// records what arrives into `log`: a reader of dead letters or replies.
async fn record_into(dispatcher: &Dispatcher, topic: &str, subscription: &str, log: &Log) {
    let log = log.clone();
    let recorder = async move |message: &Message| {
        record(&log, message);
        Ok::<(), std::convert::Infallible>(())
    };
    let options = SubscribeOptions::new()
        .subscription(subscription)
        .subscription_type(SubType::Shared);
    dispatcher
        .subscribe(topic, recorder, options)
        .await
        .unwrap();
}

fn runs_of(log: &Log, payload: &str, on: impl Fn(&str) -> bool) -> usize {
    log.borrow()
        .iter()
        .filter(|handled| handled.payload == payload && on(&handled.topic))
        .count()
}

/// A batch with one member retried, one nacked and the rest succeeding:
/// the batch is nacked for the failed member and comes back whole; the
/// retried member is not retried again, so exactly one retry copy is
/// published, carrying the member's own origin.
fn one_retry_copy_for_a_batch_with_a_retried_and_a_nacked_member(kind: TopicKind) {
    for subscription_type in [SubType::Shared, SubType::KeyShared, SubType::Exclusive] {
        retried_and_nacked(kind, subscription_type);
    }
}

fn retried_and_nacked(kind: TopicKind, subscription_type: SubType) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("batch-retry", kind);
        let retry_topic = unique_topic("batch-retry-r");
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let log = Log::default();
        let handler = {
            let log = log.clone();
            let retry_topic = retry_topic.clone();
            async move |message: &Message| {
                let on_retry_topic = message.topic() == retry_topic;
                let payload = record(&log, message);
                let nacked_before = runs_of(&log, "nack", |_| true) > 1;
                match payload.as_str() {
                    "retry" if !on_retry_topic => Err(Box::new(Busy) as HandlerError),
                    "nack" if !nacked_before => Err("fails the first time".into()),
                    _ => Ok(()),
                }
            }
        };
        let options = |priority| {
            SubscribeOptions::new()
                .priority(priority)
                .subscription(&subscription)
                .subscription_type(SubType::Shared)
                .receiver_queue_size(10)
                .negative_ack_redelivery_delay(Duration::from_millis(300))
                .retry_errors(ErrorClass::of::<Busy>())
                .retry_topic(&retry_topic)
                .retry_backoff(|_| Duration::from_millis(200))
                .max_retries(3)
        };
        let handler = Rc::new(handler);
        let main = {
            let handler = handler.clone();
            async move |message: &Message| handler(message).await
        };
        dispatcher
            .subscribe(
                &topic,
                main,
                options(1).subscription_type(subscription_type),
            )
            .await
            .unwrap();
        dispatcher
            .subscribe(
                &retry_topic,
                async move |message: &Message| handler(message).await,
                options(2),
            )
            .await
            .unwrap();
        let run = start(&dispatcher);
        produce_batched(
            &topic,
            &[("a", "k"), ("retry", "k"), ("nack", "k"), ("b", "k")],
        )
        .await;
        let on_retry = |name: &str| name == retry_topic;
        wait_until(
            "the retry and the nack's second run",
            Duration::from_secs(30),
            || runs_of(&log, "retry", on_retry) >= 1 && runs_of(&log, "nack", |_| true) >= 2,
        )
        .await;
        let done = wait_for_empty_backlog(&topic, &subscription).await;
        let retried = wait_for_empty_backlog(&retry_topic, &subscription).await;
        // Time for a second retry copy to arrive, if one was published.
        tokio::time::sleep(Duration::from_secs(2)).await;
        close_and_join(&dispatcher, run).await;
        let what = format!("{subscription_type:?}, {kind:?}: {:#?}", log.borrow());
        assert_eq!(done.msg_backlog, 0, "{what}: the batch is acked");
        assert_eq!(retried.msg_backlog, 0, "{what}: the retry is acked");
        let on_main = |name: &str| name != retry_topic;
        assert_eq!(runs_of(&log, "a", on_main), 1, "{what}");
        assert_eq!(runs_of(&log, "b", on_main), 1, "{what}");
        assert_eq!(runs_of(&log, "nack", on_main), 2, "{what}");
        assert_eq!(runs_of(&log, "retry", on_main), 1, "{what}");
        assert_eq!(
            runs_of(&log, "retry", on_retry),
            1,
            "{what}: one retry copy"
        );
        let log = log.borrow();
        assert_one_batch(&log, |h| on_main(&h.topic), 4, &what);
        let original = log
            .iter()
            .find(|h| h.payload == "retry" && on_main(&h.topic))
            .unwrap();
        let copy = log
            .iter()
            .find(|h| h.payload == "retry" && on_retry(&h.topic))
            .unwrap();
        assert_eq!(
            copy.properties.get("REAL_TOPIC"),
            Some(&original.topic),
            "{what}"
        );
        assert_eq!(
            copy.properties.get("ORIGIN_MESSAGE_ID"),
            Some(&original.id),
            "{what}"
        );
        assert_eq!(
            copy.properties.get("RECONSUMETIMES").map(String::as_str),
            Some("1"),
            "{what}"
        );
    });
}

on_plain_and_partitioned_topics!(one_retry_copy_for_a_batch_with_a_retried_and_a_nacked_member);

/// Asserts that the first `count` handlings `which` selects came from one
/// producer batch: one entry, each with a batch index.
fn assert_one_batch(log: &[Handled], which: impl Fn(&Handled) -> bool, count: usize, what: &str) {
    let firsts: Vec<&Handled> = log.iter().filter(|h| which(h)).take(count).collect();
    let entries: std::collections::BTreeSet<&str> = firsts
        .iter()
        .map(|h| h.id.rsplit_once(':').unwrap().0)
        .collect();
    assert_eq!(entries.len(), 1, "{what}: the producer sent one batch");
    assert!(
        firsts.iter().all(|h| h.id.matches(':').count() == 3),
        "{what}: members carry batch indexes"
    );
}

/// With a `dead_letter_policy`, a message that keeps failing is
/// dead-lettered once the broker has redelivered it `max_redeliver_count`
/// times. A batch with one such member is redelivered whole each time; its
/// members that succeeded are settled on arrival and must not end in the
/// dead letter topic with it.
fn a_dead_letter_policy_dead_letters_only_the_failing_member_of_a_batch(kind: TopicKind) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("batch-dlp", kind);
        let dlq = unique_topic("batch-dlp-dlq");
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let log = Log::default();
        let dead = Log::default();
        let handler = {
            let log = log.clone();
            async move |message: &Message| match record(&log, message).as_str() {
                "bad" => Err("always fails"),
                _ => Ok(()),
            }
        };
        let options = batch_options(&subscription, SubType::Shared).dead_letter_policy(
            pulsar_dispatcher::DeadLetterPolicy {
                max_redeliver_count: 2,
                dead_letter_topic: dlq.clone(),
            },
        );
        dispatcher
            .subscribe(&topic, handler, options)
            .await
            .unwrap();
        record_into(&dispatcher, &dlq, &subscription, &dead).await;
        let run = start(&dispatcher);
        produce_batched(&topic, &[("a", "k"), ("bad", "k"), ("b", "k")]).await;
        wait_until("the dead letter", Duration::from_secs(30), || {
            !dead.borrow().is_empty()
        })
        .await;
        let done = wait_for_empty_backlog(&topic, &subscription).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        close_and_join(&dispatcher, run).await;
        let what = format!("{kind:?}: handled {:#?}", log.borrow());
        assert_one_batch(&log.borrow(), |_| true, 3, &what);
        assert_eq!(done.msg_backlog, 0, "{what}");
        assert_eq!(runs_of(&log, "a", |_| true), 1, "{what}");
        assert_eq!(runs_of(&log, "b", |_| true), 1, "{what}");
        let dead: Vec<String> = dead.borrow().iter().map(|h| h.payload.clone()).collect();
        assert_eq!(
            dead,
            ["bad"],
            "{what}: only the failing member is dead-lettered"
        );
    });
}

mod a_dead_letter_policy_dead_letters_only_the_failing_member_of_a_batch {
    // Known defect, not fixed: the `pulsar` crate dead-letters every
    // member of an entry whose redelivery count reached the policy's
    // limit, batch-mates that succeeded included, before the dispatcher
    // sees them.
    #[test]
    #[ignore = "the pulsar crate dead-letters a batch whole"]
    fn plain() {
        super::a_dead_letter_policy_dead_letters_only_the_failing_member_of_a_batch(
            crate::common::TopicKind::Plain,
        )
    }
    #[test]
    #[ignore = "the pulsar crate dead-letters a batch whole"]
    fn partitioned() {
        super::a_dead_letter_policy_dead_letters_only_the_failing_member_of_a_batch(
            crate::common::TopicKind::Partitioned(3),
        )
    }
}

/// Key ordering on a Key_Shared subscription, with one producer batch
/// holding several keys: members of one key never run at once and start
/// in order; a member that fails is nacked, the batch comes back, and only
/// that member runs again.
fn key_ordering_holds_inside_a_batch_of_several_keys(kind: TopicKind) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("batch-keys", kind);
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher_with(Dispatcher::builder().concurrency(8)).await;
        let log = Log::default();
        let running: Rc<RefCell<BTreeMap<String, usize>>> = Rc::default();
        let overlaps = Rc::new(std::cell::Cell::new(0));
        let handler = {
            let (log, running, overlaps) = (log.clone(), running.clone(), overlaps.clone());
            async move |message: &Message| {
                let key = message.partition_key().unwrap_or_default().to_owned();
                let payload = record(&log, message);
                let busy = {
                    let mut running = running.borrow_mut();
                    let count = running.entry(key.clone()).or_default();
                    *count += 1;
                    *count > 1
                };
                if busy {
                    overlaps.set(overlaps.get() + 1);
                }
                tokio::time::sleep(Duration::from_millis(if payload == "a0" {
                    300
                } else {
                    20
                }))
                .await;
                *running.borrow_mut().get_mut(&key).unwrap() -= 1;
                if payload == "a2" && runs_of(&log, "a2", |_| true) == 1 {
                    return Err("fails the first time");
                }
                Ok(())
            }
        };
        let options = batch_options(&subscription, SubType::KeyShared)
            .ordering(pulsar_dispatcher::Ordering::Key);
        dispatcher
            .subscribe(&topic, handler, options)
            .await
            .unwrap();
        let run = start(&dispatcher);
        let messages = [
            ("a0", "A"),
            ("a1", "A"),
            ("b0", "B"),
            ("a2", "A"),
            ("b1", "B"),
            ("a3", "A"),
            ("b2", "B"),
        ];
        produce_batched(&topic, &messages).await;
        wait_until("a2's second run", Duration::from_secs(30), || {
            runs_of(&log, "a2", |_| true) >= 2
        })
        .await;
        let done = wait_for_empty_backlog(&topic, &subscription).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        close_and_join(&dispatcher, run).await;
        let order: Vec<String> = log.borrow().iter().map(|h| h.payload.clone()).collect();
        let what = format!("{kind:?}: handled {order:?}");
        if kind == TopicKind::Plain {
            assert_one_batch(&log.borrow(), |_| true, messages.len(), &what);
        }
        assert_eq!(done.msg_backlog, 0, "{what}");
        assert_eq!(
            overlaps.get(),
            0,
            "{what}: two members of one key ran at once"
        );
        for (payload, _) in messages {
            let runs = if payload == "a2" { 2 } else { 1 };
            assert_eq!(runs_of(&log, payload, |_| true), runs, "{what}: {payload}");
        }
        for key in ["a", "b"] {
            let firsts: Vec<&String> = order
                .iter()
                .filter(|p| p.starts_with(key))
                .take(if key == "a" { 4 } else { 3 })
                .collect();
            let mut sorted = firsts.clone();
            sorted.sort();
            assert_eq!(firsts, sorted, "{what}: key {key} in order");
        }
    });
}

on_plain_and_partitioned_topics!(key_ordering_holds_inside_a_batch_of_several_keys);

/// Replies to batched requests: a batch nacked for one failed member comes
/// back whole, and the members that replied the first time are not run
/// again, so each request gets exactly one reply.
fn each_batched_request_gets_one_reply(kind: TopicKind) {
    run_local(Duration::from_secs(90), async {
        let topic = fresh_topic("batch-requests", kind);
        let reply_topic = unique_topic("batch-replies");
        let subscription = unique_name("sub");
        let dispatcher = common::dispatcher().await;
        let log = Log::default();
        let replies = Log::default();
        let handler = {
            let log = log.clone();
            async move |message: &Message| {
                let payload = record(&log, message);
                if payload == "nack" && runs_of(&log, "nack", |_| true) == 1 {
                    return Err("fails the first time");
                }
                Ok(format!("re-{payload}"))
            }
        };
        let options = batch_options(&subscription, SubType::Shared).reply_topic(&reply_topic);
        dispatcher
            .subscribe(&topic, handler, options)
            .await
            .unwrap();
        record_into(&dispatcher, &reply_topic, &subscription, &replies).await;
        let run = start(&dispatcher);
        produce_batched(&topic, &[("a", "k"), ("nack", "k"), ("b", "k")]).await;
        wait_until("three replies", Duration::from_secs(30), || {
            replies.borrow().len() >= 3
        })
        .await;
        let done = wait_for_empty_backlog(&topic, &subscription).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        close_and_join(&dispatcher, run).await;
        let what = format!("{kind:?}: handled {:#?}", log.borrow());
        assert_one_batch(&log.borrow(), |_| true, 3, &what);
        assert_eq!(done.msg_backlog, 0, "{what}");
        let mut replied: Vec<String> = replies.borrow().iter().map(|h| h.payload.clone()).collect();
        replied.sort();
        assert_eq!(
            replied,
            ["re-a", "re-b", "re-nack"],
            "{what}: one reply each"
        );
    });
}

on_plain_and_partitioned_topics!(each_batched_request_gets_one_reply);
