//! The comparison run behind `cargo xtask bench`: every figure the design is
//! judged by, measured side by side in one process, printed as JSON lines
//! and as a table, and written to `target/bench-report.json`.
//!
//! `cargo bench --bench report -- [--quick] [--no-e2e] [--out PATH]`
//!
//! - in memory (no-op handlers, messages waiting before the clock starts):
//!   ours, the `spawn_local` floor, the multi-threaded port and the Python
//!   original on a fake client, on the same workload (K = 1, C = 20), plus
//!   the K × C matrix, scaling to 1000 subscriptions and allocations per
//!   message counted by this binary's global allocator;
//! - on the broker at `PULSAR_URL` (skipped with `--no-e2e`): ours against a
//!   plain `pulsar` consumer loop and against the Python original, at
//!   receiver queue sizes 1 and 1000, and one dispatcher per core at 1 and 2
//!   cores.
//!
//! The Python runs need `PULSAR_DISPATCHER_PYTHON` (a Python with
//! `pulsar-client` and `pulsar-dispatcher` 0.1.0); without it they are left
//! out of the report.
//!
//! Run without `--bench` (as `cargo test --benches` does), it checks that
//! each in-memory workload completes, on a handful of messages.
//!
//! `--profile ours|ours-k1000|ours-k1000-l16|floor|mt` runs one in-memory
//! workload once (for
//! `valgrind --tool=callgrind`); `--profile e2e-q<N>` runs ours and the
//! plain loop once on the broker at receiver queue size N.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use pulsar::consumer::InitialPosition;
use pulsar::{ConsumerOptions, Pulsar, SubType, TokioExecutor};
use pulsar_dispatcher::per_core::PerCore;
use pulsar_dispatcher::{Dispatcher, Message, SubscribeOptions};
use serde_json::{json, Map, Value};

use support::{mt_port, on_local, Workload};

/// Counts this thread's heap allocations.
struct CountingAllocator;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counter is a thread-local `Cell` with a const initialiser and no
// destructor, so touching it neither allocates nor re-enters.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

struct Options {
    quick: bool,
    e2e: bool,
    out: PathBuf,
}

impl Options {
    fn sizes(&self) -> Sizes {
        if self.quick {
            Sizes {
                repeats: 3,
                in_memory: 100_000,
                matrix: 30_000,
                scaling: 100_000,
                python_fake: 10_000,
                e2e: 20_000,
                e2e_queue_1: 300,
                python_e2e: 5_000,
                e2e_repeats: 2,
            }
        } else {
            Sizes {
                repeats: 7,
                in_memory: 300_000,
                matrix: 100_000,
                scaling: 300_000,
                python_fake: 30_000,
                e2e: 50_000,
                e2e_queue_1: 400,
                python_e2e: 10_000,
                e2e_repeats: 5,
            }
        }
    }
}

struct Sizes {
    repeats: usize,
    in_memory: usize,
    matrix: usize,
    scaling: usize,
    python_fake: usize,
    e2e: usize,
    e2e_queue_1: usize,
    python_e2e: usize,
    e2e_repeats: usize,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(at) = args.iter().position(|a| a == "--profile") {
        profile(args.get(at + 1).map(String::as_str).unwrap_or("ours"));
        return;
    }
    if !args.iter().any(|a| a == "--bench") {
        smoke();
        return;
    }
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|at| args.get(at + 1))
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-report.json")
        });
    let options = Options {
        quick: args.iter().any(|a| a == "--quick"),
        e2e: !args.iter().any(|a| a == "--no-e2e"),
        out,
    };
    let report = run(&options);
    print_table(&report);
    let text = serde_json::to_string_pretty(&report).expect("a JSON report");
    if let Some(dir) = options.out.parent() {
        std::fs::create_dir_all(dir).expect("creating the report's folder");
    }
    std::fs::write(&options.out, text + "\n").expect("writing the report");
    eprintln!("report written to {}", options.out.display());
}

/// Prints one measurement as a JSON line.
fn emit(record: Value) {
    println!("{record}");
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    values[values.len() / 2]
}

fn ns_per_msg(elapsed: Duration, messages: usize) -> f64 {
    elapsed.as_nanos() as f64 / messages as f64
}

fn ours_ns(workload: Workload) -> f64 {
    ns_per_msg(on_local(support::ours(workload)), workload.messages)
}

fn floor_ns(concurrency: usize, messages: usize) -> f64 {
    ns_per_msg(on_local(support::floor(concurrency, messages)), messages)
}

fn mt_ns(runtime: &tokio::runtime::Runtime, workload: Workload) -> f64 {
    let ns = ns_per_msg(mt_port::run(runtime, workload), workload.messages);
    let_workers_park();
    ns
}

