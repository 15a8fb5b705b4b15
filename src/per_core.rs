//! One dispatcher per core.
//!
//! A [`Dispatcher`] uses one thread. To use more cores, [`PerCore::start`]
//! runs several side by side, each on a thread of its own with its own
//! `current_thread` runtime, `LocalSet` and broker connection, sharing
//! nothing. A factory you supply builds each one on its worker thread (so it
//! may create `!Send` state there) and returns it subscribed; point the
//! dispatchers at Shared or Key_Shared subscriptions and the broker spreads
//! the messages across them. All start together or not at all, and one
//! [`Shutdown`] handle, `Send` and cheap to clone, closes them all; a
//! [`Monitor`], just as portable, reads their health and stats.
//!
//! ```no_run
//! use pulsar_dispatcher::per_core::{self, PerCore};
//! use pulsar_dispatcher::{Dispatcher, Message, SubType, SubscribeOptions};
//!
//! // Configuration is `Send + Sync`: built once, cloned for every core.
//! let options = SubscribeOptions::new()
//!     .subscription("orders-workers")
//!     .subscription_type(SubType::Shared);
//! let group = PerCore::start(per_core::available_cores(), move |core| {
//!     let options = options.clone();
//!     async move {
//!         let dispatcher = Dispatcher::connect("pulsar://127.0.0.1:6650").await?;
//!         let handler = async move |message: &Message| {
//!             println!("core {core}: {}", message.id());
//!             Ok::<(), std::convert::Infallible>(())
//!         };
//!         dispatcher.subscribe("orders", handler, options).await?;
//!         Ok(dispatcher)
//!     }
//! })?;
//! let shutdown = group.shutdown_handle();
//! let monitor = group.monitor(); // `monitor.health().await.is_ready()` in a probe
//! // ... later, from any thread:
//! shutdown.shutdown();
//! for (core, result) in group.join().into_iter().enumerate() {
//!     if let Err(error) = result {
//!         eprintln!("dispatcher {core} failed: {error}");
//!     }
//! }
//! # Ok::<(), pulsar_dispatcher::Error>(())
//! ```

mod monitor;

use std::future::Future;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::watch;
use tracing::{debug, warn};

use crate::dispatcher::Dispatcher;
use crate::error::Error;
use crate::transport::Transport;
use monitor::Queries;
pub use monitor::{GroupHealth, Monitor};

/// The number of cores this process may use
/// ([`std::thread::available_parallelism`]), or 1 if it cannot be told.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// What the workers are told to do, in the order it can change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Command {
    /// Build the dispatcher and wait.
    Prepare,
    /// Every dispatcher is built: run.
    Run,
    /// Close (or never run) and return.
    Stop,
}

/// Closes every dispatcher of a [`PerCore`] group. `Send`, `Sync` and cheap
/// to clone, so a signal handler or another runtime can hold it.
#[derive(Clone, Debug)]
pub struct Shutdown {
    command: Arc<watch::Sender<Command>>,
}

impl Shutdown {
    /// Starts a graceful shutdown of every dispatcher in the group (each
    /// drains as [`Dispatcher::close`] does) and returns at once; use
    /// [`PerCore::join`] to wait for the end. Idempotent.
    pub fn shutdown(&self) {
        self.command.send_if_modified(|command| {
            let changed = *command != Command::Stop;
            *command = Command::Stop;
            changed
        });
    }

    /// Whether [`shutdown`](Self::shutdown) has been called, or a dispatcher
    /// of the group has stopped.
    pub fn is_shutdown(&self) -> bool {
        *self.command.borrow() == Command::Stop
    }
}

/// A group of dispatchers, one per worker thread.
///
/// The group lives and dies together: when one dispatcher's run ends for
/// any reason (it failed, was closed through its own handle, or its worker
/// panicked), the others are shut down too.
#[must_use = "the dispatchers run until shut down; call `join` to wait for them"]
pub struct PerCore {
    workers: Vec<JoinHandle<Result<(), Error>>>,
    shutdown: Shutdown,
    monitor: Monitor,
}

impl std::fmt::Debug for PerCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerCore")
            .field("dispatchers", &self.workers.len())
            .field("shut_down", &self.shutdown.is_shutdown())
            .finish()
    }
}

