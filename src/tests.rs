//! Dispatcher behaviour on the in-memory transport: scheduling, backpressure,
//! settlement and shutdown, end to end through the public API.

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::future::Future;
use std::rc::Rc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::{spawn_local, yield_now, LocalSet};

use crate::transport::MemoryTransport;
use crate::{Dispatcher, Error, HealthPhase, Message, SubscribeOptions};

/// Runs `test` on a `LocalSet` of a fresh `current_thread` runtime: the
/// setup of every unit test that drives tasks (the engine's and routing's
/// own tests use it too).
pub(crate) fn run_local<F: Future>(test: F) -> F::Output {
    on_local_set(false, test)
}

/// Runs `test` as [`run_local`] does, on a paused clock: it jumps ahead
/// only when every task waits.
fn run_paused<F: Future>(test: F) -> F::Output {
    on_local_set(true, test)
}

fn on_local_set<F: Future>(paused: bool, test: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(paused)
        .build()
        .unwrap();
    LocalSet::new().block_on(&runtime, test)
}

/// Never returns for payload `hang`; succeeds otherwise.
async fn hangs_on_request(message: &Message) -> Result<(), Infallible> {
    if message.payload() == b"hang" {
        std::future::pending::<()>().await;
    }
    Ok(())
}

fn dispatcher(concurrency: usize) -> (Dispatcher<MemoryTransport>, MemoryTransport) {
    let transport = MemoryTransport::new();
    let dispatcher = Dispatcher::builder()
        .concurrency(concurrency)
        .build(transport.clone())
        .unwrap();
    (dispatcher, transport)
}

/// Whether `result` is an `Error::InvalidOption` naming `option`.
fn refused_for<T>(result: &Result<T, Error>, option: &str) -> bool {
    matches!(result, Err(Error::InvalidOption { option: named, .. }) if *named == option)
}

fn options(priority: i64) -> SubscribeOptions {
    SubscribeOptions::new()
        .priority(priority)
        .negative_ack_redelivery_delay(Duration::ZERO)
}

type Log = Rc<RefCell<Vec<String>>>;

/// A handler that records `<label>:<payload>` and yields before returning,
/// so that readers get to refill their slots while it runs.
fn recorder(log: &Log, label: &'static str) -> impl AsyncFn(&Message) -> Result<(), Infallible> {
    let log = log.clone();
    async move |message: &Message| {
        let payload = String::from_utf8_lossy(message.payload()).into_owned();
        log.borrow_mut().push(format!("{label}:{payload}"));
        yield_now().await;
        Ok(())
    }
}

/// A latch that handlers wait on until the test opens it.
#[derive(Clone, Default)]
struct Gate {
    open: Rc<Cell<bool>>,
    notify: Rc<Notify>,
}

impl Gate {
    async fn wait(&self) {
        while !self.open.get() {
            self.notify.notified().await;
        }
    }

    fn open(&self) {
        self.open.set(true);
        self.notify.notify_waiters();
    }
}

/// A handler that waits for `gate` to open, then succeeds.
fn gated(gate: &Gate) -> impl AsyncFn(&Message) -> Result<(), Infallible> {
    let gate = gate.clone();
    async move |_: &Message| {
        gate.wait().await;
        Ok(())
    }
}

/// A running dispatcher whose one subscription, `jobs`, has `count`
/// messages waiting and a handler that waits for `gate`.
struct GatedJobs {
    dispatcher: Rc<Dispatcher<MemoryTransport>>,
    transport: MemoryTransport,
    gate: Gate,
    ids: Vec<crate::MessageId>,
    run: tokio::task::JoinHandle<Result<(), Error>>,
}

async fn gated_jobs(concurrency: usize, count: usize) -> GatedJobs {
    let (dispatcher, transport) = dispatcher(concurrency);
    let gate = Gate::default();
    let ids = (0..count)
        .map(|n| transport.send("jobs", format!("{n}")))
        .collect();
    dispatcher
        .subscribe("jobs", gated(&gate), options(1))
        .await
        .unwrap();
    let dispatcher = Rc::new(dispatcher);
    let run = spawn_run(&dispatcher);
    settle_down().await;
    GatedJobs {
        dispatcher,
        transport,
        gate,
        ids,
        run,
    }
}

async fn settle_down() {
    for _ in 0..50 {
        yield_now().await;
    }
}

