//! `cargo xtask chaos [--quick] [--only NAME,..] [--debug]`: the
//! fault-injection suite.
//!
//! Each scenario publishes messages with unique ids (`chaos produce`), runs
//! a dispatcher in a process of its own (`chaos work`, the `chaos` crate of
//! this workspace) that appends a line per message it handles successfully
//! before its handler returns, injects its fault (SIGKILL of that process, a
//! graceful close, SIGKILL of the broker, hung handlers and a close with a
//! deadline), restarts what it stopped, waits until every subscription's
//! backlog is empty (delayed retries included), closes the worker, reads the
//! dead letter topics (`chaos drain`) and counts:
//!
//! - handled: ids with at least one `ok` line; duplicated: ids with more;
//! - dead-lettered: ids read from the dead letter topics;
//! - lost: produced ids neither handled nor dead-lettered, once the
//!   backlogs are empty (a backlog that does not empty fails the scenario);
//! - acked: acks the dispatchers handed to the main topics' consumers (the
//!   sum of each run's last counters, so a SIGKILLed run's last second is
//!   missing), and the broker's backlog at the end.
//!
//! Targets, checked at the end (exit code 1 when one is missed): nothing
//! lost in any scenario; no duplicate where the dispatcher was only closed
//! gracefully; no message handled before the broker's SIGKILL and again
//! after it, but as two copies on the retry topic (the acks the broker lost
//! are recognised); `close_within(d)` returning within d + 1 s with
//! handlers hung; every message ending where its outcome says (a message
//! meant to succeed is never dead-lettered, and so on).
//!
//! The broker is killed only when this command started it (no broker
//! answered); otherwise that scenario is skipped with a note. `cargo xtask
//! test` runs the quick suite (`--quick`: the first five scenarios, 3,000
//! messages each) after the tests.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::broker::{self, BrokerAddr, StartedBroker};
use crate::{cargo, http, info, run_checked, setup, Paths};

/// The dispatcher's settings in every scenario.
const CONCURRENCY: u32 = 20;
const NACK_DELAY_MS: u64 = 200;
const MAX_RETRIES: u32 = 2;
/// Retry n waits n times this on the broker.
const BACKOFF_MS: u64 = 500;
/// Longest simulated work of a handler call.
const HANDLER_MS: u64 = 4;
/// The hung-handler scenario: processing deadline, the deadline of the
/// close made while handlers hang, and every worker's shutdown deadline.
const PROCESSING_TIMEOUT_MS: u64 = 4000;
const CLOSE_WITHIN_MS: u64 = 2000;
const SHUTDOWN_TIMEOUT_MS: u64 = 5000;
/// How long the killed broker stays down before it is started again.
const BROKER_DOWN: Duration = Duration::from_secs(3);
/// A scenario fails when neither the handled count nor the backlog has
/// changed for this long.
const STALL_LIMIT: Duration = Duration::from_secs(180);
/// How long a worker may take to exit after SIGTERM.
const CLOSE_LIMIT: Duration = Duration::from_secs(120);
/// How many unexpected worker exits a scenario tolerates (each restarted).
const MAX_UNEXPECTED_EXITS: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Nothing but the final graceful close.
    None,
    /// SIGKILL of the worker at `at` of the messages handled, then a new one.
    KillWorker,
    /// SIGTERM (a graceful `close()`) at `at`, then a new worker.
    CloseWorker,
    /// SIGKILL of the broker at `at`, restarted after [`BROKER_DOWN`]; the
    /// worker keeps running.
    KillBroker,
    /// Hung handlers past a processing deadline; at `at` the worker calls
    /// `close_within` while some hang, then a new worker.
    HungClose,
    /// No fault; the worker's resident memory is sampled every second.
    Memory,
}

#[derive(Clone, Copy)]
struct Scenario {
    name: &'static str,
    what: &'static str,
    messages: u64,
    /// The `chaos produce --mix` of outcomes.
    mix: &'static str,
    fault: Fault,
    /// Fraction of the messages handled when the fault strikes.
    at: f64,
    /// Whether a duplicate fails the scenario (no fault but graceful closes).
    no_duplicates: bool,
    /// Whether a message handled before the fault and again after it fails
    /// the scenario, but for two retry-topic copies (a broker fault: the
    /// dispatcher must recognise the acks the broker lost).
    acks_recognised: bool,
    /// An Exclusive subscription instead of a Shared one.
    exclusive: bool,
}

impl Scenario {
    /// This scenario on an Exclusive subscription instead, as `name`.
    fn on_exclusive(self, name: &'static str, what: &'static str) -> Scenario {
        Scenario {
            name,
            what,
            exclusive: true,
            ..self
        }
    }
}

fn plan(quick: bool) -> Vec<Scenario> {
    let (n, big) = if quick { (3_000, 0) } else { (10_000, 200_000) };
    let sigkill = Scenario {
        name: "sigkill",
        what: "the worker killed with SIGKILL mid-load, then restarted",
        messages: n,
        mix: "standard",
        fault: Fault::KillWorker,
        at: 0.4,
        no_duplicates: false,
        acks_recognised: false,
        exclusive: false,
    };
    let close = Scenario {
        name: "close",
        what: "a graceful close mid-load, then restarted",
        messages: n,
        mix: "standard",
        fault: Fault::CloseWorker,
        at: 0.4,
        no_duplicates: true,
        acks_recognised: false,
        exclusive: false,
    };
    let broker_kill = Scenario {
        name: "broker-kill",
        what: "the broker killed with SIGKILL mid-load, restarted 3 s later; \
               the worker left running",
        messages: n,
        mix: "standard",
        fault: Fault::KillBroker,
        at: 0.3,
        no_duplicates: false,
        acks_recognised: true,
        exclusive: false,
    };
    let mut plan = vec![
        Scenario {
            name: "mixed",
            what: "4 topics, 2 priorities, concurrency 20; 86% ok, 10% retryable \
                   (max 2 retries), 2% fatal, 2% panics",
            messages: n,
            mix: "standard",
            fault: Fault::None,
            at: 0.0,
            no_duplicates: true,
            acks_recognised: false,
            exclusive: false,
        },
        sigkill,
        close,
        // On an Exclusive subscription a nack makes the broker deliver
        // again everything not yet acked, messages still being handled
        // included: those run twice without any fault.
        Scenario {
            no_duplicates: false,
            ..close.on_exclusive(
                "close-exclusive",
                "as close, on an Exclusive subscription (duplicates expected: a nack \
                 redelivers every unacked message)",
            )
        },
        broker_kill,
    ];
    if !quick {
        plan.extend([
            broker_kill.on_exclusive(
                "broker-kill-exclusive",
                "as broker-kill, on an Exclusive subscription",
            ),
            sigkill.on_exclusive(
                "sigkill-exclusive",
                "as sigkill, on an Exclusive subscription",
            ),
            Scenario {
                name: "hung",
                what: "3% of handlers hang once: processing deadline 4 s; close_within(2 s) \
                       while some hang, then restarted (shutdown_timeout 5 s)",
                messages: 3_000,
                mix: "hang",
                fault: Fault::HungClose,
                at: 0.3,
                no_duplicates: false,
                acks_recognised: false,
                exclusive: false,
            },
            Scenario {
                name: "memory",
                what: "200,000 messages, the worker's resident memory sampled every second",
                messages: big,
                mix: "standard",
                fault: Fault::Memory,
                at: 0.0,
                no_duplicates: false,
                acks_recognised: false,
                exclusive: false,
            },
        ]);
    }
    plan
}