/// The port's workers spin for a while before they park; give them time,
/// so that they do not compete with the single-threaded run that follows.
fn let_workers_park() {
    std::thread::sleep(Duration::from_millis(100));
}

/// CPU time used so far by every live thread of this process, in
/// nanoseconds (the first field of `/proc/self/task/*/schedstat`); 0 where
/// that is not available.
fn cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|stat| stat.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// CPU time used so far by the calling thread, in nanoseconds; 0 where
/// `/proc/thread-self/schedstat` is not available.
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|stat| stat.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Wall time and CPU time per message of one implementation.
#[derive(Default)]
struct Samples {
    wall: Vec<f64>,
    cpu: Vec<f64>,
}

impl Samples {
    fn push(&mut self, wall: f64, cpu: Option<f64>) {
        self.wall.push(wall);
        self.cpu.extend(cpu);
    }

    fn medians(self) -> (f64, f64) {
        let cpu = if self.cpu.is_empty() {
            f64::NAN
        } else {
            median(self.cpu)
        };
        (median(self.wall), cpu)
    }
}

/// Runs the three implementations in turn, `repeats` times, and returns
/// the medians (wall, CPU) of each, so that drift on the machine hits all of
/// them alike.
fn side_by_side(sizes: &Sizes, mt_runtime: &tokio::runtime::Runtime) -> [(f64, f64); 3] {
    let messages = sizes.in_memory;
    let workload = Workload::new(1, 20, messages);
    // Warm-up: page in the code and the allocator's arenas.
    ours_ns(workload.messages(20_000));
    floor_ns(20, 20_000);
    mt_ns(mt_runtime, workload.messages(20_000));
    let mut ours = Samples::default();
    let mut floor = Samples::default();
    let mut mt = Samples::default();
    for _ in 0..sizes.repeats {
        // The single-threaded runs count their own thread only, so that the
        // port's idle workers do not add to them.
        let run = on_local(support::ours_counted(workload, 1, Some(thread_cpu_ns)));
        ours.push(ns_per_msg(run.elapsed, messages), run.allocs_per_msg);
        let (elapsed, cpu) = on_local(support::floor_counted(20, messages, 0, Some(thread_cpu_ns)));
        floor.push(ns_per_msg(elapsed, messages), cpu);
        let (elapsed, cpu) = mt_port::run_counted(mt_runtime, workload, Some(cpu_ns));
        let_workers_park();
        mt.push(ns_per_msg(elapsed, messages), cpu);
    }
    [ours.medians(), floor.medians(), mt.medians()]
}

