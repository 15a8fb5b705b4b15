//! Replays against a real Apache Pulsar broker: an operator resets a
//! subscription's cursor to run its messages again, and the dispatcher
//! handles every one of them again, although it acked them, on every
//! subscription type, on plain and partitioned topics, batched or not.

mod common;

on_plain_and_partitioned_topics!(a_reset_cursor_replays_every_acked_message);

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use common::{
    close_and_join, fresh_topic, keyed_messages, payload_number, publish, publish_batched,
    reset_cursor, run_local, start, unique_name, wait_for_empty_backlog, wait_until, TopicKind,
};
use pulsar_dispatcher::{Message, SubType, SubscribeOptions};

/// How long the dispatcher takes an ack for one perhaps lost with its
/// connection (the transport's window, 10 s), and a margin.
const LOST_ACK_WINDOW_AND_MARGIN: Duration = Duration::from_secs(12);

const SUBSCRIPTION_TYPES: [SubType; 4] = [
    SubType::Shared,
    SubType::KeyShared,
    SubType::Exclusive,
    SubType::Failover,
];

/// Per subscription type, how often each payload was handled.
type Handled = Rc<RefCell<Vec<BTreeMap<usize, usize>>>>;

fn a_reset_cursor_replays_every_acked_message(kind: TopicKind) {
    run_local(Duration::from_secs(120), async {
        const UNBATCHED: usize = 20;
        const TOTAL: usize = 40;
        let topic = fresh_topic("replay", kind);
        // Subscribed by its short name, as many services name topics.
        let short_name = topic.trim_start_matches("persistent://public/default/");
        let subscriptions: Vec<String> = SUBSCRIPTION_TYPES
            .iter()
            .map(|kind| unique_name(&format!("{kind:?}")))
            .collect();
        let handled: Handled = Rc::new(RefCell::new(vec![BTreeMap::new(); 4]));
        let dispatcher = common::dispatcher().await;
        for (index, (subscription_type, subscription)) in
            SUBSCRIPTION_TYPES.iter().zip(&subscriptions).enumerate()
        {
            let handled = handled.clone();
            let handler = async move |message: &Message| {
                *handled.borrow_mut()[index]
                    .entry(payload_number(message))
                    .or_default() += 1;
                Ok::<_, Infallible>(())
            };
            let options = SubscribeOptions::new()
                .subscription(subscription)
                .subscription_type(*subscription_type);
            dispatcher
                .subscribe(short_name, handler, options)
                .await
                .unwrap();
        }
        let run = start(&dispatcher);
        publish(&topic, keyed_messages(UNBATCHED, 5)).await;
        publish_batched(&topic, 5, keyed_messages(TOTAL, 5).skip(UNBATCHED)).await;
        // Every message handled `times` times on every subscription, and
        // every ack stored.
        let handled_everywhere = async |times: usize| {
            wait_until(
                &format!("every message handled {times} times"),
                Duration::from_secs(30),
                || {
                    handled.borrow().iter().all(|counts| {
                        counts.len() == TOTAL && counts.values().all(|&count| count >= times)
                    })
                },
            )
            .await;
            for subscription in &subscriptions {
                let drained = wait_for_empty_backlog(&topic, subscription).await;
                assert_eq!(drained.msg_backlog, 0, "every message acked: {drained:?}");
            }
        };
        handled_everywhere(1).await;
        // Acks this recent could be taken for acks lost with a connection.
        tokio::time::sleep(LOST_ACK_WINDOW_AND_MARGIN).await;
        for subscription in &subscriptions {
            let (topic, subscription) = (topic.clone(), subscription.clone());
            tokio::task::spawn_blocking(move || reset_cursor(&topic, &subscription, 0))
                .await
                .unwrap();
        }
        handled_everywhere(2).await;
        close_and_join(&dispatcher, run).await;
        for (subscription_type, counts) in SUBSCRIPTION_TYPES.iter().zip(handled.borrow().iter()) {
            let not_twice: Vec<_> = counts.iter().filter(|(_, &count)| count != 2).collect();
            assert!(
                not_twice.is_empty(),
                "{subscription_type:?}: (payload, times handled) not twice: {not_twice:?}"
            );
        }
    });
}
