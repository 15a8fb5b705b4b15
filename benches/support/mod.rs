//! Workloads shared by the criterion suites (`benches/dispatch.rs`) and the
//! comparison run (`benches/report.rs`).
//!
//! Every workload is "N messages through K subscriptions at concurrency C"
//! with no-op handlers. Messages are put on the in-memory transport before
//! the clock starts; the clock runs from `run()` until the last handler has
//! run. Each implementation (ours, the `spawn_local` floor, the
//! multi-threaded port) builds its own runtime, so that nothing is shared
//! between measurements.
#![allow(dead_code)]

pub mod latency;
pub mod mt_port;
pub mod scheduling;

use std::cell::Cell;
use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use pulsar_dispatcher::transport::{
    Consumer, ConsumerSpec, Event, MemoryTransport, OutgoingMessage, Transport,
};
use pulsar_dispatcher::{
    Dispatcher, Message, Ordering as MessageOrdering, SubscribeOptions, DEFAULT_METRICS_INTERVAL,
};
use tokio::runtime::Runtime;
use tokio::sync::Notify;
use tokio::task::LocalSet;

/// N messages through K subscriptions at concurrency C, the subscriptions
/// spread round-robin over `levels` priority levels; optionally with
/// partition keys and an ordering mode (ours only: the port ignores both).
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub subscriptions: usize,
    pub levels: usize,
    pub concurrency: usize,
    pub messages: usize,
    /// How many distinct partition keys the messages carry, taken in turn
    /// (0: no key).
    pub keys: usize,
    /// How each subscription's messages may overlap.
    pub ordering: MessageOrdering,
    /// Whether the handler's future holds 1 KiB across an await (ours
    /// only), as a handler with a buffer would.
    pub large_future: bool,
    /// How often ours publishes its metrics (the dispatcher's default
    /// unless a counted profile lengthens it, see `counted`).
    pub metrics_interval: Duration,
}

impl Workload {
    pub fn new(subscriptions: usize, concurrency: usize, messages: usize) -> Self {
        Workload {
            subscriptions,
            levels: 1,
            concurrency,
            messages,
            keys: 0,
            ordering: MessageOrdering::Unordered,
            large_future: false,
            metrics_interval: DEFAULT_METRICS_INTERVAL,
        }
    }

    /// For a run counted under valgrind: ours publishes its metrics as it
    /// starts and as it shuts down, and not in between. A run under
    /// callgrind is some fifty times slower than a timed one, so that a
    /// periodic publication (once a second by default, over every
    /// subscription: about 1.1 million instructions at 1,000) would land in
    /// some counted runs and not in others, and by the run's length rather
    /// than its messages; a timed run, well under a second, meets none.
    pub fn counted(mut self) -> Self {
        self.metrics_interval = Duration::from_secs(3600);
        self
    }

    /// The handler's future holds 1 KiB across an await.
    pub fn large_future(mut self) -> Self {
        self.large_future = true;
        self
    }

    /// Messages carry `keys` distinct partition keys in turn, and each
    /// subscription orders them by `ordering`.
    pub fn keyed(mut self, keys: usize, ordering: MessageOrdering) -> Self {
        self.keys = keys;
        self.ordering = ordering;
        self
    }

    pub fn levels(mut self, levels: usize) -> Self {
        self.levels = levels;
        self
    }

    pub fn messages(mut self, messages: usize) -> Self {
        self.messages = messages;
        self
    }

    pub fn topic(&self, index: usize) -> String {
        format!("bench-{index}")
    }
}

/// The runtime the library is made for.
pub fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current_thread runtime")
}

/// Runs `f` on a fresh `current_thread` runtime inside a fresh `LocalSet`.
pub fn on_local<F: std::future::Future>(f: F) -> F::Output {
    let runtime = current_thread();
    LocalSet::new().block_on(&runtime, f)
}

/// A no-op handler that counts, so that the run knows when it is over.
/// Counting is one `Cell` update; the last message wakes the waiter.
fn counting_handler(
    count: Rc<Cell<usize>>,
    done: Rc<Notify>,
    total: usize,
) -> impl AsyncFn(&Message) -> Result<(), Infallible> {
    async move |_message: &Message| {
        let handled = count.get() + 1;
        count.set(handled);
        if handled == total {
            done.notify_one();
        }
        Ok(())
    }
}

