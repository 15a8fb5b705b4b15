//! The baseline: the same design translated the obvious way to tokio's
//! multi-thread runtime.
//!
//! One reader task per subscription receives from its consumer and waits
//! for room in a bounded mpsc queue of one message (the one-message slot).
//! The dispatch loop takes a `tokio::sync::Semaphore` permit first, then
//! scans the subscriptions by priority under a `Mutex`, round-robin within a
//! priority (popping the front of each group and pushing it to the back), and
//! `tokio::spawn`s one task per message that runs the handler, acks through
//! the consumer and drops the permit. A `Notify` stands in for the
//! condition variable that tells the dispatch loop a message arrived.
//!
//! Made as cheap as the same design allows, so that the comparison is fair:
//! the handler is a generic type whose future is stored unboxed in the
//! spawned task (no `Box<dyn Fn>`, no boxed future per message), and the
//! in-memory consumer does exactly the bookkeeping `MemoryTransport` does per
//! message: a receive copies the first waiting message out of one queue
//! that keeps the unsettled messages at its front, its ack pops it from
//! there, and every ack's id is logged by its parts; here behind mutexes,
//! since any thread may ack.
//!
//! What it skips, compared with the library: the handler's task acks
//! directly (no outcome routing: replies, retries, dead letters, error
//! classes), no panic guard, no per-subscription counters, no negative-ack
//! delay, no processing deadline, no graceful shutdown (its tasks are
//! aborted).
//!
//! This is a benchmark baseline, not part of the library.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pulsar_dispatcher::MessageId;
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};

use super::latency::warm_up_messages;
use super::{prefault, Workload};

/// A message of the multi-threaded port.
#[derive(Clone, Debug)]
pub struct MtMessage {
    pub topic: Arc<str>,
    pub id: MessageId,
    pub payload: Vec<u8>,
}

/// A message id by its parts: ledger, entry, partition, batch index.
type IdParts = (u64, u64, i32, Option<i32>);

/// An in-memory topic with one consumer.
#[derive(Default)]
pub struct MtTopic {
    name: Arc<str>,
    queue: Mutex<Queue>,
    arrived: Notify,
    /// Every ack, its id by parts, as `MemoryTransport` logs them.
    acked: Mutex<Vec<IdParts>>,
    acked_count: AtomicUsize,
    next_entry: AtomicU64,
}

/// A topic's messages as `MemoryTransport` keeps them: the first
/// `delivered` are received and unsettled, in the order received; the rest
/// wait.
#[derive(Default)]
struct Queue {
    messages: VecDeque<MtMessage>,
    delivered: usize,
}

impl Queue {
    fn deliver(&mut self) -> Option<MtMessage> {
        let message = self.messages.get(self.delivered)?.clone();
        self.delivered += 1;
        Some(message)
    }

    /// As `MemoryTransport` settles: the oldest unsettled message, the
    /// usual one, is popped without a search.
    fn settle(&mut self, id: &MessageId) -> Option<MtMessage> {
        let is_id = |message: &MtMessage| message.id.entry_id() == id.entry_id();
        let at = if self.delivered > 0 && self.messages.front().is_some_and(is_id) {
            0
        } else {
            self.messages.iter().take(self.delivered).position(is_id)?
        };
        self.delivered -= 1;
        if at == 0 {
            self.messages.pop_front()
        } else {
            self.messages.remove(at)
        }
    }
}

impl MtTopic {
    pub fn new(name: &str) -> Arc<Self> {
        Arc::new(MtTopic {
            name: name.into(),
            ..Default::default()
        })
    }

    /// Makes room in the ack log for `additional` more acks, written once,
    /// as `MemoryTransport::reserve_events` does for ours.
    pub fn reserve_acks(&self, additional: usize) {
        prefault(
            &mut self.acked.lock().unwrap(),
            additional,
            (0, 0, -1, None),
        );
    }

