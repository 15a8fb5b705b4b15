//! The processes of `cargo xtask chaos` (see `xtask/src/chaos.rs`, which
//! runs them, injects the faults and counts).
//!
//! ```text
//! chaos produce --url U --topics T1,T2,.. --count N [--first-id 0] [--mix standard|hang|ok] --out FILE
//! chaos work    --url U --topics T1,T2,.. --retry-topic R --subscription S --log FILE [options]
//! chaos drain   --url U --topics D1,D2,.. --out FILE [--expect N] [--idle-ms 5000]
//! chaos mix     --count N [--mix standard|hang|ok]
//! ```
//!
//! - `produce` publishes N messages round-robin over the topics. Each carries
//!   its unique id (property `chaos-id`) and the outcome its handler is to
//!   have (`chaos-outcome`), chosen from the id by a hash; it writes
//!   `p <id> <outcome>` for every message the broker confirmed.
//! - `work` runs a dispatcher on the topics and the retry topic and appends
//!   one line per event to its log, each with a single `write` call and
//!   before the handler returns, so that a SIGKILL loses nothing already
//!   recorded: `ok <id> <m|r>` (handled successfully, from a main topic or
//!   the retry topic), `fatal <id>`, `retry <id> <n>`, `panic <id>`,
//!   `hang <id>`, a `stats k=v ...` line every second and at the end,
//!   `closed ms=<elapsed> cancelled=<n> limit_ms=<d>` after a close and
//!   `exit ok|err <error>` when `run()` returns. SIGTERM closes the
//!   dispatcher (`close()`, or `close_within(d)` with `--close-within-ms`).
//! - `drain` reads dead letter topics from their start with a plain
//!   consumer and writes `d <id> <topic>` per message.
//! - `mix --count N [--mix M]` prints how many of ids 0..N get each outcome
//!   (no broker needed).

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::error::Error as StdError;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::process::ExitCode;
use std::rc::Rc;
use std::str::FromStr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use pulsar_dispatcher::pulsar::consumer::InitialPosition;
use pulsar_dispatcher::pulsar::{self, ConsumerOptions, Pulsar, TokioExecutor};
use pulsar_dispatcher::{
    full_topic_name, Dispatcher, DispatcherStats, ErrorClass, Message, SubType, SubscribeOptions,
};

const USAGE: &str = "usage: chaos produce|work|drain|mix --key value ... (see chaos/src/main.rs)";

