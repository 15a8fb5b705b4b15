//! One dispatcher per core on a Shared subscription.
//!
//! Starts one dispatcher per available core (or `CORES`), each on its own
//! thread with its own runtime and connection, all consuming the same
//! Shared subscription so that the broker spreads the messages across them.
//! Produces `DEMO_MESSAGES` messages (default 1000), waits until every one
//! has been handled, prints how many each core handled, and shuts the group
//! down. Ctrl-C shuts down early.
//!
//! ```text
//! cargo xtask broker start
//! cargo run --example per_core
//! CORES=4 DEMO_MESSAGES=10000 cargo run --release --example per_core
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pulsar::{Pulsar, TokioExecutor};
use pulsar_dispatcher::per_core::{self, PerCore};
use pulsar_dispatcher::{Dispatcher, Message, SubType, SubscribeOptions};

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("PULSAR_URL").unwrap_or_else(|_| "pulsar://127.0.0.1:6650".into());
    let cores = env_number("CORES", per_core::available_cores());
    let messages = env_number("DEMO_MESSAGES", 1000);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let topic = format!("persistent://public/default/per-core-demo-{nanos:x}");

    // One counter per core; the handlers on each thread update their own.
    let handled: Arc<Vec<AtomicUsize>> =
        Arc::new((0..cores).map(|_| AtomicUsize::new(0)).collect());
    let group = PerCore::start(cores, {
        let (url, topic, handled) = (url.clone(), topic.clone(), handled.clone());
        move |core| {
            let (url, topic, handled) = (url.clone(), topic.clone(), handled.clone());
            async move {
                let dispatcher = Dispatcher::builder().concurrency(20).connect(&url).await?;
                let options = SubscribeOptions::new()
                    .subscription("per-core-demo")
                    .subscription_type(SubType::Shared)
                    .receiver_queue_size(100);
                let handler = async move |_message: &Message| {
                    handled[core].fetch_add(1, Ordering::Relaxed);
                    Ok::<(), std::convert::Infallible>(())
                };
                dispatcher.subscribe(&topic, handler, options).await?;
                Ok(dispatcher)
            }
        }
    })?;
    println!("{cores} dispatcher(s) running on {topic}");

    // Ctrl-C shuts the whole group down, from a thread of its own.
    let shutdown = group.shutdown_handle();
    std::thread::spawn({
        let shutdown = shutdown.clone();
        move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the signal handler");
            runtime.block_on(async {
                if tokio::signal::ctrl_c().await.is_ok() {
                    println!("ctrl-c: shutting down");
                    shutdown.shutdown();
                }
            });
        }
    });

    // Produce from this thread's own runtime.
    let start = Instant::now();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let client = Pulsar::builder(&url, TokioExecutor).build().await?;
            // A send waits for room in the crate's queue of 100 instead of
            // failing.
            let options = pulsar::ProducerOptions {
                block_queue_if_full: true,
                ..Default::default()
            };
            let mut producer = client
                .producer()
                .with_topic(&topic)
                .with_options(options)
                .build()
                .await?;
            let mut receipts = Vec::new();
            for index in 0..messages {
                // Ctrl-C stops the producing too.
                if shutdown.is_shutdown() {
                    break;
                }
                receipts.push(
                    producer
                        .send_non_blocking(format!("message {index}"))
                        .await?,
                );
            }
            for receipt in receipts {
                receipt.await?;
            }
            Ok::<(), pulsar::Error>(())
        })?;

    let total = || {
        handled
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .sum::<usize>()
    };
    while total() < messages && !shutdown.is_shutdown() {
        std::thread::sleep(Duration::from_millis(10));
    }
    let elapsed = start.elapsed();
    shutdown.shutdown();
    for (core, result) in group.join().into_iter().enumerate() {
        let count = handled[core].load(Ordering::Relaxed);
        match result {
            Ok(()) => println!("core {core}: handled {count} messages"),
            Err(error) => println!("core {core}: handled {count} messages, then failed: {error}"),
        }
    }
    println!(
        "{} messages in {:.2} s ({:.0} msg/s, produce and consume overlapping)",
        total(),
        elapsed.as_secs_f64(),
        total() as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}
