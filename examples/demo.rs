//! The dispatcher at a glance: a backlog at two priorities drained best
//! first, equal priorities taking turns, one delayed retry, one dead letter,
//! and each subscription's statistics at the end.
//!
//! Five topics, one subscription each (priority in brackets, lower first):
//!
//! - `demo-payments` [10] and `demo-refunds` [10];
//! - `demo-orders` [20], a partitioned topic (`cargo xtask demo` creates it
//!   with 3 partitions; one subscription consumes them all), and
//!   `demo-emails` [20];
//! - `demo-retries` [30], where orders that failed with a retryable error
//!   come back after a delay.
//!
//! Connects to `PULSAR_URL` (default `pulsar://127.0.0.1:6650`) and runs
//! until Ctrl-C. With `DEMO_MESSAGES=N` (at least 8) it first publishes a
//! backlog of N messages over the first four topics, then starts the
//! dispatcher with room for two handlers at a time, prints one line per
//! dispatch (a column per subscription), and stops once every message is
//! settled: `payment-2` fails fatally (dead-lettered), `order-2` fails once
//! with a retryable error (republished to `demo-retries`, then succeeds).
//! `cargo xtask demo` runs it that way. Logs go to the file named by
//! `DEMO_LOG`, or to stderr (errors only, unless `RUST_LOG` says otherwise),
//! never into the table.

#[path = "support/demo_env.rs"]
mod demo_env;

use std::error::Error;
use std::time::{Duration, Instant};

use pulsar_dispatcher::{
    CloseHandle, Dispatcher, DispatcherStats, ErrorClass, Message, SubType, SubscribeOptions,
};

/// Column title, topic and priority of each subscription. The first four
/// get the backlog; the last takes the retries.
const COLUMNS: [(&str, &str, i64); 5] = [
    ("payments", "demo-payments", 10),
    ("refunds", "demo-refunds", 10),
    ("orders", "demo-orders", 20),
    ("emails", "demo-emails", 20),
    ("retries", RETRY_TOPIC, 30),
];
const PARTITIONED_TOPIC: &str = "demo-orders";
const RETRY_TOPIC: &str = "demo-retries";
const SUBSCRIPTION: &str = "demo";
const CONCURRENCY: usize = 2;
/// How long each handler works.
const WORK: Duration = Duration::from_millis(100);

/// Fatal: the message goes to the dead letter topic.
#[derive(Debug, thiserror::Error)]
#[error("card declined")]
struct CardDeclined;

/// Retryable: the message is republished to the retry topic with a delay.
#[derive(Debug, thiserror::Error)]
#[error("warehouse busy")]
struct WarehouseBusy;

fn main() -> Result<(), Box<dyn Error>> {
    // Errors only on stderr; more in the file `cargo xtask demo` names.
    let default_filter = match std::env::var_os("DEMO_LOG") {
        Some(_) => "warn,pulsar=error,pulsar_dispatcher=info",
        None => "error",
    };
    demo_env::init_logging(default_filter)?;
    let url = std::env::var("PULSAR_URL").unwrap_or_else(|_| "pulsar://127.0.0.1:6650".into());
    let demo_messages: Option<usize> = std::env::var("DEMO_MESSAGES")
        .ok()
        .map(|n| n.parse().expect("DEMO_MESSAGES is a number"));
    if demo_messages.is_some() {
        demo_env::skip_leftovers(COLUMNS.map(|(_, topic, _)| (topic, SUBSCRIPTION)));
    }
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(tokio::task::LocalSet::new().run_until(run(url, demo_messages)))
}

