//! Orders across six live and batch topics, through the topic-family API,
//! with delayed retries, dead-lettering and order confirmations as replies.
//!
//! The family `orders` × {live = 100, batch = 200} × {high = 10, low = 20,
//! retry = 50} gives six topics, `orders_live_high` (110) to
//! `orders_batch_retry` (250); within each level the `retry` topic takes
//! that level's retries, so a failed live order still goes ahead of batch
//! work. An order that can never succeed is dead-lettered at once; one that
//! hits an unavailable service is retried after a delay; every processed
//! order's confirmation is published to `order-confirmations`.
//!
//! Connects to `PULSAR_URL` (default `pulsar://127.0.0.1:6650`) and runs
//! until Ctrl-C. With `DEMO_MESSAGES=N` it first publishes N orders spread
//! over the four non-retry topics (every fifth invalid, every third hitting
//! an unavailable service once), prints each dispatch, and stops when all N
//! are settled.

#[path = "support/demo_env.rs"]
mod demo_env;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use pulsar_dispatcher::{
    exponential_backoff, priorities, Dispatcher, ErrorClass, Message, SubType, SubscribeOptions,
    TopicFamily,
};

priorities! {
    /// Which stream of work an order belongs to.
    enum Level { Live = 100, Batch = 200 }
}

priorities! {
    /// Lanes within a level; `Retry` takes the level's delayed retries.
    enum Lane { High = 10, Low = 20, Retry = 50 }
}

/// The order can never be processed: dead-letter it.
#[derive(Debug, thiserror::Error)]
#[error("invalid order")]
struct InvalidOrder;

/// The warehouse is busy: try again later.
#[derive(Debug, thiserror::Error)]
#[error("warehouse unavailable")]
struct ServiceUnavailable;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    demo_env::init_logging("warn,pulsar=error,pulsar_dispatcher=error")?;
    let url = std::env::var("PULSAR_URL").unwrap_or_else(|_| "pulsar://127.0.0.1:6650".into());
    let demo_messages: Option<usize> = std::env::var("DEMO_MESSAGES")
        .ok()
        .map(|n| n.parse().expect("DEMO_MESSAGES is a number"));
    tokio::task::LocalSet::new()
        .run_until(run(url, demo_messages))
        .await
}

const SUBSCRIPTION: &str = "orders-sub";

#[derive(Default)]
struct Tally {
    dispatched: Cell<usize>,
    settled: Cell<usize>,
    retried: Cell<usize>,
    dead_lettered: Cell<usize>,
    confirmed: Cell<usize>,
    priorities: RefCell<Vec<(String, i64)>>,
}