    /// Appends a message, as a producer would; returns its entry id.
    pub fn send(&self, payload: Vec<u8>) -> u64 {
        let entry = self.next_entry.fetch_add(1, Ordering::Relaxed);
        let message = MtMessage {
            topic: self.name.clone(),
            id: MessageId::new(0, entry, -1, None),
            payload,
        };
        self.queue.lock().unwrap().messages.push_back(message);
        self.arrived.notify_one();
        entry
    }

    async fn receive(&self) -> MtMessage {
        loop {
            let arrived = self.arrived.notified();
            if let Some(message) = self.queue.lock().unwrap().deliver() {
                return message;
            }
            arrived.await;
        }
    }

    fn ack(&self, id: &MessageId) {
        drop(self.queue.lock().unwrap().settle(id));
        let parts = (
            id.ledger_id(),
            id.entry_id(),
            id.partition(),
            id.batch_index(),
        );
        self.acked.lock().unwrap().push(parts);
        self.acked_count.fetch_add(1, Ordering::Release);
    }

    fn nack(&self, id: &MessageId) {
        let mut queue = self.queue.lock().unwrap();
        if let Some(message) = queue.settle(id) {
            let first_waiting = queue.delivered;
            queue.messages.insert(first_waiting, message);
            drop(queue);
            self.arrived.notify_one();
        }
    }

    pub fn acked_count(&self) -> usize {
        self.acked_count.load(Ordering::Acquire)
    }
}

pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// A handler of the port: borrows the message; its future is a concrete
/// type, stored in the task that runs it.
pub trait MtHandler: Send + Sync + 'static {
    fn handle<'a>(
        &'a self,
        message: &'a MtMessage,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send + 'a;
}

struct Source<H> {
    topic: Arc<MtTopic>,
    handler: Arc<H>,
    slot_tx: mpsc::Sender<MtMessage>,
    slot_rx: Mutex<mpsc::Receiver<MtMessage>>,
}

/// The subscriptions of one priority, in the order they take turns.
type Group<H> = (i64, VecDeque<Arc<Source<H>>>);

struct Shared<H> {
    /// Groups of equal priority, lowest value first.
    groups: Mutex<Vec<Group<H>>>,
    permits: Arc<Semaphore>,
    arrived: Notify,
}

/// The multi-threaded dispatcher.
pub struct MtDispatcher<H> {
    shared: Arc<Shared<H>>,
    sources: Vec<Arc<Source<H>>>,
}

impl<H: MtHandler> MtDispatcher<H> {
    pub fn new(concurrency: usize) -> Self {
        MtDispatcher {
            shared: Arc::new(Shared {
                groups: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(concurrency)),
                arrived: Notify::new(),
            }),
            sources: Vec::new(),
        }
    }

    pub fn subscribe(&mut self, topic: Arc<MtTopic>, priority: i64, handler: Arc<H>) {
        let (slot_tx, slot_rx) = mpsc::channel(1);
        let source = Arc::new(Source {
            topic,
            handler,
            slot_tx,
            slot_rx: Mutex::new(slot_rx),
        });
        let mut groups = self.shared.groups.lock().unwrap();
        let at = match groups.binary_search_by_key(&priority, |(p, _)| *p) {
            Ok(at) => at,
            Err(at) => {
                groups.insert(at, (priority, VecDeque::new()));
                at
            }
        };
        groups[at].1.push_back(source.clone());
        self.sources.push(source);
    }

    /// Spawns the readers and the dispatch loop on the current runtime;
    /// returns their handles so that the caller can abort them.
    pub fn start(&self) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks: Vec<_> = self
            .sources
            .iter()
            .map(|source| tokio::spawn(read(self.shared.clone(), source.clone())))
            .collect();
        tasks.push(tokio::spawn(dispatch(self.shared.clone())));
        tasks
    }
}

async fn read<H>(shared: Arc<Shared<H>>, source: Arc<Source<H>>) {
    loop {
        let message = source.topic.receive().await;
        if source.slot_tx.send(message).await.is_err() {
            return;
        }
        shared.arrived.notify_one();
    }
}

