//! One dispatcher per core against a real broker: two dispatchers, each on
//! its own thread with its own runtime and connection, share a Shared
//! subscription; every message is processed, none twice, and counted in
//! the group's stats, and one shutdown closes both; on a plain topic and on
//! a partitioned one.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pulsar_dispatcher::per_core::PerCore;
use pulsar_dispatcher::{Dispatcher, Error, Message, SubType, SubscribeOptions};

const MESSAGES: usize = 200;

/// Which core processed each payload, and how often.
type Seen = Arc<Mutex<HashMap<String, Vec<usize>>>>;

fn options(subscription: &str) -> SubscribeOptions {
    SubscribeOptions::new()
        .subscription(subscription)
        .subscription_type(SubType::Shared)
}

on_plain_and_partitioned_topics!(
    two_dispatchers_share_a_subscription_and_process_every_message_once
);

fn two_dispatchers_share_a_subscription_and_process_every_message_once(kind: common::TopicKind) {
    let url = common::pulsar_url();
    let topic = common::fresh_topic("per-core", kind);
    let subscription = common::unique_name("per-core-sub");
    let seen: Seen = Arc::default();

    let factory = {
        let (url, topic, subscription, seen) = (
            url.clone(),
            topic.clone(),
            subscription.clone(),
            seen.clone(),
        );
        move |core: usize| {
            let (url, topic, subscription, seen) = (
                url.clone(),
                topic.clone(),
                subscription.clone(),
                seen.clone(),
            );
            async move {
                // Each worker has its own thread and runtime.
                assert_eq!(
                    std::thread::current().name(),
                    Some(format!("pulsar-dispatcher-{core}").as_str())
                );
                let dispatcher = Dispatcher::connect(&url).await?;
                let handler = async move |message: &Message| {
                    // Long enough that the broker has to spread the work.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let payload = String::from_utf8_lossy(message.payload()).into_owned();
                    seen.lock().unwrap().entry(payload).or_default().push(core);
                    Ok::<(), std::convert::Infallible>(())
                };
                dispatcher
                    .subscribe(&topic, handler, options(&subscription))
                    .await?;
                Ok(dispatcher)
            }
        }
    };
    let group = PerCore::start(2, factory).expect("both dispatchers start");
    assert_eq!(group.len(), 2);

    // Both consumers are connected before the first message is produced.
    common::run_local(Duration::from_secs(60), async {
        let client = common::client().await;
        let mut producer = client
            .producer()
            .with_topic(&topic)
            .build()
            .await
            .expect("a producer");
        for index in 0..MESSAGES {
            producer
                .send_non_blocking(format!("message-{index}").into_bytes())
                .await
                .expect("queued")
                .await
                .expect("sent");
        }
    });

    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.lock().unwrap().len() < MESSAGES && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Read from outside the group's threads. A handler records its message
    // just before its success is counted: wait for the last count.
    let monitor = group.monitor();
    let succeeded = common::run_local(Duration::from_secs(30), async {
        loop {
            let stats = monitor.stats().await;
            let succeeded: u64 = stats.iter().flatten().map(|s| s.total().succeeded).sum();
            if succeeded >= MESSAGES as u64 {
                break succeeded;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    assert_eq!(succeeded, MESSAGES as u64, "counted over both cores");
    let health = common::run_local(Duration::from_secs(10), monitor.health());
    assert!(health.is_ready(), "{health:?}");
    let shutdown = group.shutdown_handle();
    // The handle is Send: shut down from another thread.
    std::thread::spawn(move || shutdown.shutdown())
        .join()
        .unwrap();
    let results = group.join();
    assert_eq!(results.len(), 2);
    for (core, result) in results.into_iter().enumerate() {
        assert!(result.is_ok(), "dispatcher {core} failed: {result:?}");
    }
    let health = common::run_local(Duration::from_secs(10), monitor.health());
    assert!(!health.is_live(), "{health:?}");

    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), MESSAGES, "every message is processed");
    for index in 0..MESSAGES {
        let cores = &seen[&format!("message-{index}")];
        assert_eq!(cores.len(), 1, "message-{index} processed by {cores:?}");
    }
    for core in 0..2 {
        assert!(
            seen.values().any(|cores| cores[0] == core),
            "dispatcher {core} processed nothing"
        );
    }
    // Shutdown acked everything it processed.
    let stats = common::run_local(
        Duration::from_secs(30),
        common::wait_for_stats(&topic, &subscription, Duration::from_secs(10), |s| {
            s.msg_backlog == 0 && s.consumers == 0
        }),
    );
    assert_eq!(stats.msg_backlog, 0, "{:?}", stats.raw);
    assert_eq!(stats.consumers, 0, "both consumers are closed");
}

/// One core's factory fails: the group does not start, and the dispatcher
/// another core had built never runs (its backlog stays unhandled) and its
/// consumer leaves the broker.
#[test]
fn a_failing_factory_stops_the_whole_group_before_anything_runs() {
    let url = common::pulsar_url();
    let topic = common::unique_topic("per-core-built");
    let subscription = common::unique_name("sub");
    common::run_local(
        Duration::from_secs(30),
        common::publish(&topic, common::keyed_messages(1, 1)),
    );
    let handled = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let result = PerCore::start(2, {
        let (topic, subscription, handled) = (topic.clone(), subscription.clone(), handled.clone());
        move |core| {
            let (url, topic, subscription) = (url.clone(), topic.clone(), subscription.clone());
            let handled = handled.clone();
            async move {
                let dispatcher = Dispatcher::connect(&url).await?;
                let handler = async move |_: &Message| {
                    handled.store(true, std::sync::atomic::Ordering::SeqCst);
                    Ok::<(), Error>(())
                };
                if core == 0 {
                    let options =
                        common::from_the_start(SubscribeOptions::new().subscription(&subscription));
                    dispatcher.subscribe(&topic, handler, options).await?;
                } else {
                    // An invalid option fails the subscription.
                    let invalid = SubscribeOptions::new().receiver_queue_size(0);
                    dispatcher
                        .subscribe(&common::unique_topic("never"), handler, invalid)
                        .await?;
                }
                Ok(dispatcher)
            }
        }
    });
    match result {
        Err(Error::InvalidOption { option, .. }) => assert_eq!(option, "receiver_queue_size"),
        Err(other) => panic!("expected the factory's own error, got {other}"),
        Ok(_) => panic!("a group with a failed factory must not start"),
    }
    let stats = common::run_local(
        Duration::from_secs(30),
        common::wait_for_stats(&topic, &subscription, Duration::from_secs(10), |s| {
            s.consumers == 0
        }),
    );
    assert_eq!(
        stats.consumers, 0,
        "core 0's dispatcher closed: {:?}",
        stats.raw
    );
    assert_eq!(stats.msg_backlog, 1, "its message left with the broker");
    assert!(
        !handled.load(std::sync::atomic::Ordering::SeqCst),
        "core 0's dispatcher never ran"
    );
}

#[test]
fn shutdown_before_any_message_returns_cleanly() {
    let url = common::pulsar_url();
    let topic = common::unique_topic("per-core-idle");
    let group = PerCore::start(1, move |_core| {
        let (url, topic) = (url.clone(), topic.clone());
        async move {
            let dispatcher = Dispatcher::connect(&url).await?;
            let handler = async |_: &Message| Ok::<(), Error>(());
            dispatcher
                .subscribe(&topic, handler, SubscribeOptions::new())
                .await?;
            Ok(dispatcher)
        }
    })
    .expect("starts");
    let shutdown = group.shutdown_handle();
    assert!(!shutdown.is_shutdown());
    shutdown.shutdown();
    shutdown.shutdown();
    assert!(shutdown.is_shutdown());
    for result in group.join() {
        result.expect("a clean shutdown");
    }
}