fn run(options: &Options) -> Map<String, Value> {
    let sizes = options.sizes();
    let mut report = Map::new();
    report.insert("quick".into(), json!(options.quick));
    report.insert(
        "cores".into(),
        json!(pulsar_dispatcher::per_core::available_cores()),
    );
    let mt_runtime = mt_port::runtime();

    eprintln!("in memory: ours, floor and multi-threaded port (K=1, C=20)");
    let [(ours, ours_cpu), (floor, floor_cpu), (mt, mt_cpu)] = side_by_side(&sizes, &mt_runtime);
    for (bench, ns, cpu) in [
        ("ours", ours, ours_cpu),
        ("floor", floor, floor_cpu),
        ("mt_port", mt, mt_cpu),
    ] {
        emit(
            json!({"bench": bench, "subscriptions": 1, "concurrency": 20,
                    "messages": sizes.in_memory, "ns_per_msg": ns, "cpu_ns_per_msg": cpu}),
        );
    }
    report.insert("dispatch_ns_per_msg".into(), json!(ours));
    report.insert("spawn_floor_ns_per_msg".into(), json!(floor));
    report.insert("mt_port_ns_per_msg".into(), json!(mt));
    report.insert("dispatch_cpu_ns_per_msg".into(), json!(ours_cpu));
    report.insert("spawn_floor_cpu_ns_per_msg".into(), json!(floor_cpu));
    report.insert("mt_port_cpu_ns_per_msg".into(), json!(mt_cpu));
    report.insert("dispatch_vs_floor".into(), json!(ours / floor));
    report.insert("mt_port_vs_dispatch".into(), json!(mt / ours));

    eprintln!("in memory: the Python original on a fake client (K=1, C=20)");
    match python() {
        Some(python) => match python_fake(&python, 1, 20, sizes.python_fake) {
            Ok(ns) => {
                emit(
                    json!({"bench": "python_fake", "subscriptions": 1, "concurrency": 20,
                            "messages": sizes.python_fake, "ns_per_msg": ns}),
                );
                report.insert("python_ref_ns_per_msg".into(), json!(ns));
                report.insert("python_ref_vs_dispatch".into(), json!(ns / ours));
            }
            Err(error) => eprintln!("  skipped: {error}"),
        },
        None => eprintln!("  skipped: PULSAR_DISPATCHER_PYTHON is not set"),
    }

    eprintln!("in memory: allocations per message in steady state");
    let allocs = on_local(support::ours_counted(
        Workload::new(1, 20, sizes.in_memory),
        sizes.in_memory / 10,
        Some(allocations),
    ))
    .allocs_per_msg
    .expect("counted");
    let (_, floor_allocs) = on_local(support::floor_counted(
        20,
        sizes.in_memory,
        sizes.in_memory / 10,
        Some(allocations),
    ));
    let floor_allocs = floor_allocs.expect("counted");
    let scheduler_allocs = scheduler_allocations(sizes.in_memory);
    emit(json!({"bench": "allocations", "ours_per_msg": allocs,
                "floor_per_msg": floor_allocs, "scheduler_per_msg": scheduler_allocs}));
    report.insert("allocs_per_msg".into(), json!(allocs));
    report.insert("floor_allocs_per_msg".into(), json!(floor_allocs));
    report.insert("scheduler_allocs_per_msg".into(), json!(scheduler_allocs));

    eprintln!("in memory: scaling with subscriptions (C=20)");
    let mut scaling = Map::new();
    for levels in [1usize, 16] {
        for subscriptions in [1usize, 10, 100, 1000] {
            let workload =
                Workload::new(subscriptions, 20, sizes.scaling).levels(levels.min(subscriptions));
            let ns = median((0..sizes.repeats).map(|_| ours_ns(workload)).collect());
            emit(
                json!({"bench": "scaling", "levels": levels, "subscriptions": subscriptions,
                        "messages": sizes.scaling, "ns_per_msg": ns}),
            );
            scaling.insert(format!("levels{levels}_subs{subscriptions}"), json!(ns));
        }
    }
    let ratio = |levels: usize| {
        scaling[&format!("levels{levels}_subs1000")]
            .as_f64()
            .unwrap()
            / scaling[&format!("levels{levels}_subs1")].as_f64().unwrap()
    };
    report.insert("scaling_1000_vs_1".into(), json!(ratio(1)));
    report.insert("scaling_1000_vs_1_16_levels".into(), json!(ratio(16)));
    report.insert("scaling_ns_per_msg".into(), Value::Object(scaling));

    eprintln!("in memory: K x C matrix");
    let mut matrix = Map::new();
    for concurrency in [1usize, 20, 256] {
        let floor = floor_ns(concurrency, sizes.matrix);
        matrix.insert(format!("floor_C{concurrency}"), json!(floor));
        emit(json!({"bench": "floor", "concurrency": concurrency,
                    "messages": sizes.matrix, "ns_per_msg": floor}));
        for subscriptions in [1usize, 10, 100] {
            let workload = Workload::new(subscriptions, concurrency, sizes.matrix);
            let ours = ours_ns(workload);
            let mt = mt_ns(&mt_runtime, workload);
            for (bench, ns) in [("ours", ours), ("mt_port", mt)] {
                emit(json!({"bench": bench, "subscriptions": subscriptions,
                            "concurrency": concurrency, "messages": sizes.matrix,
                            "ns_per_msg": ns}));
                matrix.insert(
                    format!("{bench}_K{subscriptions}_C{concurrency}"),
                    json!(ns),
                );
            }
        }
    }
    report.insert("matrix_ns_per_msg".into(), Value::Object(matrix));
    drop(mt_runtime);

    if options.e2e {
        e2e(&sizes, &mut report);
    }
    report
}

/// Allocations per message of the pure scheduler: insert, pick, release.
fn scheduler_allocations(messages: usize) -> f64 {
    let mut scheduler =
        pulsar_dispatcher::scheduler::Scheduler::new(std::num::NonZeroUsize::new(20).unwrap());
    let keys: Vec<_> = (0..16).map(|i| scheduler.add_subscription(i)).collect();
    let before = allocations();
    for index in 0..messages {
        let key = keys[index % keys.len()];
        scheduler.try_insert(key, index).expect("an empty slot");
        let Some((permit, _)) = scheduler.try_dispatch() else {
            unreachable!("a message and a permit are there");
        };
        scheduler.release(permit);
    }
    (allocations() - before) as f64 / messages as f64
}

fn python() -> Option<PathBuf> {
    std::env::var_os("PULSAR_DISPATCHER_PYTHON")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

fn python_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("benches/python")
        .join(name)
}