/// `cargo xtask chaos ARGS`.
pub fn cmd_chaos(paths: &Paths, args: &[String]) -> Result<(), String> {
    let mut quick = false;
    let mut release = true;
    let mut only: Option<Vec<String>> = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--debug" => release = false,
            "--only" => {
                let names = it.next().ok_or("--only needs scenario names")?;
                only = Some(names.split(',').map(str::to_owned).collect());
            }
            other => {
                return Err(format!(
                    "unknown option `{other}` for chaos (expected --quick, --only NAMES, --debug)"
                ))
            }
        }
    }
    let mut scenarios = plan(quick);
    if let Some(only) = &only {
        let all: Vec<&str> = plan(false).iter().map(|s| s.name).collect();
        if let Some(bad) = only.iter().find(|n| !all.contains(&n.as_str())) {
            return Err(format!("--only: no scenario `{bad}` (there are {all:?})"));
        }
        scenarios.retain(|s| only.iter().any(|n| n == s.name));
    }
    setup::ensure_protoc()?;
    let addr = BrokerAddr::from_env()?;
    // Dropping `started` stops the broker, on every way out of this function.
    let mut started = broker::ensure_running(paths, &addr)?;
    let binary = build(paths, release)?;
    let outcome = run_suite(paths, &addr, &binary, &scenarios, &mut started);
    if let Some(started) = started {
        started.stop()?;
    }
    outcome
}

/// The quick suite, for `cargo xtask test` once the tests have run: the
/// broker at `addr` answers, and is killed in `broker-kill` only if
/// `broker` is the one the caller started.
pub fn run_quick(
    paths: &Paths,
    addr: &BrokerAddr,
    broker: &mut Option<StartedBroker>,
) -> Result<(), String> {
    // The test run built the binary already (the chaos crate's integration
    // test needs it), with the workspace's features: this compiles nothing,
    // where `cargo build -p chaos` would rebuild tokio and all above it.
    let mut cmd = cargo();
    cmd.args([
        "test",
        "--workspace",
        "--all-targets",
        "--no-run",
        "--quiet",
    ])
    .current_dir(&paths.root);
    info("making sure the chaos worker is built (cargo test --workspace --all-targets --no-run)");
    run_checked(&mut cmd)?;
    let binary = paths.target.join("debug").join("chaos");
    run_suite(paths, addr, &binary, &plan(true), broker)
}

/// Builds the `chaos` binary and returns its path.
fn build(paths: &Paths, release: bool) -> Result<PathBuf, String> {
    let mut cmd = cargo();
    cmd.args(["build", "--package", "chaos"]);
    if release {
        cmd.arg("--release");
    }
    cmd.current_dir(&paths.root);
    info(&format!(
        "building the chaos worker ({})",
        if release { "release" } else { "debug" }
    ));
    run_checked(&mut cmd)?;
    let profile = if release { "release" } else { "debug" };
    Ok(paths.target.join(profile).join("chaos"))
}

/// Runs `scenarios` in order and prints the report table; fails naming
/// every target missed.
fn run_suite(
    paths: &Paths,
    addr: &BrokerAddr,
    binary: &Path,
    scenarios: &[Scenario],
    broker: &mut Option<StartedBroker>,
) -> Result<(), String> {
    let suite_begun = Instant::now();
    let run_id = format!("{:x}", unix_millis());
    let dir = paths.target.join("chaos").join(&run_id);
    fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    info(&format!(
        "chaos run {run_id}: {} scenario(s) against {}; files in {}",
        scenarios.len(),
        addr.service_url,
        dir.display()
    ));
    let mut reports = Vec::new();
    for scenario in scenarios {
        if scenario.fault == Fault::KillBroker && broker.is_none() {
            reports.push(skip_broker_kill(scenario, addr));
            continue;
        }
        info(&format!(
            "scenario {}: {} messages; {}",
            scenario.name, scenario.messages, scenario.what
        ));
        let ctx = Ctx {
            paths,
            addr,
            binary,
            dir: dir.join(scenario.name),
            prefix: format!("chaos-{run_id}-{}", scenario.name),
        };
        let report = match ctx.run(scenario, broker) {
            Ok(report) => report,
            Err(e) => {
                let mut report = Report::new(scenario);
                report.failures.push(format!("could not run: {e}"));
                report
            }
        };
        info(&format!(
            "scenario {} done: {}",
            scenario.name,
            if report.failures.is_empty() {
                "targets met".to_string()
            } else {
                report.failures.join("; ")
            }
        ));
        let broker_gone = report.broker_gone;
        reports.push(report);
        if broker_gone {
            break;
        }
    }
    summarize(&reports, &dir, suite_begun)
}

/// The report of a broker-kill scenario skipped because the broker at
/// `addr` is not one this command started.
fn skip_broker_kill(scenario: &Scenario, addr: &BrokerAddr) -> Report {
    let mut report = Report::new(scenario);
    report.skipped = Some(format!(
        "skipped: the broker at {} was not started by this command, and chaos kills \
         only a broker it started (stop it with `cargo xtask broker stop`, or point \
         PULSAR_URL / PULSAR_WEB_URL / XTASK_BROKER_DIR at a free port and directory)",
        addr.service_url
    ));
    info(&format!(
        "{}: {}",
        scenario.name,
        report.skipped.as_deref().unwrap_or("")
    ));
    report
}

/// Prints the table of `reports` and saves it in `dir`; fails naming every
/// target missed.
fn summarize(reports: &[Report], dir: &Path, suite_begun: Instant) -> Result<(), String> {
    let table = render(reports, suite_begun.elapsed());
    println!("{table}");
    let _ = fs::write(dir.join("report.txt"), &table);
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.failures.is_empty())
        .map(|r| format!("{}: {}", r.name, r.failures.join("; ")))
        .collect();
    if failed.is_empty() {
        info(&format!(
            "chaos: every target met in {:.0} s",
            suite_begun.elapsed().as_secs_f64()
        ));
        Ok(())
    } else {
        Err(format!("chaos targets missed: {}", failed.join(" | ")))
    }
}

/// What one scenario measured.
struct Report {
    name: &'static str,
    produced: u64,
    handled: u64,
    acked: u64,
    dead_lettered: u64,
    lost: u64,
    duplicated: u64,
    backlog: Option<u64>,
    /// From the first worker's start until every backlog was empty.
    secs: f64,
    notes: Vec<String>,
    failures: Vec<String>,
    skipped: Option<String>,
    /// The broker could not be restarted: nothing more can run.
    broker_gone: bool,
}

