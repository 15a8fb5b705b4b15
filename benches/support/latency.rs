//! Latency on the in-memory transport: open-loop arrivals (no coordinated
//! omission), idle latency, priority inversions, and one dispatcher per
//! core with a CPU-bound handler.
//!
//! Arrival to handler start is measured from outside the library: the
//! arrival loop (a task on the same `LocalSet`) sends message `i` once it is
//! due, and the handler stamps the time it starts into slot `i`: its entry
//! id less the warm-up messages sent before the run (the in-memory broker
//! counts entry ids from 0). Lateness
//! is the start stamp minus the due time, so a dispatcher that falls behind
//! is charged for every message it delays, including those the arrival
//! loop could not send on time because the thread was busy.

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pulsar_dispatcher::per_core::PerCore;
use pulsar_dispatcher::transport::{
    Consumer, ConsumerSpec, MemoryConsumer, MemoryProducer, MemoryTransport, Transport,
    TransportError,
};
use pulsar_dispatcher::{Dispatcher, Message, MessageId, SubscribeOptions};

use super::{lateness, prefault, receive_into, requeue, send_on_schedule};

/// p50, p99, p99.9 and max of a set of latencies, in nanoseconds, through
/// an HDR histogram (3 significant digits).
#[derive(Clone, Copy, Debug, Default)]
pub struct Percentiles {
    pub p50: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    pub count: u64,
}

impl Percentiles {
    pub fn of(values: &[u64]) -> Percentiles {
        let mut histogram =
            Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds");
        for &value in values {
            histogram.saturating_record(value.max(1));
        }
        Percentiles {
            p50: histogram.value_at_quantile(0.5),
            p99: histogram.value_at_quantile(0.99),
            p999: histogram.value_at_quantile(0.999),
            max: histogram.max(),
            count: histogram.len(),
        }
    }
}

const TOPIC: &str = "open-loop";

/// How many messages go through a transport before a latency run of
/// `messages`: at least as many, sent at once, so that no backlog the run
/// can build makes the topic's queue grow again (a copy, in the middle of
/// the run), and the dispatcher's workers and the code they run are warm.
/// A power of two: the queue is a ring (`VecDeque`) whose capacity doubles
/// as it fills, so a burst of 2^k leaves it exactly full, and the run,
/// which goes round the ring, writes to no slot for the first time (a page
/// fault, and on a virtual machine often a host fault: see
/// [`MemoryTransport::reserve_events`], which does the same for the
/// broker's log).
pub fn warm_up_messages(messages: usize) -> usize {
    messages.next_power_of_two()
}

/// A dispatcher (K = 1, C = 20) whose handler stamps its start time, in
/// nanoseconds after `origin`, into `started[entry id - offset]` (the
/// messages before `offset`, a warm-up, are only counted).
async fn stamping_dispatcher(
    origin: Instant,
    started: Arc<[AtomicU64]>,
    count: Rc<Cell<usize>>,
    offset: usize,
) -> (MemoryTransport, Dispatcher<MemoryTransport>) {
    let transport = MemoryTransport::new();
    transport.reserve_events(offset + started.len());
    let dispatcher = Dispatcher::builder()
        .concurrency(20)
        .build(transport.clone())
        .expect("a valid concurrency");
    let handler = async move |message: &Message| {
        let now = origin.elapsed().as_nanos() as u64;
        if let Some(index) = (message.id().entry_id() as usize).checked_sub(offset) {
            started[index].store(now, Ordering::Relaxed);
        }
        count.set(count.get() + 1);
        Ok::<(), Infallible>(())
    };
    dispatcher
        .subscribe(TOPIC, handler, SubscribeOptions::new())
        .await
        .expect("subscribing to the in-memory transport");
    (transport, dispatcher)
}

/// Runs the dispatcher until `count` reaches `messages`, with `arrivals`
/// running beside it as a task of its own.
async fn run_until_handled<A>(
    dispatcher: &Dispatcher<MemoryTransport>,
    count: &Cell<usize>,
    messages: usize,
    arrivals: A,
) -> A::Output
where
    A: std::future::Future + 'static,
    A::Output: 'static,
{
    let closer = dispatcher.close_handle();
    let finish = async {
        let arrivals = tokio::task::spawn_local(arrivals);
        let output = arrivals.await.expect("the arrival loop does not panic");
        while count.get() < messages {
            requeue().await;
        }
        closer.close().await;
        output
    };
    let (result, output) = tokio::join!(dispatcher.run(), finish);
    result.expect("the dispatcher shuts down cleanly");
    output
}