/// What one run of our dispatcher measured.
#[derive(Clone, Copy, Debug)]
pub struct OursRun {
    /// From `run()` until the last handler ran.
    pub elapsed: Duration,
    /// Heap allocations (or whatever the counter given counts) per message
    /// between the `warmup`-th message (the start, for 0) and the last, if
    /// a counter was given.
    pub allocs_per_msg: Option<f64>,
}

/// [`counting_handler`] with 1 KiB in its future, kept across an await.
fn large_future_handler(
    count: Rc<Cell<usize>>,
    done: Rc<Notify>,
    total: usize,
) -> impl AsyncFn(&Message) -> Result<(), Infallible> {
    let counting = counting_handler(count, done, total);
    async move |message: &Message| {
        let buffer = std::hint::black_box([0u8; 1024]);
        std::future::ready(()).await;
        std::hint::black_box(&buffer);
        counting(message).await
    }
}

/// Our dispatcher on the in-memory transport. Must be called inside a
/// `LocalSet`.
pub async fn ours(workload: Workload) -> Duration {
    ours_counted(workload, 0, None).await.elapsed
}

/// Like [`ours`]; with `allocations` (a reader of the current thread's
/// allocation count, or of its CPU time), also counts the allocations made
/// while the messages after the first `warmup` are dispatched. With
/// `warmup` 0 the count starts where the clock starts, as the floor's and
/// the plain loop's do, so that a CPU window covers what the wall time
/// covers (the dispatcher's start up to the first handler included).
pub async fn ours_counted(
    workload: Workload,
    warmup: usize,
    allocations: Option<fn() -> u64>,
) -> OursRun {
    let Workload {
        subscriptions,
        levels,
        concurrency,
        messages,
        keys,
        ordering,
        large_future,
        metrics_interval,
    } = workload;
    assert!(subscriptions > 0 && levels > 0 && warmup < messages.max(1));
    let transport = MemoryTransport::new();
    transport.reserve_events(messages);
    let dispatcher = Dispatcher::builder()
        .concurrency(concurrency)
        .metrics_interval(Some(metrics_interval))
        .build(transport.clone())
        .expect("a valid concurrency");
    let count = Rc::new(Cell::new(0));
    let done = Rc::new(Notify::new());
    let topics: Vec<String> = (0..subscriptions).map(|i| workload.topic(i)).collect();
    // Snapshot of the allocation counter taken by the handler of message
    // number `warmup`, or where the clock starts for 0.
    let at_warmup = Rc::new(Cell::new(None));
    for (index, topic) in topics.iter().enumerate() {
        let options = SubscribeOptions::new()
            .priority((index % levels) as i64)
            .ordering(ordering);
        match allocations {
            None if large_future => {
                let handler = large_future_handler(count.clone(), done.clone(), messages);
                dispatcher.subscribe(topic, handler, options).await
            }
            None => {
                let handler = counting_handler(count.clone(), done.clone(), messages);
                dispatcher.subscribe(topic, handler, options).await
            }
            Some(read) => {
                let (count, done, at_warmup) = (count.clone(), done.clone(), at_warmup.clone());
                let handler = async move |_message: &Message| {
                    let handled = count.get() + 1;
                    count.set(handled);
                    if handled == warmup {
                        at_warmup.set(Some(read()));
                    }
                    if handled == messages {
                        done.notify_one();
                    }
                    Ok::<(), Infallible>(())
                };
                dispatcher.subscribe(topic, handler, options).await
            }
        }
        .expect("subscribing to the in-memory transport");
    }
    // Key names are made before the clock starts; each message's copy of
    // its key is made as it is sent, before the clock starts too.
    let key_names: Vec<String> = (0..keys).map(|key| format!("key-{key}")).collect();
    for index in 0..messages {
        let topic = &topics[index % subscriptions];
        match key_names.get(index % keys.max(1)) {
            None => transport.send(topic, Vec::new()),
            Some(key) => transport.send_message(
                topic,
                OutgoingMessage::new(Vec::new()).with_partition_key(key.clone()),
            ),
        };
    }
    if messages == 0 {
        dispatcher.close().await;
        return OursRun {
            elapsed: Duration::ZERO,
            allocs_per_msg: None,
        };
    }
    let closer = dispatcher.close_handle();
    let mut elapsed = Duration::ZERO;
    let mut allocs_at_end = None;
    if warmup == 0 {
        at_warmup.set(allocations.map(|read| read()));
    }
    let start = Instant::now();
    let finish = async {
        done.notified().await;
        elapsed = start.elapsed();
        allocs_at_end = allocations.map(|read| read());
        closer.close().await;
    };
    let (result, ()) = tokio::join!(dispatcher.run(), finish);
    result.expect("the dispatcher shuts down cleanly");
    let acked = transport
        .events()
        .iter()
        .filter(|event| matches!(event, Event::Acked { .. }))
        .count();
    assert_eq!(acked, messages, "every message is acknowledged");
    let allocs_per_msg = match (at_warmup.get(), allocs_at_end) {
        (Some(begin), Some(end)) => Some((end - begin) as f64 / (messages - warmup) as f64),
        _ => None,
    };
    OursRun {
        elapsed,
        allocs_per_msg,
    }
}

