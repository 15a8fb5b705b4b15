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
//! The in-memory consumer does what `MemoryTransport` does per message:
//! it keeps a clone of each received message until it is settled and
//! records every ack, here behind a `Mutex` since any thread may ack.
//!
//! This is a benchmark baseline, not part of the library.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use pulsar_dispatcher::MessageId;
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};

use super::Workload;

/// A message of the multi-threaded port.
#[derive(Clone, Debug)]
pub struct MtMessage {
    pub topic: Arc<str>,
    pub id: MessageId,
    pub payload: Vec<u8>,
}

/// An in-memory topic with one consumer.
#[derive(Default)]
pub struct MtTopic {
    name: Arc<str>,
    backlog: Mutex<VecDeque<MtMessage>>,
    arrived: Notify,
    unsettled: Mutex<HashMap<MessageId, MtMessage>>,
    acked: Mutex<Vec<MessageId>>,
    next_entry: AtomicUsize,
}

impl MtTopic {
    pub fn new(name: &str) -> Arc<Self> {
        Arc::new(MtTopic {
            name: name.into(),
            ..Default::default()
        })
    }

    /// Appends a message, as a producer would.
    pub fn send(&self, payload: Vec<u8>) {
        let entry = self.next_entry.fetch_add(1, Ordering::Relaxed) as u64;
        let message = MtMessage {
            topic: self.name.clone(),
            id: MessageId::new(0, entry, -1, None),
            payload,
        };
        self.backlog.lock().unwrap().push_back(message);
        self.arrived.notify_one();
    }

    async fn receive(&self) -> MtMessage {
        loop {
            let arrived = self.arrived.notified();
            if let Some(message) = self.backlog.lock().unwrap().pop_front() {
                self.unsettled
                    .lock()
                    .unwrap()
                    .insert(message.id.clone(), message.clone());
                return message;
            }
            arrived.await;
        }
    }

    fn ack(&self, id: &MessageId) {
        self.unsettled.lock().unwrap().remove(id);
        self.acked.lock().unwrap().push(id.clone());
    }

    fn nack(&self, id: &MessageId) {
        if let Some(message) = self.unsettled.lock().unwrap().remove(id) {
            self.backlog.lock().unwrap().push_front(message);
            self.arrived.notify_one();
        }
    }

    pub fn acked_count(&self) -> usize {
        self.acked.lock().unwrap().len()
    }
}

pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// A handler of the port: borrows the message, returns a boxed future.
pub type Handler =
    Box<dyn for<'a> Fn(&'a MtMessage) -> BoxFuture<'a, Result<(), HandlerError>> + Send + Sync>;

struct Source {
    topic: Arc<MtTopic>,
    handler: Handler,
    slot_tx: mpsc::Sender<MtMessage>,
    slot_rx: Mutex<mpsc::Receiver<MtMessage>>,
}

struct Shared {
    /// Groups of equal priority, lowest value first.
    groups: Mutex<Vec<(i64, VecDeque<Arc<Source>>)>>,
    permits: Arc<Semaphore>,
    arrived: Notify,
}

/// The multi-threaded dispatcher.
pub struct MtDispatcher {
    shared: Arc<Shared>,
    sources: Vec<Arc<Source>>,
}

impl MtDispatcher {
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

    pub fn subscribe(&mut self, topic: Arc<MtTopic>, priority: i64, handler: Handler) {
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

async fn read(shared: Arc<Shared>, source: Arc<Source>) {
    loop {
        let message = source.topic.receive().await;
        if source.slot_tx.send(message).await.is_err() {
            return;
        }
        shared.arrived.notify_one();
    }
}

impl Shared {
    /// The best waiting message, rotating each group as it is scanned.
    fn pick(&self) -> Option<(Arc<Source>, MtMessage)> {
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

async fn dispatch(shared: Arc<Shared>) {
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

async fn process(source: Arc<Source>, message: MtMessage, permit: OwnedSemaphorePermit) {
    match (source.handler)(&message).await {
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

fn counting_handler(count: Arc<AtomicUsize>, done: Arc<Notify>, total: usize) -> Handler {
    Box::new(move |_message| {
        let count = count.clone();
        let done = done.clone();
        Box::pin(async move {
            if count.fetch_add(1, Ordering::Relaxed) + 1 == total {
                done.notify_one();
            }
            Ok(())
        })
    })
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
    } = workload;
    if messages == 0 {
        return (Duration::ZERO, None);
    }
    let count = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(Notify::new());
    let mut dispatcher = MtDispatcher::new(concurrency);
    let topics: Vec<_> = (0..subscriptions)
        .map(|i| MtTopic::new(&workload.topic(i)))
        .collect();
    for (index, topic) in topics.iter().enumerate() {
        let handler = counting_handler(count.clone(), done.clone(), messages);
        dispatcher.subscribe(topic.clone(), (index % levels) as i64, handler);
    }
    for index in 0..messages {
        topics[index % subscriptions].send(Vec::new());
    }
    let (elapsed, counted) = runtime.block_on(async {
        let begin = counter.map(|read| read());
        let start = Instant::now();
        let tasks = dispatcher.start();
        done.notified().await;
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
    assert_eq!(count.load(Ordering::Relaxed), messages);
    (elapsed, counted)
}

/// "Message available → handler started" on a running port with one
/// subscription.
pub struct MtLatency {
    runtime: Runtime,
    topic: Arc<MtTopic>,
    started: Arc<Mutex<Option<Instant>>>,
    signal: Arc<Notify>,
    _tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl MtLatency {
    pub fn new() -> Self {
        let runtime = runtime();
        let topic = MtTopic::new("latency");
        let started = Arc::new(Mutex::new(None));
        let signal = Arc::new(Notify::new());
        let mut dispatcher = MtDispatcher::new(20);
        let handler: Handler = {
            let (started, signal) = (started.clone(), signal.clone());
            Box::new(move |_message| {
                let (started, signal) = (started.clone(), signal.clone());
                Box::pin(async move {
                    *started.lock().unwrap() = Some(Instant::now());
                    signal.notify_one();
                    Ok(())
                })
            })
        };
        dispatcher.subscribe(topic.clone(), 0, handler);
        let tasks = runtime.block_on(async { dispatcher.start() });
        MtLatency {
            runtime,
            topic,
            started,
            signal,
            _tasks: tasks,
        }
    }

    pub fn measure(&self, iters: u64) -> Duration {
        self.runtime.block_on(async {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                // Taken before the send: another worker may start the
                // handler before `send` returns.
                let sent = Instant::now();
                self.topic.send(Vec::new());
                self.signal.notified().await;
                let started = self.started.lock().unwrap().take().expect("handler ran");
                total += started.saturating_duration_since(sent);
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