async fn run(url: String, demo_messages: Option<usize>) -> Result<(), Box<dyn Error>> {
    let dispatcher = Dispatcher::builder()
        .concurrency(CONCURRENCY)
        .timings(true) // slot wait and handler duration in stats()
        .connect(&url)
        .await?;
    for (column, (_, topic, priority)) in COLUMNS.into_iter().enumerate() {
        let handler = async move |message: &Message| handle(column, message).await;
        let options = SubscribeOptions::new()
            .priority(priority)
            .subscription(SUBSCRIPTION)
            .subscription_type(SubType::Shared)
            .fatal_errors(ErrorClass::of::<CardDeclined>())
            .retry_errors(ErrorClass::of::<WarehouseBusy>())
            .retry_topic(RETRY_TOPIC)
            .max_retries(3);
        dispatcher.subscribe(topic, handler, options).await?;
    }

    let closer = dispatcher.close_handle();
    let begun = Instant::now();
    let watcher = match demo_messages {
        Some(requested) => {
            let total = requested.max(8);
            let partitions = publish_backlog(&url, total).await?;
            explain(partitions);
            print_header();
            // Give the broker a moment to push each consumer its first
            // message, so that the first pick sees every subscription
            // (otherwise the first dispatch goes to whichever came first).
            tokio::time::sleep(Duration::from_millis(300)).await;
            tokio::task::spawn_local(close_when_settled(closer, total as u64))
        }
        None => {
            print_header();
            tokio::task::spawn_local(async move {
                let _ = tokio::signal::ctrl_c().await;
                closer.close().await;
                Ok(())
            })
        }
    };
    dispatcher.run().await?;
    let settled = watcher.await?;
    print_summary(&dispatcher.stats(), begun.elapsed());
    if let Some(log) = std::env::var_os("DEMO_LOG") {
        println!("\nthe dispatcher's log: {}", log.to_string_lossy());
    }
    settled
}

/// Prints the message in its column, works, and fails where the demo says.
async fn handle(column: usize, message: &Message) -> Result<(), Box<dyn Error>> {
    let name = String::from_utf8_lossy(message.payload()).into_owned();
    let retries = message.property("RECONSUMETIMES");
    let (outcome, note): (Result<(), Box<dyn Error>>, String) = match (name.as_str(), retries) {
        ("payment-2", _) => (
            Err(CardDeclined.into()),
            "card declined: dead-lettered to demo-payments-demo-DLQ".into(),
        ),
        ("order-2", None) => (
            Err(WarehouseBusy.into()),
            format!("warehouse busy: to {RETRY_TOPIC}, due in 1 s"),
        ),
        (_, Some(n)) => (Ok(()), format!("(retry {n}) ok")),
        _ => (Ok(()), String::new()),
    };
    print_dispatch(column, &name, &note);
    tokio::time::sleep(WORK).await;
    outcome
}