/// Sends `warm_up` messages at once and waits until they are handled.
async fn warm(transport: &MemoryTransport, count: &Cell<usize>, warm_up: usize) {
    for _ in 0..warm_up {
        transport.send(TOPIC, Vec::new());
    }
    while count.get() < warm_up {
        requeue().await;
    }
}

/// Ours under open-loop load: message `i` arrives `i * interval` after the
/// start. Returns each message's lateness (handler start minus due time,
/// ns) and the time from the start to the last handler's start (ns). Must
/// be called inside a `LocalSet`.
pub async fn ours_open_loop(interval: Duration, messages: usize) -> (Vec<u64>, u64) {
    let origin = Instant::now();
    let started: Arc<[AtomicU64]> = (0..messages).map(|_| AtomicU64::new(0)).collect();
    let count = Rc::new(Cell::new(0));
    let warm_up = warm_up_messages(messages);
    let (transport, dispatcher) =
        stamping_dispatcher(origin, started.clone(), count.clone(), warm_up).await;
    let arrivals = {
        let count = count.clone();
        async move {
            warm(&transport, &count, warm_up).await;
            let start = origin.elapsed().as_nanos() as u64;
            send_on_schedule(start, interval, messages, origin, || {
                transport.send(TOPIC, Vec::new());
            })
            .await;
            start
        }
    };
    let start = run_until_handled(&dispatcher, &count, warm_up + messages, arrivals).await;
    let last = started
        .iter()
        .map(|stamp| stamp.load(Ordering::Relaxed))
        .max()
        .unwrap_or(start);
    (lateness(&started, start, interval), last - start)
}

/// Ours' backlog rate with the arrival loop on the same thread: every
/// message is due at once, and the loop sends them (64 per turn) as fast as
/// the thread lets it while the dispatcher drains them; the loop, cheaper
/// per message, soon leaves a backlog that workers drain without waiting.
/// Messages per second.
pub async fn ours_backlog_rate(messages: usize) -> f64 {
    let (_, span) = ours_open_loop(Duration::ZERO, messages).await;
    messages as f64 / (span.max(1) as f64 / 1e9)
}

/// How late, at most, the median of the last tenth of an open-loop run's
/// messages may start for ours to count as keeping up with the rate. A
/// queue that builds over a run of tens of milliseconds makes it grow to
/// milliseconds; a run that keeps up has a median of a few microseconds,
/// and one stall of the machine (tens of microseconds, rarely a few
/// hundred) moves the median of thousands of messages little.
const KEEPS_UP_NS: u64 = 100_000;

/// Whether ours kept up in an open-loop run: see [`KEEPS_UP_NS`].
pub fn kept_up(lateness: &[u64]) -> bool {
    let mut last_tenth = lateness[lateness.len() - lateness.len() / 10..].to_vec();
    last_tenth.sort_unstable();
    last_tenth[last_tenth.len() / 2] <= KEEPS_UP_NS
}

/// Ours' sustained rate: the highest arrival rate, within `steps` halvings
/// of the range from a third of `backlog_rate` to all of it, at which ours
/// keeps up with the open-loop arrival loop ([`kept_up`]). It is the rate
/// the open-loop loads are shares of, so that "ours keeps up" is part of
/// what a load point means (measured so far at 0.83-0.99x the backlog
/// rate; how far the machine's speed drifts decides where in that
/// range). Must be called inside a `LocalSet`.
pub async fn ours_sustained_rate(backlog_rate: f64, messages: usize, steps: u32) -> f64 {
    let (mut kept, mut lost) = (backlog_rate / 3.0, backlog_rate);
    for _ in 0..steps {
        let rate = (kept + lost) / 2.0;
        let (lateness, _) = ours_open_loop(Duration::from_secs_f64(1.0 / rate), messages).await;
        if kept_up(&lateness) {
            kept = rate;
        } else {
            lost = rate;
        }
    }
    kept
}