fn spawn_run<T: crate::transport::Transport>(
    dispatcher: &Rc<Dispatcher<T>>,
) -> tokio::task::JoinHandle<Result<(), Error>> {
    let dispatcher = dispatcher.clone();
    spawn_local(async move { dispatcher.run().await })
}

#[test]
fn the_configuration_types_can_be_built_once_and_shared_by_every_core() {
    // `PerCore` factories are `Send + Sync`: what they capture must be too.
    fn shareable<T: Send + Sync + Clone>(_: &T) {}
    let options = SubscribeOptions::new()
        .retry_errors(crate::ErrorClass::of::<std::io::Error>())
        .retry_backoff(|retry| Duration::from_millis(10 * u64::from(retry)));
    shareable(&options);
    shareable(&Dispatcher::builder().concurrency(4));
    shareable(&crate::DeadLetterTargets::known());
    shareable(&crate::SchedulingPolicy::Strict);
    let built_here = format!("{options:?}");
    let from_another_thread = std::thread::spawn(move || options.clone())
        .join()
        .expect("the options cross threads");
    assert_eq!(
        format!("{from_another_thread:?}"),
        built_here,
        "the clone made on another thread keeps every setting"
    );
}

#[test]
fn messages_waiting_in_several_subscriptions_go_out_in_priority_order() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let log = Log::default();
        for (topic, priority) in [("low", 30), ("high", 10), ("mid", 20)] {
            for n in 0..4 {
                transport.send(topic, format!("{n}"));
            }
            dispatcher
                .subscribe(topic, recorder(&log, topic), options(priority))
                .await
                .unwrap();
        }
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("low", 4).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        let expected: Vec<String> = ["high", "mid", "low"]
            .iter()
            .flat_map(|topic| (0..4).map(move |n| format!("{topic}:{n}")))
            .collect();
        assert_eq!(*log.borrow(), expected);
    });
}

#[test]
fn a_backlog_of_handlers_that_never_wait_still_lets_other_tasks_run() {
    run_local(async {
        const CONCURRENCY: usize = 4;
        // Each worker handles at most a budget of messages per poll, and a
        // worker may be polled twice between two turns of a task that
        // yields (once when it steps aside, once when it is handed work).
        let bound = 2 * CONCURRENCY * crate::engine::JOBS_PER_POLL as usize;
        let messages = 4 * bound;
        let (dispatcher, transport) = dispatcher(CONCURRENCY);
        for _ in 0..messages {
            transport.send("jobs", Vec::new());
        }
        let handled = Rc::new(Cell::new(0));
        let counter = handled.clone();
        let handler = async move |_: &Message| {
            counter.set(counter.get() + 1);
            Ok::<(), Infallible>(())
        };
        dispatcher
            .subscribe("jobs", handler, options(0))
            .await
            .unwrap();
        // Another task on the thread, as the broker connection's are: the
        // most handlers that ran between two of its turns.
        let ticker = spawn_local(async move {
            let (mut last, mut longest) = (0, 0);
            while handled.get() < messages {
                yield_now().await;
                longest = longest.max(handled.get() - last);
                last = handled.get();
            }
            longest
        });
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        let longest = ticker.await.unwrap();
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert!(
            (1..=bound).contains(&longest),
            "{longest} handlers ran between two turns of another task"
        );
    });
}

#[test]
fn subscriptions_of_equal_priority_take_turns() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let log = Log::default();
        for topic in ["orders", "payments", "notifications"] {
            for n in 0..3 {
                transport.send(topic, format!("{n}"));
            }
            dispatcher
                .subscribe(topic, recorder(&log, topic), options(10))
                .await
                .unwrap();
        }
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("notifications", 3).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        let topics: Vec<String> = log
            .borrow()
            .iter()
            .map(|entry| entry.split(':').next().unwrap().to_owned())
            .collect();
        assert_eq!(
            topics,
            ["orders", "payments", "notifications"].repeat(3),
            "log: {:?}",
            log.borrow()
        );
    });
}