/// The floor: one empty `spawn_local` task per message with at most
/// `concurrency` in flight, and no scheduler, transport or settlement.
/// Must be called inside a `LocalSet`.
pub async fn floor(concurrency: usize, messages: usize) -> Duration {
    floor_counted(concurrency, messages, 0, None).await.0
}

/// Like [`floor`]; also returns allocations per message after `warmup`.
pub async fn floor_counted(
    concurrency: usize,
    messages: usize,
    warmup: usize,
    allocations: Option<fn() -> u64>,
) -> (Duration, Option<f64>) {
    struct Bound {
        in_flight: Cell<usize>,
        waker: Cell<Option<Waker>>,
    }
    /// Returns the task's place however it ends, like the dispatcher's
    /// permit guard.
    struct Slot(Rc<Bound>);
    impl Drop for Slot {
        fn drop(&mut self) {
            self.0.in_flight.set(self.0.in_flight.get() - 1);
            if let Some(waker) = self.0.waker.take() {
                waker.wake();
            }
        }
    }
    let bound = Rc::new(Bound {
        in_flight: Cell::new(0),
        waker: Cell::new(None),
    });
    fn wait_below(bound: Rc<Bound>, limit: usize) -> impl std::future::Future<Output = ()> {
        poll_fn(move |cx| {
            if bound.in_flight.get() < limit {
                Poll::Ready(())
            } else {
                bound.waker.set(Some(cx.waker().clone()));
                Poll::Pending
            }
        })
    }
    // The loop is a task of its own, as the dispatch loop is.
    let spawner = {
        let bound = bound.clone();
        tokio::task::spawn_local(async move {
            let start = Instant::now();
            let mut begin = None;
            for index in 0..messages {
                if index == warmup {
                    begin = allocations.map(|read| read());
                }
                wait_below(bound.clone(), concurrency).await;
                bound.in_flight.set(bound.in_flight.get() + 1);
                let slot = Slot(bound.clone());
                tokio::task::spawn_local(async move {
                    let _slot = slot;
                });
            }
            wait_below(bound.clone(), 1).await;
            let elapsed = start.elapsed();
            let allocs = match (begin, allocations) {
                (Some(begin), Some(read)) => {
                    Some((read() - begin) as f64 / (messages - warmup) as f64)
                }
                _ => None,
            };
            (elapsed, allocs)
        })
    };
    spawner.await.expect("the floor loop does not panic")
}

/// The plain loop: one consumer of the in-memory transport, each message
/// received, handed to the same counting handler inline and acked, one at a
/// time: no concurrency, no scheduler, no task per message. What a
/// dispatcher that does nothing but receive, handle and ack costs on this
/// transport. Must be called inside a `LocalSet`.
pub async fn plain_loop(messages: usize) -> Duration {
    plain_loop_over(1, messages).await
}

