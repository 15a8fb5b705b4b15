//! Prometheus metrics and a health endpoint for a dispatcher.
//!
//! Installs the `metrics-exporter-prometheus` recorder (before the
//! dispatcher is built: its permits gauge is registered then, and each
//! subscription's metrics at subscribe) and serves, on
//! `127.0.0.1:METRICS_PORT` (default 9464):
//!
//! - `/metrics`: the Prometheus text exposition of every metric;
//! - `/health`: `Dispatcher::health()` as JSON, with HTTP 200 while the
//!   dispatcher is ready (running, every subscription receiving) and 503
//!   otherwise.
//!
//! It subscribes `observability-orders` (priority 10) and
//! `observability-payments` (20), whose handler's outcome depends on the
//! payload: `ok` succeeds; `invalid` fails fatally (dead letter topic);
//! `busy` fails with a retryable error every time (two delayed retries
//! through `observability-retry` (50), then the dead letter topic);
//! `busy-once` succeeds on its first retry; `crash` panics the first time
//! (nacked, redelivered a second later, then succeeds).
//!
//! Connects to `PULSAR_URL` (default `pulsar://127.0.0.1:6650`) and runs
//! until Ctrl-C. With `DEMO_MESSAGES=N` it publishes N messages of those
//! kinds, waits until every one is settled, prints one scrape of `/metrics`
//! (its `pulsar_dispatcher_` lines) and the `/health` answer, and stops.
//! `cargo xtask demo observability` runs it that way. Logs go to stderr, or
//! to the file named by `DEMO_LOG`.

#[path = "support/demo_env.rs"]
mod demo_env;
#[path = "observability/http.rs"]
mod http;

use std::cell::RefCell;
use std::collections::HashSet;
use std::error::Error;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use pulsar_dispatcher::{
    CloseHandle, Dispatcher, ErrorClass, Message, SubType, SubscribeOptions,
    DEFAULT_METRICS_INTERVAL,
};
use tokio::net::TcpListener;

use http::{health_page, Page, PROMETHEUS_TEXT};

const SUBSCRIPTION: &str = "observability";
const RETRY_TOPIC: &str = "observability-retry";
/// Topic and priority of each subscription; the last takes the retries.
const TOPICS: [(&str, i64); 3] = [
    ("observability-orders", 10),
    ("observability-payments", 20),
    (RETRY_TOPIC, 50),
];
const DEFAULT_PORT: u16 = 9464;

/// Can never succeed: dead-lettered at once.
#[derive(Debug, thiserror::Error)]
#[error("invalid order")]
struct Invalid;

/// May succeed later: republished to the retry topic with a delay.
#[derive(Debug, thiserror::Error)]
#[error("service busy")]
struct Busy;

type Outcome = Result<(), Box<dyn Error>>;

fn main() -> Result<(), Box<dyn Error>> {
    demo_env::init_logging("warn,pulsar=error,pulsar_dispatcher=info")?;
    let url = std::env::var("PULSAR_URL").unwrap_or_else(|_| "pulsar://127.0.0.1:6650".into());
    let demo_messages: Option<usize> = std::env::var("DEMO_MESSAGES")
        .ok()
        .map(|n| n.parse().expect("DEMO_MESSAGES is a number"));
    if demo_messages.is_some() {
        demo_env::skip_leftovers(TOPICS.map(|(topic, _)| (topic, SUBSCRIPTION)));
        // The demo panics on purpose: one line instead of the whole report.
        std::panic::set_hook(Box::new(|panic| {
            eprintln!(
                "(intended by the demo) {}",
                panic.to_string().replace('\n', " ")
            );
        }));
    }
    // First the recorder: the dispatcher registers its permits gauge when it
    // is built, and each subscription's metrics at subscribe.
    // Latency histograms are rendered as summaries with these quantiles.
    let prometheus = PrometheusBuilder::new()
        .set_quantiles(&[0.5, 0.99])?
        .install_recorder()?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(tokio::task::LocalSet::new().run_until(run(url, demo_messages, prometheus)))
}