#[test]
fn a_high_priority_message_arriving_while_all_permits_are_taken_goes_next() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        let log = Log::default();
        let gate = Gate::default();
        for n in 0..5 {
            transport.send("batch", format!("{n}"));
        }
        let batch_log = log.clone();
        let batch_gate = gate.clone();
        dispatcher
            .subscribe(
                "batch",
                async move |message: &Message| {
                    batch_log.borrow_mut().push(format!(
                        "batch:{}",
                        String::from_utf8_lossy(message.payload())
                    ));
                    batch_gate.wait().await;
                    Ok::<_, Infallible>(())
                },
                options(50),
            )
            .await
            .unwrap();
        dispatcher
            .subscribe("urgent", recorder(&log, "urgent"), options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        assert_eq!(*log.borrow(), ["batch:0", "batch:1"], "both permits taken");
        transport.send("urgent", "now");
        settle_down().await;
        assert_eq!(
            log.borrow().len(),
            2,
            "no preemption: nothing starts without a permit"
        );
        gate.open();
        transport.wait_acked("batch", 5).await;
        assert_eq!(log.borrow()[2], "urgent:now", "log: {:?}", log.borrow());
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// A running dispatcher (concurrency 3) on the topic `jobs`, whose handler
/// counts the messages it starts and waits at the gate on a message that
/// says `wait`; one message has been handled, so a worker exists and waits
/// idle, offering to dispatch.
struct IdleWorker {
    dispatcher: Rc<Dispatcher<MemoryTransport>>,
    transport: MemoryTransport,
    gate: Gate,
    started: Rc<Cell<usize>>,
    run: tokio::task::JoinHandle<Result<(), Error>>,
}

async fn idle_worker() -> IdleWorker {
    let (dispatcher, transport) = dispatcher(3);
    let gate = Gate::default();
    let started = Rc::new(Cell::new(0));
    let handler = {
        let (gate, started) = (gate.clone(), started.clone());
        async move |message: &Message| {
            started.set(started.get() + 1);
            if message.payload() == b"wait" {
                gate.wait().await;
            }
            Ok::<_, Infallible>(())
        }
    };
    dispatcher
        .subscribe("jobs", handler, options(1))
        .await
        .unwrap();
    let dispatcher = Rc::new(dispatcher);
    let run = spawn_run(&dispatcher);
    settle_down().await;
    transport.send("jobs", "quick");
    transport.wait_acked("jobs", 1).await;
    settle_down().await;
    IdleWorker {
        dispatcher,
        transport,
        gate,
        started,
        run,
    }
}

impl IdleWorker {
    /// Opens the gate, waits until `total` messages are acked, and closes
    /// the dispatcher, which must shut down cleanly.
    async fn open_gate_and_close(self, total: usize) {
        self.gate.open();
        self.transport.wait_acked("jobs", total).await;
        self.dispatcher.close().await;
        self.run.await.unwrap().unwrap();
    }
}

/// Messages that arrive one at a time: the worker that went idle after the
/// first dispatches the next itself when the consumer wakes, and, once it is
/// busy with a handler that waits, the message after that still starts at
/// once on another worker (no message waits while a permit is free).
#[test]
fn messages_arriving_one_by_one_each_start_while_earlier_ones_wait() {
    run_local(async {
        let worker = idle_worker().await;
        let (transport, started) = (&worker.transport, &worker.started);
        transport.send("jobs", "wait");
        settle_down().await;
        assert_eq!(started.get(), 2);
        transport.send("jobs", "wait");
        settle_down().await;
        assert_eq!(
            started.get(),
            3,
            "started though the one before still waits"
        );
        transport.send("jobs", "quick");
        transport.wait_acked("jobs", 2).await;
        assert_eq!(started.get(), 4);
        worker.open_gate_and_close(4).await;
    });
}

/// A burst that arrives while a worker is idle is picked by that worker,
/// which keeps the messages for its own handler and runs them in turn;
/// when the first one's handler waits, the rest go to other workers at
/// once instead of waiting behind it.
#[test]
fn a_burst_kept_by_one_worker_is_handed_on_when_its_first_handler_waits() {
    run_local(async {
        let worker = idle_worker().await;
        let (transport, started) = (&worker.transport, &worker.started);
        for payload in ["wait", "quick", "quick"] {
            transport.send("jobs", payload);
        }
        settle_down().await;
        assert_eq!(started.get(), 4, "the two behind the waiting one ran");
        assert_eq!(transport.acked("jobs").len(), 3);
        worker.open_gate_and_close(4).await;
    });
}

/// A consumer that wakes while a worker is idle wakes that worker (the
/// engine's helper) to dispatch. If a job is handed to the same worker
/// before it runs, it runs the job and the consumer is the engine's to
/// poll. Here the wake-up comes from a handler (K2 sends to `b`), whose
/// queued batch-mate (L1) then goes to the idle helper; the busy handlers
/// wait for `b`'s handler, and with metrics off no periodic tick polls the
/// consumers: a lost wake-up is a hang.
#[test]
fn a_wake_up_for_an_idle_worker_that_is_then_handed_a_job_is_not_lost() {
    run_paused(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder()
            .concurrency(3)
            .metrics_interval(None)
            .build(transport.clone())
            .unwrap();
        for (payload, key) in [("K1", "k"), ("M1", "m"), ("K2", "k"), ("L1", "l")] {
            let message = crate::transport::OutgoingMessage::new(payload).with_partition_key(key);
            transport.send_message("orders", message);
        }
        let gate = Gate::default();
        let (sender, wait) = (transport.clone(), gate.clone());
        let orders = async move |message: &Message| {
            match message.payload() {
                b"K1" => yield_now().await,
                b"M1" => {}
                b"K2" => {
                    sender.send("b", "ping");
                    wait.wait().await;
                }
                _ => wait.wait().await,
            }
            Ok::<_, Infallible>(())
        };
        // Key-ordered with a buffer of one, so that a dispatch picks K2
        // and L1 together for one worker.
        let ordered = options(1).ordering(crate::Ordering::Key).key_buffer(1);
        dispatcher
            .subscribe("orders", orders, ordered)
            .await
            .unwrap();
        let open = gate.clone();
        let b = async move |_: &Message| {
            open.open();
            Ok::<_, Infallible>(())
        };
        dispatcher.subscribe("b", b, options(1)).await.unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        let waited =
            tokio::time::timeout(Duration::from_secs(3600), transport.wait_acked("b", 1)).await;
        let stats = dispatcher.stats();
        assert!(
            waited.is_ok(),
            "b never handled: in flight {} of {}, waiting {}",
            stats.in_flight,
            stats.concurrency,
            stats.waiting
        );
        transport.wait_acked("orders", 4).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn never_more_handlers_in_flight_than_the_concurrency_limit() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(3);
        let in_flight = Rc::new(Cell::new(0usize));
        let peak = Rc::new(Cell::new(0usize));
        let topics = ["a", "b", "c", "d"];
        for topic in topics {
            for n in 0..10 {
                transport.send(topic, format!("{n}"));
            }
            let (in_flight, peak) = (in_flight.clone(), peak.clone());
            dispatcher
                .subscribe(
                    topic,
                    async move |_: &Message| {
                        in_flight.set(in_flight.get() + 1);
                        peak.set(peak.get().max(in_flight.get()));
                        for _ in 0..5 {
                            yield_now().await;
                        }
                        in_flight.set(in_flight.get() - 1);
                        Ok::<_, Infallible>(())
                    },
                    options(10),
                )
                .await
                .unwrap();
        }
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        for topic in topics {
            transport.wait_acked(topic, 10).await;
        }
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert_eq!(peak.get(), 3);
    });
}