/// Ours' backlog rate over `messages`, then its sustained rate searched
/// with half as many per step and [`SUSTAINED_RATE_STEPS`] halvings: the
/// rate a one-off run (a profile, a criterion bench) takes loads as shares
/// of. Must be called inside a `LocalSet`.
pub async fn ours_saturation(messages: usize) -> f64 {
    let backlog = ours_backlog_rate(messages).await;
    ours_sustained_rate(backlog, messages / 2, SUSTAINED_RATE_STEPS).await
}

/// How many halvings the search for ours' sustained rate takes (the rate
/// is then known to 1/64 of the range searched).
pub const SUSTAINED_RATE_STEPS: u32 = 6;

/// Ours when idle: one message at a time, from just before `send` to its
/// handler starting, with the previous message settled and nothing else
/// happening. Must be called inside a `LocalSet`.
pub async fn ours_idle(messages: usize) -> Vec<u64> {
    ours_bursts(messages, 1).await
}

/// Ours when messages arrive in bursts of `burst` (sent in one turn of
/// the arrival loop) on an idle dispatcher: from just before each burst's
/// first `send` to each handler starting, with the previous burst settled.
/// Must be called inside a `LocalSet`.
pub async fn ours_bursts(messages: usize, burst: usize) -> Vec<u64> {
    let messages = messages / burst * burst;
    let origin = Instant::now();
    let started: Arc<[AtomicU64]> = (0..messages).map(|_| AtomicU64::new(0)).collect();
    let count = Rc::new(Cell::new(0));
    let warm_up = warm_up_messages(messages);
    let (transport, dispatcher) =
        stamping_dispatcher(origin, started.clone(), count.clone(), warm_up).await;
    let arrivals = {
        let (transport, count) = (transport.clone(), count.clone());
        async move {
            warm(&transport, &count, warm_up).await;
            let mut sent_at = Vec::with_capacity(messages);
            for first in (warm_up..warm_up + messages).step_by(burst) {
                // Let the previous burst settle and the workers go idle.
                for _ in 0..4 {
                    requeue().await;
                }
                let at = origin.elapsed().as_nanos() as u64;
                for _ in 0..burst {
                    sent_at.push(at);
                    transport.send(TOPIC, Vec::new());
                }
                while count.get() < first + burst {
                    requeue().await;
                }
            }
            sent_at
        }
    };
    let sent_at = run_until_handled(&dispatcher, &count, warm_up + messages, arrivals).await;
    assert_eq!(
        transport.acked(TOPIC).len(),
        warm_up + messages,
        "every message acked"
    );
    sent_at
        .iter()
        .zip(started.iter())
        .map(|(sent, stamp)| stamp.load(Ordering::Relaxed).saturating_sub(*sent))
        .collect()
}

/// The plain loop under the same open-loop load: one task receives from
/// the in-memory consumer (parked on its waker when nothing is there), runs
/// the same stamping handler inline and acks. No dispatcher: its latency is
/// what this machine and the arrival loop cost any single-threaded
/// consumer. Must be called inside a `LocalSet`.
pub async fn plain_open_loop(interval: Duration, messages: usize) -> Vec<u64> {
    let origin = Instant::now();
    let started: Arc<[AtomicU64]> = (0..messages).map(|_| AtomicU64::new(0)).collect();
    let warm_up = warm_up_messages(messages);
    let transport = MemoryTransport::new();
    transport.reserve_events(warm_up + messages);
    let mut consumer = transport
        .subscribe(&ConsumerSpec::new(TOPIC))
        .await
        .expect("subscribing to the in-memory transport");
    let count = Rc::new(Cell::new(0usize));
    let consuming = {
        let (started, count) = (started.clone(), count.clone());
        tokio::task::spawn_local(async move {
            let mut slot = None;
            for _ in 0..warm_up + messages {
                receive_into(&mut consumer, &mut slot).await;
                let message = slot.as_ref().expect("received into the slot");
                let now = origin.elapsed().as_nanos() as u64;
                if let Some(index) = (message.id().entry_id() as usize).checked_sub(warm_up) {
                    started[index].store(now, Ordering::Relaxed);
                }
                count.set(count.get() + 1);
                consumer.ack(message.id()).expect("acking");
            }
        })
    };
    let arrivals = {
        let transport = transport.clone();
        tokio::task::spawn_local(async move {
            warm(&transport, &count, warm_up).await;
            let start = origin.elapsed().as_nanos() as u64;
            send_on_schedule(start, interval, messages, origin, || {
                transport.send(TOPIC, Vec::new());
            })
            .await;
            start
        })
    };
    let start = arrivals.await.expect("the arrival loop does not panic");
    consuming.await.expect("the plain loop does not panic");
    lateness(&started, start, interval)
}