async fn run(
    url: String,
    demo_messages: Option<usize>,
    prometheus: PrometheusHandle,
) -> Result<(), Box<dyn Error>> {
    let dispatcher = Dispatcher::builder()
        .concurrency(4)
        .timings(true) // the slot wait and handler duration histograms
        .connect(&url)
        .await?;
    let crashed: Rc<RefCell<HashSet<String>>> = Rc::default();
    for (topic, priority) in TOPICS {
        let crashed = crashed.clone();
        let handler = async move |message: &Message| handle(&crashed, message).await;
        let options = SubscribeOptions::new()
            .priority(priority)
            .subscription(SUBSCRIPTION)
            .subscription_type(SubType::Shared)
            .negative_ack_redelivery_delay(Duration::from_secs(1))
            .fatal_errors(ErrorClass::of::<Invalid>())
            .retry_errors(ErrorClass::of::<Busy>())
            .retry_topic(RETRY_TOPIC)
            .max_retries(2);
        dispatcher.subscribe(topic, handler, options).await?;
    }

    // The endpoints, served from this thread beside the dispatcher.
    let listener = bind().await?;
    let address = listener.local_addr()?;
    let health = dispatcher.close_handle();
    let scrape = prometheus.clone();
    tokio::task::spawn_local(http::serve(listener, move |path| match path {
        "/metrics" => Page {
            status: 200,
            content_type: PROMETHEUS_TEXT,
            body: scrape.render(),
        },
        "/health" => health_page(health.health()),
        _ => Page::text(404, "not found: try /metrics or /health\n"),
    }));
    // The exporter's histograms need upkeep now and then.
    tokio::task::spawn_local(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            prometheus.run_upkeep();
        }
    });
    println!("serving http://{address}/metrics and http://{address}/health");

    let closer = dispatcher.close_handle();
    match demo_messages {
        Some(total) => {
            publish(&url, total).await?;
            tokio::task::spawn_local(async move {
                if let Err(error) = show_when_settled(&closer, total, address).await {
                    eprintln!("{error}");
                }
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
    let (status, _) = get(address, "/health").await?;
    println!("\nclosed; GET /health now answers HTTP {status}");
    Ok(())
}

/// Outcomes by payload, `<name>:<kind>`; see the module documentation.
async fn handle(crashed: &RefCell<HashSet<String>>, message: &Message) -> Outcome {
    let payload = String::from_utf8_lossy(message.payload()).into_owned();
    let kind = payload.split_once(':').map_or("ok", |(_, kind)| kind);
    tokio::time::sleep(Duration::from_millis(20)).await; // the work
    let retried = message.property("RECONSUMETIMES").is_some();
    match kind {
        "invalid" => Err(Invalid.into()),
        "busy" => Err(Busy.into()),
        "busy-once" if !retried => Err(Busy.into()),
        "crash" if crashed.borrow_mut().insert(payload.clone()) => {
            panic!("simulated crash handling {payload}")
        }
        _ => Ok(()),
    }
}

/// The kind of the `n`th demo message (from 1).
fn kind(n: usize) -> &'static str {
    match n % 10 {
        3 => "invalid",
        6 => "busy",
        8 => "busy-once",
        5 if n == 5 => "crash",
        _ => "ok",
    }
}

/// Publishes `total` messages, alternating between the two topics.
async fn publish(url: &str, total: usize) -> Result<(), pulsar::Error> {
    let client = pulsar::Pulsar::builder(url, pulsar::TokioExecutor)
        .build()
        .await?;
    // All the sends are queued before any receipt is awaited.
    let mut producers =
        demo_env::producers(&client, TOPICS[..2].iter().map(|(topic, _)| *topic)).await?;
    let mut receipts = Vec::new();
    for n in 1..=total {
        let payload = format!("message-{n}:{}", kind(n));
        receipts.push(producers[n % 2].send_non_blocking(payload).await?);
    }
    for receipt in receipts {
        receipt.await?;
    }
    let count = |wanted: &str| (1..=total).filter(|&n| kind(n) == wanted).count();
    println!(
        "published {total} messages: {} ok, {} invalid, {} busy, {} busy-once, {} crash",
        count("ok"),
        count("invalid"),
        count("busy"),
        count("busy-once"),
        count("crash")
    );
    Ok(())
}

/// Waits until all `total` messages are settled (succeeded or
/// dead-lettered), then for the next publication of the counters, and
/// prints what a scraper and a health probe would see.
async fn show_when_settled(
    closer: &CloseHandle,
    total: usize,
    address: SocketAddr,
) -> Result<(), Box<dyn Error>> {
    let begun = Instant::now();
    loop {
        let settled = closer.stats().map_or(0, |stats| {
            let total = stats.total();
            total.succeeded + total.dead_lettered
        });
        if settled >= total as u64 {
            break;
        }
        if begun.elapsed() > Duration::from_secs(60) {
            return Err(format!("only {settled} of {total} messages settled within 60 s").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "all {total} settled after {:.1} s",
        begun.elapsed().as_secs_f64()
    );
    // Counters reach the recorder every metrics interval (1 s by default).
    tokio::time::sleep(DEFAULT_METRICS_INTERVAL + Duration::from_millis(500)).await;

    let (status, body) = get(address, "/metrics").await?;
    let mut lines: Vec<&str> = body
        .lines()
        .filter(|line| line.starts_with("pulsar_dispatcher_"))
        .collect();
    lines.sort_unstable(); // by name, then labels
    println!(
        "\nGET http://{address}/metrics: HTTP {status}, {} lines, {} of them pulsar_dispatcher_ samples:\n",
        body.lines().count(),
        lines.len()
    );
    for line in lines {
        println!("{line}");
    }
    let (status, body) = get(address, "/health").await?;
    println!(
        "\nGET http://{address}/health: HTTP {status}\n{}",
        body.trim_end()
    );
    Ok(())
}

/// A real HTTP request to the endpoints, as a scraper makes it (on the
/// blocking pool: the endpoints are served by this thread).
async fn get(address: SocketAddr, path: &str) -> Result<(u16, String), Box<dyn Error>> {
    let url = format!("http://{address}{path}");
    let response = tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        let mut response = agent.get(&url).call()?;
        let body = response.body_mut().read_to_string()?;
        Ok::<_, ureq::Error>((response.status().as_u16(), body))
    })
    .await??;
    Ok(response)
}

/// Binds `127.0.0.1:METRICS_PORT`; without `METRICS_PORT`, port 9464, or
/// any free port if that one is taken.
async fn bind() -> Result<TcpListener, Box<dyn Error>> {
    if let Ok(port) = std::env::var("METRICS_PORT") {
        let port: u16 = port.parse().map_err(|_| "METRICS_PORT is a port number")?;
        return Ok(TcpListener::bind(("127.0.0.1", port)).await?);
    }
    match TcpListener::bind(("127.0.0.1", DEFAULT_PORT)).await {
        Ok(listener) => Ok(listener),
        Err(error) if error.kind() == std::io::ErrorKind::AddrInUse => {
            Ok(TcpListener::bind(("127.0.0.1", 0)).await?)
        }
        Err(error) => Err(error.into()),
    }
}