#[test]
fn a_full_slot_stops_only_its_own_reader() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let gate = Gate::default();
        for n in 0..10 {
            transport.send("slow", format!("{n}"));
            transport.send("other", format!("{n}"));
        }
        dispatcher
            .subscribe("slow", gated(&gate), options(1))
            .await
            .unwrap();
        dispatcher
            .subscribe("other", recorder(&Log::default(), "other"), options(2))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        // One message in its handler and one in its slot; the rest stays with
        // the broker.
        assert_eq!(transport.received_count("slow"), 2);
        assert_eq!(transport.backlog_len("slow"), 8);
        // The other subscription filled its own slot regardless.
        assert_eq!(transport.received_count("other"), 1);
        assert_eq!(transport.backlog_len("other"), 9);
        gate.open();
        transport.wait_acked("slow", 10).await;
        transport.wait_acked("other", 10).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn success_acks_while_errors_and_panics_nack_without_stopping_anything() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let ok = transport.send("jobs", "ok");
        let failing = transport.send("jobs", "error");
        let panicking = transport.send("jobs", "panic");
        let redeliveries = Rc::new(RefCell::new(Vec::new()));
        let seen = redeliveries.clone();
        dispatcher
            .subscribe(
                "jobs",
                async move |message: &Message| {
                    let first_delivery = message.redelivery_count() == Some(0);
                    if !first_delivery {
                        seen.borrow_mut().push(message.payload().to_vec());
                    }
                    match (message.payload(), first_delivery) {
                        (b"error", true) => Err("boom"),
                        (b"panic", true) => panic!("handler bug"),
                        _ => Ok(()),
                    }
                },
                options(1),
            )
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("jobs", 3).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert_eq!(
            transport.nacked("jobs"),
            [failing.clone(), panicking.clone()]
        );
        assert_eq!(transport.acked("jobs"), [ok, failing, panicking]);
        assert_eq!(
            *redeliveries.borrow(),
            [b"error".to_vec(), b"panic".to_vec()]
        );
    });
}