/// Runs a Python benchmark script and returns the JSON line it printed.
fn run_python(python: &PathBuf, script: &str, args: &[String]) -> Result<Value, String> {
    let output = Command::new(python)
        .arg(python_script(script))
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "{script} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        ));
    }
    stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .ok_or_else(|| format!("{script} printed no JSON line"))
}

fn python_fake(
    python: &PathBuf,
    subscriptions: usize,
    concurrency: usize,
    messages: usize,
) -> Result<f64, String> {
    let args = [
        "--subscriptions".to_string(),
        subscriptions.to_string(),
        "--concurrency".into(),
        concurrency.to_string(),
        "--messages".into(),
        messages.to_string(),
    ];
    let value = run_python(python, "fake_client_bench.py", &args)?;
    value["ns_per_msg"]
        .as_f64()
        .ok_or_else(|| "no ns_per_msg".into())
}

fn pulsar_url() -> String {
    std::env::var("PULSAR_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "pulsar://127.0.0.1:6650".into())
}

fn fresh_topic(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    format!(
        "persistent://public/default/bench-{what}-{nanos:x}-{}",
        std::process::id()
    )
}

const SUBSCRIPTION: &str = "bench";
const PAYLOAD_SIZE: usize = 64;

/// Creates the subscription (so that the broker keeps the messages for
/// it), then produces `messages` payloads of 64 bytes, at most 64 in
/// flight.
async fn produce(url: &str, topic: &str, messages: usize, sub_type: SubType) {
    let client = Pulsar::builder(url, TokioExecutor)
        .build()
        .await
        .expect("connecting to the broker");
    let mut consumer: pulsar::Consumer<Vec<u8>, TokioExecutor> = client
        .consumer()
        .with_topic(topic)
        .with_subscription(SUBSCRIPTION)
        .with_subscription_type(sub_type)
        .build()
        .await
        .expect("creating the subscription");
    consumer.close().await.expect("closing the first consumer");
    let mut producer = client
        .producer()
        .with_topic(topic)
        .build()
        .await
        .expect("creating a producer");
    let mut receipts = Vec::with_capacity(64);
    for _ in 0..messages {
        receipts.push(
            producer
                .send_non_blocking(vec![b'x'; PAYLOAD_SIZE])
                .await
                .expect("sending"),
        );
        if receipts.len() == 64 {
            for receipt in receipts.drain(..) {
                receipt.await.expect("a receipt");
            }
        }
    }
    for receipt in receipts.drain(..) {
        receipt.await.expect("a receipt");
    }
    producer.close().await.expect("closing the producer");
}

fn consumer_options(receiver_queue: u32) -> ConsumerOptions {
    ConsumerOptions {
        initial_position: InitialPosition::Earliest,
        receiver_queue_size: Some(receiver_queue),
        ..Default::default()
    }
}

/// A rate on the broker, with the CPU time this process spent per message
/// over the same window (the client's side only; the broker is another
/// process).
#[derive(Clone, Copy, Debug)]
struct Rate {
    msgs_per_s: f64,
    cpu_us_per_msg: f64,
}

impl Rate {
    fn between(start: (Instant, u64), end: (Instant, u64), messages: usize) -> Rate {
        Rate {
            msgs_per_s: messages as f64 / (end.0 - start.0).as_secs_f64(),
            cpu_us_per_msg: (end.1 - start.1) as f64 / 1e3 / messages as f64,
        }
    }
}

/// How many messages each broker run leaves out of its rate: the first
/// receiver queue's worth, which a client may already hold when it starts,
/// so that every implementation is measured in steady state.
fn e2e_warmup(messages: usize, receiver_queue: u32) -> usize {
    (receiver_queue as usize).min(messages * 3 / 4).max(1)
}

/// Ours on the broker: messages per second between the warm-up message and
/// the last handler.
async fn e2e_ours(url: &str, messages: usize, receiver_queue: u32) -> Rate {
    let warmup = e2e_warmup(messages, receiver_queue);
    let topic = fresh_topic("ours");
    produce(url, &topic, messages, SubType::Exclusive).await;
    let dispatcher = Dispatcher::builder()
        .concurrency(20)
        .connect(url)
        .await
        .expect("connecting");
    let count = std::rc::Rc::new(Cell::new(0usize));
    let done = std::rc::Rc::new(tokio::sync::Notify::new());
    let warm = std::rc::Rc::new(Cell::new(None));
    let handler = {
        let (count, done, warm) = (count.clone(), done.clone(), warm.clone());
        async move |_message: &Message| {
            count.set(count.get() + 1);
            if count.get() == warmup {
                warm.set(Some((Instant::now(), cpu_ns())));
            }
            if count.get() == messages {
                done.notify_one();
            }
            Ok::<(), std::convert::Infallible>(())
        }
    };
    let options = SubscribeOptions::new()
        .subscription(SUBSCRIPTION)
        .receiver_queue_size(receiver_queue)
        .consumer_options(consumer_options(receiver_queue));
    dispatcher
        .subscribe(&topic, handler, options)
        .await
        .expect("subscribing");
    let closer = dispatcher.close_handle();
    let mut end = None;
    let finish = async {
        done.notified().await;
        end = Some((Instant::now(), cpu_ns()));
        closer.close().await;
    };
    let (result, ()) = tokio::join!(dispatcher.run(), finish);
    result.expect("a clean run");
    Rate::between(
        warm.get().expect("warmed up"),
        end.expect("finished"),
        messages - warmup,
    )
}

/// Turns Nagle's algorithm off on this process's TCP connections to the
/// broker at `url`, as the library's Pulsar transport does for its own, so
/// that the plain loop is measured on the same footing. Linux only (it
/// finds the sockets under `/proc/self/fd`); returns how many it changed.
fn disable_nagle_towards(url: &str) -> usize {
    use std::net::ToSocketAddrs;
    use std::os::fd::{BorrowedFd, RawFd};
    let authority = url.split("://").nth(1).unwrap_or(url);
    let authority = authority.split('/').next().unwrap_or(authority);
    let Ok(brokers) = authority.to_socket_addrs() else {
        return 0;
    };
    let brokers: Vec<_> = brokers.collect();
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    fds.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<RawFd>().ok())
        .filter(|&fd| {
            // SAFETY: the descriptor was just listed as open; it is only
            // borrowed for these calls, which fail harmlessly if it is not
            // a socket.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let socket = socket2::SockRef::from(&fd);
            let to_broker = socket
                .peer_addr()
                .ok()
                .and_then(|peer| peer.as_socket())
                .is_some_and(|peer| brokers.contains(&peer));
            to_broker && socket.set_tcp_nodelay(true).is_ok()
        })
        .count()
}