/// What this machine takes from a thread that never blocks: a loop that
/// only reads the clock for `duration`, and the gaps of more than 5 µs
/// between two readings (interrupts, the hypervisor, other processes).
#[derive(Clone, Debug, Default)]
pub struct Stalls {
    /// Gaps per second.
    pub per_second: f64,
    pub gap_p50_ns: u64,
    pub gap_max_ns: u64,
    /// The share of the time lost in gaps.
    pub lost_fraction: f64,
    /// The kernel's local timer interrupts (its scheduler tick) per second
    /// on the CPU the loop ran on, from `/proc/interrupts`; `None` where
    /// that is not readable or the loop moved to another CPU. A tick that
    /// costs more than 5 µs is one gap.
    pub timer_ticks_per_second: Option<f64>,
    /// The share of the gaps that begin in the same sixteenth of the tick's
    /// period (the busiest one): about 1/16 for gaps that come at random,
    /// near 1 for gaps that are the tick.
    pub on_tick_share: Option<f64>,
    pub trace: StallTrace,
}

/// Every gap [`stalls`] saw: when it began and how long it lasted (ns from
/// the loop's start), in order, and how long the loop ran.
#[derive(Clone, Default)]
pub struct StallTrace {
    gaps: Vec<(u64, u64)>,
    span_ns: u64,
}

impl std::fmt::Debug for StallTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} gaps over {} ns", self.gaps.len(), self.span_ns)
    }
}

impl StallTrace {
    /// A trace of `gaps` (start, length) over `span_ns`.
    pub fn new(gaps: Vec<(u64, u64)>, span_ns: u64) -> Self {
        StallTrace { gaps, span_ns }
    }

    /// The lateness of every message for a consumer that costs `service`
    /// per message and loses nothing but this trace's gaps, with arrivals
    /// every `interval` over the trace's span: what the machine alone
    /// takes, the floor under any single-threaded consumer's open-loop
    /// latency at that load. Lateness, as in the open loop, runs from the
    /// scheduled arrival to the handler's start; a handler does not start
    /// in a gap, and a gap in the middle of a handler lengthens it.
    pub fn ideal_consumer(&self, interval: Duration, service: Duration) -> Vec<u64> {
        let (interval, service) = (interval.as_secs_f64() * 1e9, service.as_secs_f64() * 1e9);
        let gaps = &self.gaps;
        let mut next_gap = 0;
        let mut free_at = 0.0f64;
        let mut lateness = Vec::with_capacity((self.span_ns as f64 / interval) as usize + 1);
        let mut arrival = 0.0f64;
        while arrival < self.span_ns as f64 {
            let mut start = arrival.max(free_at);
            while let Some(&(gap_start, length)) = gaps.get(next_gap) {
                let (gap_start, gap_end) = (gap_start as f64, (gap_start + length) as f64);
                if gap_start > start {
                    break;
                }
                start = start.max(gap_end);
                next_gap += 1;
            }
            let mut finish = start + service;
            while let Some(&(gap_start, length)) = gaps.get(next_gap) {
                if gap_start as f64 >= finish {
                    break;
                }
                finish += length as f64;
                next_gap += 1;
            }
            free_at = finish;
            lateness.push((start - arrival) as u64);
            arrival += interval;
        }
        lateness
    }
}