impl Report {
    fn new(scenario: &Scenario) -> Report {
        Report {
            name: scenario.name,
            produced: 0,
            handled: 0,
            acked: 0,
            dead_lettered: 0,
            lost: 0,
            duplicated: 0,
            backlog: None,
            secs: 0.0,
            notes: Vec::new(),
            failures: Vec::new(),
            skipped: None,
            broker_gone: false,
        }
    }
}

fn render(reports: &[Report], total: Duration) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "\n{:<17} {:>9} {:>9} {:>9} {:>9} {:>6} {:>6} {:>8} {:>8} {:>8}  {}\n",
        "scenario",
        "produced",
        "handled",
        "acked",
        "dead-let.",
        "lost",
        "dupl.",
        "backlog",
        "time s",
        "msg/s",
        "result"
    ));
    for r in reports {
        if let Some(why) = &r.skipped {
            out.push_str(&format!("{:<17} {why}\n", r.name));
            continue;
        }
        let rate = if r.secs > 0.0 {
            format!("{:.0}", r.produced as f64 / r.secs)
        } else {
            "-".into()
        };
        out.push_str(&format!(
            "{:<17} {:>9} {:>9} {:>9} {:>9} {:>6} {:>6} {:>8} {:>8.1} {:>8}  {}\n",
            r.name,
            r.produced,
            r.handled,
            r.acked,
            r.dead_lettered,
            r.lost,
            r.duplicated,
            r.backlog.map_or("?".into(), |b| b.to_string()),
            r.secs,
            rate,
            if r.failures.is_empty() {
                "ok"
            } else {
                "FAILED"
            }
        ));
    }
    out.push_str(
        "\nhandled: ids handled successfully at least once; dupl.: ids handled successfully more \
         than once;\nacked: acks the dispatchers sent on the main topics (each run's last \
         counters); backlog: on the broker at the end;\ntime: first worker start until every \
         backlog was empty (delayed retries included)\n",
    );
    for r in reports.iter().filter(|r| r.skipped.is_none()) {
        out.push_str(&format!("\n{}:\n", r.name));
        for note in &r.notes {
            out.push_str(&format!("  - {note}\n"));
        }
        for failure in &r.failures {
            out.push_str(&format!("  - TARGET MISSED: {failure}\n"));
        }
    }
    out.push_str(&format!("\nsuite time: {:.0} s\n", total.as_secs_f64()));
    out
}

struct Ctx<'a> {
    paths: &'a Paths,
    addr: &'a BrokerAddr,
    binary: &'a Path,
    dir: PathBuf,
    /// Prefix of the scenario's topic names, unique to this run.
    prefix: String,
}

/// The scenario's topics.
struct Topics {
    main: Vec<String>,
    retry: String,
    subscription: String,
}

impl Topics {
    fn new(prefix: &str) -> Topics {
        Topics {
            main: (0..4)
                .map(|i| format!("persistent://public/default/{prefix}-{i}"))
                .collect(),
            retry: format!("persistent://public/default/{prefix}-retry"),
            subscription: "chaos-sub".to_owned(),
        }
    }

    /// The topics with the dispatcher's subscription.
    fn consumed(&self) -> impl Iterator<Item = &String> {
        self.main.iter().chain([&self.retry])
    }

    fn dead_letter_topics(&self) -> Vec<String> {
        self.consumed()
            .map(|t| format!("{t}-{}-DLQ", self.subscription))
            .collect()
    }
}

/// One `chaos work` process and what its log said.
struct WorkerRun {
    index: usize,
    child: Child,
    pid: u32,
    log: LogTail,
    /// The last `stats` line, as key/value pairs.
    stats: BTreeMap<String, u64>,
    /// `closed ms=.. cancelled=.. limit_ms=..`, if it closed.
    closed: Option<BTreeMap<String, String>>,
    exit_line: Option<String>,
    subscribed: Option<Instant>,
    /// Its exit was asked for (SIGTERM sent, or it closes itself).
    exit_expected: bool,
    status: Option<ExitStatus>,
}

impl WorkerRun {
    fn stat(&self, key: &str) -> u64 {
        self.stats.get(key).copied().unwrap_or(0)
    }
}

impl Drop for WorkerRun {
    /// No worker outlives its scenario, whatever way the scenario ends.
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Reads the lines appended to a file since the last call.
struct LogTail {
    path: PathBuf,
    offset: u64,
    partial: String,
}

impl LogTail {
    fn new(path: PathBuf) -> LogTail {
        LogTail {
            path,
            offset: 0,
            partial: String::new(),
        }
    }

    fn read(&mut self) -> Vec<String> {
        let Ok(mut file) = fs::File::open(&self.path) else {
            return Vec::new();
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut bytes = Vec::new();
        let Ok(n) = file.read_to_end(&mut bytes) else {
            return Vec::new();
        };
        self.offset += n as u64;
        self.partial.push_str(&String::from_utf8_lossy(&bytes));
        let mut lines: Vec<String> = self.partial.split('\n').map(str::to_owned).collect();
        self.partial = lines.pop().unwrap_or_default();
        lines
    }
}

/// Every successful handling of one id.
type Handlings = HashMap<u64, Vec<Handling>>;

#[derive(Clone, Copy)]
struct Handling {
    /// Which worker run.
    run: usize,
    /// When it was read from the log, in seconds since the scenario's first
    /// worker started.
    at: f64,
    /// From the retry topic (a republished copy) rather than a main topic.
    retry: bool,
}

struct Memory {
    /// (seconds, handled so far, VmRSS in KiB) every second.
    samples: Vec<(f64, u64, u64)>,
    last: Option<Instant>,
}

/// One scenario's workers, what their logs said, and the state the watch
/// loop keeps between two polls.
struct Watch {
    /// When the first worker started: the origin of every [`Handling::at`].
    begun: Instant,
    /// In start order: the last one is the current worker.
    runs: Vec<WorkerRun>,
    handlings: Handlings,
    memory: Memory,
    /// How many messages handled make the fault strike.
    threshold: u64,
    /// The fault struck, or the scenario has none.
    fault_done: bool,
    /// When the fault struck, in seconds since `begun`.
    fault_at: Option<f64>,
    unexpected_exits: usize,
    /// The backlog at the last check (once a second).
    backlog: Option<u64>,
    last_check: Instant,
    /// Checks in a row that found every backlog empty.
    empty_checks: u32,
    /// (handled, backlog) as last seen, and when that last changed.
    last_seen: (u64, Option<u64>),
    last_change: Instant,
}

/// What [`Ctx::handle_exit`] did about the current worker.
enum ExitAction {
    /// Nothing: it runs, or it exited when asked to.
    None,
    /// It exited and a new worker replaced it.
    Replaced,
    /// One unexpected exit too many: the scenario gives up.
    GiveUp,
}

impl Watch {
    /// Records that the fault strikes now.
    fn strike(&mut self) {
        self.fault_done = true;
        self.fault_at = Some(self.begun.elapsed().as_secs_f64());
    }

