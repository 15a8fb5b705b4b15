//! Failure handling on the in-memory transport: processing and shutdown
//! deadlines, receive errors, bounded subscribes, invalid durations and
//! failures of the dispatcher's own code.

use std::convert::Infallible;
use std::rc::Rc;
use std::time::Duration;

use super::hooked::Hooked;
use super::{
    dispatcher, hangs_on_request, options, refused_for, run_local, settle_down, spawn_run, Gate,
};
use crate::transport::{MemoryTransport, OutgoingMessage};
use crate::{
    Dispatcher, Error, ErrorClass, Message, MessageId, SubType, SubscribeOptions, MAX_DURATION,
};

#[test]
fn a_handler_past_its_deadline_is_dropped_and_its_message_retried() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let hung = transport.send("jobs", "hang");
        let next = transport.send("jobs", "next");
        dispatcher
            .subscribe(
                "jobs",
                hangs_on_request,
                options(1)
                    .subscription("jobs-sub")
                    .subscription_type(SubType::Shared)
                    .processing_timeout(Duration::from_millis(50))
                    .retry_errors(ErrorClass::matching(|_| false))
                    .retry_topic("jobs-retry"),
            )
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        // The only permit came back: the next message was handled.
        transport.wait_acked("jobs", 2).await;
        assert_eq!(transport.acked("jobs"), [hung.clone(), next]);
        let retried = transport.published("jobs-retry");
        assert_eq!(retried.len(), 1, "retried, whatever its error class");
        assert_eq!(retried[0].payload, b"hang");
        assert_eq!(retried[0].property("RECONSUMETIMES"), Some("1"));
        let stats = dispatcher.stats().total();
        assert_eq!((stats.deadline_exceeded, stats.retried), (1, 1));
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn without_a_retry_topic_a_handler_past_its_deadline_is_nacked() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let hung = transport.send("jobs", "hang");
        dispatcher
            .subscribe(
                "jobs",
                hangs_on_request,
                options(1).processing_timeout(Duration::from_millis(20)),
            )
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        while transport.nacked("jobs").is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(transport.nacked("jobs")[0], hung);
        assert!(transport.acked("jobs").is_empty(), "never acked");
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn close_within_cancels_hung_handlers_nacks_their_messages_and_still_closes() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        let ids: Vec<_> = ["hang", "hang", "hang"]
            .iter()
            .map(|payload| transport.send("jobs", *payload))
            .collect();
        dispatcher
            .subscribe("jobs", hangs_on_request, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        assert_eq!(dispatcher.stats().in_flight, 2);
        let cancelled = dispatcher
            .close_handle()
            .close_within(Duration::from_millis(50))
            .await;
        assert_eq!(cancelled, 2, "both running handlers");
        let result = run.await.unwrap();
        assert!(
            matches!(result, Err(Error::HandlersCancelled { cancelled: 2 })),
            "{result:?}"
        );
        let mut nacked = transport.nacked("jobs");
        nacked.sort_by_key(|id| id.entry_id());
        assert_eq!(nacked, ids, "the two running and the one waiting");
        assert!(
            transport.acked("jobs").is_empty(),
            "nothing acked that did not succeed"
        );
        assert!(transport.is_closed());
        assert_eq!(transport.open_consumers(), 0);
    });
}

/// A handler that returned before the shutdown deadline, whose reply is
/// still being published at it, is not cancelled: the reply goes out once
/// and the message is acked (before, it was nacked and handled again, its
/// reply sent twice). A publish that outlasts the grace too is cancelled,
/// its message nacked.
#[test]
fn the_shutdown_deadline_lets_a_reply_being_published_finish_within_a_grace() {
    for (publish_takes, finished) in [
        (Duration::from_millis(300), true),
        (Duration::from_secs(5), false),
    ] {
        super::run_paused(async move {
            let transport = Hooked::default().publishes_take(publish_takes);
            let dispatcher = Rc::new(Dispatcher::builder().build(transport.clone()).unwrap());
            let replying =
                async |message: &Message| Ok::<_, Infallible>(message.payload().to_vec());
            dispatcher
                .subscribe("jobs", replying, options(1).reply_topic("replies"))
                .await
                .unwrap();
            let run = spawn_run(&dispatcher);
            let id = transport.inner.send("jobs", "1");
            settle_down().await;
            let closing = tokio::time::Instant::now();
            let cancelled = dispatcher.close_within(Duration::from_millis(100)).await;
            let took = closing.elapsed();
            let result = run.await.unwrap();
            let replies = transport
                .inner
                .published("persistent://public/default/replies");
            if finished {
                assert_eq!(cancelled, 0, "{result:?}");
                assert!(result.is_ok(), "{result:?}");
                assert_eq!(transport.inner.acked("jobs"), [id]);
                assert_eq!(replies.len(), 1);
            } else {
                assert_eq!(cancelled, 1);
                assert!(
                    matches!(result, Err(Error::HandlersCancelled { cancelled: 1 })),
                    "{result:?}"
                );
                assert_eq!(transport.inner.nacked("jobs"), [id]);
                assert!(replies.is_empty());
                // On the paused clock, to the millisecond the timers round to.
                let bound = Duration::from_millis(100) + crate::PUBLISH_GRACE;
                assert!(
                    took >= bound && took <= bound + Duration::from_millis(5),
                    "the grace bounds the wait: {took:?}"
                );
            }
        });
    }
}

