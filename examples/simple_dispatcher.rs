//! Orders, payments and notifications, each topic with its own handler, at
//! one priority: the three subscriptions take turns, at most
//! [`CONCURRENCY`] handlers run at once, and each message is acked when its
//! handler returns.
//!
//! Connects to `PULSAR_URL` (default `pulsar://127.0.0.1:6650`) and runs
//! until Ctrl-C. With `DEMO_MESSAGES=N` it first publishes N messages over
//! the three topics and stops once all of them are handled
//! (`cargo xtask demo simple` runs it that way). `examples/demo.rs` shows
//! more: priorities, retries and dead letters.

#[path = "support/demo_env.rs"]
mod demo_env;

use std::error::Error;
use std::time::Duration;

use pulsar_dispatcher::{CloseHandle, Dispatcher, Message, SubType, SubscribeOptions};

/// Each topic and how long its handler works on a message.
const TOPICS: [(&str, Duration); 3] = [
    ("orders", Duration::from_millis(500)),
    ("payments", Duration::from_millis(200)),
    ("notifications", Duration::from_millis(50)),
];
const PRIORITY: i64 = 10;
const CONCURRENCY: usize = 20;

fn main() -> Result<(), Box<dyn Error>> {
    demo_env::init_logging("warn,pulsar=error,pulsar_dispatcher=info")?;
    let url = std::env::var("PULSAR_URL").unwrap_or_else(|_| "pulsar://127.0.0.1:6650".into());
    let messages: Option<u64> = std::env::var("DEMO_MESSAGES")
        .ok()
        .map(|n| n.parse().expect("DEMO_MESSAGES is a number"));
    if messages.is_some() {
        let subscriptions = TOPICS.map(|(topic, _)| (topic, subscription(topic)));
        demo_env::skip_leftovers(
            subscriptions
                .iter()
                .map(|(topic, name)| (*topic, name.as_str())),
        );
    }
    // One thread: the dispatcher and its handlers run on a `LocalSet`.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(tokio::task::LocalSet::new().run_until(run(url, messages)))
}

async fn run(url: String, messages: Option<u64>) -> Result<(), Box<dyn Error>> {
    let dispatcher = Dispatcher::builder()
        .concurrency(CONCURRENCY)
        .connect(&url)
        .await?;
    for (topic, work) in TOPICS {
        let handler = async move |message: &Message| {
            let text = String::from_utf8_lossy(message.payload());
            println!("processing {topic}: {text}");
            tokio::time::sleep(work).await;
            Ok::<_, std::convert::Infallible>(())
        };
        let options = SubscribeOptions::new()
            .priority(PRIORITY)
            .subscription(subscription(topic))
            .subscription_type(SubType::Shared);
        dispatcher.subscribe(topic, handler, options).await?;
    }

    let closer = dispatcher.close_handle();
    let stopper = match messages {
        Some(total) => {
            publish(&url, total).await?;
            tokio::task::spawn_local(close_when_handled(closer, total))
        }
        None => tokio::task::spawn_local(async move {
            let _ = tokio::signal::ctrl_c().await;
            closer.close().await;
            Ok(())
        }),
    };
    dispatcher.run().await?;
    stopper.await??;
    println!("handled {} messages", dispatcher.stats().total().succeeded);
    Ok(())
}

/// Each topic's subscription.
fn subscription(topic: &str) -> String {
    format!("{topic}-sub")
}

/// Publishes `total` messages round-robin over the three topics.
async fn publish(url: &str, total: u64) -> Result<(), pulsar::Error> {
    let client = pulsar::Pulsar::builder(url, pulsar::TokioExecutor)
        .build()
        .await?;
    let mut producers = demo_env::producers(&client, TOPICS.map(|(topic, _)| topic)).await?;
    for n in 0..total {
        let index = n as usize % TOPICS.len();
        let text = format!("{}-{n}", TOPICS[index].0);
        producers[index].send_non_blocking(text).await?.await?;
    }
    Ok(())
}

/// Closes the dispatcher once `total` messages have been handled; gives up
/// after a minute.
async fn close_when_handled(closer: CloseHandle, total: u64) -> Result<(), String> {
    let handled = || closer.stats().map_or(0, |stats| stats.total().succeeded);
    let waited = tokio::time::timeout(Duration::from_secs(60), async {
        while handled() < total {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    closer.close().await;
    waited.map_err(|_| format!("only {} of {total} messages handled within 60 s", handled()))
}