#[test]
fn nacks_wait_out_the_negative_ack_delay_but_not_shutdown() {
    run_local(async {
        tokio::time::pause();
        let (dispatcher, transport) = dispatcher(5);
        let first = transport.send("jobs", "a");
        // The default delay: a minute, as in Pulsar's other clients.
        dispatcher
            .subscribe(
                "jobs",
                async |_: &Message| Err::<(), _>("always fails"),
                SubscribeOptions::new(),
            )
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        assert!(transport.nacked("jobs").is_empty(), "nack held back");
        tokio::time::advance(Duration::from_secs(59)).await;
        settle_down().await;
        assert!(
            transport.nacked("jobs").is_empty(),
            "still within the delay"
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        settle_down().await;
        assert_eq!(transport.nacked("jobs"), std::slice::from_ref(&first));
        // The redelivered message fails again and its nack is held; closing
        // sends it at once instead of waiting another minute.
        let closing_at = tokio::time::Instant::now();
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert!(closing_at.elapsed() < Duration::from_secs(1));
        assert_eq!(transport.nacked("jobs"), [first.clone(), first]);
    });
}

#[test]
fn defaults_are_the_python_originals() {
    run_local(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder().build(transport.clone()).unwrap();
        assert_eq!(dispatcher.stats().concurrency, 20);
        let options = SubscribeOptions::new();
        let consumer = options.resolve("jobs").unwrap().consumer;
        assert_eq!(consumer.receiver_queue_size, 1);
        dispatcher
            .subscribe("jobs", recorder(&Log::default(), "jobs"), options)
            .await
            .unwrap();
        let info = &dispatcher.subscriptions()[0];
        assert_eq!(info.priority, 100);
        assert_eq!(info.subscription_type, pulsar::SubType::Exclusive);
        assert_eq!(info.subscription, None);
    });
}

/// The consumer options the dispatcher does not interpret reach the
/// transport as they were given.
#[test]
fn the_consumer_options_passed_through_reach_the_consumer_as_given() {
    let metadata = std::collections::BTreeMap::from([("team".to_owned(), "billing".to_owned())]);
    let crate_options = pulsar::ConsumerOptions::default()
        .with_metadata(metadata.clone())
        .read_compacted(true);
    let options = SubscribeOptions::new()
        .consumer_name("billing-1")
        .consumer_options(crate_options)
        .unacked_message_resend_delay(Duration::from_secs(30));
    let consumer = options.resolve("jobs").unwrap().consumer;
    assert_eq!(consumer.consumer_name.as_deref(), Some("billing-1"));
    assert_eq!(consumer.consumer_options.metadata, metadata);
    assert_eq!(consumer.consumer_options.read_compacted, Some(true));
    assert_eq!(
        consumer.unacked_message_resend_delay,
        Some(Duration::from_secs(30))
    );
}

#[test]
fn shutdown_finishes_queued_and_in_flight_work_then_closes() {
    run_local(async {
        let GatedJobs {
            dispatcher,
            transport,
            gate,
            ids,
            run,
        } = gated_jobs(1, 3).await;
        let closer = dispatcher.clone();
        let closing = spawn_local(async move { closer.close().await });
        settle_down().await;
        assert!(
            !closing.is_finished(),
            "close waits for the handler in flight"
        );
        assert!(!transport.is_closed());
        gate.open();
        closing.await.unwrap();
        run.await.unwrap().unwrap();
        // The message in flight and the one queued in the slot were handled;
        // the third was never taken from the broker.
        assert_eq!(transport.acked("jobs"), ids[..2]);
        assert_eq!(transport.backlog_len("jobs"), 1);
        assert!(transport.is_closed());
        assert_eq!(transport.open_consumers(), 0);
    });
}