/// The ceiling: a plain `pulsar` consumer loop that acks each message.
async fn e2e_raw(url: &str, messages: usize, receiver_queue: u32) -> Rate {
    use futures::StreamExt;
    let topic = fresh_topic("raw");
    produce(url, &topic, messages, SubType::Exclusive).await;
    let client = Pulsar::builder(url, TokioExecutor)
        .build()
        .await
        .expect("connecting");
    let mut consumer: pulsar::Consumer<Vec<u8>, TokioExecutor> = client
        .consumer()
        .with_topic(&topic)
        .with_subscription(SUBSCRIPTION)
        .with_batch_size(receiver_queue)
        .with_options(consumer_options(receiver_queue))
        .build()
        .await
        .expect("subscribing");
    disable_nagle_towards(url);
    let warmup = e2e_warmup(messages, receiver_queue);
    let mut start = (Instant::now(), cpu_ns());
    for index in 1..=messages {
        let message = consumer
            .next()
            .await
            .expect("the stream goes on")
            .expect("a message");
        consumer.ack(&message).await.expect("acking");
        if index == warmup {
            start = (Instant::now(), cpu_ns());
        }
    }
    let end = (Instant::now(), cpu_ns());
    consumer.close().await.expect("closing");
    Rate::between(start, end, messages - warmup)
}

/// One dispatcher per core on a Shared subscription: messages per second
/// from the moment every dispatcher runs until the last handler.
fn e2e_per_core(url: &str, cores: usize, messages: usize, receiver_queue: u32) -> f64 {
    let topic = fresh_topic("per-core");
    on_local(produce(url, &topic, messages, SubType::Shared));
    let count = Arc::new(AtomicUsize::new(0));
    let warmup = e2e_warmup(messages, receiver_queue);
    let (done_tx, done_rx) = mpsc::channel();
    let factory = {
        let (url, topic) = (url.to_string(), topic.clone());
        move |_core: usize| {
            let (url, topic, count, done) =
                (url.clone(), topic.clone(), count.clone(), done_tx.clone());
            async move {
                let dispatcher = Dispatcher::builder().concurrency(20).connect(&url).await?;
                let handler = async move |_message: &Message| {
                    let handled = count.fetch_add(1, Ordering::Relaxed) + 1;
                    if handled == warmup || handled == messages {
                        let _ = done.send(Instant::now());
                    }
                    Ok::<(), std::convert::Infallible>(())
                };
                let options = SubscribeOptions::new()
                    .subscription(SUBSCRIPTION)
                    .subscription_type(SubType::Shared)
                    .receiver_queue_size(receiver_queue)
                    .consumer_options(consumer_options(receiver_queue));
                dispatcher.subscribe(&topic, handler, options).await?;
                Ok(dispatcher)
            }
        }
    };
    let group = PerCore::start(cores, factory).expect("starting the dispatchers");
    let wait = || {
        done_rx
            .recv_timeout(Duration::from_secs(300))
            .expect("every message is handled")
    };
    let (start, end) = (wait(), wait());
    group.shutdown_handle().shutdown();
    for result in group.join() {
        result.expect("a clean run");
    }
    (messages - warmup) as f64 / (end - start).as_secs_f64()
}