/// Closes the dispatcher once `total` messages have ended, succeeded or
/// dead-lettered; gives up after a minute.
async fn close_when_settled(closer: CloseHandle, total: u64) -> Result<(), Box<dyn Error>> {
    let begun = Instant::now();
    let result = loop {
        let settled = closer.stats().map_or(0, |stats| {
            let total = stats.total();
            total.succeeded + total.dead_lettered
        });
        if settled >= total {
            break Ok(());
        }
        if begun.elapsed() > Duration::from_secs(60) {
            break Err(format!("only {settled} of {total} messages settled within 60 s").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    closer.close().await;
    result
}

/// Publishes `total` messages round-robin over the four backlog topics,
/// named `payment-1`, `refund-1`, `order-1`, `email-1`, `payment-2`, ...;
/// returns the partition count of the partitioned topic.
async fn publish_backlog(url: &str, total: usize) -> Result<u32, pulsar::Error> {
    let client = pulsar::Pulsar::builder(url, pulsar::TokioExecutor)
        .build()
        .await?;
    let backlog = &COLUMNS[..4];
    // All the sends are queued before any receipt is awaited.
    let mut producers =
        demo_env::producers(&client, backlog.iter().map(|(_, topic, _)| *topic)).await?;
    let mut receipts = Vec::new();
    for n in 0..total {
        let (title, _, _) = backlog[n % backlog.len()];
        let name = format!("{}-{}", title.trim_end_matches('s'), n / backlog.len() + 1);
        receipts.push(producers[n % backlog.len()].send_non_blocking(name).await?);
    }
    for receipt in receipts {
        receipt.await?;
    }
    let partitions = client
        .lookup_partitioned_topic_number(format!("persistent://public/default/{PARTITIONED_TOPIC}"))
        .await?;
    if partitions > 0 {
        println!(
            "{PARTITIONED_TOPIC} is a partitioned topic with {partitions} partitions: \
             one subscribe() call consumes them all (the orders column)."
        );
    } else {
        println!(
            "{PARTITIONED_TOPIC} is not partitioned on this broker \
             (`cargo xtask demo` creates it with 3 partitions)."
        );
    }
    let counts: Vec<String> = backlog
        .iter()
        .enumerate()
        .map(|(i, (title, _, _))| {
            let count = (i..total).step_by(backlog.len()).count();
            format!("{count} {title}")
        })
        .collect();
    println!(
        "Published a backlog of {total} messages before starting the dispatcher: {}.",
        counts.join(", ")
    );
    Ok(partitions)
}

fn explain(partitions: u32) {
    println!(
        "\nOne line per dispatch, in the order the handlers start ({CONCURRENCY} run at a time, \
         {} ms each).\nLook for:\n\
         \x20 - the best priority first: every payment and refund [10] before any order or email [20];\n\
         \x20 - equal priorities take turns: payment, refund, payment, ...; then order, email, order, ...;\n\
         \x20 - order-2 fails with a retryable error and comes back through {RETRY_TOPIC} [30] a second later;\n\
         \x20 - payment-2 fails for good and goes to the dead letter topic.",
        WORK.as_millis()
    );
    if partitions > 1 {
        println!(
            "  (Orders come from {partitions} partitions, read in turns: Pulsar keeps order within \
             a partition, so order numbers may interleave.)"
        );
    }
}

const WIDTH: usize = 15;

fn print_header() {
    let header: String = COLUMNS
        .iter()
        .map(|(title, _, priority)| format!("{:<WIDTH$}", format!("{title} [{priority}]")))
        .collect();
    println!("\n   #  {}", header.trim_end());
    println!("   -  {}", "-".repeat(WIDTH * COLUMNS.len()));
}

fn print_dispatch(column: usize, name: &str, note: &str) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static DISPATCHED: AtomicUsize = AtomicUsize::new(0);
    let number = DISPATCHED.fetch_add(1, Ordering::Relaxed) + 1;
    let indent = " ".repeat(WIDTH * column);
    println!(
        "{number:>4}  {indent}{}",
        format!("{name} {note}").trim_end()
    );
}

fn print_summary(stats: &DispatcherStats, elapsed: Duration) {
    let total = stats.total();
    println!(
        "\nDone in {:.1} s: {} dispatches, {} succeeded, {} retried, {} dead-lettered.",
        elapsed.as_secs_f64(),
        total.dispatched,
        total.succeeded,
        total.retried,
        total.dead_lettered
    );
    println!("\nPer subscription, from dispatcher.stats():\n");
    println!(
        "  {:<14} {:>8} {:>9} {:>7} {:>13} {:>14} {:>9}",
        "subscription", "received", "succeeded", "retried", "dead-lettered", "slot wait p50", "p99"
    );
    for (subscription, (title, _, priority)) in stats.subscriptions.iter().zip(COLUMNS) {
        let (p50, p99) = subscription
            .slot_wait
            .map_or(("-".into(), "-".into()), |wait| {
                (millis(wait.p50), millis(wait.p99))
            });
        println!(
            "  {:<14} {:>8} {:>9} {:>7} {:>13} {:>14} {:>9}",
            format!("{title} [{priority}]"),
            subscription.received,
            subscription.succeeded,
            subscription.retried,
            subscription.dead_lettered,
            p50,
            p99
        );
    }
    println!(
        "\nSlot wait: from a message's arrival in its subscription's slot to its handler's start.\n\
         The worse priorities waited while the better ones drained."
    );
}

fn millis(duration: Duration) -> String {
    if duration < Duration::from_millis(1) {
        format!("{} µs", duration.as_micros())
    } else {
        format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
    }
}