impl<H> Shared<H> {
    /// The best waiting message, rotating each group as it is scanned.
    fn pick(&self) -> Option<(Arc<Source<H>>, MtMessage)> {
        let mut groups = self.groups.lock().unwrap();
        for (_, group) in groups.iter_mut() {
            for _ in 0..group.len() {
                let source = group.pop_front().expect("non-empty group");
                group.push_back(source.clone());
                let received = source.slot_rx.lock().unwrap().try_recv();
                if let Ok(message) = received {
                    return Some((source, message));
                }
            }
        }
        None
    }
}

async fn dispatch<H: MtHandler>(shared: Arc<Shared<H>>) {
    loop {
        let permit = shared
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (source, message) = loop {
            let arrived = shared.arrived.notified();
            if let Some(picked) = shared.pick() {
                break picked;
            }
            arrived.await;
        };
        tokio::spawn(process(source, message, permit));
    }
}

async fn process<H: MtHandler>(
    source: Arc<Source<H>>,
    message: MtMessage,
    permit: OwnedSemaphorePermit,
) {
    match source.handler.handle(&message).await {
        Ok(()) => source.topic.ack(&message.id),
        Err(_) => source.topic.nack(&message.id),
    }
    drop(permit);
}

/// The multi-thread runtime the port runs on: one worker per core.
pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
        )
        .enable_all()
        .build()
        .expect("a multi-thread runtime")
}

/// Counts, and wakes the waiter at the last message.
pub struct Counting {
    count: AtomicUsize,
    done: Notify,
    total: usize,
}

impl MtHandler for Counting {
    #[allow(clippy::manual_async_fn)]
    fn handle<'a>(
        &'a self,
        _message: &'a MtMessage,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send + 'a {
        async move {
            if self.count.fetch_add(1, Ordering::Relaxed) + 1 == self.total {
                self.done.notify_one();
            }
            Ok(())
        }
    }
}

/// The workload on the port: from starting the tasks until the last
/// handler ran.
pub fn run(runtime: &Runtime, workload: Workload) -> Duration {
    run_counted(runtime, workload, None).0
}

/// Like [`run`]; with `counter`, also returns how much it advanced per
/// message over the same window (for CPU time, a process-wide counter).
pub fn run_counted(
    runtime: &Runtime,
    workload: Workload,
    counter: Option<fn() -> u64>,
) -> (Duration, Option<f64>) {
    let Workload {
        subscriptions,
        levels,
        concurrency,
        messages,
        ..
    } = workload;
    if messages == 0 {
        return (Duration::ZERO, None);
    }
    let handler = Arc::new(Counting {
        count: AtomicUsize::new(0),
        done: Notify::new(),
        total: messages,
    });
    let mut dispatcher = MtDispatcher::new(concurrency);
    let topics: Vec<_> = (0..subscriptions)
        .map(|i| MtTopic::new(&workload.topic(i)))
        .collect();
    for topic in &topics {
        topic.reserve_acks(messages.div_ceil(subscriptions));
    }
    for (index, topic) in topics.iter().enumerate() {
        dispatcher.subscribe(topic.clone(), (index % levels) as i64, handler.clone());
    }
    for index in 0..messages {
        topics[index % subscriptions].send(Vec::new());
    }
    let (elapsed, counted) = runtime.block_on(async {
        let begin = counter.map(|read| read());
        let start = Instant::now();
        let tasks = dispatcher.start();
        handler.done.notified().await;
        let elapsed = start.elapsed();
        let counted = begin
            .zip(counter)
            .map(|(begin, read)| (read() - begin) as f64 / messages as f64);
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            let _ = task.await;
        }
        // In-flight tasks ack right after counting; wait for the last acks.
        while topics.iter().map(|t| t.acked_count()).sum::<usize>() < messages {
            tokio::task::yield_now().await;
        }
        (elapsed, counted)
    });
    assert_eq!(handler.count.load(Ordering::Relaxed), messages);
    (elapsed, counted)
}