fn e2e(sizes: &Sizes, report: &mut Map<String, Value>) {
    let url = pulsar_url();
    let mut e2e = Map::new();
    eprintln!("on the broker: warming the broker up");
    on_local(e2e_raw(&url, sizes.e2e / 4, 1000));
    on_local(e2e_ours(&url, sizes.e2e / 4, 1000));
    for receiver_queue in [1000u32, 1] {
        let messages = if receiver_queue == 1 {
            sizes.e2e_queue_1
        } else {
            sizes.e2e
        };
        eprintln!(
            "on the broker: ours and the plain consumer loop, receiver queue {receiver_queue}"
        );
        let (mut ours, mut raw) = (Vec::new(), Vec::new());
        for repeat in 0..sizes.e2e_repeats {
            // Alternate which goes first, so that drift hits both alike.
            if repeat % 2 == 1 {
                raw.push(on_local(e2e_raw(&url, messages, receiver_queue)));
            }
            ours.push(on_local(e2e_ours(&url, messages, receiver_queue)));
            if repeat % 2 == 0 {
                raw.push(on_local(e2e_raw(&url, messages, receiver_queue)));
            }
        }
        for (bench, samples) in [("e2e_ours_sample", &ours), ("e2e_raw_sample", &raw)] {
            for sample in samples.iter() {
                emit(json!({"bench": bench, "receiver_queue": receiver_queue,
                            "messages": messages, "msgs_per_s": sample.msgs_per_s,
                            "cpu_us_per_msg": sample.cpu_us_per_msg}));
            }
        }
        let ours_cpu = median(ours.iter().map(|r: &Rate| r.cpu_us_per_msg).collect());
        let raw_cpu = median(raw.iter().map(|r: &Rate| r.cpu_us_per_msg).collect());
        let ours = median(ours.iter().map(|r| r.msgs_per_s).collect());
        let raw = median(raw.iter().map(|r| r.msgs_per_s).collect());
        for (bench, rate, cpu) in [("e2e_ours", ours, ours_cpu), ("e2e_raw", raw, raw_cpu)] {
            emit(json!({"bench": bench, "receiver_queue": receiver_queue,
                        "messages": messages, "msgs_per_s": rate, "cpu_us_per_msg": cpu}));
        }
        e2e.insert(format!("ours_q{receiver_queue}"), json!(ours));
        e2e.insert(format!("raw_q{receiver_queue}"), json!(raw));
        e2e.insert(format!("ours_cpu_us_q{receiver_queue}"), json!(ours_cpu));
        e2e.insert(format!("raw_cpu_us_q{receiver_queue}"), json!(raw_cpu));
        if receiver_queue == 1000 {
            report.insert("e2e_msgs_per_s".into(), json!(ours));
            report.insert("e2e_raw_msgs_per_s".into(), json!(raw));
            report.insert("e2e_vs_raw".into(), json!(ours / raw));
            report.insert("e2e_cpu_us_per_msg".into(), json!(ours_cpu));
            report.insert("e2e_raw_cpu_us_per_msg".into(), json!(raw_cpu));
        } else {
            report.insert("e2e_q1_vs_raw".into(), json!(ours / raw));
        }
    }
    if let Some(python) = python() {
        for receiver_queue in [1000u32, 1] {
            eprintln!("on the broker: the Python original, receiver queue {receiver_queue}");
            let messages = if receiver_queue == 1 {
                sizes.python_e2e / 2
            } else {
                sizes.python_e2e
            };
            let args = [
                "--url".to_string(),
                url.clone(),
                "--topic".into(),
                fresh_topic("python"),
                "--messages".into(),
                messages.to_string(),
                "--receiver-queue".into(),
                receiver_queue.to_string(),
                "--warmup".into(),
                e2e_warmup(messages, receiver_queue).to_string(),
            ];
            // The C++ client has been seen to crash now and then on exit;
            // a fresh topic and another try make the figure.
            let mut attempt = run_python(&python, "e2e_bench.py", &args);
            for _ in 0..2 {
                if attempt.is_ok() {
                    break;
                }
                eprintln!("  retrying after: {}", attempt.as_ref().unwrap_err());
                let mut args = args.clone();
                args[3] = fresh_topic("python");
                attempt = run_python(&python, "e2e_bench.py", &args);
            }
            match attempt {
                Ok(value) => {
                    let rate = value["msgs_per_s"].as_f64().unwrap_or(f64::NAN);
                    let cpu = value["cpu_us_per_msg"].as_f64().unwrap_or(f64::NAN);
                    emit(
                        json!({"bench": "e2e_python", "receiver_queue": receiver_queue,
                                "messages": messages, "msgs_per_s": rate, "cpu_us_per_msg": cpu}),
                    );
                    e2e.insert(format!("python_q{receiver_queue}"), json!(rate));
                    e2e.insert(format!("python_cpu_us_q{receiver_queue}"), json!(cpu));
                    if receiver_queue == 1000 {
                        report.insert("e2e_python_msgs_per_s".into(), json!(rate));
                        report.insert("e2e_python_cpu_us_per_msg".into(), json!(cpu));
                    }
                }
                Err(error) => eprintln!("  skipped: {error}"),
            }
        }
    } else {
        eprintln!(
            "on the broker: the Python original skipped (PULSAR_DISPATCHER_PYTHON is not set)"
        );
    }
    eprintln!("on the broker: one dispatcher per core, 1 and 2 cores, receiver queue 1000");
    let (mut one, mut two) = (Vec::new(), Vec::new());
    for repeat in 0..sizes.e2e_repeats {
        if repeat % 2 == 1 {
            two.push(e2e_per_core(&url, 2, sizes.e2e, 1000));
        }
        one.push(e2e_per_core(&url, 1, sizes.e2e, 1000));
        if repeat % 2 == 0 {
            two.push(e2e_per_core(&url, 2, sizes.e2e, 1000));
        }
    }
    for (cores, samples) in [(1, &one), (2, &two)] {
        for rate in samples.iter() {
            emit(json!({"bench": "e2e_per_core_sample", "cores": cores,
                        "receiver_queue": 1000, "messages": sizes.e2e, "msgs_per_s": rate}));
        }
    }
    let (one, two) = (median(one), median(two));
    for (cores, rate) in [(1, one), (2, two)] {
        emit(
            json!({"bench": "e2e_per_core", "cores": cores, "receiver_queue": 1000,
                    "messages": sizes.e2e, "msgs_per_s": rate}),
        );
    }
    e2e.insert("per_core_1".into(), json!(one));
    e2e.insert("per_core_2".into(), json!(two));
    report.insert("per_core_2_vs_1".into(), json!(two / one));
    report.insert("e2e_msgs_per_s_detail".into(), Value::Object(e2e));
}