    /// Samples the current worker's resident memory once it has subscribed,
    /// at most once a second.
    fn sample_memory(&mut self, handled: u64) {
        let run = &self.runs[self.runs.len() - 1];
        if run.subscribed.is_some()
            && self
                .memory
                .last
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            self.memory.last = Some(Instant::now());
            if let Some(kib) = rss_kib(run.pid) {
                self.memory
                    .samples
                    .push((self.begun.elapsed().as_secs_f64(), handled, kib));
            }
        }
    }

    /// Whether neither the handled count nor the backlog has changed for
    /// [`STALL_LIMIT`]; if so, a failure says so.
    fn stalled(&mut self, handled: u64, report: &mut Report) -> bool {
        let backlog = self.backlog;
        if (handled, backlog) != self.last_seen {
            self.last_seen = (handled, backlog);
            self.last_change = Instant::now();
        }
        if self.last_change.elapsed() <= STALL_LIMIT {
            return false;
        }
        let when = if self.fault_done {
            ""
        } else {
            " before the fault"
        };
        report.failures.push(format!(
            "stalled: nothing handled and the backlog ({backlog:?}) unchanged for {} s{}",
            STALL_LIMIT.as_secs(),
            when
        ));
        true
    }
}

impl Ctx<'_> {
    /// Runs one scenario: produces its messages, has workers handle them
    /// through the fault, and counts where every message ended.
    fn run(
        &self,
        scenario: &Scenario,
        broker: &mut Option<StartedBroker>,
    ) -> Result<Report, String> {
        fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        let topics = Topics::new(&self.prefix);
        let mut report = Report::new(scenario);
        // Produce everything first: the load is the backlog.
        let produced = self.produce(scenario, &topics, &mut report)?;
        let mut watch = self.start(scenario, &topics)?;
        let drained = self.watch(scenario, &topics, &mut watch, &mut report, broker)?;
        report.secs = watch.begun.elapsed().as_secs_f64();
        if !drained {
            let backlog = watch.backlog;
            report.notes.push(format!(
                "gave up waiting after {:.0} s with backlog {backlog:?}",
                report.secs
            ));
        }
        let end_rss = watch.runs.last().and_then(|r| rss_kib(r.pid));
        self.stop_workers(&mut watch, &mut report);
        let dead = self.drain(&topics, &produced)?;
        report.backlog = self.total_backlog(&topics);
        count(scenario, &produced, &dead, &watch, &mut report);
        if scenario.fault == Fault::Memory {
            memory_notes(&watch.memory, end_rss, &mut report);
        }
        Ok(report)
    }

    /// Publishes the scenario's messages and returns the outcome meant for
    /// each id; fails unless the broker confirmed every one.
    fn produce(
        &self,
        scenario: &Scenario,
        topics: &Topics,
        report: &mut Report,
    ) -> Result<HashMap<u64, String>, String> {
        let produced_file = self.dir.join("produced.txt");
        let mut produce = Command::new(self.binary);
        produce
            .arg("produce")
            .args(["--url", &self.addr.service_url])
            .args(["--topics", &topics.main.join(",")])
            .args(["--count", &scenario.messages.to_string()])
            .args(["--mix", scenario.mix])
            .arg("--out")
            .arg(&produced_file);
        let begun = Instant::now();
        self.run_to_end(&mut produce, "produce", Duration::from_secs(600))?;
        let produced = read_produced(&produced_file)?;
        report.produced = produced.len() as u64;
        if report.produced != scenario.messages {
            return Err(format!(
                "produce confirmed {} of {} messages",
                report.produced, scenario.messages
            ));
        }
        report.notes.push(format!(
            "produced {} messages in {:.1} s before the first worker started",
            report.produced,
            begun.elapsed().as_secs_f64()
        ));
        Ok(produced)
    }

    /// Starts the first worker and returns the watch over it.
    fn start(&self, scenario: &Scenario, topics: &Topics) -> Result<Watch, String> {
        let threshold = (scenario.messages as f64 * scenario.at).ceil() as u64;
        let begun = Instant::now();
        // With hung handlers the fault is the first worker's own close.
        let first_extra: Vec<(&str, String)> = match scenario.fault {
            Fault::HungClose => vec![
                ("close-within-ms", CLOSE_WITHIN_MS.to_string()),
                ("close-when-hung-after", threshold.to_string()),
            ],
            _ => Vec::new(),
        };
        let mut first = self.spawn_worker(scenario, topics, 1, &first_extra)?;
        if scenario.fault == Fault::HungClose {
            first.exit_expected = true;
        }
        Ok(Watch {
            begun,
            runs: vec![first],
            handlings: HashMap::new(),
            memory: Memory {
                samples: Vec::new(),
                last: None,
            },
            threshold,
            fault_done: scenario.fault == Fault::None || scenario.fault == Fault::Memory,
            fault_at: None,
            unexpected_exits: 0,
            backlog: None,
            last_check: Instant::now(),
            empty_checks: 0,
            last_seen: (0, None),
            last_change: Instant::now(),
        })
    }

    /// Polls the workers every 200 ms, replacing those that exit and
    /// injecting the fault, until every backlog is empty (`true`) or the
    /// scenario stalls, loses too many workers or its broker (`false`).
    fn watch(
        &self,
        scenario: &Scenario,
        topics: &Topics,
        w: &mut Watch,
        report: &mut Report,
        broker: &mut Option<StartedBroker>,
    ) -> Result<bool, String> {
        loop {
            thread::sleep(Duration::from_millis(200));
            let current = w.runs.len() - 1;
            self.read_worker(&mut w.runs[current], &mut w.handlings, w.begun);
            let handled = w.handlings.len() as u64;
            if scenario.fault == Fault::Memory {
                w.sample_memory(handled);
            }
            match self.handle_exit(scenario, topics, w, report)? {
                ExitAction::None => {}
                ExitAction::Replaced => continue,
                ExitAction::GiveUp => return Ok(false),
            }
            if !w.fault_done && handled >= w.threshold && scenario.fault != Fault::HungClose {
                w.strike();
                self.inject(scenario, topics, w, report, broker)?;
                if report.broker_gone {
                    return Ok(false);
                }
                continue;
            }
            if self.drained(topics, w) {
                return Ok(true);
            }
            if w.stalled(handled, report) {
                return Ok(false);
            }
        }
    }

    /// Takes in the current worker's exit, if it exited: the hung-close
    /// worker is checked and replaced (that exit is the fault), an
    /// unexpected exit is a failure and replaced.
    fn handle_exit(
        &self,
        scenario: &Scenario,
        topics: &Topics,
        w: &mut Watch,
        report: &mut Report,
    ) -> Result<ExitAction, String> {
        let current = w.runs.len() - 1;
        let run = &mut w.runs[current];
        if run.status.is_some() {
            return Ok(ExitAction::None);
        }
        let Ok(Some(status)) = run.child.try_wait() else {
            return Ok(ExitAction::None);
        };
        run.status = Some(status);
        self.read_worker(run, &mut w.handlings, w.begun);
        if scenario.fault == Fault::HungClose && w.runs[current].index == 1 {
            w.strike();
            self.check_hung_close(&w.runs[current], report);
            w.runs.push(self.spawn_worker(scenario, topics, 2, &[])?);
            return Ok(ExitAction::Replaced);
        }
        let run = &w.runs[current];
        if run.exit_expected {
            return Ok(ExitAction::None);
        }
        w.unexpected_exits += 1;
        report.failures.push(format!(
            "worker {} exited unexpectedly ({status}; its last line: {}); see {}",
            run.index,
            run.exit_line.as_deref().unwrap_or("none"),
            self.dir
                .join(format!("worker-{}.stderr", run.index))
                .display()
        ));
        if w.unexpected_exits > MAX_UNEXPECTED_EXITS {
            return Ok(ExitAction::GiveUp);
        }
        let next = w.runs.len() + 1;
        w.runs.push(self.spawn_worker(scenario, topics, next, &[])?);
        Ok(ExitAction::Replaced)
    }