#[test]
fn the_builders_shutdown_timeout_applies_to_every_close() {
    run_local(async {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder()
            .shutdown_timeout(Duration::from_millis(30))
            .build(transport.clone())
            .unwrap();
        transport.send("jobs", "hang");
        transport.send("jobs", "fine");
        dispatcher
            .subscribe("jobs", hangs_on_request, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("jobs", 1).await;
        dispatcher.close().await;
        assert!(matches!(
            run.await.unwrap(),
            Err(Error::HandlersCancelled { cancelled: 1 })
        ));
        assert_eq!(transport.nacked("jobs").len(), 1);
        assert!(transport.is_closed());
    });
}

#[test]
fn a_shutdown_with_nothing_hung_finishes_gracefully_within_its_deadline() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        let gate = Gate::default();
        transport.send("jobs", "a");
        dispatcher
            .subscribe("jobs", super::gated(&gate), options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        gate.open();
        let cancelled = dispatcher.close_within(Duration::from_secs(30)).await;
        assert_eq!(cancelled, 0);
        run.await.unwrap().unwrap();
        assert_eq!(transport.acked("jobs").len(), 1);
    });
}

#[test]
fn receive_errors_are_retried_with_backoff_and_counted() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        transport.fail_receives("jobs", 3);
        let id = transport.send("jobs", "after the errors");
        dispatcher
            .subscribe("jobs", hangs_on_request, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("jobs", 1).await;
        assert_eq!(transport.acked("jobs"), [id]);
        let stats = dispatcher.stats().total();
        assert_eq!((stats.receive_errors, stats.received), (3, 1));
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

#[test]
fn a_consumer_that_keeps_failing_stops_the_dispatcher_with_an_error() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        transport.fail_receives("jobs", usize::MAX);
        dispatcher
            .subscribe(
                "jobs",
                hangs_on_request,
                options(1).receive_failure_limit(Duration::from_millis(200)),
            )
            .await
            .unwrap();
        let result = dispatcher.run().await;
        assert!(
            matches!(&result, Err(Error::ConsumerFailing { topic, .. }) if topic.ends_with("/jobs")),
            "{result:?}"
        );
        // The consumer's own error is the typed source, to look into.
        let source = std::error::Error::source(result.as_ref().unwrap_err());
        assert!(
            source.is_some_and(|e| matches!(
                e.downcast_ref::<crate::TransportError>(),
                Some(crate::TransportError::Injected(_))
            )),
            "{source:?}"
        );
        let errors = dispatcher.stats().total().receive_errors;
        // 10 ms doubling: about 5 attempts in 200 ms, not a busy loop.
        assert!((2..=12).contains(&errors), "{errors} attempts");
        assert!(transport.is_closed());
    });
}

#[test]
fn a_subscribe_the_broker_never_answers_fails_with_a_typed_error() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        transport.hang_subscribe("held");
        let refused = dispatcher
            .subscribe(
                "held",
                hangs_on_request,
                SubscribeOptions::new()
                    .subscription("held-sub")
                    .subscribe_timeout(Duration::from_millis(30)),
            )
            .await;
        match refused {
            Err(Error::SubscribeTimeout {
                topic,
                subscription,
                waited,
            }) => {
                assert_eq!(topic, "persistent://public/default/held");
                assert_eq!(subscription.as_deref(), Some("held-sub"));
                assert_eq!(waited, Duration::from_millis(30));
            }
            other => panic!("{other:?}"),
        }
        assert!(dispatcher.subscriptions().is_empty());
    });
}

/// An unsubscribe waits for its subscription's messages to be settled.
/// When the shutdown deadline nacks the only one, still waiting for a
/// permit, the unsubscribe returns too.
#[test]
fn an_unsubscribe_returns_when_the_shutdown_deadline_nacks_its_waiting_message() {
    super::run_paused(async {
        let (dispatcher, transport) = dispatcher(1);
        let gate = Gate::default();
        transport.send("a", "1");
        let waiting = transport.send("b", "1");
        dispatcher
            .subscribe("a", super::gated(&gate), options(1))
            .await
            .unwrap();
        let b = dispatcher
            .subscribe("b", super::gated(&gate), options(2))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        assert_eq!(
            dispatcher.stats().waiting,
            1,
            "b's message waits for the permit"
        );
        let removing = dispatcher.clone();
        let unsubscribe = tokio::task::spawn_local(async move { removing.unsubscribe(b).await });
        settle_down().await;
        assert_eq!(dispatcher.close_within(Duration::from_secs(1)).await, 1);
        let ended = run.await.unwrap();
        assert!(
            matches!(ended, Err(Error::HandlersCancelled { cancelled: 1 })),
            "{ended:?}"
        );
        assert_eq!(transport.nacked("b"), [waiting]);
        let removed = tokio::time::timeout(Duration::from_secs(3600), unsubscribe).await;
        assert!(
            removed.is_ok(),
            "unsubscribe still waiting after the dispatcher closed"
        );
    });
}