async fn run(url: String, demo_messages: Option<usize>) -> Result<(), Box<dyn std::error::Error>> {
    let family = TopicFamily::<Level, Lane>::new("orders").retry_sublevel(Lane::Retry);
    if demo_messages.is_some() {
        let topics: Vec<String> = family.topics()?.into_iter().map(|t| t.name).collect();
        tokio::task::spawn_blocking(move || {
            demo_env::skip_leftovers(topics.iter().map(|topic| (topic.as_str(), SUBSCRIPTION)));
        })
        .await?;
    }
    let dispatcher = Dispatcher::builder().concurrency(2).connect(&url).await?;
    let tally = Rc::new(Tally::default());
    *tally.priorities.borrow_mut() = family
        .topics()?
        .into_iter()
        .map(|t| {
            (
                format!("persistent://public/default/{}", t.name),
                t.priority,
            )
        })
        .collect();

    let handler_tally = tally.clone();
    let handler = async move |message: &Message| process_order(&handler_tally, message).await;
    let options = SubscribeOptions::new()
        .subscription(SUBSCRIPTION)
        .subscription_type(SubType::Shared)
        .fatal_errors(ErrorClass::of::<InvalidOrder>())
        .retry_errors(ErrorClass::of::<ServiceUnavailable>())
        .retry_backoff(exponential_backoff(
            Duration::from_secs(1),
            2.0,
            Duration::from_secs(60),
        )?)
        .max_retries(5)
        .reply_topic("order-confirmations");
    dispatcher
        .subscribe_family(&family, handler, options)
        .await?;
    println!("subscribed:");
    for subscription in dispatcher.subscriptions() {
        println!(
            "  {:<22} priority {:>3}  retries to {}",
            short(&subscription.topic),
            subscription.priority,
            short(subscription.retry_topic.as_deref().unwrap_or("-"))
        );
    }

    let closer = dispatcher.close_handle();
    match demo_messages {
        Some(total) => {
            publish_orders(&url, total).await?;
            println!(
                "\n   #  {:<22} {:>3}  {:<10} outcome",
                "topic", "pri", "order"
            );
            let done = tally.clone();
            tokio::task::spawn_local(async move {
                while done.settled.get() < total {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                // The close waits for the last handlers, their
                // confirmations and their acks.
                closer.close().await;
            });
        }
        None => {
            tokio::task::spawn_local(async move {
                let _ = tokio::signal::ctrl_c().await;
                closer.close().await;
            });
        }
    }
    dispatcher.run().await?;
    println!(
        "\n{} dispatches: {} orders confirmed, {} retried later, {} dead-lettered",
        tally.dispatched.get(),
        tally.confirmed.get(),
        tally.retried.get(),
        tally.dead_lettered.get()
    );
    Ok(())
}

/// Orders look like `order-7:ok`, `order-8:invalid` or `order-9:busy`.
async fn process_order(
    tally: &Tally,
    message: &Message,
) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let text = String::from_utf8_lossy(message.payload()).into_owned();
    let (order, kind) = text.split_once(':').unwrap_or((&text, "ok"));
    let retries = message.property("RECONSUMETIMES").unwrap_or("0");
    let outcome = match kind {
        "invalid" => "invalid: dead-lettered",
        "busy" if retries == "0" => "busy: retry later",
        "busy" => "retried: confirmed",
        _ => "confirmed",
    };
    tally.dispatched.set(tally.dispatched.get() + 1);
    let priority = tally
        .priorities
        .borrow()
        .iter()
        .find(|(topic, _)| topic == message.topic())
        .map_or(0, |(_, p)| *p);
    println!(
        "{:>4}  {:<22} {:>3}  {:<10} {outcome}",
        tally.dispatched.get(),
        short(message.topic()),
        priority,
        order
    );
    tokio::time::sleep(Duration::from_millis(30)).await;
    match kind {
        "invalid" => {
            tally.dead_lettered.set(tally.dead_lettered.get() + 1);
            tally.settled.set(tally.settled.get() + 1);
            Err(InvalidOrder.into())
        }
        "busy" if retries == "0" => {
            tally.retried.set(tally.retried.get() + 1);
            Err(ServiceUnavailable.into())
        }
        _ => {
            tally.confirmed.set(tally.confirmed.get() + 1);
            tally.settled.set(tally.settled.get() + 1);
            Ok(format!("{order} confirmed").into_bytes())
        }
    }
}

fn short(topic: &str) -> &str {
    topic.rsplit('/').next().unwrap_or(topic)
}

async fn publish_orders(url: &str, total: usize) -> Result<(), pulsar::Error> {
    let client = pulsar::Pulsar::builder(url, pulsar::TokioExecutor)
        .build()
        .await?;
    let topics = [
        "orders_batch_low",
        "orders_batch_high",
        "orders_live_low",
        "orders_live_high",
    ];
    let mut producers = demo_env::producers(&client, topics).await?;
    for n in 1..=total {
        let kind = if n % 5 == 0 {
            "invalid"
        } else if n % 3 == 0 {
            "busy"
        } else {
            "ok"
        };
        let producer = &mut producers[n % topics.len()];
        producer
            .send_non_blocking(format!("order-{n}:{kind}"))
            .await?
            .await?;
    }
    println!("\npublished {total} orders to {}", topics.join(", "));
    Ok(())
}