#[test]
fn a_consumer_that_ends_stops_the_dispatcher_with_an_error_and_still_closes() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        transport.fail_close();
        dispatcher
            .subscribe("a", recorder(&Log::default(), "a"), options(1))
            .await
            .unwrap();
        dispatcher
            .subscribe("b", recorder(&Log::default(), "b"), options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        transport.end_stream("a");
        let result = run.await.unwrap();
        assert!(
            matches!(&result, Err(Error::ConsumerEnded { topic }) if topic.ends_with("/a")),
            "{result:?}"
        );
        assert!(transport.is_closed(), "closed even though a reader failed");
        assert_eq!(transport.open_consumers(), 0);
    });
}

#[test]
fn close_is_idempotent_shared_by_concurrent_callers_and_survives_dropped_callers() {
    run_local(async {
        let GatedJobs {
            dispatcher,
            transport,
            gate,
            ids,
            run,
        } = gated_jobs(2, 1).await;
        let handle = dispatcher.close_handle();
        let callers: Vec<_> = (0..3)
            .map(|_| {
                let handle = handle.clone();
                spawn_local(async move { handle.close().await })
            })
            .collect();
        // A caller that gives up half-way does not cancel the shutdown.
        let abandoned = {
            let handle = handle.clone();
            spawn_local(async move { handle.close().await })
        };
        settle_down().await;
        abandoned.abort();
        gate.open();
        for caller in callers {
            caller.await.unwrap();
        }
        run.await.unwrap().unwrap();
        assert!(transport.is_closed());
        assert_eq!(transport.acked("jobs"), ids);
        // Closing again returns at once.
        handle.close().await;
        dispatcher.close().await;
    });
}

#[test]
fn dropping_the_run_future_shuts_down_gracefully() {
    run_local(async {
        let GatedJobs {
            dispatcher,
            transport,
            gate,
            ids,
            run,
        } = gated_jobs(1, 2).await;
        run.abort();
        assert!(run.await.unwrap_err().is_cancelled());
        // No close() from here on: the dropped run() alone shuts down.
        assert_eq!(dispatcher.health().phase, HealthPhase::Draining);
        gate.open();
        for _ in 0..10_000 {
            if transport.is_closed() {
                break;
            }
            yield_now().await;
        }
        assert!(
            transport.is_closed(),
            "the dropped run() closed the connection"
        );
        assert_eq!(transport.acked("jobs"), ids);
        assert_eq!(dispatcher.health().phase, HealthPhase::Closed);
    });
}

#[test]
fn close_without_run_closes_consumers_and_connection() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        transport.send("jobs", "kept");
        dispatcher
            .subscribe("jobs", recorder(&Log::default(), "jobs"), options(1))
            .await
            .unwrap();
        dispatcher.close().await;
        assert!(transport.is_closed());
        assert_eq!(transport.open_consumers(), 0);
        assert_eq!(transport.received_count("jobs"), 0);
        assert!(matches!(
            dispatcher.run().await,
            Err(Error::RunNotAllowed { .. })
        ));
    });
}

/// A URL the `pulsar` crate cannot connect with is refused before any
/// connection is tried, naming the option.
#[test]
fn a_url_that_is_not_a_broker_service_url_is_refused_at_once() {
    run_local(async {
        for url in ["http://127.0.0.1:8080", "127.0.0.1:6650", "not a url", ""] {
            let refused = Dispatcher::connect(url).await;
            assert!(refused_for(&refused, "url"), "{url:?}: {refused:?}");
        }
    });
}