/// The plain loop over `subscriptions` topics, receiving from each in turn
/// as ours' benchmark sends to them: what the same backlog costs to read
/// when nothing schedules it, the baseline of the scaling figures.
pub async fn plain_loop_over(subscriptions: usize, messages: usize) -> Duration {
    plain_loop_counted(subscriptions, messages, 0, None).await.0
}

/// Receives the next message into `slot`, as the dispatcher receives into
/// its boxes, for the plain loops: they reuse one slot for every message.
/// A plain future, not an `async fn`: the extra state machine of an `async
/// fn` costs the plain loop about 27 instructions per message.
pub fn receive_into<'a>(
    consumer: &'a mut impl Consumer,
    slot: &'a mut Option<Message>,
) -> impl Future<Output = ()> + 'a {
    poll_fn(move |cx| {
        consumer
            .poll_receive(cx, slot)
            .map(|polled| polled.expect("the stream goes on").expect("a message"))
    })
}

/// Like [`plain_loop_over`]; also returns allocations per message after
/// `warmup`.
pub async fn plain_loop_counted(
    subscriptions: usize,
    messages: usize,
    warmup: usize,
    allocations: Option<fn() -> u64>,
) -> (Duration, Option<f64>) {
    let transport = MemoryTransport::new();
    transport.reserve_events(messages);
    let topics: Vec<String> = (0..subscriptions)
        .map(|index| format!("plain-loop-{index}"))
        .collect();
    let mut consumers = Vec::with_capacity(subscriptions);
    for topic in &topics {
        let consumer = transport
            .subscribe(&ConsumerSpec::new(topic))
            .await
            .expect("subscribing to the in-memory transport");
        consumers.push(consumer);
    }
    // Sent in the same order as ours' benchmark sends, so the backlog lies
    // in memory alike.
    for index in 0..messages {
        transport.send(&topics[index % subscriptions], Vec::new());
    }
    let count = Rc::new(Cell::new(0));
    let done = Rc::new(Notify::new());
    let handler = counting_handler(count.clone(), done.clone(), messages);
    // The loop runs in a task of its own, as ours' workers and the floor's
    // tasks do, so that callgrind's count of `LocalSet::tick` (the
    // report's instruction counts) is the loop's and none of the setup's.
    let looped = tokio::task::spawn_local(async move {
        let mut begin = None;
        // The loop receives into one place, as the dispatcher does.
        let mut slot = None;
        let start = Instant::now();
        for index in 0..messages {
            if index == warmup {
                begin = allocations.map(|read| read());
            }
            let consumer = &mut consumers[index % subscriptions];
            receive_into(consumer, &mut slot).await;
            let message = slot.as_ref().expect("received into the slot");
            match handler(message).await {
                Ok(()) => consumer.ack(message.id()),
                Err(never) => match never {},
            }
            .expect("acking");
        }
        let elapsed = start.elapsed();
        let allocs = begin
            .zip(allocations)
            .map(|(begin, read)| (read() - begin) as f64 / (messages - warmup) as f64);
        (elapsed, allocs)
    });
    let (elapsed, allocs) = looped.await.expect("the plain loop does not panic");
    assert_eq!(count.get(), messages);
    let acked: usize = topics
        .iter()
        .map(|topic| transport.acked(topic).len())
        .sum();
    assert_eq!(acked, messages, "every message acked");
    (elapsed, allocs)
}

/// Makes room in `items` for `additional` more and writes each place once
/// (with `blank`, cut off again), so that filling them in a measured run
/// touches no memory for the first time (what that costs on a virtual
/// machine: see `MemoryTransport::reserve_events`, which does the same for
/// the in-memory broker's log).
pub fn prefault<T: Clone>(items: &mut Vec<T>, additional: usize, blank: T) {
    let len = items.len();
    items.resize(len + additional, blank);
    items.truncate(len);
}