pub fn stalls(duration: Duration) -> Stalls {
    let cpu = current_cpu();
    let ticks_before = cpu.and_then(timer_interrupts);
    let origin = Instant::now();
    let end = duration.as_nanos() as u64;
    let mut gaps = Vec::new();
    prefault(&mut gaps, 1 << 16, (0, 0));
    let mut last = 0u64;
    while last < end {
        let now = origin.elapsed().as_nanos() as u64;
        if now - last > 5_000 {
            gaps.push((last, now - last));
        }
        last = now;
    }
    let starts: Vec<u64> = gaps.iter().map(|&(start, _)| start).collect();
    let lengths: Vec<u64> = gaps.iter().map(|&(_, length)| length).collect();
    let seconds = last as f64 / 1e9;
    let ticks_after = cpu
        .filter(|&cpu| current_cpu() == Some(cpu))
        .and_then(timer_interrupts);
    let ticks_per_second = ticks_before
        .zip(ticks_after)
        .map(|(before, after)| after.saturating_sub(before) as f64 / seconds);
    let lost: u64 = lengths.iter().sum();
    let p = Percentiles::of(&lengths);
    Stalls {
        per_second: gaps.len() as f64 / duration.as_secs_f64(),
        gap_p50_ns: p.p50,
        gap_max_ns: p.max,
        lost_fraction: lost as f64 / last as f64,
        timer_ticks_per_second: ticks_per_second,
        on_tick_share: ticks_per_second.and_then(|ticks| busiest_phase_share(&starts, ticks)),
        trace: StallTrace::new(gaps, last),
    }
}

/// Of events at `starts` (ns), the share in the busiest sixteenth of the
/// tick's period, the tick rate being the kernel's choice (`CONFIG_HZ`:
/// 100, 250, 300 or 1000 a second) nearest `ticks_per_second`; a rate
/// counted over a second that is off by one would smear the phases.
pub fn busiest_phase_share(starts: &[u64], ticks_per_second: f64) -> Option<f64> {
    const KERNEL_TICK_RATES: [u64; 4] = [100, 250, 300, 1000];
    if starts.is_empty() {
        return None;
    }
    let rate = KERNEL_TICK_RATES.into_iter().min_by(|&a, &b| {
        (a as f64 - ticks_per_second)
            .abs()
            .total_cmp(&(b as f64 - ticks_per_second).abs())
    })?;
    let period = 1_000_000_000 / rate;
    let mut sixteenths = [0usize; 16];
    for start in starts {
        sixteenths[(start % period * 16 / period) as usize] += 1;
    }
    let busiest = sixteenths.iter().max().copied().unwrap_or(0);
    Some(busiest as f64 / starts.len() as f64)
}

/// The CPU this thread runs on, where the platform says.
fn current_cpu() -> Option<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: no arguments; returns -1 on failure.
        let cpu = unsafe { libc::sched_getcpu() };
        usize::try_from(cpu).ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Local timer interrupts so far on `cpu` (the `LOC:` row of
/// `/proc/interrupts`, one column per CPU).
fn timer_interrupts(cpu: usize) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/interrupts").ok()?;
    let row = table
        .lines()
        .find_map(|line| line.trim_start().strip_prefix("LOC:"))?;
    row.split_whitespace().nth(cpu)?.parse().ok()
}

/// What the priority-inversion benchmark found.
#[derive(Clone, Debug, Default)]
pub struct Inversions {
    /// High-priority messages sent (and handled).
    pub high_messages: usize,
    /// Low-priority messages dispatched while a high-priority message
    /// waited: from its send until its dispatch. The wait starts at the
    /// send, not when the dispatcher takes the message from its consumer,
    /// so that a dispatcher that picks before it takes what arrived is
    /// charged; it ends at the dispatch, not at the handler's start, since
    /// jobs picked before the high one may start after it without having
    /// overtaken it.
    pub inversions: usize,
    /// Per high-priority message: its handler's start minus the first
    /// permit release after it was sent (or minus its send, when no permit
    /// was released in between), ns.
    pub excess_wait: Vec<u64>,
    /// Per high-priority message: from its send to its handler's start, ns.
    pub wait: Vec<u64>,
    /// Low-priority messages handled during the run.
    pub low_messages: usize,
    /// How often the low-priority backlog ran dry (0 in a valid run: the
    /// count relies on every low-priority receive following a dispatch).
    pub low_ran_dry: usize,
}