/// Records when each message's handler started, in nanoseconds after a
/// common origin, indexed by entry id less `offset` (the messages before
/// `offset`, a warm-up, are only counted); wakes the task waiting in
/// [`StampStarts::handled`] when the count it waits for is reached.
pub struct StampStarts {
    origin: Instant,
    started: Arc<[AtomicU64]>,
    offset: usize,
    count: AtomicUsize,
    /// The count [`StampStarts::handled`] waits for.
    until: AtomicUsize,
    reached: Notify,
}

impl StampStarts {
    fn new(origin: Instant, messages: usize, offset: usize) -> Arc<StampStarts> {
        Arc::new(StampStarts {
            origin,
            started: (0..messages).map(|_| AtomicU64::new(0)).collect(),
            offset,
            count: AtomicUsize::new(0),
            until: AtomicUsize::new(usize::MAX),
            reached: Notify::new(),
        })
    }

    /// Waits, parked rather than spinning (a spinning waiter would be a
    /// third runnable thread beside the port's two workers on a 2-core
    /// machine), until `count` handlers have started. `until` and `count`
    /// are written and read in opposite orders, all sequentially
    /// consistent, so that the handler sees the target or this task sees
    /// the count.
    async fn handled(&self, count: usize) {
        self.until.store(count, Ordering::SeqCst);
        loop {
            let reached = self.reached.notified();
            if self.count.load(Ordering::SeqCst) >= count {
                return;
            }
            reached.await;
        }
    }

    /// Each message's start, in nanoseconds after the origin.
    fn stamps(&self) -> &[AtomicU64] {
        &self.started
    }
}

impl MtHandler for StampStarts {
    #[allow(clippy::manual_async_fn)]
    fn handle<'a>(
        &'a self,
        message: &'a MtMessage,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send + 'a {
        async move {
            let now = self.origin.elapsed().as_nanos() as u64;
            let entry = message.id.entry_id() as usize;
            if let Some(index) = entry.checked_sub(self.offset) {
                self.started[index].store(now, Ordering::Relaxed);
            }
            let count = self.count.fetch_add(1, Ordering::SeqCst) + 1;
            if count == self.until.load(Ordering::SeqCst) {
                self.reached.notify_one();
            }
            Ok(())
        }
    }
}

/// Sends `warm_up` messages at once and waits until they are handled: the
/// same warm-up ours and the plain loop get before their latency runs
/// (the ack log and the queues grow to their size first).
async fn warm(topic: &MtTopic, handler: &StampStarts, warm_up: usize) {
    for _ in 0..warm_up {
        topic.send(Vec::new());
    }
    handler.handled(warm_up).await;
}

/// Aborts the port's tasks and waits until they are gone.
async fn stop(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        let _ = task.await;
    }
}

/// Open-loop arrivals on the port: after the warm-up ours gets, message
/// `i` is due `i * interval` after the start and is sent by an arrival
/// task on the port's own runtime (as ours' arrival task shares ours'
/// thread) as soon as it is due. Returns, per message, how long after it
/// was due its handler started.
pub fn open_loop(runtime: &Runtime, interval: Duration, messages: usize) -> Vec<u64> {
    let origin = Instant::now();
    let warm_up = warm_up_messages(messages);
    let handler = StampStarts::new(origin, messages, warm_up);
    let topic = MtTopic::new("open-loop");
    topic.reserve_acks(warm_up + messages);
    let mut dispatcher = MtDispatcher::new(20);
    dispatcher.subscribe(topic.clone(), 0, handler.clone());
    let start = runtime.block_on(async {
        let tasks = dispatcher.start();
        warm(&topic, &handler, warm_up).await;
        let sender = {
            let topic = topic.clone();
            tokio::spawn(async move {
                let start = origin.elapsed().as_nanos() as u64;
                super::send_on_schedule(start, interval, messages, origin, || {
                    topic.send(Vec::new());
                })
                .await;
                start
            })
        };
        let start = sender.await.expect("the arrival task does not panic");
        handler.handled(warm_up + messages).await;
        stop(tasks).await;
        start
    });
    super::lateness(handler.stamps(), start, interval)
}