    /// Checks the backlogs once a second; done when two checks in a row
    /// find every one empty, after the fault, with the current worker
    /// subscribed.
    fn drained(&self, topics: &Topics, w: &mut Watch) -> bool {
        if w.last_check.elapsed() < Duration::from_secs(1) {
            return false;
        }
        w.last_check = Instant::now();
        w.backlog = self.total_backlog(topics);
        let current = w.runs.len() - 1;
        if w.fault_done && w.backlog == Some(0) && w.runs[current].subscribed.is_some() {
            w.empty_checks += 1;
        } else {
            w.empty_checks = 0;
        }
        w.empty_checks >= 2
    }

    /// Closes the current worker gracefully, kills any other still running,
    /// and reads every worker's log to its end.
    fn stop_workers(&self, w: &mut Watch, report: &mut Report) {
        let current = w.runs.len() - 1;
        if w.runs[current].status.is_none() {
            self.close_worker(&mut w.runs[current], &mut w.handlings, w.begun, report);
        }
        for run in &mut w.runs {
            if run.status.is_none() {
                let _ = run.child.kill();
                run.status = run.child.wait().ok();
            }
            // Every line of every worker counts, the last ones included.
            self.read_worker(run, &mut w.handlings, w.begun);
        }
    }

    /// Reads the dead letter topics and returns how often each id was read.
    fn drain(
        &self,
        topics: &Topics,
        produced: &HashMap<u64, String>,
    ) -> Result<HashMap<u64, u64>, String> {
        let dlq_file = self.dir.join("dead-letters.txt");
        let expected_dead = produced
            .values()
            .filter(|outcome| meant_for_dead_letters(outcome))
            .count();
        let mut drain = Command::new(self.binary);
        drain
            .arg("drain")
            .args(["--url", &self.addr.service_url])
            .args(["--topics", &topics.dead_letter_topics().join(",")])
            .args(["--expect", &expected_dead.to_string()])
            .args(["--idle-ms", "10000"])
            .arg("--out")
            .arg(&dlq_file);
        self.run_to_end(&mut drain, "drain", Duration::from_secs(300))?;
        read_dead_letters(&dlq_file)
    }

    /// Starts `cmd` with its standard error written to `stderr_path` (and
    /// backtraces on), its other streams closed.
    fn spawn(&self, cmd: &mut Command, stderr_path: &Path) -> Result<Child, String> {
        let stderr =
            fs::File::create(stderr_path).map_err(|e| format!("{}: {e}", stderr_path.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .env("RUST_BACKTRACE", "1")
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.binary.display()))
    }