#[test]
fn misuse_is_refused_with_a_typed_error() {
    run_local(async {
        let transport = MemoryTransport::new();
        let refused = Dispatcher::builder()
            .concurrency(0)
            .build(transport.clone());
        assert!(refused_for(&refused, "concurrency"));
        // Refused before connecting: nothing listens on port 1.
        let refused = Dispatcher::builder()
            .max_message_size(0)
            .connect("pulsar://127.0.0.1:1")
            .await;
        assert!(refused_for(&refused, "max_message_size"));
        let (dispatcher, transport) = dispatcher(1);
        let refused = dispatcher
            .subscribe(
                "jobs",
                recorder(&Log::default(), "jobs"),
                options(1).receiver_queue_size(0),
            )
            .await;
        assert!(refused_for(&refused, "receiver_queue_size"));
        let refused = dispatcher
            .subscribe("a//b", recorder(&Log::default(), "x"), options(1))
            .await;
        assert!(matches!(refused, Err(Error::InvalidTopic { .. })));
        transport.fail_subscribe("broken");
        let refused = dispatcher
            .subscribe("broken", recorder(&Log::default(), "x"), options(1))
            .await;
        assert!(matches!(refused, Err(Error::Subscribe { .. })));
        assert_eq!(transport.open_consumers(), 0, "nothing left behind");

        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        assert!(matches!(
            dispatcher.run().await,
            Err(Error::RunNotAllowed { state: "running" })
        ));
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        let closed = dispatcher
            .subscribe("late", recorder(&Log::default(), "late"), options(1))
            .await;
        assert!(matches!(
            closed,
            Err(Error::SubscribeNotAllowed {
                state: "closed",
                ..
            })
        ));
        assert_eq!(transport.open_consumers(), 0);
    });
}

/// After `close()` a subscription is not gone: its handle answers with its
/// last state, a priority change is accepted and shows, and an unsubscribe
/// is accepted and changes nothing (the shutdown closed everything). Once
/// the dispatcher is dropped, the handle answers that it is gone.
#[test]
fn a_closed_dispatchers_handles_still_answer() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let log = Log::default();
        let jobs = dispatcher
            .subscribe("jobs", recorder(&log, "jobs"), options(3))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.send("jobs", "1");
        transport.wait_acked("jobs", 1).await;
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert_eq!(jobs.info().map(|info| info.priority), Some(3));
        assert_eq!(jobs.stats().map(|stats| stats.succeeded), Some(1));
        jobs.set_priority(7).unwrap();
        assert_eq!(jobs.info().map(|info| info.priority), Some(7));
        let again = jobs.clone();
        dispatcher.unsubscribe(jobs).await.unwrap();
        assert_eq!(transport.open_consumers(), 0);
        assert_eq!(dispatcher.stats().subscriptions.len(), 1);
        drop(dispatcher);
        // The closed workers' tasks hold the engine until their last turn.
        settle_down().await;
        assert!(again.info().is_none());
        assert!(matches!(
            again.set_priority(1),
            Err(Error::UnknownSubscription { .. })
        ));
    });
}

/// A dispatcher prints its phase and subscriptions; a handle prints what it
/// points at: its topic and whether the subscription is still registered,
/// or whether the dispatcher still lives.
#[test]
fn handles_show_whether_what_they_point_at_is_still_there() {
    run_local(async {
        let (dispatcher, _transport) = dispatcher(1);
        let log = Log::default();
        let jobs = dispatcher
            .subscribe("jobs", recorder(&log, "jobs"), options(3))
            .await
            .unwrap();
        let closer = dispatcher.close_handle();
        let shown = format!("{dispatcher:?}");
        assert!(
            shown.contains("phase: Idle")
                && shown.contains("topic: \"persistent://public/default/jobs\"")
                && shown.contains("priority: 3"),
            "{shown}"
        );
        let shown = format!("{jobs:?}");
        assert!(
            shown.contains("persistent://public/default/jobs")
                && shown.contains("registered: true"),
            "{shown}"
        );
        assert!(format!("{closer:?}").contains("dispatcher_alive: true"));
        dispatcher.unsubscribe(jobs.clone()).await.unwrap();
        assert!(format!("{jobs:?}").contains("registered: false"));
        assert!(format!("{dispatcher:?}").contains("subscriptions: []"));
        drop(dispatcher);
        settle_down().await;
        assert!(format!("{closer:?}").contains("dispatcher_alive: false"));
        assert!(closer.health().is_none() && closer.stats().is_none());
        assert_eq!(closer.close_within(Duration::from_secs(1)).await, 0);
    });
}

/// Subscriptions are numbered per dispatcher, so two dispatchers' first
/// subscriptions have the same number: a handle is still only its own
/// dispatcher's to remove.
#[test]
fn a_handle_is_refused_by_another_dispatcher() {
    run_local(async {
        let log = Log::default();
        let (first, _) = dispatcher(1);
        let (second, _) = dispatcher(1);
        let first_jobs = first
            .subscribe("jobs", recorder(&log, "first"), options(3))
            .await
            .unwrap();
        let second_jobs = second
            .subscribe("jobs", recorder(&log, "second"), options(3))
            .await
            .unwrap();
        assert!(matches!(
            second.unsubscribe(first_jobs.clone()).await,
            Err(Error::UnknownSubscription { .. })
        ));
        assert!(first_jobs.info().is_some() && second_jobs.info().is_some());
        first.unsubscribe(first_jobs).await.unwrap();
        assert!(second_jobs.info().is_some());
    });
}