/// What happened, in order, as seen from outside the library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    /// The arrival loop sent a high-priority message.
    HighSent,
    /// The high-priority consumer handed a message over: it goes into the
    /// subscription's empty slot in the same step.
    HighReceived,
    /// The high-priority consumer was polled with nothing to give: its slot
    /// was empty, so the message it last gave had been dispatched.
    HighPolledEmpty,
    /// The low-priority consumer handed a message over. Its backlog never
    /// runs dry, so its slot is refilled only right after its previous
    /// message was dispatched: one of these per low-priority dispatch.
    LowReceived,
    /// The low-priority consumer had nothing (its backlog ran dry).
    LowPolledEmpty,
    /// A high-priority handler started.
    HighStarted,
    /// A low-priority handler returned (its permit is released in the same
    /// step).
    LowReturned,
}

type Log = Rc<RefCell<Vec<(u64, Seen)>>>;

fn note(log: &Log, origin: Instant, seen: Seen) {
    log.borrow_mut()
        .push((origin.elapsed().as_nanos() as u64, seen));
}

const HIGH: &str = "inversion-high";
const LOW: &str = "inversion-low";

/// The in-memory transport, with every receive logged.
#[derive(Clone)]
struct Traced {
    inner: MemoryTransport,
    log: Log,
    origin: Instant,
}

struct TracedConsumer {
    inner: MemoryConsumer,
    high: bool,
    log: Log,
    origin: Instant,
}

impl Transport for Traced {
    type Consumer = TracedConsumer;
    type Producer = MemoryProducer;

    async fn subscribe(&self, spec: &ConsumerSpec) -> Result<TracedConsumer, TransportError> {
        Ok(TracedConsumer {
            inner: self.inner.subscribe(spec).await?,
            high: spec.topic.ends_with(HIGH),
            log: self.log.clone(),
            origin: self.origin,
        })
    }

    async fn create_producer(&self, topic: &str) -> Result<MemoryProducer, TransportError> {
        self.inner.create_producer(topic).await
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}

impl Consumer for TracedConsumer {
    fn poll_receive(
        &mut self,
        cx: &mut Context<'_>,
        slot: &mut Option<Message>,
    ) -> Poll<Option<Result<(), TransportError>>> {
        let polled = self.inner.poll_receive(cx, slot);
        let got = matches!(polled, Poll::Ready(Some(Ok(_))));
        let seen = match (self.high, got) {
            (true, true) => Seen::HighReceived,
            (true, false) => Seen::HighPolledEmpty,
            (false, true) => Seen::LowReceived,
            (false, false) => Seen::LowPolledEmpty,
        };
        note(&self.log, self.origin, seen);
        polled
    }

    fn ack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        self.inner.ack(id)
    }

    fn nack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        self.inner.nack(id)
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}

/// Burns about `iterations` steps of CPU (a xorshift that the compiler
/// cannot drop).
pub fn spin(iterations: u64) -> u64 {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ iterations;
    for _ in 0..iterations {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    std::hint::black_box(x)
}

/// A small deterministic random source (xorshift64*).
struct Random(u64);

impl Random {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % bound
    }
}