    fn run_to_end(&self, cmd: &mut Command, what: &str, limit: Duration) -> Result<(), String> {
        let stderr_path = self.dir.join(format!("{what}.stderr"));
        let mut child = self.spawn(cmd, &stderr_path)?;
        let begun = Instant::now();
        loop {
            if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
                if status.success() {
                    return Ok(());
                }
                return Err(format!(
                    "chaos {what} failed ({status}): {}",
                    broker::log_tail(&stderr_path, 10)
                ));
            }
            if begun.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "chaos {what} did not finish within {} s",
                    limit.as_secs()
                ));
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    fn spawn_worker(
        &self,
        scenario: &Scenario,
        topics: &Topics,
        index: usize,
        extra: &[(&str, String)],
    ) -> Result<WorkerRun, String> {
        let log = self.dir.join(format!("worker-{index}.log"));
        let mut cmd = Command::new(self.binary);
        cmd.arg("work")
            .args(["--url", &self.addr.service_url])
            .args(["--topics", &topics.main.join(",")])
            .args(["--retry-topic", &topics.retry])
            .args(["--subscription", &topics.subscription])
            .args(["--concurrency", &CONCURRENCY.to_string()])
            .args(["--nack-delay-ms", &NACK_DELAY_MS.to_string()])
            .args(["--max-retries", &MAX_RETRIES.to_string()])
            .args(["--backoff-ms", &BACKOFF_MS.to_string()])
            .args(["--handler-ms", &HANDLER_MS.to_string()])
            .arg("--log")
            .arg(&log);
        if scenario.fault == Fault::HungClose {
            cmd.args([
                "--processing-timeout-ms",
                &PROCESSING_TIMEOUT_MS.to_string(),
            ])
            .args(["--shutdown-timeout-ms", &SHUTDOWN_TIMEOUT_MS.to_string()]);
        }
        if scenario.exclusive {
            cmd.args(["--exclusive", "true"]);
        }
        for (key, value) in extra {
            cmd.arg(format!("--{key}")).arg(value);
        }
        let child = self.spawn(&mut cmd, &self.dir.join(format!("worker-{index}.stderr")))?;
        Ok(WorkerRun {
            index,
            pid: child.id(),
            child,
            log: LogTail::new(log),
            stats: BTreeMap::new(),
            closed: None,
            exit_line: None,
            subscribed: None,
            exit_expected: false,
            status: None,
        })
    }

    /// Takes in what the worker's log gained.
    fn read_worker(&self, run: &mut WorkerRun, handlings: &mut Handlings, begun: Instant) {
        let now = begun.elapsed().as_secs_f64();
        for line in run.log.read() {
            let mut words = line.split_whitespace();
            match words.next() {
                Some("ok") => {
                    if let Some(id) = words.next().and_then(|w| w.parse().ok()) {
                        handlings.entry(id).or_default().push(Handling {
                            run: run.index,
                            at: now,
                            retry: words.next() == Some("r"),
                        });
                    }
                }
                Some("stats") => {
                    run.stats = words
                        .filter_map(|w| w.split_once('='))
                        .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
                        .collect();
                }
                Some("closed") => {
                    run.closed = Some(
                        words
                            .filter_map(|w| w.split_once('='))
                            .map(|(k, v)| (k.to_owned(), v.to_owned()))
                            .collect(),
                    );
                }
                Some("exit") => run.exit_line = Some(line.clone()),
                Some("subscribed") => run.subscribed = Some(Instant::now()),
                _ => {}
            }
        }
    }

    /// Injects the scenario's fault, at [`Scenario::at`] of the messages
    /// handled.
    fn inject(
        &self,
        scenario: &Scenario,
        topics: &Topics,
        w: &mut Watch,
        report: &mut Report,
        broker: &mut Option<StartedBroker>,
    ) -> Result<(), String> {
        let t = w.begun.elapsed().as_secs_f64();
        let handled = w.handlings.len();
        let current = w.runs.len() - 1;
        match scenario.fault {
            Fault::KillWorker => {
                let run = &mut w.runs[current];
                run.exit_expected = true;
                let _ = run.child.kill();
                run.status = run.child.wait().ok();
                // What it wrote before it died.
                self.read_worker(run, &mut w.handlings, w.begun);
                report.notes.push(format!(
                    "worker 1 (pid {}) killed with SIGKILL at {t:.1} s, {handled} messages \
                     handled; worker 2 started 1 s later",
                    run.pid
                ));
                thread::sleep(Duration::from_secs(1));
                w.runs.push(self.spawn_worker(scenario, topics, 2, &[])?);
            }
            Fault::CloseWorker => {
                let run = &mut w.runs[current];
                let asked = Instant::now();
                self.close_worker(run, &mut w.handlings, w.begun, report);
                report.notes.push(format!(
                    "worker 1 closed gracefully (SIGTERM → close()) at {t:.1} s, {handled} \
                     messages handled; exited after {:.1} s ({}); worker 2 started",
                    asked.elapsed().as_secs_f64(),
                    run.exit_line.as_deref().unwrap_or("no exit line"),
                ));
                w.runs.push(self.spawn_worker(scenario, topics, 2, &[])?);
            }
            Fault::KillBroker => self.kill_broker(w.begun, t, handled, report, broker)?,
            Fault::None | Fault::Memory | Fault::HungClose => {}
        }
        Ok(())
    }

    /// SIGKILLs the broker this command started and starts it again after
    /// [`BROKER_DOWN`]; the fault struck `t` s after `begun`, with `handled`
    /// messages handled. A broker that does not come back sets
    /// [`Report::broker_gone`].
    fn kill_broker(
        &self,
        begun: Instant,
        t: f64,
        handled: usize,
        report: &mut Report,
        broker: &mut Option<StartedBroker>,
    ) -> Result<(), String> {
        let Some(started) = broker.take() else {
            return Err("no broker of ours to kill".into());
        };
        let pid = started.pid();
        started.kill()?;
        let killed_log = self.dir.join("broker-before-kill.log");
        let _ = fs::copy(&self.paths.log_file, &killed_log);
        thread::sleep(BROKER_DOWN);
        let restarting = Instant::now();
        match broker::start(self.paths, self.addr) {
            Ok(started) => *broker = Some(started),
            Err(e) => {
                report.broker_gone = true;
                report
                    .failures
                    .push(format!("the broker did not come back: {e}"));
                return Ok(());
            }
        }
        report.notes.push(format!(
            "broker (pid {pid}) killed with SIGKILL at {t:.1} s, {handled} messages \
             handled; started again {} s later, answering after {:.1} s more \
             (down {:.1} s in all); its log before the kill: {}",
            BROKER_DOWN.as_secs(),
            restarting.elapsed().as_secs_f64(),
            begun.elapsed().as_secs_f64() - t,
            killed_log.display()
        ));
        Ok(())
    }

    /// SIGTERM, then waits for the worker to exit ([`CLOSE_LIMIT`]) and
    /// reads the rest of its log.
    fn close_worker(
        &self,
        run: &mut WorkerRun,
        handlings: &mut Handlings,
        begun: Instant,
        report: &mut Report,
    ) {
        run.exit_expected = true;
        let _ = Command::new("kill")
            .args(["-TERM", &run.pid.to_string()])
            .status();
        let asked = Instant::now();
        loop {
            if let Ok(Some(status)) = run.child.try_wait() {
                run.status = Some(status);
                break;
            }
            if asked.elapsed() > CLOSE_LIMIT {
                report.failures.push(format!(
                    "worker {} did not exit within {} s of SIGTERM; killed",
                    run.index,
                    CLOSE_LIMIT.as_secs()
                ));
                let _ = run.child.kill();
                run.status = run.child.wait().ok();
                break;
            }
            thread::sleep(Duration::from_millis(50));
        }
        self.read_worker(run, handlings, begun);
        match (&run.status, &run.exit_line) {
            (Some(status), Some(line)) if status.success() && line == "exit ok" => {}
            (status, line) => report.notes.push(format!(
                "worker {} ended with {status:?}, {}",
                run.index,
                line.as_deref().unwrap_or("no exit line")
            )),
        }
    }

    fn check_hung_close(&self, run: &WorkerRun, report: &mut Report) {
        let Some(closed) = &run.closed else {
            report.failures.push(format!(
                "worker 1 exited ({:?}) without closing; see {}",
                run.status,
                self.dir.join("worker-1.stderr").display()
            ));
            return;
        };
        let ms: u64 = closed
            .get("ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(u64::MAX);
        let cancelled = closed.get("cancelled").map_or("?", String::as_str);
        report.notes.push(format!(
            "close_within({} ms) with handlers hung returned after {ms} ms, {cancelled} \
             handler(s) cancelled; worker 1 {}; deadline_exceeded={} retried={} in worker 1",
            CLOSE_WITHIN_MS,
            run.exit_line.as_deref().unwrap_or("wrote no exit line"),
            run.stat("deadline_exceeded"),
            run.stat("retried"),
        ));
        if ms > CLOSE_WITHIN_MS + 1000 {
            report.failures.push(format!(
                "close_within({CLOSE_WITHIN_MS} ms) took {ms} ms (target: within {} ms)",
                CLOSE_WITHIN_MS + 1000
            ));
        }
    }

    /// The sum of the backlogs of every subscription of the dispatcher;
    /// `None` if the broker does not answer or a subscription is missing.
    fn total_backlog(&self, topics: &Topics) -> Option<u64> {
        let mut total = 0;
        for topic in topics.consumed() {
            let name = topic.strip_prefix("persistent://")?;
            let path = format!("/admin/v2/persistent/{name}/stats");
            let resp = http::get(&self.addr.web, &path, Duration::from_secs(10)).ok()?;
            if resp.status != 200 {
                return None;
            }
            total += subscription_backlog(&resp.body, &topics.subscription)?;
        }
        Some(total)
    }
}

/// Where the produced messages ended, from the workers' logs and the dead
/// letter topics.
struct Tally<'a> {
    handled: u64,
    dead_lettered: u64,
    /// Produced ids neither handled nor dead-lettered.
    lost: Vec<u64>,
    /// Ids handled successfully more than once, with their handlings.
    duplicated: Vec<(&'a u64, &'a Vec<Handling>)>,
    /// Ids that ended against their outcome, as `id (outcome: where)`.
    wrong: Vec<String>,
    /// Handled or dead-lettered ids that were never produced.
    unknown: usize,
    /// Ids read more than once from the dead letter topics.
    dead_twice: usize,
}

