//! Orders, payments and notifications, one handler each, at equal priority.
//!
//! Connects to `PULSAR_URL` (default `pulsar://127.0.0.1:6650`) and runs
//! until Ctrl-C. With `DEMO_MESSAGES=N` it first publishes N messages spread
//! over the three topics, prints each dispatch as it happens (one column per
//! subscription, so round-robin between equal priorities shows at a glance)
//! and stops once all N are handled. `cargo xtask demo` runs it that way.

use std::cell::RefCell;
use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use pulsar_dispatcher::{Dispatcher, Message, SubType, SubscribeOptions};

const TOPICS: [(&str, &str, u64); 3] = [
    // topic, subscription, simulated work in milliseconds
    ("orders", "orders-sub", 120),
    ("payments", "payments-sub", 60),
    ("notifications", "notifications-sub", 20),
];

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,pulsar=error,pulsar_dispatcher=info".into()),
        )
        .init();
    let url = std::env::var("PULSAR_URL").unwrap_or_else(|_| "pulsar://127.0.0.1:6650".into());
    let demo_messages: Option<usize> = std::env::var("DEMO_MESSAGES")
        .ok()
        .map(|n| n.parse().expect("DEMO_MESSAGES is a number"));
    tokio::task::LocalSet::new()
        .run_until(run(url, demo_messages))
        .await
}

async fn run(url: String, demo_messages: Option<usize>) -> Result<(), Box<dyn std::error::Error>> {
    let dispatcher = Rc::new(Dispatcher::builder().concurrency(2).connect(&url).await?);
    let table = Rc::new(DispatchTable::default());
    for (column, (topic, subscription, work_ms)) in TOPICS.into_iter().enumerate() {
        let table = table.clone();
        let handler = async move |message: &Message| {
            table.record(column, &String::from_utf8_lossy(message.payload()));
            tokio::time::sleep(Duration::from_millis(work_ms)).await;
            Ok::<_, Infallible>(())
        };
        let options = SubscribeOptions::new()
            .priority(10)
            .subscription(subscription)
            .subscription_type(SubType::Shared);
        dispatcher.subscribe(topic, handler, options).await?;
    }

    let closer = dispatcher.close_handle();
    match demo_messages {
        Some(total) => {
            publish_demo_traffic(&url, total).await?;
            table.print_header();
            let done = table.clone();
            tokio::task::spawn_local(async move {
                while done.count() < total {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                closer.close().await;
            });
        }
        None => {
            tokio::task::spawn_local(async move {
                let _ = tokio::signal::ctrl_c().await;
                closer.close().await;
            });
            table.print_header();
        }
    }
    dispatcher.run().await?;
    table.print_summary();
    Ok(())
}

/// Publishes `total` messages, round-robin over the topics, in bursts that
/// keep the producer's outbound queue bounded.
async fn publish_demo_traffic(url: &str, total: usize) -> Result<(), pulsar::Error> {
    let client = pulsar::Pulsar::builder(url, pulsar::TokioExecutor)
        .build()
        .await?;
    let mut producers = Vec::new();
    for (topic, _, _) in TOPICS {
        producers.push(client.producer().with_topic(topic).build().await?);
    }
    let mut receipts = Vec::new();
    for n in 0..total {
        let (topic, _, _) = TOPICS[n % TOPICS.len()];
        let name = topic.trim_end_matches('s');
        let payload = format!("{name}-{}", n / TOPICS.len() + 1);
        receipts.push(
            producers[n % TOPICS.len()]
                .send_non_blocking(payload)
                .await?,
        );
        if receipts.len() == 50 {
            for receipt in receipts.drain(..) {
                receipt.await?;
            }
        }
    }
    for receipt in receipts {
        receipt.await?;
    }
    println!(
        "published {total} messages to {}",
        TOPICS.map(|t| t.0).join(", ")
    );
    Ok(())
}

/// Prints one line per dispatched message, in a column per subscription.
#[derive(Default)]
struct DispatchTable {
    dispatched: RefCell<Vec<usize>>,
}

const WIDTH: usize = 18;

impl DispatchTable {
    fn print_header(&self) {
        let header: String = TOPICS
            .iter()
            .map(|(topic, _, _)| format!("{topic:<WIDTH$}"))
            .collect();
        println!("\n   #  {header}");
        println!("   -  {}", "-".repeat(WIDTH * TOPICS.len()));
    }

    fn record(&self, column: usize, payload: &str) {
        let mut dispatched = self.dispatched.borrow_mut();
        dispatched.push(column);
        let indent = " ".repeat(WIDTH * column);
        println!("{:>4}  {indent}{payload}", dispatched.len());
    }

    fn count(&self) -> usize {
        self.dispatched.borrow().len()
    }

    fn print_summary(&self) {
        let dispatched = self.dispatched.borrow();
        let counts: Vec<String> = TOPICS
            .iter()
            .enumerate()
            .map(|(column, (topic, _, _))| {
                let n = dispatched.iter().filter(|&&c| c == column).count();
                format!("{topic}: {n}")
            })
            .collect();
        println!(
            "\ndispatched {} messages ({})",
            dispatched.len(),
            counts.join(", ")
        );
    }
}