/// The port when idle, after the warm-up ours gets: one message at a time,
/// from just before the send to its handler starting, with the previous
/// message settled. The messages are sent by a task on the port's runtime
/// that parks between them, as ours' arrival task shares ours' thread.
pub fn idle(runtime: &Runtime, messages: usize) -> Vec<u64> {
    let origin = Instant::now();
    let warm_up = warm_up_messages(messages);
    let handler = StampStarts::new(origin, messages, warm_up);
    let topic = MtTopic::new("idle");
    topic.reserve_acks(warm_up + messages);
    let mut dispatcher = MtDispatcher::new(20);
    dispatcher.subscribe(topic.clone(), 0, handler.clone());
    let sent_at = runtime.block_on(async {
        let tasks = dispatcher.start();
        warm(&topic, &handler, warm_up).await;
        let sender = {
            let (topic, handler) = (topic.clone(), handler.clone());
            tokio::spawn(
                async move { send_one_at_a_time(&topic, &handler, warm_up, messages).await },
            )
        };
        let sent_at = sender.await.expect("the sending task does not panic");
        stop(tasks).await;
        sent_at
    });
    sent_at
        .iter()
        .zip(handler.stamps())
        .map(|(sent, stamp)| stamp.load(Ordering::Relaxed).saturating_sub(*sent))
        .collect()
}

/// Sends `messages` one at a time after the `warm_up` handled ones, each
/// once the previous one is acked; returns when each was sent.
async fn send_one_at_a_time(
    topic: &MtTopic,
    handler: &StampStarts,
    warm_up: usize,
    messages: usize,
) -> Vec<u64> {
    let mut sent_at = Vec::with_capacity(messages);
    for index in warm_up..warm_up + messages {
        // The ack follows the handler's start at once, in the same task:
        // this rarely yields more than once.
        while topic.acked_count() < index {
            tokio::task::yield_now().await;
        }
        sent_at.push(handler.origin.elapsed().as_nanos() as u64);
        topic.send(Vec::new());
        handler.handled(index + 1).await;
    }
    sent_at
}

/// Signals each handler start to the measuring task.
struct Signal {
    started: Mutex<Option<Instant>>,
    signal: Notify,
}

impl MtHandler for Signal {
    #[allow(clippy::manual_async_fn)]
    fn handle<'a>(
        &'a self,
        _message: &'a MtMessage,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send + 'a {
        async move {
            *self.started.lock().unwrap() = Some(Instant::now());
            self.signal.notify_one();
            Ok(())
        }
    }
}

/// "Message available → handler started" on a running port with one
/// subscription (the criterion `latency` group).
pub struct MtLatency {
    runtime: Runtime,
    topic: Arc<MtTopic>,
    handler: Arc<Signal>,
    _tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl MtLatency {
    pub fn new() -> Self {
        let runtime = runtime();
        let topic = MtTopic::new("latency");
        let handler = Arc::new(Signal {
            started: Mutex::new(None),
            signal: Notify::new(),
        });
        let mut dispatcher = MtDispatcher::new(20);
        dispatcher.subscribe(topic.clone(), 0, handler.clone());
        let tasks = runtime.block_on(async { dispatcher.start() });
        MtLatency {
            runtime,
            topic,
            handler,
            _tasks: tasks,
        }
    }

    pub fn measure(&self, iters: u64) -> Duration {
        self.topic.reserve_acks(iters as usize);
        self.runtime.block_on(async {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                // Taken before the send: another worker may start the
                // handler before `send` returns.
                let sent = Instant::now();
                self.topic.send(Vec::new());
                self.handler.signal.notified().await;
                let started = self.handler.started.lock().unwrap().take();
                total += started
                    .expect("handler ran")
                    .saturating_duration_since(sent);
                tokio::task::yield_now().await;
            }
            total
        })
    }
}

impl Default for MtLatency {
    fn default() -> Self {
        Self::new()
    }
}
