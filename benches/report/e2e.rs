//! The broker part of the report: ours against a plain `pulsar` consumer
//! loop, the library's Pulsar transport in a plain loop, and the Python
//! original, on the broker at `PULSAR_URL`.
//!
//! - Rates at receiver queue 1000 and 1, with the client CPU time and the
//!   allocations per message over the same window. Every Rust consumer
//!   uses an Exclusive subscription (ours' default), so that the plain loop
//!   pays for the same subscription type. The transport loop (receive
//!   through `PulsarTransport`'s consumer, ack through it, nothing else)
//!   splits the client's cost between the `pulsar` crate (the plain loop),
//!   the library's transport (the transport loop minus the plain loop) and
//!   the dispatcher (ours minus the transport loop).
//! - Publish to handler start at a fixed rate: a producer on a thread of
//!   its own stamps each payload with the wall clock just before sending;
//!   the handler subtracts it from the wall clock when it starts.
//! - One dispatcher per core on a Shared subscription (the broker shares
//!   the two cores, so this cannot show scaling here; see `per_core_mem`).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pulsar::consumer::InitialPosition;
use pulsar::{ConsumerOptions, Pulsar, SubType, TokioExecutor};
use pulsar_dispatcher::per_core::PerCore;
use pulsar_dispatcher::transport::{Consumer, ConsumerSpec, PulsarTransport, Transport};
use pulsar_dispatcher::{Dispatcher, Message, SubscribeOptions};
use serde_json::{json, Map, Value};

use super::support::{on_local, receive_into};
use super::{
    allocations, cpu_ns, emit, insert, median, one_and_two, python, python_script, run_python,
    steady_part, successful_runs, Percentiles, Sizes,
};

pub fn pulsar_url() -> String {
    std::env::var("PULSAR_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "pulsar://127.0.0.1:6650".into())
}

fn fresh_topic(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    format!(
        "persistent://public/default/bench-{what}-{nanos:x}-{}",
        std::process::id()
    )
}

const SUBSCRIPTION: &str = "bench";
const PAYLOAD_SIZE: usize = 64;
/// Messages per second of the latency runs: well below every consumer's
/// saturation, so that the figure is the path, not a queue.
const LATENCY_RATE: f64 = 2_000.0;

/// The wall clock in nanoseconds since 1970 (the same clock in every
/// process on the machine, so that a payload stamped by one process can be
/// compared in another).
fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos() as u64
}

/// How long ago the payload was stamped by [`produce_at_rate`].
fn age_of(payload: &[u8]) -> u64 {
    let stamp = u64::from_le_bytes(payload[..8].try_into().expect("a stamped payload"));
    wall_ns().saturating_sub(stamp)
}

/// Creates the subscription (so that the broker keeps the messages for
/// it), then produces `messages` payloads of 64 bytes.
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
        .with_options(waiting_producer())
        .build()
        .await
        .expect("creating a producer");
    let mut receipts = Vec::with_capacity(messages);
    for _ in 0..messages {
        let payload = vec![b'x'; PAYLOAD_SIZE];
        receipts.push(producer.send_non_blocking(payload).await.expect("sending"));
    }
    for receipt in receipts {
        receipt.await.expect("a receipt");
    }
    producer.close().await.expect("closing the producer");
}

/// Options for a producer whose send waits for room when the crate's
/// outbound queue (100 sends per connection) is full, instead of failing.
fn waiting_producer() -> pulsar::ProducerOptions {
    pulsar::ProducerOptions {
        block_queue_if_full: true,
        ..Default::default()
    }
}