impl<'a> Tally<'a> {
    /// Tallies every id, produced or not.
    fn new(
        produced: &HashMap<u64, String>,
        handlings: &'a Handlings,
        dead: &HashMap<u64, u64>,
    ) -> Tally<'a> {
        let handled = produced
            .keys()
            .filter(|id| handlings.contains_key(id))
            .count() as u64;
        let dead_lettered = produced.keys().filter(|id| dead.contains_key(id)).count() as u64;
        let lost: Vec<u64> = produced
            .keys()
            .filter(|id| !handlings.contains_key(id) && !dead.contains_key(id))
            .copied()
            .collect();
        let duplicated: Vec<(&u64, &Vec<Handling>)> =
            handlings.iter().filter(|(_, h)| h.len() > 1).collect();
        let unknown = handlings
            .keys()
            .filter(|id| !produced.contains_key(id))
            .count()
            + dead.keys().filter(|id| !produced.contains_key(id)).count();
        Tally {
            handled,
            dead_lettered,
            lost,
            duplicated,
            wrong: misplaced(produced, handlings, dead),
            unknown,
            dead_twice: dead.values().filter(|&&n| n > 1).count(),
        }
    }
}

/// Whether a message produced with `outcome` should end in a dead letter
/// topic rather than handled.
fn meant_for_dead_letters(outcome: &str) -> bool {
    matches!(outcome, "fatal" | "retry-dlq")
}

/// The handled or dead-lettered ids that ended against their outcome, as
/// `id (outcome: where)`.
fn misplaced(
    produced: &HashMap<u64, String>,
    handlings: &Handlings,
    dead: &HashMap<u64, u64>,
) -> Vec<String> {
    let mut wrong = Vec::new();
    for (id, outcome) in produced {
        let ok = handlings.contains_key(id);
        let dead_lettered = dead.contains_key(id);
        let right = if meant_for_dead_letters(outcome) {
            dead_lettered && !ok
        } else {
            ok && !dead_lettered
        };
        if !right && (ok || dead_lettered) {
            wrong.push(format!(
                "{id} ({outcome}: {})",
                if ok { "handled" } else { "dead-lettered" }
            ));
        }
    }
    wrong
}

/// Counts where every produced message ended into `report`, with notes on
/// each worker, the duplicates and the oddities, then checks the targets.
fn count(
    scenario: &Scenario,
    produced: &HashMap<u64, String>,
    dead: &HashMap<u64, u64>,
    watch: &Watch,
    report: &mut Report,
) {
    let tally = Tally::new(produced, &watch.handlings, dead);
    report.handled = tally.handled;
    report.dead_lettered = tally.dead_lettered;
    report.lost = tally.lost.len() as u64;
    report.duplicated = tally.duplicated.len() as u64;
    report.acked = watch.runs.iter().map(|r| r.stat("acked_main")).sum();

    report
        .notes
        .extend(watch.runs.iter().map(worker_stats_note));
    if !tally.duplicated.is_empty() {
        report
            .notes
            .push(duplicates_note(&tally.duplicated, watch.fault_at));
    }
    let (dead_twice, unknown) = (tally.dead_twice, tally.unknown);
    if dead_twice > 0 {
        report.notes.push(format!(
            "{dead_twice} message(s) dead-lettered more than once"
        ));
    }
    if unknown > 0 {
        report.notes.push(format!(
            "{unknown} handled or dead-lettered id(s) never produced"
        ));
    }
    target_failures(scenario, produced, tally, watch.fault_at, report);
}

/// One worker run's last counters.
fn worker_stats_note(r: &WorkerRun) -> String {
    format!(
        "worker {}: succeeded={} failed={} panicked={} retried={} dead_lettered={} \
         acked={} nacked={} deadline_exceeded={} acks_failed={} receive_errors={} \
         redelivered_after_ack={} rewinds_repeated={} dropped_in_flight={} \
         redelivered_after_success={}",
        r.index,
        r.stat("succeeded"),
        r.stat("failed"),
        r.stat("panicked"),
        r.stat("retried"),
        r.stat("dead_lettered"),
        r.stat("acked"),
        r.stat("nacked"),
        r.stat("deadline_exceeded"),
        r.stat("acks_failed"),
        r.stat("receive_errors"),
        r.stat("redelivered_after_ack"),
        r.stat("rewinds_repeated"),
        r.stat("dropped_in_flight"),
        r.stat("redelivered_after_success"),
    )
}

/// How the duplicates came about: across worker runs or within one, as
/// retry-topic copies, around the fault.
fn duplicates_note(duplicated: &[(&u64, &Vec<Handling>)], fault_at: Option<f64>) -> String {
    let retry_copies = duplicated
        .iter()
        .filter(|(_, h)| as_two_retry_copies(h))
        .count();
    let across = duplicated
        .iter()
        .filter(|(_, h)| h.iter().any(|x| x.run != h[0].run))
        .count();
    let around_fault = fault_at.map_or(0, |at| {
        duplicated.iter().filter(|(_, h)| around(h, at)).count()
    });
    let mut sample: Vec<&u64> = duplicated.iter().map(|(id, _)| *id).collect();
    sample.sort();
    sample.truncate(10);
    format!(
        "{} message(s) handled successfully more than once: {across} in two worker \
         runs, {} within one run; {retry_copies} of them as two retry-topic copies (the \
         original republished twice); {around_fault} handled before the fault and again \
         after it; e.g. ids {sample:?}",
        duplicated.len(),
        duplicated.len() - across,
    )
}

/// Whether an id's handlings include two of retry-topic copies: the
/// original was republished twice, the receipt of the first publish lost.
fn as_two_retry_copies(handlings: &[Handling]) -> bool {
    handlings.iter().filter(|h| h.retry).count() > 1
}

/// Whether an id was handled before the fault at `at` and again after it.
fn around(handlings: &[Handling], at: f64) -> bool {
    handlings[0].at <= at && handlings[handlings.len() - 1].at > at
}

/// The scenario's targets: an empty backlog, nothing lost, no duplicate
/// where only graceful closes happened, no message handled before a broker
/// fault and again after it (but as two retry-topic copies), every message
/// where its outcome says.
fn target_failures(
    scenario: &Scenario,
    produced: &HashMap<u64, String>,
    tally: Tally,
    fault_at: Option<f64>,
    report: &mut Report,
) {
    if report.backlog != Some(0) {
        report.failures.push(format!(
            "the backlog did not empty (at the end: {:?})",
            report.backlog
        ));
    }
    let lost = &tally.lost;
    if !lost.is_empty() {
        let mut sample = lost.clone();
        sample.sort();
        sample.truncate(20);
        let outcomes: BTreeMap<&str, usize> = lost.iter().fold(BTreeMap::new(), |mut m, id| {
            *m.entry(produced[id].as_str()).or_default() += 1;
            m
        });
        report.failures.push(format!(
            "{} message(s) lost (neither handled nor dead-lettered), by outcome \
             {outcomes:?}; e.g. ids {sample:?}",
            lost.len()
        ));
    }
    if scenario.no_duplicates && !tally.duplicated.is_empty() {
        report.failures.push(format!(
            "{} duplicate(s) with only graceful closes (target: 0)",
            tally.duplicated.len()
        ));
    }
    if let (true, Some(at)) = (scenario.acks_recognised, fault_at) {
        let mut again: Vec<&u64> = tally
            .duplicated
            .iter()
            .filter(|(_, h)| around(h, at) && !as_two_retry_copies(h))
            .map(|(id, _)| *id)
            .collect();
        if !again.is_empty() {
            again.sort();
            let count = again.len();
            again.truncate(10);
            report.failures.push(format!(
                "{count} message(s) handled before the fault and again after it, not as \
                 retry-topic copies: acks the broker lost, not recognised (target: 0); \
                 e.g. ids {again:?}"
            ));
        }
    }
    let mut wrong = tally.wrong;
    if !wrong.is_empty() {
        wrong.sort();
        wrong.truncate(10);
        report.failures.push(format!(
            "messages that ended against their outcome, e.g. {}",
            wrong.join(", ")
        ));
    }
}