impl PerCore {
    /// Starts `cores` worker threads. Worker `i` builds a `current_thread`
    /// runtime (with I/O and time) and a `LocalSet`, awaits `factory(i)`
    /// there, and runs the dispatcher it returns until the group is shut
    /// down.
    ///
    /// Returns once every factory has returned. If any fails, the
    /// dispatchers already built are closed without running and the first
    /// failure (by core index) is returned; no dispatcher runs unless all
    /// can.
    ///
    /// # Panics
    ///
    /// If `cores` is zero, or a thread or runtime cannot be created; and if
    /// a factory panics, with its panic, once the other dispatchers are
    /// closed.
    pub fn start<F, Fut, T>(cores: usize, factory: F) -> Result<PerCore, Error>
    where
        F: Fn(usize) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Dispatcher<T>, Error>>,
        T: Transport,
    {
        assert!(cores > 0, "a PerCore group needs at least one core");
        let factory = Arc::new(factory);
        let (command, _) = watch::channel(Command::Prepare);
        let shutdown = Shutdown {
            command: Arc::new(command),
        };
        let (monitor, queries) = Monitor::new(cores);
        let (ready_tx, ready_rx) = mpsc::channel();
        let mut workers = Vec::with_capacity(cores);
        for (core, queries) in queries.into_iter().enumerate() {
            let factory = factory.clone();
            let worker_shutdown = shutdown.clone();
            let ready = ready_tx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("pulsar-dispatcher-{core}"))
                .spawn(move || worker(core, &*factory, worker_shutdown, ready, queries));
            match spawned {
                Ok(worker) => workers.push(worker),
                Err(error) => {
                    // The workers started would wait for a start that never
                    // comes: stop them before giving up.
                    shutdown.shutdown();
                    for worker in workers {
                        let _ = worker.join();
                    }
                    panic!("spawning a dispatcher thread: {error}");
                }
            }
        }
        drop(ready_tx);
        // Each worker reports once (or drops its sender by panicking).
        let all_built = ready_rx.iter().take(cores).filter(|built| *built).count() == cores;
        let group = PerCore {
            workers,
            shutdown,
            monitor,
        };
        if all_built {
            group.shutdown.command.send_if_modified(|command| {
                let go = *command == Command::Prepare;
                if go {
                    *command = Command::Run;
                }
                go
            });
            return Ok(group);
        }
        group.shutdown.shutdown();
        let first_failure = group.join().into_iter().find_map(Result::err);
        Err(first_failure.expect("a worker that failed to build reports its error"))
    }

    /// A handle that shuts the whole group down.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// A handle that reads every dispatcher's health and stats from any
    /// thread; it outlives the group.
    pub fn monitor(&self) -> Monitor {
        self.monitor.clone()
    }

    /// How many dispatchers the group has.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Always false: a group has at least one dispatcher.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Blocks until every worker has finished, and returns each
    /// dispatcher's run result, by core index. Call it from a plain thread
    /// (or `spawn_blocking`), not from inside an async task.
    ///
    /// # Panics
    ///
    /// If a worker panicked, its panic resumes here once every other worker
    /// has finished.
    pub fn join(self) -> Vec<Result<(), Error>> {
        let mut panic = None;
        let mut results = Vec::with_capacity(self.workers.len());
        for worker in self.workers {
            match worker.join() {
                Ok(result) => results.push(result),
                Err(payload) => {
                    self.shutdown.shutdown();
                    panic.get_or_insert(payload);
                    results.push(Ok(()));
                }
            }
        }
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
        results
    }
}

/// Reports that the worker could not build its dispatcher if dropped before
/// being disarmed, which covers a factory that panics.
struct ReadyReport {
    ready: Option<mpsc::Sender<bool>>,
}

impl ReadyReport {
    fn send(&mut self, built: bool) {
        if let Some(ready) = self.ready.take() {
            // The receiver outlives the start-up phase; a failed send means
            // `start` itself is gone, and there is no one left to tell.
            let _ = ready.send(built);
        }
    }
}

impl Drop for ReadyReport {
    fn drop(&mut self) {
        self.send(false);
    }
}

fn worker<F, Fut, T>(
    core: usize,
    factory: &F,
    shutdown: Shutdown,
    ready: mpsc::Sender<bool>,
    queries: Queries,
) -> Result<(), Error>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<Dispatcher<T>, Error>>,
    T: Transport,
{
    // However this worker ends, a panic included, the group ends with it.
    let _ends_the_group = EndsTheGroup(shutdown.clone());
    let mut report = ReadyReport { ready: Some(ready) };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a current_thread runtime for a dispatcher");
    let local = tokio::task::LocalSet::new();
    let result = local.block_on(&runtime, async {
        let dispatcher = match factory(core).await {
            Ok(dispatcher) => dispatcher,
            Err(error) => {
                report.send(false);
                return Err(error);
            }
        };
        report.send(true);
        // Only this thread may look at the dispatcher: monitors ask here.
        tokio::task::spawn_local(queries.answer(core, dispatcher.close_handle()));
        let mut commands = shutdown.command.subscribe();
        let command = *commands
            .wait_for(|command| *command != Command::Prepare)
            .await
            .expect("the sender lives in the worker's own Shutdown");
        if command == Command::Stop {
            debug!(core, "group shut down before running; closing");
            dispatcher.close().await;
            return Ok(());
        }
        let closer = dispatcher.close_handle();
        let watcher = tokio::task::spawn_local(async move {
            let _ = commands.wait_for(|command| *command == Command::Stop).await;
            closer.close().await;
        });
        let result = dispatcher.run().await;
        watcher.abort();
        result
    });
    if let Err(error) = &result {
        warn!(core, %error, "dispatcher stopped with an error; shutting the group down");
    }
    result
}

/// Shuts the group down when dropped: a worker holds one for its life.
struct EndsTheGroup(Shutdown);

impl Drop for EndsTheGroup {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}