/// An unsubscribe whose caller gave up (a timeout around it) still
/// removes the subscription, and a later unsubscribe of it returns.
#[test]
fn an_unsubscribe_given_up_by_its_caller_still_completes() {
    super::run_paused(async {
        let (dispatcher, transport) = dispatcher(1);
        let gate = Gate::default();
        transport.send("jobs", "1");
        let jobs = dispatcher
            .subscribe("jobs", super::gated(&gate), options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        let given_up = tokio::time::timeout(
            Duration::from_millis(10),
            dispatcher.unsubscribe(jobs.clone()),
        )
        .await;
        assert!(given_up.is_err(), "it waits for the handler");
        gate.open();
        settle_down().await;
        assert_eq!(transport.acked("jobs").len(), 1);
        assert_eq!(transport.open_consumers(), 0, "removed all the same");
        assert!(jobs.info().is_none());
        let again =
            tokio::time::timeout(Duration::from_secs(3600), dispatcher.unsubscribe(jobs)).await;
        assert!(
            matches!(again, Ok(Err(Error::UnknownSubscription { .. }))),
            "{again:?}"
        );
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// Shutdown closes the connection last, after every consumer: also after
/// one that an unsubscribe is still closing when shutdown begins.
#[test]
fn shutdown_closes_the_connection_after_a_consumer_an_unsubscribe_is_closing() {
    super::run_paused(async {
        let transport = Hooked::default().consumer_close_takes(Duration::from_secs(1));
        let closes = transport.closes.clone();
        let dispatcher = Dispatcher::builder()
            .concurrency(1)
            .build(transport)
            .unwrap();
        let jobs = dispatcher
            .subscribe("jobs", hangs_on_request, options(1))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        let removing = dispatcher.clone();
        let unsubscribe = tokio::task::spawn_local(async move { removing.unsubscribe(jobs).await });
        settle_down().await;
        dispatcher.close().await;
        assert_eq!(
            *closes.borrow(),
            [
                "consumer persistent://public/default/jobs closed",
                "transport closed"
            ]
        );
        unsubscribe.await.unwrap().unwrap();
        run.await.unwrap().unwrap();
    });
}

/// Sizes the scheduler's tables are built for are bounded: a concurrency
/// or key buffer beyond them is refused by name, not a panic or an
/// allocation that takes the process down.
#[test]
fn a_concurrency_or_key_buffer_too_large_to_hold_is_refused() {
    let built = Dispatcher::builder()
        .concurrency(crate::MAX_CONCURRENCY + 1)
        .build(MemoryTransport::new());
    assert!(refused_for(&built, "concurrency"), "{built:?}");
    assert!(Dispatcher::builder()
        .concurrency(crate::MAX_CONCURRENCY)
        .build(MemoryTransport::new())
        .is_ok());
    run_local(async {
        let (dispatcher, _transport) = dispatcher(1);
        for size in [crate::MAX_KEY_BUFFER + 1, usize::MAX] {
            let options = options(1).ordering(crate::Ordering::Key).key_buffer(size);
            let refused = dispatcher
                .subscribe("jobs", hangs_on_request, options)
                .await;
            assert!(refused_for(&refused, "key_buffer"), "{size}: {refused:?}");
        }
    });
    let largest = options(1)
        .ordering(crate::Ordering::Key)
        .key_buffer(crate::MAX_KEY_BUFFER);
    assert!(largest.resolve("jobs").is_ok());
}

/// Reservations that take every permit would leave a level worse than
/// all of them nothing, ever (and a shutdown waiting for its message
/// forever): at least one permit stays unreserved.
#[test]
fn reservations_must_leave_a_permit_unreserved() {
    for reservations in [vec![(0, 2)], vec![(0, 1), (10, 1)]] {
        let mut builder = Dispatcher::builder().concurrency(2);
        for &(priority, permits) in &reservations {
            builder = builder.reserve(priority, permits);
        }
        let built = builder.build(MemoryTransport::new());
        assert!(
            refused_for(&built, "reserve"),
            "{reservations:?}: {built:?}"
        );
    }
    let built = Dispatcher::builder()
        .concurrency(2)
        .reserve(0, 1)
        .build(MemoryTransport::new());
    assert!(built.is_ok(), "one of two reserved");
}

/// One receive error, then a consumer that works but has nothing to
/// deliver for a long time: the next error, much later, starts a spell of
/// its own rather than counting as a failure all along (which stopped the
/// dispatcher at once), and health reports the idle consumer as receiving.
#[test]
fn an_old_receive_error_and_a_long_idle_time_are_not_a_long_failure() {
    super::run_paused(async {
        let transport = MemoryTransport::new();
        transport.fail_receives("jobs", 1);
        let (dispatcher, run) = running_on(&transport, Duration::from_secs(5)).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(dispatcher.stats().total().receive_errors, 1);
        tokio::time::sleep(Duration::from_secs(600)).await;
        let health = dispatcher.health();
        assert!(health.subscriptions[0].receiving, "{health:?}");
        transport.fail_receives("jobs", 1);
        let id = transport.send("jobs", "after one more error");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!run.is_finished(), "stopped: {:?}", run.await);
        assert_eq!(transport.acked("jobs"), [id]);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// A handler cancelled at the shutdown deadline, while its processing
/// deadline is still ahead, is not left behind in health as overdue.
#[test]
fn a_handler_cancelled_at_shutdown_is_not_reported_overdue_later() {
    super::run_paused(async {
        let (dispatcher, transport) = dispatcher(1);
        let timeout = options(1).processing_timeout(Duration::from_millis(200));
        dispatcher
            .subscribe("jobs", hangs_on_request, timeout)
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.send("jobs", "hang");
        settle_down().await;
        assert_eq!(dispatcher.close_within(Duration::from_millis(20)).await, 1);
        let _cancelled = run.await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let health = dispatcher.health();
        assert_eq!(health.overdue_handlers(), 0, "{health:?}");
    });
}

/// Handlers still running past their deadline show in health, per
/// subscription and in total: here one that awaits forever and one that
/// blocks the thread past both deadlines, and reads health while it does.
#[test]
fn handlers_past_their_deadline_show_as_overdue_while_they_run() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(2);
        let deadline = Duration::from_millis(20);
        let handle = dispatcher.close_handle();
        let seen = Rc::new(std::cell::Cell::new(None));
        let record = seen.clone();
        let blocks = async move |_: &Message| {
            std::thread::sleep(deadline * 2);
            let health = handle.health().expect("running");
            let each: Vec<usize> = health
                .subscriptions
                .iter()
                .map(|s| s.overdue_handlers)
                .collect();
            record.set(Some((health.overdue_handlers(), each)));
            Ok::<_, Infallible>(())
        };
        let awaiting = options(1).processing_timeout(deadline);
        let awaiting = dispatcher.subscribe("awaits", hangs_on_request, awaiting);
        awaiting.await.unwrap();
        let blocking =
            dispatcher.subscribe("blocks", blocks, options(2).processing_timeout(deadline));
        blocking.await.unwrap();
        transport.send("awaits", "hang");
        transport.send("blocks", "1");
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        transport.wait_acked("blocks", 1).await;
        assert_eq!(seen.take(), Some((2, vec![1, 1])));
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// A running dispatcher of one permit on `transport`, with one
/// subscription to "jobs" of the given receive failure limit.
async fn running_on<T: crate::transport::Transport + Clone>(
    transport: &T,
    receive_failure_limit: Duration,
) -> (
    Rc<Dispatcher<T>>,
    tokio::task::JoinHandle<Result<(), Error>>,
) {
    let dispatcher = Dispatcher::builder()
        .concurrency(1)
        .build(transport.clone())
        .unwrap();
    let limit = options(1).receive_failure_limit(receive_failure_limit);
    dispatcher
        .subscribe("jobs", hangs_on_request, limit)
        .await
        .unwrap();
    let dispatcher = Rc::new(dispatcher);
    let run = spawn_run(&dispatcher);
    (dispatcher, run)
}

/// [`running_on`] the hooked transport.
async fn running_on_hooks(
    receive_failure_limit: Duration,
) -> (
    Hooked,
    Rc<Dispatcher<Hooked>>,
    tokio::task::JoinHandle<Result<(), Error>>,
) {
    let transport = Hooked::default();
    let (dispatcher, run) = running_on(&transport, receive_failure_limit).await;
    (transport, dispatcher, run)
}

/// A consumer part of which has stopped delivering (a partition being
/// subscribed again, after its stream ended with an error) stops the
/// dispatcher at the receive failure limit: also when the other parts
/// deliver all along (each message used to count as a recovery), and also
/// when no further error comes (a subscribe that hangs).
#[test]
fn a_partition_that_stays_down_stops_the_dispatcher_at_the_limit() {
    for others_deliver in [true, false] {
        super::run_paused(async {
            let (transport, dispatcher, run) = running_on_hooks(Duration::from_secs(5)).await;
            let memory = transport.inner.clone();
            memory.fail_receives("jobs", 1);
            transport.part_failing_since(Some(tokio::time::Instant::now()));
            for second in 0..20 {
                if others_deliver {
                    memory.send("jobs", format!("{second}"));
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                if second == 2 {
                    let health = dispatcher.health();
                    assert!(!health.subscriptions[0].receiving, "{health:?}");
                }
                if run.is_finished() {
                    break;
                }
            }
            let ended = run.await.unwrap();
            assert!(
                matches!(&ended, Err(Error::ConsumerFailing { failing_for, .. })
                    if *failing_for >= Duration::from_secs(5) && *failing_for < Duration::from_secs(7)),
                "others deliver: {others_deliver}: {ended:?}"
            );
            if others_deliver {
                assert!(
                    memory.acked("jobs").len() >= 4,
                    "the others delivered meanwhile"
                );
            }
        });
    }
}

/// After a partition was subscribed again (its stream had ended), an idle
/// subscription is healthy again as soon as the consumer reports the
/// partition back, not once a message comes or the quiet period after the
/// error (the receive failure limit, 60 s by default) has passed.
#[test]
fn a_resubscribed_partition_is_healthy_again_before_any_message_comes() {
    super::run_paused(async {
        let limit = crate::DEFAULT_RECEIVE_FAILURE_LIMIT;
        let (transport, dispatcher, run) = running_on_hooks(limit).await;
        let memory = transport.inner.clone();
        let receiving = || dispatcher.health().subscriptions[0].receiving;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(receiving());
        transport.part_resubscribing();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!receiving(), "a partition is being subscribed again");
        assert_eq!(dispatcher.stats().total().receive_errors, 1);
        transport.part_resubscribed();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(receiving(), "{:?}", dispatcher.health());
        memory.send("jobs", "after");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(memory.acked("jobs").len(), 1);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// A message the consumer cannot read (encrypted, say), which it leaves
/// unacknowledged and, on a Failover subscription, gets again every few
/// seconds, is no failure of receiving: the dispatcher stays healthy and
/// goes on past the receive failure limit, and the messages around it are
/// handled.
#[test]
fn messages_that_cannot_be_read_are_no_failure_of_receiving() {
    super::run_paused(async {
        let (transport, dispatcher, run) = running_on_hooks(Duration::from_secs(5)).await;
        let memory = transport.inner.clone();
        // An idle topic: nothing else arrives to show that receiving works.
        for second in 0..20 {
            transport.unreadable_message();
            tokio::time::sleep(Duration::from_secs(1)).await;
            let health = dispatcher.health();
            assert!(health.is_ready(), "after {second} s: {health:?}");
        }
        assert!(!run.is_finished(), "the dispatcher stopped");
        assert_eq!(dispatcher.stats().total().receive_errors, 20);
        memory.send("jobs", "readable");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(memory.acked("jobs").len(), 1);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
    });
}

/// A handler past its processing deadline whose drop panics (a value it
/// holds panics in `Drop`) is the handler's panic: its message is nacked
/// as a panicked one, the worker goes on, and health does not keep it as
/// overdue.
#[test]
fn a_handler_whose_drop_panics_at_its_deadline_counts_as_panicked() {
    struct PanicsOnDrop;
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("a panic in drop");
        }
    }
    super::run_paused(async {
        let (dispatcher, transport) = dispatcher(1);
        let timeout = options(1)
            .processing_timeout(Duration::from_millis(20))
            .negative_ack_redelivery_delay(Duration::from_secs(3600));
        let handler = async |message: &Message| {
            if message.payload() == b"bomb" {
                let _held = PanicsOnDrop;
                std::future::pending::<()>().await;
            }
            Ok::<_, Infallible>(())
        };
        let jobs = dispatcher
            .subscribe("jobs", handler, timeout)
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        let bomb = transport.send("jobs", "bomb");
        tokio::time::sleep(Duration::from_millis(100)).await;
        transport.send("jobs", "after");
        transport.wait_acked("jobs", 1).await;
        let stats = jobs.stats().unwrap();
        assert_eq!(
            (stats.panicked, stats.deadline_exceeded),
            (1, 0),
            "{stats:?}"
        );
        assert_eq!(dispatcher.health().overdue_handlers(), 0);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert_eq!(transport.nacked("jobs"), [bomb], "held, sent at shutdown");
    });
}

/// A worker of a per-core group that panics after its dispatcher ran
/// (here in a handler's `Drop`, as its dispatcher goes) shuts the rest of
/// the group down: `join` returns, resuming the panic, instead of waiting
/// for ever on a worker that was never told to stop.
#[test]
fn a_per_core_worker_that_panics_late_still_shuts_the_group_down() {
    struct PanicsOnDrop;
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("a late panic");
        }
    }
    let group = crate::per_core::PerCore::start(2, |core| async move {
        let transport = MemoryTransport::new();
        let dispatcher = Dispatcher::builder().build(transport.clone())?;
        let held = (core == 1).then(|| Rc::new(PanicsOnDrop));
        let handler = async move |_: &Message| {
            let _ = &held;
            Ok::<_, Infallible>(())
        };
        dispatcher
            .subscribe("jobs", handler, SubscribeOptions::new())
            .await?;
        if core == 1 {
            tokio::task::spawn_local(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                transport.end_stream("jobs");
            });
        }
        Ok(dispatcher)
    })
    .unwrap();
    let (joined_tx, joined) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let join = std::panic::AssertUnwindSafe(|| group.join());
        let _ = joined_tx.send(std::panic::catch_unwind(join).is_err());
    });
    let resumed_the_panic = joined
        .recv_timeout(Duration::from_secs(30))
        .expect("join returned: the group was shut down");
    assert!(resumed_the_panic);
}

/// Reservations that add up past `usize::MAX` are refused like any others
/// above the concurrency limit, not a panic (an overflow in a debug build,
/// a wrapped sum that passes the check in a release build).
#[test]
fn reservations_adding_up_past_usize_max_are_refused() {
    let built = Dispatcher::builder()
        .concurrency(4)
        .reserve(0, usize::MAX)
        .reserve(1, 2)
        .build(MemoryTransport::new());
    assert!(refused_for(&built, "reserve"), "{built:?}");
}

#[test]
fn durations_out_of_range_are_refused_by_name() {
    run_local(async {
        let (dispatcher, _) = dispatcher(1);
        let cases = [
            (
                "negative_ack_redelivery_delay",
                SubscribeOptions::new().negative_ack_redelivery_delay(Duration::MAX),
            ),
            (
                "processing_timeout",
                SubscribeOptions::new().processing_timeout(Duration::ZERO),
            ),
            (
                "processing_timeout",
                SubscribeOptions::new().processing_timeout(MAX_DURATION * 2),
            ),
            (
                "subscribe_timeout",
                SubscribeOptions::new().subscribe_timeout(Duration::ZERO),
            ),
            (
                "unacked_message_resend_delay",
                SubscribeOptions::new().unacked_message_resend_delay(Duration::MAX),
            ),
            (
                "receive_failure_limit",
                SubscribeOptions::new().receive_failure_limit(Duration::MAX),
            ),
            (
                "partition_refresh_interval",
                SubscribeOptions::new().partition_refresh_interval(Duration::ZERO),
            ),
            (
                "partition_refresh_interval",
                SubscribeOptions::new().partition_refresh_interval(Duration::MAX),
            ),
            (
                "stall_check",
                SubscribeOptions::new().stall_check(Some(Duration::ZERO)),
            ),
            (
                "stall_check",
                SubscribeOptions::new().stall_check(Some(Duration::MAX)),
            ),
        ];
        for (name, options) in cases {
            let refused = dispatcher
                .subscribe("jobs", hangs_on_request, options)
                .await;
            assert!(refused_for(&refused, name), "{name}: {refused:?}");
        }
        assert!(dispatcher.subscriptions().is_empty());
        let refused = Dispatcher::builder()
            .shutdown_timeout(Duration::MAX)
            .build(MemoryTransport::new());
        assert!(refused_for(&refused, "shutdown_timeout"));
    });
}

/// A user's backoff curve that panics (here on a retry count that whoever
/// published to the topic set to 1,000: `mul_f64` overflows) fails that
/// message, which is nacked, and the dispatcher goes on.
#[test]
fn a_panicking_backoff_curve_nacks_its_message_and_the_dispatcher_goes_on() {
    run_local(async {
        let (dispatcher, transport) = dispatcher(1);
        let forged = OutgoingMessage::new("x").with_property("RECONSUMETIMES", "1000");
        let id = transport.send_message("jobs", forged);
        let options = options(1)
            .subscription("jobs-sub")
            .subscription_type(SubType::Shared)
            .negative_ack_redelivery_delay(Duration::from_secs(3600))
            .retry_errors(ErrorClass::matching(|_| true))
            .retry_topic("jobs-retry")
            .retry_backoff(|retry| Duration::from_secs(1).mul_f64(1.5f64.powi(retry as i32)));
        dispatcher
            .subscribe(
                "jobs",
                async |_: &Message| Err::<(), _>("retry me"),
                options,
            )
            .await
            .unwrap();
        dispatcher
            .subscribe("later", hangs_on_request, super::options(2))
            .await
            .unwrap();
        let dispatcher = Rc::new(dispatcher);
        let run = spawn_run(&dispatcher);
        settle_down().await;
        transport.send("later", "after");
        tokio::time::timeout(Duration::from_secs(10), transport.wait_acked("later", 1))
            .await
            .expect("the dispatcher went on");
        assert!(transport.published("jobs-retry").is_empty());
        assert_eq!(dispatcher.stats().total().failed, 1);
        dispatcher.close().await;
        run.await.unwrap().unwrap();
        assert_eq!(
            transport.nacked("jobs"),
            [id],
            "held for its delay, sent at shutdown"
        );
    });
}

/// A transport whose acks panic: a panic in the dispatcher's own path
/// after a handler (routing and settling), where no user code runs.
#[test]
fn a_panic_in_the_dispatchers_own_path_stops_it_with_an_error() {
    run_local(async {
        let transport = Hooked::default().acks_panic();
        let memory = transport.inner.clone();
        let dispatcher = Dispatcher::builder()
            .concurrency(1)
            .build(transport)
            .unwrap();
        let id = memory.send("jobs", "x");
        dispatcher
            .subscribe("jobs", hangs_on_request, options(1))
            .await
            .unwrap();
        let result = dispatcher.run().await;
        assert!(
            matches!(&result, Err(Error::EngineFailed { reason }) if reason.contains("broken transport")),
            "{result:?}"
        );
        assert_eq!(memory.nacked("jobs"), [id], "the message went back");
        assert!(memory.is_closed());
    });
}

/// A consumer whose receive panics (a transport's bug), polled while a
/// worker picks the next message (`receiving_in`: the refill within a
/// pick, or the one within a job's follow-on): the dispatcher fails and
/// shuts down, and every message it took is settled; no permit is lost, so
/// `run()` returns.
fn a_receive_that_panics(receiving_in: &str) {
    run_local(async {
        let (hooks, memory, dispatcher) = one_permit_on_hooked();
        let gate = Gate::default();
        let handler = {
            let (gate, hooks) = (gate.clone(), hooks.clone());
            async move |message: &Message| {
                match message.payload() {
                    b"gated" => gate.wait().await,
                    // Its end is followed on in place, and receives.
                    b"breaks" => hooks.receives_before_panic.set(Some(0)),
                    _ => {}
                }
                Ok::<_, Infallible>(())
            }
        };
        let sent: Vec<_> = match receiving_in {
            "pick" => vec![memory.send("jobs", "gated")],
            _ => ["breaks", "1", "2"]
                .into_iter()
                .map(|payload| memory.send("jobs", payload))
                .collect(),
        };
        dispatcher
            .subscribe("jobs", handler, options(1))
            .await
            .unwrap();
        let run = spawn_run(&dispatcher);
        settle_down().await;
        let mut sent = sent;
        if receiving_in == "pick" {
            // The second waits in its slot while the first runs; when the
            // first ends, its worker picks the second and receives.
            sent.push(memory.send("jobs", "2"));
            settle_down().await;
            assert_eq!(dispatcher.stats().waiting, 1);
            hooks.receives_before_panic.set(Some(0));
            gate.open();
        }
        let result = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("run() returns")
            .unwrap();
        let received = failed_on_a_broken_receive(&result, &dispatcher, &memory, &sent);
        assert!(received >= 2, "the panic came after the first: {received}");
    });
}

/// A dispatcher with one permit on a hooked in-memory transport, with the
/// hooks and the in-memory broker behind it.
fn one_permit_on_hooked() -> (Hooked, MemoryTransport, Rc<Dispatcher<Hooked>>) {
    let transport = Hooked::default();
    let (hooks, memory) = (transport.clone(), transport.inner.clone());
    let dispatcher = Dispatcher::builder()
        .concurrency(1)
        .build(transport)
        .unwrap();
    (hooks, memory, Rc::new(dispatcher))
}

/// Checks that `run()` failed on a broken receive and lost nothing: no
/// permit or message is left, every message taken from "jobs" is settled,
/// and each was one of `sent`. Returns how many were taken.
fn failed_on_a_broken_receive(
    result: &Result<(), Error>,
    dispatcher: &Dispatcher<Hooked>,
    memory: &MemoryTransport,
    sent: &[MessageId],
) -> usize {
    assert!(
        matches!(result, Err(Error::EngineFailed { reason }) if reason.contains("a broken receive")),
        "{result:?}"
    );
    let stats = dispatcher.stats();
    assert_eq!((stats.in_flight, stats.waiting), (0, 0), "{stats:?}");
    let settled = [memory.acked("jobs"), memory.nacked("jobs")].concat();
    let received = memory.received_count("jobs") as usize;
    assert_eq!(settled.len(), received, "every message taken is settled");
    assert!(settled.iter().all(|id| sent.contains(id)));
    received
}

#[test]
fn a_receive_that_panics_within_a_pick_fails_the_dispatcher_and_loses_nothing() {
    a_receive_that_panics("pick");
}

#[test]
fn a_receive_that_panics_within_a_follow_on_fails_the_dispatcher_and_loses_nothing() {
    a_receive_that_panics("follow-on");
}

/// A key buffer's re-dispatch stores the subscription's next message
/// behind a busy key, and takes more while everything it holds waits:
/// that receive panics after the exchange is made. The dispatcher fails,
/// and every message taken is settled.
#[test]
fn a_receive_that_panics_within_a_key_buffers_follow_on_fails_the_dispatcher_and_loses_nothing() {
    run_local(async {
        let (hooks, memory, dispatcher) = one_permit_on_hooked();
        let panicked_before_b1 = Rc::new(std::cell::Cell::new(None));
        let handler = {
            let (hooks, panicked_before_b1) = (hooks.clone(), panicked_before_b1.clone());
            async move |message: &Message| {
                match message.payload() {
                    // a1's end follows on with b1 (free); the receive into
                    // its box takes b2, parked behind b1; the next receive,
                    // the buffer's refill, panics before b1 runs.
                    b"a1" => hooks.receives_before_panic.set(Some(1)),
                    b"b1" => {
                        let panicked = hooks.receives_before_panic.get().is_none();
                        panicked_before_b1.set(Some(panicked));
                    }
                    _ => {}
                }
                Ok::<_, Infallible>(())
            }
        };
        let sent: Vec<_> = [("a1", "A"), ("b1", "B"), ("b2", "B"), ("c1", "C")]
            .into_iter()
            .map(|(payload, key)| {
                let outgoing =
                    OutgoingMessage::new(payload.as_bytes().to_vec()).with_partition_key(key);
                memory.send_message("jobs", outgoing)
            })
            .collect();
        let keyed = options(1).ordering(crate::Ordering::Key).key_buffer(2);
        dispatcher.subscribe("jobs", handler, keyed).await.unwrap();
        let result = tokio::time::timeout(Duration::from_secs(10), dispatcher.run())
            .await
            .expect("run() returns");
        let received = failed_on_a_broken_receive(&result, &dispatcher, &memory, &sent);
        assert_eq!(received, 3, "a1, b1 and b2");
        assert_eq!(
            panicked_before_b1.get(),
            Some(true),
            "the refill within a1's follow-on panicked, before b1 ran"
        );
    });
}

#[test]
fn a_nack_that_panics_as_a_job_is_cancelled_still_returns_its_permit() {
    run_local(async {
        // The ack panics and fails the dispatcher; the unsettled job is
        // nacked as it is dropped, and that nack panics too.
        let transport = Hooked::default().acks_panic().nacks_panic();
        let memory = transport.inner.clone();
        let dispatcher = Dispatcher::builder()
            .concurrency(1)
            .shutdown_timeout(Duration::from_secs(1))
            .build(transport)
            .unwrap();
        memory.send("jobs", "x");
        dispatcher
            .subscribe("jobs", hangs_on_request, options(1))
            .await
            .unwrap();
        let result = tokio::time::timeout(Duration::from_secs(10), dispatcher.run())
            .await
            .expect("run() returns");
        assert!(
            matches!(&result, Err(Error::EngineFailed { reason }) if reason.contains("broken transport")),
            "{result:?}"
        );
        assert_eq!(dispatcher.stats().in_flight, 0);
    });
}

/// A consumer whose close panics (a transport's bug), at shutdown, at a
/// close before `run()` and at an unsubscribe: the other consumer and the
/// connection are still closed, and rather than hang, `run()` reports the
/// panic (and the dispatcher shuts down); a close before `run()` has no
/// `run()` to report to, and closes the rest all the same.
#[test]
fn a_consumer_close_that_panics_still_closes_the_rest() {
    run_local(async {
        for when in ["running", "before run", "unsubscribing"] {
            let transport = Hooked::default().consumer_close_panics("a");
            let memory = transport.inner.clone();
            let closes = transport.closes.clone();
            let dispatcher = Rc::new(Dispatcher::builder().build(transport).unwrap());
            let mut handles = Vec::new();
            for topic in ["a", "b"] {
                let handle = dispatcher
                    .subscribe(topic, hangs_on_request, options(1))
                    .await
                    .unwrap();
                handles.push(handle);
            }
            let closing = async {
                if when == "before run" {
                    dispatcher.close().await;
                    return Ok(());
                }
                let run = spawn_run(&dispatcher);
                settle_down().await;
                if when == "unsubscribing" {
                    let a = handles.remove(0);
                    dispatcher.unsubscribe(a).await.unwrap();
                } else {
                    dispatcher.close().await;
                }
                run.await.unwrap()
            };
            let result = tokio::time::timeout(Duration::from_secs(10), closing)
                .await
                .expect("the close finishes");
            if when != "before run" {
                assert!(
                    matches!(&result, Err(Error::EngineFailed { reason }) if reason.contains("closing a consumer panicked: a broken close")),
                    "{when}: {result:?}"
                );
            }
            assert!(memory.is_closed(), "{when}");
            let b_closed = "consumer persistent://public/default/b closed";
            assert_eq!(*closes.borrow(), [b_closed, "transport closed"], "{when}");
        }
    });
}