/// The most the worker's resident memory may grow while it handles the
/// second half of the memory scenario's messages. The allocator's steps
/// up to its high-water mark stay well below it (measured at most
/// 0.3 MiB); a leak of 21 bytes a message over
/// 100,000 messages crosses it.
const SECOND_HALF_GROWTH_LIMIT_KIB: u64 = 2 * 1024;

/// KiB in MiB, as the memory notes and failures print them.
fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// VmRSS in KiB at the first sample taken once `handled` messages were
/// handled; `fallback` when no sample was.
fn rss_once_handled(samples: &[(f64, u64, u64)], handled: u64, fallback: u64) -> u64 {
    samples
        .iter()
        .find(|(_, so_far, _)| *so_far >= handled)
        .map_or(fallback, |sample| sample.2)
}

/// A failure when resident memory grew by more than
/// [`SECOND_HALF_GROWTH_LIMIT_KIB`] from the first sample at half of
/// `produced` handled to `end` (none when no sample reached the half).
fn second_half_growth_failure(
    samples: &[(f64, u64, u64)],
    produced: u64,
    end: u64,
) -> Option<String> {
    let half = rss_once_handled(samples, produced / 2, end);
    let growth = end.saturating_sub(half);
    (growth > SECOND_HALF_GROWTH_LIMIT_KIB).then(|| {
        format!(
            "resident memory grew by {:.1} MiB over the second half of the messages \
             (target: at most {:.1} MiB): a leak?",
            mib(growth),
            mib(SECOND_HALF_GROWTH_LIMIT_KIB)
        )
    })
}

fn memory_notes(memory: &Memory, end: Option<u64>, report: &mut Report) {
    let Some(&(_, _, first)) = memory.samples.first() else {
        report.failures.push("no memory samples".into());
        return;
    };
    let warm = rss_once_handled(&memory.samples, report.produced / 10, first);
    let peak = memory.samples.iter().map(|s| s.2).max().unwrap_or(first);
    let end = end.or(memory.samples.last().map(|s| s.2)).unwrap_or(first);
    report.notes.push(format!(
        "worker resident memory (VmRSS, {} samples 1 s apart): {:.1} MiB after subscribing, \
         {:.1} MiB at 10% handled, peak {:.1} MiB, {:.1} MiB at the end; growth from 10% to \
         the end {:+.1} MiB ({:+.1} MiB from the start)",
        memory.samples.len(),
        mib(first),
        mib(warm),
        mib(peak),
        mib(end),
        mib(end) - mib(warm),
        mib(end) - mib(first),
    ));
    let mut curve = String::new();
    let step = (memory.samples.len() / 10).max(1);
    for (t, handled, kib) in memory.samples.iter().step_by(step) {
        curve.push_str(&format!(" {t:.0}s:{handled}:{:.1}", mib(*kib)));
    }
    report
        .notes
        .push(format!("RSS curve (time:handled:MiB):{curve}"));
    report.failures.extend(second_half_growth_failure(
        &memory.samples,
        report.produced,
        end,
    ));
}

/// `msgBacklog` of `subscription` in a topic's stats JSON.
fn subscription_backlog(stats: &str, subscription: &str) -> Option<u64> {
    let subscriptions = &stats[stats.find("\"subscriptions\"")?..];
    let key = format!("\"{subscription}\"");
    let at = subscriptions.find(&key)? + key.len();
    broker::json_u64_field(&subscriptions[at..], "msgBacklog")
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `p <id> <outcome>` lines.
fn read_produced(path: &Path) -> Result<HashMap<u64, String>, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "p").then_some(())?;
            Some((w.next()?.parse().ok()?, w.next()?.to_owned()))
        })
        .collect())
}

/// `d <id> <topic>` lines: how often each id was read.
fn read_dead_letters(path: &Path) -> Result<HashMap<u64, u64>, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut dead = HashMap::new();
    for line in text.lines() {
        let mut w = line.split_whitespace();
        if w.next() == Some("d") {
            if let Some(id) = w.next().and_then(|v| v.parse().ok()) {
                *dead.entry(id).or_default() += 1;
            }
        }
    }
    Ok(dead)
}

fn unix_millis() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_subscription_backlog() {
        let stats = r#"{"msgRateIn":0.0,"backlogSize":12,"subscriptions":{"other":{"msgBacklog":7},"chaos-sub":{"msgRateOut":1.0,"msgBacklogNoDelayed":3,"msgBacklog":5,"consumers":[]}}}"#;
        assert_eq!(subscription_backlog(stats, "chaos-sub"), Some(5));
        assert_eq!(subscription_backlog(stats, "other"), Some(7));
        assert_eq!(subscription_backlog(stats, "missing"), None);
    }

    #[test]
    fn memory_that_grows_over_the_second_half_fails_the_memory_scenario() {
        const MIB: u64 = 1024;
        // (seconds, handled, KiB): warm-up steps, then level.
        let level = [
            (0.0, 0, 12 * MIB),
            (1.0, 20_000, 14 * MIB),
            (2.0, 100_000, 15 * MIB),
            (3.0, 150_000, 15 * MIB + 300),
        ];
        assert_eq!(rss_once_handled(&level, 100_000, 0), 15 * MIB);
        assert_eq!(rss_once_handled(&level, 250_000, 7), 7);
        assert_eq!(
            second_half_growth_failure(&level, 200_000, 15 * MIB + 300),
            None
        );
        // The same start, then 3 MiB more by the end: a leak.
        let failure = second_half_growth_failure(&level, 200_000, 18 * MIB)
            .expect("3 MiB over the second half fails");
        assert!(failure.contains("3.0 MiB"), "{failure}");
        // Growth before the half does not count.
        let early = [
            (0.0, 0, 12 * MIB),
            (1.0, 50_000, 18 * MIB),
            (2.0, 100_000, 18 * MIB),
        ];
        assert_eq!(
            second_half_growth_failure(&early, 200_000, 18 * MIB + 500),
            None
        );
    }

    #[test]
    fn the_quick_plan_is_the_first_five_scenarios() {
        let quick: Vec<&str> = plan(true).iter().map(|s| s.name).collect();
        let full: Vec<&str> = plan(false).iter().map(|s| s.name).collect();
        assert_eq!(quick, full[..5]);
        assert_eq!(quick[4], "broker-kill");
        assert!(plan(true).iter().all(|s| s.messages <= 5_000));
    }
}