fn print_table(report: &Map<String, Value>) {
    let number = |key: &str| report.get(key).and_then(Value::as_f64);
    let show = |value: Option<f64>, unit: &str| match value {
        Some(v) if v >= 100.0 => format!("{v:>10.0} {unit}"),
        Some(v) => format!("{v:>10.2} {unit}"),
        None => format!("{:>10} {unit}", "n/a"),
    };
    let verdict = |ok: Option<bool>| match ok {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "n/a",
    };
    let ours = number("dispatch_ns_per_msg");
    let rows: Vec<(&str, String, String, &str)> = vec![
        (
            "dispatch, K=1 C=20 (ours)",
            show(ours, "ns/msg"),
            "".into(),
            "",
        ),
        (
            "spawn_local floor, C=20",
            show(number("spawn_floor_ns_per_msg"), "ns/msg"),
            format!(
                "ours/floor {}  (target <= 1.3x)",
                show(number("dispatch_vs_floor"), "x")
            ),
            verdict(number("dispatch_vs_floor").map(|r| r <= 1.3)),
        ),
        (
            "  CPU time per message (ours)",
            show(number("dispatch_cpu_ns_per_msg"), "ns/msg"),
            format!(
                "floor {} port {}",
                show(number("spawn_floor_cpu_ns_per_msg"), "ns"),
                show(number("mt_port_cpu_ns_per_msg"), "ns")
            ),
            "",
        ),
        (
            "multi-threaded port",
            show(number("mt_port_ns_per_msg"), "ns/msg"),
            format!(
                "port/ours  {}  (target >= 20x)",
                show(number("mt_port_vs_dispatch"), "x")
            ),
            verdict(number("mt_port_vs_dispatch").map(|r| r >= 20.0)),
        ),
        (
            "Python original, fake client",
            show(number("python_ref_ns_per_msg"), "ns/msg"),
            format!(
                "python/ours{}  (target >= 100x)",
                show(number("python_ref_vs_dispatch"), "x")
            ),
            verdict(number("python_ref_vs_dispatch").map(|r| r >= 100.0)),
        ),
        (
            "allocations per message",
            show(number("allocs_per_msg"), "allocs"),
            format!(
                "floor {} scheduler {}",
                show(number("floor_allocs_per_msg"), ""),
                show(number("scheduler_allocs_per_msg"), "")
            ),
            verdict(number("allocs_per_msg").map(|a| a <= 1.01)),
        ),
        (
            "1000 subs vs 1 (1 level)",
            show(number("scaling_1000_vs_1"), "x"),
            format!(
                "16 levels {}  (target <= 1.5x)",
                show(number("scaling_1000_vs_1_16_levels"), "x")
            ),
            verdict(number("scaling_1000_vs_1").map(|r| r <= 1.5)),
        ),
        (
            "e2e ours, queue 1000",
            show(number("e2e_msgs_per_s"), "msg/s"),
            format!(
                "ours/raw   {}  (target >= 0.9)",
                show(number("e2e_vs_raw"), "x")
            ),
            verdict(number("e2e_vs_raw").map(|r| r >= 0.9)),
        ),
        (
            "  client CPU per message (ours)",
            show(number("e2e_cpu_us_per_msg"), "us/msg"),
            format!(
                "raw {} python {}",
                show(number("e2e_raw_cpu_us_per_msg"), "us"),
                show(number("e2e_python_cpu_us_per_msg"), "us")
            ),
            "",
        ),
        (
            "e2e plain consumer loop",
            show(number("e2e_raw_msgs_per_s"), "msg/s"),
            format!("queue 1: ours/raw {}", show(number("e2e_q1_vs_raw"), "x")),
            "",
        ),
        (
            "e2e Python original",
            show(number("e2e_python_msgs_per_s"), "msg/s"),
            format!(
                "ours/python {}",
                show(
                    number("e2e_msgs_per_s")
                        .zip(number("e2e_python_msgs_per_s"))
                        .map(|(a, b)| a / b),
                    "x"
                )
            ),
            verdict(
                number("e2e_msgs_per_s")
                    .zip(number("e2e_python_msgs_per_s"))
                    .map(|(a, b)| a > 2.0 * b),
            ),
        ),
        (
            "per core, 2 vs 1",
            show(number("per_core_2_vs_1"), "x"),
            "".into(),
            "",
        ),
    ];
    println!();
    println!(
        "{:<32} {:>17}  {:<42} target",
        "benchmark", "figure", "comparison"
    );
    println!("{}", "-".repeat(100));
    for (name, figure, comparison, verdict) in rows {
        println!("{name:<32} {figure:>17}  {comparison:<42} {verdict}");
    }
    println!();
}