#[test]
fn a_subscribe_that_completes_after_run_started_takes_part() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let dispatcher = Rc::new(dispatcher);
        transport.send("jobs", "1");
        // The subscribe is in progress (awaiting the broker) when run starts.
        let subscriber = dispatcher.clone();
        let log = Log::default();
        let handler = recorder(&log, "jobs");
        let pending =
            spawn_local(async move { subscriber.subscribe("jobs", handler, options(1)).await });
        let run = spawn_run(&dispatcher);
        pending.await.unwrap().unwrap();
        transport.wait_acked("jobs", 1).await;
        assert_eq!(*log.borrow(), ["jobs:1"]);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert_eq!(transport.open_consumers(), 0);
    });
}

#[test]
fn a_subscribe_that_completes_after_close_started_leaves_no_consumer() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        // The subscribe is in progress (awaiting the broker) when close starts.
        let subscriber = dispatcher.clone();
        let pending = spawn_local(async move {
            subscriber
                .subscribe("jobs", recorder(&Log::default(), "jobs"), options(1))
                .await
        });
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        let result = pending.await.unwrap();
        assert!(
            matches!(result, Err(Error::SubscribeNotAllowed { .. })),
            "{result:?}"
        );
        assert_eq!(
            transport.open_consumers(),
            0,
            "the late consumer was closed"
        );
    });
}

#[test]
fn stats_count_outcomes_and_settlements_the_transport_refused() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(4);
        dispatcher
            .subscribe(
                "good",
                async |message: &Message| match message.payload() {
                    b"fail" => Err("failed"),
                    b"panic" => panic!("handler panicked"),
                    _ => Ok(()),
                },
                options(1),
            )
            .await
            .unwrap();
        dispatcher
            .subscribe("refused", recorder(&Log::default(), "r"), options(2))
            .await
            .unwrap();
        for payload in ["ok", "ok", "fail", "panic"] {
            transport.send("good", payload);
        }
        transport.fail_settlements("refused");
        transport.send("refused", "x");
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("good", 2).await;
        settle_down().await;
        let stats = dispatcher.stats();
        let (good, refused) = (&stats.subscriptions[0], &stats.subscriptions[1]);
        assert!(good.topic.ends_with("/good"), "{good:?}");
        assert_eq!(good.priority, 1);
        // The failed and panicked messages come back (nack without delay)
        // and fail again, so count at least once each.
        assert!(good.received >= 4 && good.dispatched >= 4, "{good:?}");
        assert_eq!(good.succeeded, 2, "{good:?}");
        assert!(good.failed >= 1 && good.panicked >= 1, "{good:?}");
        assert_eq!(good.acked, 2, "{good:?}");
        assert_eq!(good.nacked, good.failed + good.panicked, "{good:?}");
        assert_eq!((good.acks_failed, good.nacks_failed), (0, 0));
        assert_eq!((refused.succeeded, refused.acked), (1, 0), "{refused:?}");
        assert_eq!(refused.acks_failed, 1, "the refused ack is counted");
        assert_eq!(stats.total().acks_failed, 1);
        assert_eq!(stats.concurrency, 4);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        let closer_stats = dispatcher.close_handle().stats().unwrap();
        assert_eq!(closer_stats.total().acks_failed, 1);
    });
}

/// Options print every setting, and a placeholder for the closures they
/// hold (an error class, a backoff curve) rather than nothing.
#[test]
fn options_show_their_closures_as_placeholders() {
    let options = SubscribeOptions::new()
        .fatal_errors(crate::ErrorClass::of::<Infallible>())
        .retry_backoff(crate::default_backoff);
    let shown = format!("{options:?}");
    assert!(
        shown.contains("fatal_errors: Some(ErrorClass(..))")
            && shown.contains("retry_backoff: Some(Backoff(..))"),
        "{shown}"
    );
}

mod hardening;
mod hooked;
mod observability;
mod randomized;
mod routing;
mod scheduling;