/// Property names on every produced message.
const ID_PROPERTY: &str = "chaos-id";
const OUTCOME_PROPERTY: &str = "chaos-outcome";
/// Start of the message of every panic a handler is told to raise; the
/// panic hook stays quiet about those.
const INTENDED_PANIC: &str = "chaos: intended panic";
/// How many sends `produce` keeps waiting for their receipts.
const PRODUCE_WINDOW: usize = 1000;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(command) = args.first().cloned() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let options = match Args::parse(&args[1..]) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("chaos {command}: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                // The socket watch's rare lines date connection losses,
                // which explain a lost ack recognised, or not.
                "warn,pulsar_dispatcher=info,pulsar_dispatcher::transport::sockets=debug".into()
            }),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let intended = info
            .payload()
            .downcast_ref::<String>()
            .is_some_and(|m| m.starts_with(INTENDED_PANIC));
        if !intended {
            default_hook(info);
        }
    }));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current_thread runtime");
    let local = tokio::task::LocalSet::new();
    let result = local.block_on(&runtime, async {
        match command.as_str() {
            "produce" => produce(&options).await,
            "work" => work(&options).await,
            "drain" => drain(&options).await,
            "mix" => mix(&options),
            other => Err(format!("unknown command `{other}`")),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chaos {command}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--key value` pairs.
struct Args(HashMap<String, String>);

impl Args {
    fn parse(args: &[String]) -> Result<Args, String> {
        let mut map = HashMap::new();
        let mut it = args.iter();
        while let Some(key) = it.next() {
            let key = key
                .strip_prefix("--")
                .ok_or_else(|| format!("expected --key, got `{key}`"))?;
            let value = it.next().ok_or_else(|| format!("--{key} needs a value"))?;
            map.insert(key.to_owned(), value.clone());
        }
        Ok(Args(map))
    }

    fn str(&self, key: &str) -> Result<&str, String> {
        self.0
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| format!("--{key} is required"))
    }

    fn list(&self, key: &str) -> Result<Vec<String>, String> {
        Ok(self
            .str(key)?
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect())
    }

    fn opt<T: FromStr>(&self, key: &str) -> Result<Option<T>, String> {
        self.0
            .get(key)
            .map(|v| v.parse().map_err(|_| format!("--{key}: bad value `{v}`")))
            .transpose()
    }

    fn or<T: FromStr>(&self, key: &str, default: T) -> Result<T, String> {
        Ok(self.opt(key)?.unwrap_or(default))
    }
}

/// What a message's handler is to do with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Outcome {
    /// Succeed.
    Ok,
    /// Fail with a fatal error: dead-lettered at once.
    Fatal,
    /// Fail with a retryable error the first time, succeed on the retry.
    RetryOk,
    /// Always fail with a retryable error: dead-lettered after the retries.
    RetryDlq,
    /// Panic the first time this process sees it (nacked), then succeed.
    PanicOnce,
    /// Hang the first time this process sees it on its main topic (past the
    /// processing deadline or until a shutdown deadline), then succeed.
    HangOnce,
}

impl Outcome {
    const ALL: [Outcome; 6] = [
        Outcome::Ok,
        Outcome::Fatal,
        Outcome::RetryOk,
        Outcome::RetryDlq,
        Outcome::PanicOnce,
        Outcome::HangOnce,
    ];

    fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Fatal => "fatal",
            Outcome::RetryOk => "retry-ok",
            Outcome::RetryDlq => "retry-dlq",
            Outcome::PanicOnce => "panic-once",
            Outcome::HangOnce => "hang-once",
        }
    }

    fn parse(name: &str) -> Option<Outcome> {
        Outcome::ALL.into_iter().find(|o| o.name() == name)
    }

    /// The outcome of message `id` in `mix`, in per mille: `standard` is
    /// 2% fatal, 2% panics, 5% retried then fine, 5% retried until
    /// dead-lettered (10% retryable in all), 86% fine; `hang` adds 3% hung
    /// handlers (taken from the fine ones); `ok` is all fine.
    fn for_id(id: u64, mix: &str) -> Outcome {
        let roll = splitmix64(id) % 1000;
        match (mix, roll) {
            ("ok", _) => Outcome::Ok,
            (_, 0..=19) => Outcome::Fatal,
            (_, 20..=39) => Outcome::PanicOnce,
            (_, 40..=89) => Outcome::RetryOk,
            (_, 90..=139) => Outcome::RetryDlq,
            ("hang", 140..=169) => Outcome::HangOnce,
            _ => Outcome::Ok,
        }
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn now_millis() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// An append-only log written one line per `write` call, with no buffer in
/// this process: what was written survives a SIGKILL.
struct Log(File);

impl Log {
    fn create(path: &str) -> Result<Log, String> {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map(Log)
            .map_err(|e| format!("opening {path}: {e}"))
    }

    fn line(&self, line: &str) {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        if let Err(e) = (&self.0).write_all(&bytes) {
            // Losing a record would make the counts wrong: stop loudly.
            eprintln!("chaos: cannot write the log: {e}");
            std::process::abort();
        }
    }
}

// ---------------------------------------------------------------- produce

async fn client(url: &str) -> Result<Pulsar<TokioExecutor>, String> {
    Pulsar::builder(url, TokioExecutor)
        .build()
        .await
        .map_err(|e| format!("connecting to {url}: {e}"))
}

async fn produce(args: &Args) -> Result<(), String> {
    let url = args.str("url")?;
    let topics = args.list("topics")?;
    if topics.is_empty() {
        return Err("--topics names no topic".into());
    }
    let count: u64 = args
        .opt("count")?
        .ok_or_else(|| "--count is required".to_string())?;
    let first: u64 = args.or("first-id", 0)?;
    let mix = args.0.get("mix").map_or("standard", String::as_str);
    let out_path = args.str("out")?;
    let mut out =
        BufWriter::new(File::create(out_path).map_err(|e| format!("creating {out_path}: {e}"))?);
    let client = client(url).await?;
    let mut producers = Vec::new();
    for topic in &topics {
        producers.push(
            client
                .producer()
                .with_topic(topic)
                .with_options(pulsar::ProducerOptions {
                    // Wait for room instead of failing with SlowDown.
                    block_queue_if_full: true,
                    ..Default::default()
                })
                .build()
                .await
                .map_err(|e| format!("producer on {topic}: {e}"))?,
        );
    }
    let begun = Instant::now();
    let mut pending = FuturesUnordered::new();
    let mut record = |(id, outcome, receipt): (u64, Outcome, Result<_, pulsar::Error>)| {
        receipt.map_err(|e| format!("message {id} was not confirmed: {e}"))?;
        writeln!(out, "p {id} {}", outcome.name()).map_err(|e| format!("{out_path}: {e}"))
    };
    for id in first..first + count {
        let outcome = Outcome::for_id(id, mix);
        let message = pulsar::producer::Message {
            payload: format!("chaos message {id}").into_bytes(),
            properties: HashMap::from([
                (ID_PROPERTY.to_owned(), id.to_string()),
                (OUTCOME_PROPERTY.to_owned(), outcome.name().to_owned()),
            ]),
            ..Default::default()
        };
        let producer = &mut producers[(id % topics.len() as u64) as usize];
        let receipt = producer
            .send_non_blocking(message)
            .await
            .map_err(|e| format!("sending message {id}: {e}"))?;
        pending.push(async move { (id, outcome, receipt.await) });
        while pending.len() >= PRODUCE_WINDOW {
            if let Some(done) = pending.next().await {
                record(done)?;
            }
        }
    }
    while let Some(done) = pending.next().await {
        record(done)?;
    }
    out.flush().map_err(|e| format!("{out_path}: {e}"))?;
    eprintln!(
        "chaos produce: {count} messages on {} topics in {:.1} s",
        topics.len(),
        begun.elapsed().as_secs_f64()
    );
    for mut producer in producers {
        let _ = producer.close().await;
    }
    Ok(())
}

// ---------------------------------------------------------------- work

#[derive(Debug)]
struct Fatal;

impl fmt::Display for Fatal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("chaos: fatal error")
    }
}

impl StdError for Fatal {}

#[derive(Debug)]
struct Retryable;

impl fmt::Display for Retryable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("chaos: retryable error")
    }
}

impl StdError for Retryable {}

/// The state every handler of one worker process shares.
struct Worker {
    log: Log,
    /// Longest simulated work per call; each message gets a share of it
    /// chosen from its id.
    handler_ms: u64,
    panicked: RefCell<HashSet<u64>>,
    hung: RefCell<HashSet<u64>>,
    hung_now: Cell<usize>,
    succeeded: Cell<u64>,
}

/// Counts a hung handler until its future is dropped (cancelled).
struct Hung<'a>(&'a Worker);

impl Drop for Hung<'_> {
    fn drop(&mut self) {
        self.0.hung_now.set(self.0.hung_now.get() - 1);
    }
}

impl Worker {
    async fn handle(&self, message: &Message) -> Result<(), Box<dyn StdError>> {
        let Some(id) = message
            .property(ID_PROPERTY)
            .and_then(|v| v.parse::<u64>().ok())
        else {
            self.log.line(&format!("bad {}", message.id()));
            return Err(Fatal.into());
        };
        let outcome = message
            .property(OUTCOME_PROPERTY)
            .and_then(Outcome::parse)
            .unwrap_or(Outcome::Ok);
        let retries: u32 = message
            .property("RECONSUMETIMES")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if self.handler_ms > 0 {
            let work = splitmix64(id ^ (u64::from(retries) << 40)) % (self.handler_ms + 1);
            tokio::time::sleep(Duration::from_millis(work)).await;
        }
        match outcome {
            Outcome::Fatal => {
                self.log.line(&format!("fatal {id}"));
                return Err(Fatal.into());
            }
            Outcome::RetryDlq => {
                self.log.line(&format!("retry {id} {retries}"));
                return Err(Retryable.into());
            }
            Outcome::RetryOk if retries == 0 => {
                self.log.line(&format!("retry {id} {retries}"));
                return Err(Retryable.into());
            }
            Outcome::PanicOnce if self.panicked.borrow_mut().insert(id) => {
                self.log.line(&format!("panic {id}"));
                panic!("{INTENDED_PANIC} (message {id})");
            }
            Outcome::HangOnce if retries == 0 && self.hung.borrow_mut().insert(id) => {
                self.log.line(&format!("hang {id}"));
                self.hung_now.set(self.hung_now.get() + 1);
                let _hung = Hung(self);
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            _ => {}
        }
        // Recorded before returning: the ack can only follow this line.
        let lane = if retries > 0 { "r" } else { "m" };
        self.log.line(&format!("ok {id} {lane}"));
        self.succeeded.set(self.succeeded.get() + 1);
        Ok(())
    }
}

fn stats_line(stats: &DispatcherStats, main_topics: &HashSet<String>) -> String {
    let total = stats.total();
    let main_acked: u64 = stats
        .subscriptions
        .iter()
        .filter(|s| main_topics.contains(&s.topic))
        .map(|s| s.acked)
        .sum();
    format!(
        "stats received={} dispatched={} succeeded={} failed={} panicked={} \
         deadline_exceeded={} retried={} dead_lettered={} acked={} acked_main={} nacked={} \
         acks_failed={} nacks_failed={} receive_errors={} redelivered_after_ack={} \
         rewinds_repeated={} dropped_in_flight={} redelivered_after_success={} in_flight={} \
         waiting={}",
        total.received,
        total.dispatched,
        total.succeeded,
        total.failed,
        total.panicked,
        total.deadline_exceeded,
        total.retried,
        total.dead_lettered,
        total.acked,
        main_acked,
        total.nacked,
        total.acks_failed,
        total.nacks_failed,
        total.receive_errors,
        total.redelivered_after_ack,
        total.rewinds_repeated,
        total.dropped_in_flight,
        total.redelivered_after_success,
        stats.in_flight,
        stats.waiting,
    )
}

async fn work(args: &Args) -> Result<(), String> {
    let url = args.str("url")?;
    let topics = args.list("topics")?;
    let retry_topic = args.str("retry-topic")?;
    let subscription = args.str("subscription")?;
    let concurrency: usize = args.or("concurrency", 20)?;
    let nack_delay = Duration::from_millis(args.or("nack-delay-ms", 200)?);
    let max_retries: u32 = args.or("max-retries", 2)?;
    let backoff_ms: u64 = args.or("backoff-ms", 500)?;
    let receiver_queue: u32 = args.or("receiver-queue", 1)?;
    let subscription_type = if args.or("exclusive", false)? {
        SubType::Exclusive
    } else {
        SubType::Shared
    };
    let processing_timeout: Option<u64> = args.opt("processing-timeout-ms")?;
    let shutdown_timeout: Option<u64> = args.opt("shutdown-timeout-ms")?;
    let close_within: Option<u64> = args.opt("close-within-ms")?;
    let close_when_hung_after: Option<u64> = args.opt("close-when-hung-after")?;
    let worker = Rc::new(Worker {
        log: Log::create(args.str("log")?)?,
        handler_ms: args.or("handler-ms", 4)?,
        panicked: RefCell::default(),
        hung: RefCell::default(),
        hung_now: Cell::new(0),
        succeeded: Cell::new(0),
    });
    worker.log.line(&format!(
        "start pid={} at_ms={}",
        std::process::id(),
        now_millis()
    ));

    let mut builder = Dispatcher::builder().concurrency(concurrency);
    if let Some(ms) = shutdown_timeout {
        builder = builder.shutdown_timeout(Duration::from_millis(ms));
    }
    let dispatcher = builder
        .connect(url)
        .await
        .map_err(|e| format!("connecting to {url}: {e}"))?;
    let main_topics: HashSet<String> = topics
        .iter()
        .map(|t| full_topic_name(t).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let options = SubscribeOptions::new()
        .subscription(subscription)
        .subscription_type(subscription_type)
        .receiver_queue_size(receiver_queue)
        .consumer_options(
            ConsumerOptions::default().with_initial_position(InitialPosition::Earliest),
        )
        .negative_ack_redelivery_delay(nack_delay)
        .fatal_errors(ErrorClass::of::<Fatal>())
        .retry_errors(ErrorClass::of::<Retryable>())
        .retry_topic(retry_topic)
        .max_retries(max_retries)
        .retry_backoff(move |n| Duration::from_millis(backoff_ms * u64::from(n)));
    let options = match processing_timeout {
        Some(ms) => options.processing_timeout(Duration::from_millis(ms)),
        None => options,
    };
    // Two priorities over the main topics, the retry topic below both.
    let half = topics.len().div_ceil(2);
    let lanes = topics
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), if i < half { 10 } else { 20 }))
        .chain([(retry_topic, 30)]);
    for (topic, priority) in lanes {
        let worker = worker.clone();
        let handler = async move |message: &Message| worker.handle(message).await;
        dispatcher
            .subscribe(topic, handler, options.clone().priority(priority))
            .await
            .map_err(|e| format!("subscribing to {topic}: {e}"))?;
    }
    worker.log.line("subscribed");

    let closer = dispatcher.close_handle();
    let close = {
        let worker = worker.clone();
        move |why: &'static str| {
            let closer = closer.clone();
            let worker = worker.clone();
            async move {
                worker.log.line(&format!(
                    "closing why={why} hung={} at_ms={}",
                    worker.hung_now.get(),
                    now_millis()
                ));
                let begun = Instant::now();
                let (cancelled, limit) = match close_within {
                    Some(ms) => (
                        closer.close_within(Duration::from_millis(ms)).await,
                        ms.to_string(),
                    ),
                    None => {
                        closer.close().await;
                        (0, "none".to_owned())
                    }
                };
                worker.log.line(&format!(
                    "closed ms={} cancelled={cancelled} limit_ms={limit}",
                    begun.elapsed().as_millis()
                ));
            }
        }
    };
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("SIGTERM handler: {e}"))?;
    let on_terminate = close.clone();
    tokio::task::spawn_local(async move {
        if terminate.recv().await.is_some() {
            on_terminate("sigterm").await;
        }
    });
    if let Some(after) = close_when_hung_after {
        let worker = worker.clone();
        tokio::task::spawn_local(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                if worker.succeeded.get() >= after && worker.hung_now.get() > 0 {
                    close("hung").await;
                    return;
                }
            }
        });
    }
    let stats_source = dispatcher.close_handle();
    let stats_worker = worker.clone();
    let stats_topics = main_topics.clone();
    tokio::task::spawn_local(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            match stats_source.stats() {
                Some(stats) => stats_worker.log.line(&stats_line(&stats, &stats_topics)),
                None => return,
            }
        }
    });

    let result = dispatcher.run().await;
    worker
        .log
        .line(&stats_line(&dispatcher.stats(), &main_topics));
    match &result {
        Ok(()) => worker.log.line("exit ok"),
        Err(e) => worker
            .log
            .line(&format!("exit err {}", e.to_string().replace('\n', " "))),
    }
    match result {
        Ok(()) | Err(pulsar_dispatcher::Error::HandlersCancelled { .. }) => Ok(()),
        Err(e) => Err(format!("run() failed: {e}")),
    }
}

// ---------------------------------------------------------------- mix

fn mix(args: &Args) -> Result<(), String> {
    let count: u64 = args
        .opt("count")?
        .ok_or_else(|| "--count is required".to_string())?;
    let mix = args.0.get("mix").map_or("standard", String::as_str);
    let mut counts: HashMap<Outcome, u64> = HashMap::new();
    for id in 0..count {
        *counts.entry(Outcome::for_id(id, mix)).or_default() += 1;
    }
    for outcome in Outcome::ALL {
        println!(
            "{} {}",
            outcome.name(),
            counts.get(&outcome).copied().unwrap_or(0)
        );
    }
    Ok(())
}

// ---------------------------------------------------------------- drain

async fn drain(args: &Args) -> Result<(), String> {
    let url = args.str("url")?;
    let topics = args.list("topics")?;
    let out_path = args.str("out")?;
    let expect: u64 = args.or("expect", 0)?;
    let idle = Duration::from_millis(args.or("idle-ms", 5000)?);
    let client = client(url).await?;
    let subscription = format!("chaos-drain-{}-{}", std::process::id(), now_millis());
    let seen = Rc::new(Cell::new(0u64));
    let last = Rc::new(Cell::new(Instant::now()));
    let lines = Rc::new(RefCell::new(Vec::<String>::new()));
    let mut tasks = Vec::new();
    for topic in &topics {
        let mut consumer: pulsar::Consumer<Vec<u8>, TokioExecutor> = client
            .consumer()
            .with_topic(topic)
            .with_subscription(&subscription)
            .with_subscription_type(SubType::Exclusive)
            .with_options(
                ConsumerOptions::default().with_initial_position(InitialPosition::Earliest),
            )
            .build()
            .await
            .map_err(|e| format!("reader on {topic}: {e}"))?;
        let (seen, last, lines, topic) = (seen.clone(), last.clone(), lines.clone(), topic.clone());
        tasks.push(tokio::task::spawn_local(async move {
            while let Some(received) = consumer.next().await {
                let Ok(message) = received else { continue };
                let id = message
                    .metadata()
                    .properties
                    .iter()
                    .find(|p| p.key == ID_PROPERTY)
                    .map_or_else(|| "?".to_owned(), |p| p.value.clone());
                lines.borrow_mut().push(format!("d {id} {topic}"));
                seen.set(seen.get() + 1);
                last.set(Instant::now());
                let _ = consumer.ack(&message).await;
            }
        }));
    }
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let quiet = last.get().elapsed();
        if (seen.get() >= expect && quiet > Duration::from_millis(1500)) || quiet > idle {
            break;
        }
    }
    for task in tasks {
        task.abort();
    }
    let mut text = lines.borrow().join("\n");
    text.push('\n');
    std::fs::write(Path::new(out_path), text).map_err(|e| format!("{out_path}: {e}"))?;
    eprintln!(
        "chaos drain: {} dead letters from {} topics",
        seen.get(),
        topics.len()
    );
    Ok(())
}