/// `cargo test --benches` runs this: each workload completes and is fully
/// acknowledged.
fn smoke() {
    let workload = Workload::new(3, 4, 200).levels(2);
    assert!(on_local(support::ours(workload)) > Duration::ZERO);
    assert!(on_local(support::floor(4, 200)) > Duration::ZERO);
    let runtime = mt_port::runtime();
    assert!(mt_port::run(&runtime, workload) > Duration::ZERO);
    let counted = on_local(support::ours_counted(workload, 100, Some(allocations)));
    assert!(counted.allocs_per_msg.expect("counted") > 0.0);
    assert_eq!(scheduler_allocations(1000), 0.0);
    println!("report: smoke run passed (run with --bench for figures)");
}

fn profile(what: &str) {
    if let Some(queue) = what.strip_prefix("e2e-q") {
        // Ours and the plain loop on the broker at one receiver queue size.
        let queue: u32 = queue.parse().expect("e2e-q<receiver queue size>");
        let messages = if queue == 1 { 200 } else { 20_000 };
        let url = pulsar_url();
        let ours = on_local(e2e_ours(&url, messages, queue));
        let raw = on_local(e2e_raw(&url, messages, queue));
        println!("receiver queue {queue}: ours {ours:?}, plain loop {raw:?}");
        return;
    }
    let workload = Workload::new(1, 20, 50_000);
    let elapsed = match what {
        "ours" => on_local(support::ours(workload)),
        "ours-k1000" => on_local(support::ours(Workload::new(1000, 20, 50_000))),
        "ours-k1000-l16" => on_local(support::ours(Workload::new(1000, 20, 50_000).levels(16))),
        "floor" => on_local(support::floor(20, workload.messages)),
        "mt" => mt_port::run(&mt_port::runtime(), workload),
        other => panic!("unknown profile target {other}; use ours, floor, mt or e2e-q<N>"),
    };
    println!(
        "{what}: {:.0} ns/msg (a Message is {} bytes)",
        ns_per_msg(elapsed, workload.messages),
        std::mem::size_of::<Message>()
    );
}