/// Produces `messages` payloads of 64 bytes at `rate` per second from a
/// thread of its own, each stamped with the wall clock just before it is
/// sent. The producing loop sleeps on its own thread; the connection runs on
/// a runtime worker of its own.
fn produce_at_rate(
    url: String,
    topic: String,
    messages: usize,
    rate: f64,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime for the producer");
        runtime.block_on(async move {
            let client = Pulsar::builder(&url, TokioExecutor)
                .build()
                .await
                .expect("connecting to the broker");
            // Up to 256 sends in flight, more than the crate queues per
            // connection: a send waits for room rather than failing.
            let mut producer = client
                .producer()
                .with_topic(&topic)
                .with_options(waiting_producer())
                .build()
                .await
                .expect("creating a producer");
            disable_nagle_towards(&url);
            let interval = Duration::from_secs_f64(1.0 / rate);
            let start = Instant::now();
            let mut receipts = VecDeque::new();
            for index in 0..messages {
                let due = start + interval.mul_f64(index as f64);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                let mut payload = vec![b'x'; PAYLOAD_SIZE];
                payload[..8].copy_from_slice(&wall_ns().to_le_bytes());
                receipts.push_back(producer.send_non_blocking(payload).await.expect("sending"));
                while receipts.len() > 256 {
                    let receipt = receipts.pop_front().expect("a receipt");
                    receipt.await.expect("a receipt");
                }
            }
            for receipt in receipts {
                receipt.await.expect("a receipt");
            }
            producer.close().await.expect("closing the producer");
        })
    })
}

fn consumer_options(receiver_queue: u32) -> ConsumerOptions {
    ConsumerOptions {
        initial_position: InitialPosition::Earliest,
        receiver_queue_size: Some(receiver_queue),
        ..Default::default()
    }
}

/// A rate on the broker, with the CPU time this process spent per message
/// and the allocations this thread made per message over the same window
/// (the client's side only; the broker is another process).
#[derive(Clone, Copy, Debug)]
pub struct Rate {
    msgs_per_s: f64,
    cpu_us_per_msg: f64,
    allocs_per_msg: f64,
}

/// A point of a run: wall clock, process CPU time, this thread's
/// allocations.
type Mark = (Instant, u64, u64);

fn mark() -> Mark {
    // Allocations first: reading the clocks allocates nothing, but keep
    // the order the same at both ends.
    let allocs = allocations();
    (Instant::now(), cpu_ns(), allocs)
}

impl Rate {
    fn between(start: Mark, end: Mark, messages: usize) -> Rate {
        Rate {
            msgs_per_s: messages as f64 / (end.0 - start.0).as_secs_f64(),
            cpu_us_per_msg: (end.1 - start.1) as f64 / 1e3 / messages as f64,
            allocs_per_msg: (end.2 - start.2) as f64 / messages as f64,
        }
    }
}

/// How many messages each broker run leaves out of its rate: the first
/// receiver queue's worth, which a client may already hold when it starts,
/// so that every implementation is measured in steady state.
fn e2e_warmup(messages: usize, receiver_queue: u32) -> usize {
    (receiver_queue as usize).min(messages * 3 / 4).max(1)
}