/// Lets every other ready task of the runtime (or `LocalSet`) run once,
/// then resumes: the task wakes itself and goes to the back of the run
/// queue. Unlike `tokio::task::yield_now`, whose wake-up is deferred until
/// the runtime has polled its I/O driver, this costs no system call when
/// other tasks are ready.
pub async fn requeue() {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

/// When message `index` of an open-loop schedule is due, in nanoseconds
/// after the clock's origin.
pub fn due(start: u64, interval: Duration, index: usize) -> u64 {
    start + (interval.as_secs_f64() * 1e9 * index as f64) as u64
}

/// The arrival loop of the open-loop benchmarks: sends message `i` once
/// `due(start, interval, i)` has passed on the clock `origin`, checking the
/// clock between turns of the other tasks (at most 64 messages per turn, so
/// that a late loop catches up without starving the dispatcher).
pub async fn send_on_schedule(
    start: u64,
    interval: Duration,
    messages: usize,
    origin: Instant,
    mut send: impl FnMut(),
) {
    let mut next = 0;
    while next < messages {
        let now = origin.elapsed().as_nanos() as u64;
        let mut sent = 0;
        while next < messages && sent < 64 && due(start, interval, next) <= now {
            send();
            next += 1;
            sent += 1;
        }
        requeue().await;
    }
}

/// How late each handler started: its start stamp minus when its message
/// was due.
pub fn lateness(started: &[AtomicU64], start: u64, interval: Duration) -> Vec<u64> {
    started
        .iter()
        .enumerate()
        .map(|(index, stamp)| {
            stamp
                .load(Ordering::Relaxed)
                .saturating_sub(due(start, interval, index))
        })
        .collect()
}

/// Measures "message available → handler started" on a dispatcher that
/// stays up across criterion samples: one subscription, concurrency 20,
/// nothing else in flight.
pub struct OursLatency {
    runtime: Runtime,
    local: LocalSet,
    transport: MemoryTransport,
    started: Rc<Cell<Option<Instant>>>,
    signal: Rc<Notify>,
}

const LATENCY_TOPIC: &str = "latency";

impl OursLatency {
    pub fn new() -> Self {
        let runtime = current_thread();
        let local = LocalSet::new();
        let transport = MemoryTransport::new();
        let started = Rc::new(Cell::new(None));
        let signal = Rc::new(Notify::new());
        local.block_on(&runtime, async {
            let dispatcher = Dispatcher::builder()
                .concurrency(20)
                .build(transport.clone())
                .expect("a valid concurrency");
            let (started, signal) = (started.clone(), signal.clone());
            let handler = async move |_message: &Message| {
                started.set(Some(Instant::now()));
                signal.notify_one();
                Ok::<(), Infallible>(())
            };
            dispatcher
                .subscribe(LATENCY_TOPIC, handler, SubscribeOptions::new())
                .await
                .expect("subscribing");
            tokio::task::spawn_local(async move { dispatcher.run().await });
            tokio::task::yield_now().await;
        });
        OursLatency {
            runtime,
            local,
            transport,
            started,
            signal,
        }
    }

    /// Total latency of `iters` messages, sent one at a time.
    pub fn measure(&self, iters: u64) -> Duration {
        // Criterion calls this again and again: the log starts each batch
        // empty, in the room the largest batch so far wrote once.
        self.transport.clear_events();
        self.transport.reserve_events(iters as usize);
        self.local.block_on(&self.runtime, async {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                // Taken before the send, as the port, the floor and the
                // report's idle figure take it: the send is part of the
                // path (it wakes the consumer).
                let sent = Instant::now();
                self.transport.send(LATENCY_TOPIC, Vec::new());
                self.signal.notified().await;
                total += self.started.take().expect("the handler ran") - sent;
                // Let the ack and the permit settle before the next message.
                for _ in 0..4 {
                    tokio::task::yield_now().await;
                }
            }
            total
        })
    }
}

impl Default for OursLatency {
    fn default() -> Self {
        Self::new()
    }
}

/// Measures "spawn_local called → task started": the floor's latency.
pub fn floor_latency(runtime: &Runtime, local: &LocalSet, iters: u64) -> Duration {
    local.block_on(runtime, async {
        let started = Rc::new(Cell::new(None));
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let flag = started.clone();
            let spawned = Instant::now();
            tokio::task::spawn_local(async move { flag.set(Some(Instant::now())) })
                .await
                .expect("the task runs");
            total += started.take().expect("the task ran") - spawned;
        }
        total
    })
}
