//! Failure handling against a real Apache Pulsar broker: a subscription
//! another consumer holds, a topic the broker refuses to publish to, and a
//! handler that never returns.

mod common;

use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use common::{
    client, close_and_join, pulsar_url, run_local, start, unique_name, unique_topic, wait_for_stats,
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