/// Priority inversion: C = 4 permits, all held by low-priority handlers
/// with a backlog that never runs dry (each handler spins `low_work`
/// steps, lets the other tasks run once, spins again, so that it holds its
/// permit across a yield); `high_messages` high-priority messages arrive
/// one at a time at random moments, 5 to 50 µs after the previous one
/// started. Must be called inside a `LocalSet`.
pub async fn inversions(high_messages: usize, low_work: u64) -> Inversions {
    let origin = Instant::now();
    // Room for a run's log and acks (about 100,000 low-priority messages
    // go by while 5,000 high-priority ones arrive).
    let mut log = Vec::new();
    prefault(&mut log, 1 << 20, (0, Seen::HighSent));
    let log: Log = Rc::new(RefCell::new(log));
    let memory = MemoryTransport::new();
    memory.reserve_events(1 << 18);
    let transport = Traced {
        inner: memory.clone(),
        log: log.clone(),
        origin,
    };
    let dispatcher = Dispatcher::builder()
        .concurrency(4)
        .build(transport)
        .expect("a valid concurrency");
    let high_started = Rc::new(Cell::new(0usize));
    let low_handled = Rc::new(Cell::new(0usize));
    let high = {
        let (log, started) = (log.clone(), high_started.clone());
        async move |_message: &Message| {
            note(&log, origin, Seen::HighStarted);
            started.set(started.get() + 1);
            Ok::<(), Infallible>(())
        }
    };
    let low = {
        let (log, handled) = (log.clone(), low_handled.clone());
        async move |_message: &Message| {
            spin(low_work);
            requeue().await;
            spin(low_work);
            handled.set(handled.get() + 1);
            note(&log, origin, Seen::LowReturned);
            Ok::<(), Infallible>(())
        }
    };
    dispatcher
        .subscribe(HIGH, high, SubscribeOptions::new().priority(0))
        .await
        .expect("subscribing");
    dispatcher
        .subscribe(LOW, low, SubscribeOptions::new().priority(100))
        .await
        .expect("subscribing");
    for _ in 0..1024 {
        memory.send(LOW, Vec::new());
    }
    let arrivals = {
        let (log, high_started) = (log.clone(), high_started.clone());
        async move {
            let mut random = Random(0x5DEE_CE66_D1CE_4E5B);
            // Let every permit be taken by low-priority handlers first.
            for _ in 0..64 {
                requeue().await;
            }
            let mut next_at = origin.elapsed().as_nanos() as u64;
            let mut sent = 0;
            while sent < high_messages || high_started.get() < sent {
                if memory.backlog_len(LOW) < 512 {
                    for _ in 0..512 {
                        memory.send(LOW, Vec::new());
                    }
                }
                let now = origin.elapsed().as_nanos() as u64;
                if sent < high_messages && high_started.get() == sent && now >= next_at {
                    note(&log, origin, Seen::HighSent);
                    memory.send(HIGH, Vec::new());
                    sent += 1;
                    // The next one 5 to 50 µs after this one starts.
                    next_at = u64::MAX;
                } else if next_at == u64::MAX && high_started.get() == sent {
                    next_at = now + 5_000 + random.below(45_000);
                }
                requeue().await;
            }
        }
    };
    let closer = dispatcher.close_handle();
    let finish = async {
        tokio::task::spawn_local(arrivals)
            .await
            .expect("the arrival loop does not panic");
        closer.close().await;
    };
    let (result, ()) = tokio::join!(dispatcher.run(), finish);
    result.expect("the dispatcher shuts down cleanly");
    let mut found = analyse(&log.borrow());
    found.low_messages = low_handled.get();
    assert_eq!(
        found.high_messages, high_messages,
        "every high message seen"
    );
    found
}

/// Walks the log; see [`Inversions`] for what is counted.
fn analyse(log: &[(u64, Seen)]) -> Inversions {
    let mut found = Inversions::default();
    // The high-priority message under way: when it was sent, and the first
    // permit release after that.
    let mut sent_at: Option<u64> = None;
    let mut released_at: Option<u64> = None;
    let mut waiting = Waiting::No;
    // Whether the low-priority consumer last had nothing: then its next
    // message fills a slot that was empty, not one emptied by a dispatch.
    let mut low_dry = true;
    for &(at, seen) in log {
        waiting = waiting.after(seen);
        match seen {
            Seen::HighSent => {
                sent_at = Some(at);
                released_at = None;
            }
            Seen::HighReceived | Seen::HighPolledEmpty => {}
            Seen::LowReceived => {
                if !std::mem::take(&mut low_dry) && waiting != Waiting::No {
                    found.inversions += 1;
                }
            }
            Seen::LowPolledEmpty => {
                low_dry = true;
                found.low_ran_dry += 1;
            }
            Seen::LowReturned => {
                if sent_at.is_some() && released_at.is_none() {
                    released_at = Some(at);
                }
            }
            Seen::HighStarted => {
                let sent = sent_at
                    .take()
                    .expect("a high message starts after its send");
                let released = released_at.take().unwrap_or(sent);
                found.excess_wait.push(at.saturating_sub(released));
                found.wait.push(at.saturating_sub(sent));
                found.high_messages += 1;
            }
        }
    }
    found
}