fn subscribe_options(receiver_queue: u32) -> SubscribeOptions {
    SubscribeOptions::new()
        .subscription(SUBSCRIPTION)
        .receiver_queue_size(receiver_queue)
        .consumer_options(consumer_options(receiver_queue))
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
    let count = Rc::new(Cell::new(0usize));
    let done = Rc::new(tokio::sync::Notify::new());
    let warm = Rc::new(Cell::new(None));
    let handler = {
        let (count, done, warm) = (count.clone(), done.clone(), warm.clone());
        async move |_message: &Message| {
            count.set(count.get() + 1);
            if count.get() == warmup {
                warm.set(Some(mark()));
            }
            if count.get() == messages {
                done.notify_one();
            }
            Ok::<(), std::convert::Infallible>(())
        }
    };
    dispatcher
        .subscribe(&topic, handler, subscribe_options(receiver_queue))
        .await
        .expect("subscribing");
    let closer = dispatcher.close_handle();
    let mut end = None;
    let finish = async {
        done.notified().await;
        end = Some(mark());
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

/// A plain `pulsar` crate consumer on an Exclusive subscription (ours'
/// default type), with Nagle's algorithm off like ours.
async fn raw_consumer(
    url: &str,
    topic: &str,
    receiver_queue: u32,
) -> pulsar::Consumer<Vec<u8>, TokioExecutor> {
    let client = Pulsar::builder(url, TokioExecutor)
        .build()
        .await
        .expect("connecting");
    let consumer = client
        .consumer()
        .with_topic(topic)
        .with_subscription(SUBSCRIPTION)
        .with_subscription_type(SubType::Exclusive)
        .with_batch_size(receiver_queue)
        .with_options(consumer_options(receiver_queue))
        .build()
        .await
        .expect("subscribing");
    disable_nagle_towards(url);
    consumer
}

/// The plain loop: a `pulsar` consumer that receives and acks each message.
async fn e2e_raw(url: &str, messages: usize, receiver_queue: u32) -> Rate {
    e2e_raw_acking(url, messages, receiver_queue, 1).await
}

/// How many messages the cumulatively acking plain loop acks at once.
const CUMULATIVE_GROUP: usize = 100;

/// The plain loop, acking every `group`-th message cumulatively (and the
/// last one), which an Exclusive subscription allows: what grouping acks
/// would save (the crate sends one `CommandAck` frame, one `writev`, per
/// ack). With `group` 1, every message is acked on its own.
async fn e2e_raw_acking(url: &str, messages: usize, receiver_queue: u32, group: usize) -> Rate {
    use futures::StreamExt;
    let topic = fresh_topic("raw");
    produce(url, &topic, messages, SubType::Exclusive).await;
    let mut consumer = raw_consumer(url, &topic, receiver_queue).await;
    let warmup = e2e_warmup(messages, receiver_queue);
    let mut start = mark();
    for index in 1..=messages {
        let message = consumer
            .next()
            .await
            .expect("the stream goes on")
            .expect("a message");
        if group == 1 {
            consumer.ack(&message).await.expect("acking");
        } else if index % group == 0 || index == messages {
            consumer.cumulative_ack(&message).await.expect("acking");
        }
        if index == warmup {
            start = mark();
        }
    }
    let end = mark();
    consumer.close().await.expect("closing");
    Rate::between(start, end, messages - warmup)
}

/// The library's Pulsar transport in a plain loop: receive through its
/// consumer (which converts each message), ack through it, nothing else.
async fn e2e_transport(url: &str, messages: usize, receiver_queue: u32) -> Rate {
    let topic = fresh_topic("transport");
    produce(url, &topic, messages, SubType::Exclusive).await;
    let client = Pulsar::builder(url, TokioExecutor)
        .build()
        .await
        .expect("connecting");
    let transport = PulsarTransport::from_client(client);
    let mut spec = ConsumerSpec::new(topic.as_str());
    spec.subscription = Some(SUBSCRIPTION.into());
    spec.subscription_type = SubType::Exclusive;
    spec.receiver_queue_size = receiver_queue;
    spec.consumer_options = consumer_options(receiver_queue);
    let mut consumer = transport.subscribe(&spec).await.expect("subscribing");
    let warmup = e2e_warmup(messages, receiver_queue);
    let mut start = mark();
    let mut slot = None;
    for index in 1..=messages {
        receive_into(&mut consumer, &mut slot).await;
        let message = slot.as_ref().expect("received into the slot");
        consumer.ack(message.id()).expect("acking");
        if index == warmup {
            start = mark();
        }
    }
    let end = mark();
    consumer.close().await.expect("closing");
    transport.close().await.expect("closing the transport");
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
                let options = subscribe_options(receiver_queue).subscription_type(SubType::Shared);
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

/// How long a fixed-rate run may take to receive all of its `messages`:
/// their publishing time and a minute. A run past it fails instead of
/// waiting for messages a failed producer never sent.
fn arrival_limit(messages: usize) -> Duration {
    Duration::from_secs_f64(messages as f64 / LATENCY_RATE) + Duration::from_secs(60)
}

fn too_few_arrived(count: usize, messages: usize) -> ! {
    panic!("{count} of {messages} messages arrived in time (did the producer fail?)")
}

/// Ours, publish to handler start: the dispatcher subscribes, then the
/// producer starts at [`LATENCY_RATE`].
async fn latency_ours(url: &str, messages: usize) -> Vec<u64> {
    let topic = fresh_topic("latency-ours");
    let dispatcher = Dispatcher::builder()
        .concurrency(20)
        .connect(url)
        .await
        .expect("connecting");
    let ages = Rc::new(RefCell::new(Vec::with_capacity(messages)));
    let done = Rc::new(tokio::sync::Notify::new());
    let handler = {
        let (ages, done) = (ages.clone(), done.clone());
        async move |message: &Message| {
            let age = age_of(message.payload());
            let mut ages = ages.borrow_mut();
            ages.push(age);
            if ages.len() == messages {
                done.notify_one();
            }
            Ok::<(), std::convert::Infallible>(())
        }
    };
    dispatcher
        .subscribe(&topic, handler, subscribe_options(1000))
        .await
        .expect("subscribing");
    let producer = produce_at_rate(url.into(), topic, messages, LATENCY_RATE);
    let closer = dispatcher.close_handle();
    let finish = async {
        let arrived = tokio::time::timeout(arrival_limit(messages), done.notified()).await;
        if arrived.is_err() {
            too_few_arrived(ages.borrow().len(), messages);
        }
        closer.close().await;
    };
    let (result, ()) = tokio::join!(dispatcher.run(), finish);
    result.expect("a clean run");
    producer.join().expect("the producer does not panic");
    ages.take()
}

/// The plain loop, publish to the message received (where its handler
/// would start).
async fn latency_raw(url: &str, messages: usize) -> Vec<u64> {
    use futures::StreamExt;
    let topic = fresh_topic("latency-raw");
    let mut consumer = raw_consumer(url, &topic, 1000).await;
    let producer = produce_at_rate(url.into(), topic, messages, LATENCY_RATE);
    let mut ages = Vec::with_capacity(messages);
    let deadline = tokio::time::Instant::now() + arrival_limit(messages);
    for _ in 0..messages {
        let message = tokio::time::timeout_at(deadline, consumer.next())
            .await
            .unwrap_or_else(|_| too_few_arrived(ages.len(), messages))
            .expect("the stream goes on")
            .expect("a message");
        ages.push(age_of(&message.payload.data));
        consumer.ack(&message).await.expect("acking");
    }
    consumer.close().await.expect("closing");
    producer.join().expect("the producer does not panic");
    ages
}

/// The Python original, publish to handler start: the script subscribes,
/// says `ready`, and the same producer as for ours starts.
fn latency_python(
    python: &std::path::Path,
    url: &str,
    messages: usize,
) -> Result<Vec<u64>, String> {
    let topic = fresh_topic("latency-python");
    let mut child = Command::new(python)
        .arg(python_script("e2e_bench.py"))
        .args(["--url", url, "--topic", &topic, "--latency"])
        .args(["--messages", &messages.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let ready = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|line| line == "ready");
    if !ready {
        let _ = child.kill();
        let _ = child.wait();
        return Err("the script did not get ready".into());
    }
    let producer = produce_at_rate(url.into(), topic, messages, LATENCY_RATE);
    let result = lines
        .map_while(Result::ok)
        .find_map(|line| serde_json::from_str::<Value>(&line).ok());
    let status = child.wait().map_err(|e| e.to_string())?;
    producer.join().expect("the producer does not panic");
    let value =
        result.ok_or_else(|| format!("e2e_bench.py --latency printed no JSON ({status})"))?;
    value["ages_ns"]
        .as_array()
        .map(|ages| ages.iter().filter_map(Value::as_u64).collect())
        .ok_or_else(|| "no ages_ns".into())
}

fn python_e2e(
    python: &std::path::Path,
    url: &str,
    messages: usize,
    receiver_queue: u32,
) -> Result<Rate, String> {
    let args = [
        "--url".to_string(),
        url.into(),
        "--topic".into(),
        fresh_topic("python"),
        "--messages".into(),
        messages.to_string(),
        "--receiver-queue".into(),
        receiver_queue.to_string(),
        "--warmup".into(),
        e2e_warmup(messages, receiver_queue).to_string(),
    ];
    // The C++ client has been seen to crash now and then on exit: the
    // caller tries again ([`successful_runs`]), each try on a fresh topic.
    let value = run_python(&python.to_path_buf(), "e2e_bench.py", &args)?;
    Ok(Rate {
        msgs_per_s: value["msgs_per_s"].as_f64().unwrap_or(f64::NAN),
        cpu_us_per_msg: value["cpu_us_per_msg"].as_f64().unwrap_or(f64::NAN),
        allocs_per_msg: f64::NAN,
    })
}

fn medians(runs: &[Rate]) -> Rate {
    Rate {
        msgs_per_s: median(runs.iter().map(|r| r.msgs_per_s).collect()),
        cpu_us_per_msg: median(runs.iter().map(|r| r.cpu_us_per_msg).collect()),
        allocs_per_msg: median(runs.iter().map(|r| r.allocs_per_msg).collect()),
    }
}

pub fn run(sizes: &Sizes, report: &mut Map<String, Value>) {
    let url = &pulsar_url();
    let mut detail = Map::new();
    eprintln!("on the broker: warming the broker up");
    on_local(e2e_raw(url, sizes.e2e / 4, 1000));
    on_local(e2e_ours(url, sizes.e2e / 4, 1000));
    on_local(e2e_transport(url, sizes.e2e / 4, 1000));
    for receiver_queue in [1000u32, 1] {
        rates(url, sizes, receiver_queue, &mut detail, report);
    }
    let python = python();
    python_rates(python.as_deref(), url, sizes, &mut detail, report);
    latencies(python.as_deref(), url, sizes, report);
    per_core(url, sizes, &mut detail, report);
    insert(report, "e2e_msgs_per_s_detail", Value::Object(detail));
}

/// Ours, the plain loop, and with the large queue the transport loop and a
/// plain loop acking cumulatively, in rotating order: rate, client CPU and
/// allocations per message.
fn rates(
    url: &str,
    sizes: &Sizes,
    receiver_queue: u32,
    detail: &mut Map<String, Value>,
    report: &mut Map<String, Value>,
) {
    let messages = if receiver_queue == 1 {
        sizes.e2e_queue_1
    } else {
        sizes.e2e
    };
    eprintln!(
        "on the broker: ours, the plain loop{}, receiver queue {receiver_queue}",
        if receiver_queue == 1000 {
            " and the transport loop"
        } else {
            ""
        }
    );
    let (mut ours, mut raw, mut transport, mut cumulative) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for repeat in 0..sizes.e2e_repeats {
        // Rotate which goes first, so that drift hits all alike.
        let mut order: Vec<&str> = vec!["ours", "raw", "transport", "cumulative"];
        if receiver_queue != 1000 {
            order.truncate(2);
        }
        let turn = repeat % order.len();
        order.rotate_left(turn);
        for which in order {
            match which {
                "ours" => ours.push(on_local(e2e_ours(url, messages, receiver_queue))),
                "raw" => raw.push(on_local(e2e_raw(url, messages, receiver_queue))),
                "cumulative" => cumulative.push(on_local(e2e_raw_acking(
                    url,
                    messages,
                    receiver_queue,
                    CUMULATIVE_GROUP,
                ))),
                _ => transport.push(on_local(e2e_transport(url, messages, receiver_queue))),
            }
        }
    }
    for (bench, samples) in [
        ("e2e_ours_sample", &ours),
        ("e2e_raw_sample", &raw),
        ("e2e_transport_sample", &transport),
        ("e2e_raw_cumulative_sample", &cumulative),
    ] {
        for sample in samples.iter() {
            emit(json!({"bench": bench, "receiver_queue": receiver_queue,
                        "messages": messages, "msgs_per_s": sample.msgs_per_s,
                        "cpu_us_per_msg": sample.cpu_us_per_msg,
                        "allocs_per_msg": sample.allocs_per_msg}));
        }
    }
    let (ours, raw) = (medians(&ours), medians(&raw));
    for (bench, rate) in [("e2e_ours", ours), ("e2e_raw", raw)] {
        emit(json!({"bench": bench, "receiver_queue": receiver_queue,
                    "messages": messages, "msgs_per_s": rate.msgs_per_s,
                    "cpu_us_per_msg": rate.cpu_us_per_msg,
                    "allocs_per_msg": rate.allocs_per_msg}));
    }
    let q = receiver_queue;
    detail.insert(format!("ours_q{q}"), json!(ours.msgs_per_s));
    detail.insert(format!("raw_q{q}"), json!(raw.msgs_per_s));
    detail.insert(format!("ours_cpu_us_q{q}"), json!(ours.cpu_us_per_msg));
    detail.insert(format!("raw_cpu_us_q{q}"), json!(raw.cpu_us_per_msg));
    detail.insert(format!("ours_allocs_q{q}"), json!(ours.allocs_per_msg));
    detail.insert(format!("raw_allocs_q{q}"), json!(raw.allocs_per_msg));
    if receiver_queue == 1000 {
        let transport = medians(&transport);
        emit(
            json!({"bench": "e2e_transport", "receiver_queue": receiver_queue,
                    "messages": messages, "msgs_per_s": transport.msgs_per_s,
                    "cpu_us_per_msg": transport.cpu_us_per_msg,
                    "allocs_per_msg": transport.allocs_per_msg}),
        );
        detail.insert("transport_q1000".into(), json!(transport.msgs_per_s));
        detail.insert(
            "transport_cpu_us_q1000".into(),
            json!(transport.cpu_us_per_msg),
        );
        insert(report, "e2e_msgs_per_s", ours.msgs_per_s);
        insert(report, "e2e_raw_msgs_per_s", raw.msgs_per_s);
        insert(report, "e2e_transport_msgs_per_s", transport.msgs_per_s);
        insert(report, "e2e_vs_raw", ours.msgs_per_s / raw.msgs_per_s);
        insert(report, "e2e_cpu_us_per_msg", ours.cpu_us_per_msg);
        insert(report, "e2e_raw_cpu_us_per_msg", raw.cpu_us_per_msg);
        insert(
            report,
            "e2e_transport_cpu_us_per_msg",
            transport.cpu_us_per_msg,
        );
        insert(
            report,
            "e2e_cpu_vs_raw",
            ours.cpu_us_per_msg / raw.cpu_us_per_msg,
        );
        let cumulative = medians(&cumulative);
        insert(
            report,
            "e2e_raw_cumulative_cpu_us_per_msg",
            cumulative.cpu_us_per_msg,
        );
        insert(
            report,
            "e2e_cpu_vs_raw_cumulative",
            ours.cpu_us_per_msg / cumulative.cpu_us_per_msg,
        );
        insert(report, "e2e_allocs_per_msg", ours.allocs_per_msg);
        insert(report, "e2e_raw_allocs_per_msg", raw.allocs_per_msg);
        insert(
            report,
            "e2e_transport_allocs_per_msg",
            transport.allocs_per_msg,
        );
        insert(
            report,
            "pulsar_transport_allocs_per_msg",
            transport.allocs_per_msg - raw.allocs_per_msg,
        );
    } else {
        insert(report, "e2e_q1_vs_raw", ours.msgs_per_s / raw.msgs_per_s);
        insert(
            report,
            "e2e_q1_cpu_vs_raw",
            ours.cpu_us_per_msg / raw.cpu_us_per_msg,
        );
    }
}

/// The Python original on the broker, the median of three runs per
/// receiver queue (fewer, said so, if six tries did not make three).
fn python_rates(
    python: Option<&std::path::Path>,
    url: &str,
    sizes: &Sizes,
    detail: &mut Map<String, Value>,
    report: &mut Map<String, Value>,
) {
    match python {
        Some(python) => {
            for receiver_queue in [1000u32, 1] {
                eprintln!("on the broker: the Python original, receiver queue {receiver_queue}");
                let messages = if receiver_queue == 1 {
                    sizes.python_e2e / 2
                } else {
                    sizes.python_e2e
                };
                let wanted = sizes.python_repeats.min(3);
                let runs = successful_runs(wanted, "the Python original (broker)", || {
                    python_e2e(python, url, messages, receiver_queue)
                });
                if runs.is_empty() {
                    continue;
                }
                let rate = medians(&runs);
                emit(
                    json!({"bench": "e2e_python", "receiver_queue": receiver_queue,
                            "messages": messages, "runs": runs.len(), "runs_wanted": wanted,
                            "msgs_per_s": rate.msgs_per_s,
                            "cpu_us_per_msg": rate.cpu_us_per_msg}),
                );
                detail.insert(format!("python_q{receiver_queue}"), json!(rate.msgs_per_s));
                detail.insert(
                    format!("python_cpu_us_q{receiver_queue}"),
                    json!(rate.cpu_us_per_msg),
                );
                detail.insert(format!("python_runs_q{receiver_queue}"), json!(runs.len()));
                detail.insert(
                    format!("python_runs_wanted_q{receiver_queue}"),
                    json!(wanted),
                );
                if receiver_queue == 1000 {
                    insert(report, "e2e_python_msgs_per_s", rate.msgs_per_s);
                    insert(report, "e2e_python_cpu_us_per_msg", rate.cpu_us_per_msg);
                }
            }
        }
        None => eprintln!(
            "on the broker: the Python original skipped (PULSAR_DISPATCHER_PYTHON is not set)"
        ),
    }
}

/// Rounds of the publish-to-handler-start comparison. Each round runs every
/// consumer once and the first of a round rotates: whichever runs first
/// meets the broker straight after the throughput runs (its clean-up, its
/// garbage collection), which once put a millisecond on ours' p99 in every
/// run, as ours always ran first.
const LATENCY_ROUNDS: usize = 3;

/// The steady part of each round's ages, pooled per consumer.
#[derive(Default)]
struct LatencyAges {
    ours: Vec<u64>,
    raw: Vec<u64>,
    python: Vec<u64>,
    python_rounds: usize,
}

/// [`LATENCY_ROUNDS`] rounds of `messages` each: ours, the plain loop and
/// (when `python` is set) the Python original, the order rotated by one
/// each round. A failed Python round is reported and left out.
fn latency_rounds(python: Option<&std::path::Path>, url: &str, messages: usize) -> LatencyAges {
    let mut ages = LatencyAges::default();
    for round in 0..LATENCY_ROUNDS {
        for turn in 0..3 {
            match (round + turn) % 3 {
                0 => ages
                    .ours
                    .extend_from_slice(steady_part(&on_local(latency_ours(url, messages)))),
                1 => ages
                    .raw
                    .extend_from_slice(steady_part(&on_local(latency_raw(url, messages)))),
                _ => match python.map(|python| latency_python(python, url, messages)) {
                    Some(Ok(python_ages)) => {
                        ages.python.extend_from_slice(steady_part(&python_ages));
                        ages.python_rounds += 1;
                    }
                    Some(Err(error)) => eprintln!("  a Python round failed: {error}"),
                    None => {}
                },
            }
        }
    }
    ages
}

/// Publish to handler start at a fixed rate: ours, the plain loop and the
/// Python original, in rotated rounds.
fn latencies(
    python: Option<&std::path::Path>,
    url: &str,
    sizes: &Sizes,
    report: &mut Map<String, Value>,
) {
    eprintln!(
        "on the broker: publish to handler start at {LATENCY_RATE} msg/s, {LATENCY_ROUNDS} rounds in rotated order: ours, the plain loop, the Python original"
    );
    let per_round = sizes.e2e_latency / LATENCY_ROUNDS;
    let ages = latency_rounds(python, url, per_round);
    let ours = Percentiles::of(&ages.ours);
    let raw = Percentiles::of(&ages.raw);
    let python_latency = (ages.python_rounds > 0).then(|| Percentiles::of(&ages.python));
    let mut latencies = Map::new();
    for (bench, p, rounds) in [
        ("ours", Some(ours), LATENCY_ROUNDS),
        ("raw", Some(raw), LATENCY_ROUNDS),
        ("python", python_latency, ages.python_rounds),
    ] {
        let Some(p) = p else { continue };
        emit(
            json!({"bench": "e2e_latency", "impl": bench, "msgs_per_s": LATENCY_RATE,
                    "messages": per_round, "rounds": rounds,
                    "latency": super::percentiles_json(&p)}),
        );
        latencies.insert(bench.into(), super::percentiles_json(&p));
    }
    let us = |ns: u64| ns as f64 / 1e3;
    insert(report, "e2e_latency_p50_us", us(ours.p50));
    insert(report, "e2e_latency_p99_us", us(ours.p99));
    insert(report, "e2e_raw_latency_p50_us", us(raw.p50));
    insert(report, "e2e_raw_latency_p99_us", us(raw.p99));
    if let Some(p) = python_latency {
        insert(report, "e2e_python_latency_p50_us", us(p.p50));
        insert(report, "e2e_python_latency_p99_us", us(p.p99));
    }
    latencies.insert("msgs_per_s".into(), json!(LATENCY_RATE));
    latencies.insert("rounds".into(), json!(LATENCY_ROUNDS));
    latencies.insert("python_rounds".into(), json!(ages.python_rounds));
    insert(report, "e2e_latency", Value::Object(latencies));
}

/// One dispatcher per core on the broker, 1 against 2.
fn per_core(
    url: &str,
    sizes: &Sizes,
    detail: &mut Map<String, Value>,
    report: &mut Map<String, Value>,
) {
    eprintln!("on the broker: one dispatcher per core, 1 and 2 cores, receiver queue 1000");
    let (one, two) = one_and_two(sizes.e2e_repeats, |cores| {
        e2e_per_core(url, cores, sizes.e2e, 1000)
    });
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
    detail.insert("per_core_1".into(), json!(one));
    detail.insert("per_core_2".into(), json!(two));
    insert(report, "per_core_2_vs_1", two / one);
}

/// The broker's `--profile` targets; `None` if `what` is not one of them.
pub fn profile(what: &str) -> Option<String> {
    let url = &pulsar_url();
    if let Some(queue) = what.strip_prefix("e2e-q") {
        // Ours and the plain loop on the broker at one receiver queue size.
        let queue: u32 = queue.parse().expect("e2e-q<receiver queue size>");
        let messages = if queue == 1 { 200 } else { 20_000 };
        let ours = on_local(e2e_ours(url, messages, queue));
        let raw = on_local(e2e_raw(url, messages, queue));
        return Some(format!(
            "receiver queue {queue}: ours {ours:?}, plain loop {raw:?}"
        ));
    }
    let messages = 20_000;
    let rate = match what {
        "e2e-ours" => on_local(e2e_ours(url, messages, 1000)),
        "e2e-raw" => on_local(e2e_raw(url, messages, 1000)),
        "e2e-raw-cumulative" => on_local(e2e_raw_acking(url, messages, 1000, CUMULATIVE_GROUP)),
        "e2e-transport" => on_local(e2e_transport(url, messages, 1000)),
        "e2e-latency" => {
            // The report's rotated rounds, without the Python original.
            let ages = latency_rounds(None, url, 2_000);
            let (ours, raw) = (Percentiles::of(&ages.ours), Percentiles::of(&ages.raw));
            return Some(format!("latency: ours {ours:?}, plain loop {raw:?}"));
        }
        _ => return None,
    };
    Some(format!("{what}: {rate:?}"))
}