/// Where the high-priority message under way is, for the inversion count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Waiting {
    /// Dispatched, or none sent: nothing waits.
    No,
    /// Sent, not yet taken from its consumer: it waits all the same (a
    /// dispatcher that picks before it takes what arrived lets low
    /// messages overtake it here).
    Sent,
    /// In its subscription's slot.
    InSlot,
}

impl Waiting {
    /// The state after `seen`. A poll of the high consumer with nothing to
    /// give ends the wait only once the message was taken: the slot is
    /// refilled (the consumer polled) right after its message is
    /// dispatched, and never while it is full.
    fn after(self, seen: Seen) -> Waiting {
        match (self, seen) {
            (_, Seen::HighSent) => Waiting::Sent,
            (Waiting::Sent, Seen::HighReceived) => Waiting::InSlot,
            (Waiting::InSlot, Seen::HighPolledEmpty) => Waiting::No,
            (state, _) => state,
        }
    }
}

/// Checks [`analyse`] on hand-made logs (the smoke run calls it): low
/// dispatches count from the high message's send to its dispatch, and not
/// after it, even before its handler starts.
pub fn check_analysis() {
    use Seen::*;
    let log = |events: &[Seen]| -> Vec<(u64, Seen)> {
        events
            .iter()
            .enumerate()
            .map(|(at, &seen)| (at as u64, seen))
            .collect()
    };
    // A low message dispatched between the high message's send and its
    // receive counts as an inversion: the wait starts at the send.
    let picked_before_taken = log(&[
        LowReceived,
        HighSent,
        HighPolledEmpty,
        LowReturned,
        LowReceived,
        HighReceived,
        HighPolledEmpty,
        HighStarted,
    ]);
    assert_eq!(analyse(&picked_before_taken).inversions, 1);
    // Picked after the high message, started before it: no inversion.
    let started_first = log(&[
        LowReceived,
        HighSent,
        HighReceived,
        HighPolledEmpty,
        LowReturned,
        LowReceived,
        HighStarted,
    ]);
    let found = analyse(&started_first);
    assert_eq!((found.inversions, found.high_messages), (0, 1));
    assert_eq!(found.excess_wait, [2]);
    // The first receive of a dry backlog fills an empty slot: no dispatch.
    let refilled = log(&[LowPolledEmpty, HighSent, LowReceived, HighReceived]);
    assert_eq!(analyse(&refilled).inversions, 0);
}

/// One dispatcher per core on the in-memory transport: `cores` dispatchers
/// (K = 1, C = 20) on as many threads, each with `messages / cores`
/// messages waiting on its own transport, with a handler that spins
/// `work` steps. Returns the time from the first handler's start until
/// the last handler has run. The clock starts in a handler, not when
/// `PerCore::start` returns: on a busy machine the workers may drain their
/// whole backlog before the starting thread is scheduled again.
pub fn per_core(cores: usize, messages: usize, work: u64) -> Duration {
    let per_dispatcher = messages / cores;
    let total = per_dispatcher * cores;
    let count = Arc::new(AtomicUsize::new(0));
    let first_start = Arc::new(OnceLock::new());
    let (done_tx, done_rx) = mpsc::channel();
    let started = first_start.clone();
    let factory = move |_core: usize| {
        let (count, done, started) = (count.clone(), done_tx.clone(), started.clone());
        async move {
            let transport = MemoryTransport::new();
            transport.reserve_events(per_dispatcher);
            let dispatcher = Dispatcher::builder()
                .concurrency(20)
                .build(transport.clone())?;
            let handler = async move |_message: &Message| {
                started.get_or_init(Instant::now);
                spin(work);
                if count.fetch_add(1, Ordering::Relaxed) + 1 == total {
                    let _ = done.send(Instant::now());
                }
                Ok::<(), Infallible>(())
            };
            dispatcher
                .subscribe("per-core", handler, SubscribeOptions::new())
                .await?;
            for _ in 0..per_dispatcher {
                transport.send("per-core", Vec::new());
            }
            Ok(dispatcher)
        }
    };
    let group = PerCore::start(cores, factory).expect("starting the dispatchers");
    let end = done_rx
        .recv_timeout(Duration::from_secs(600))
        .expect("every message is handled");
    group.shutdown_handle().shutdown();
    for result in group.join() {
        result.expect("a clean run");
    }
    end - *first_start.get().expect("a handler ran")
}
