//! The project's task runner: `cargo xtask <command>`.
//!
//! Its one dependency is `ureq` without default features (no TLS, no
//! compression), the HTTP client the integration tests use too, for the
//! broker's admin API; so it still compiles quickly on a fresh machine.

mod bench;
mod broker;
mod chaos;
mod http;
mod layers;
mod setup;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};
use std::time::{Duration, Instant};

use broker::BrokerAddr;

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  test [ARGS...]   install what is missing (protoc, openssl, Python venv, broker jars), start a
                   Pulsar broker unless one answers, run every test
                   (`cargo test --workspace --all-targets --no-fail-fast`, then
                   `cargo test --workspace --doc`, then the quick fault-injection
                   suite `chaos --quick`), stop the broker it started.
                   With ARGS, runs `cargo test ARGS` instead of all three
                   (e.g. `cargo xtask test --test smoke_pulsar`).
  lint             cargo fmt --check, clippy -D warnings, rustdoc -D warnings
                   (public and private items), no import cycle among the
                   files of src/
  demo [simple|priority|observability]
                   start a broker if needed and run `cargo run --example demo`
                   (or `simple_dispatcher`, `priority_dispatcher` or `observability`) with DEMO_MESSAGES
                   messages of traffic (default 30); the dispatcher's log goes to
                   target/demo-<example>.log
  bench [--quick] [--criterion]
                   start a broker if needed and run the benchmark comparison
                   (`cargo bench --bench report`): table on stdout, figures in
                   target/bench-report.json; --quick takes fewer samples;
                   --criterion then runs the criterion suites (`--bench dispatch`), if the comparison succeeded
  chaos [--quick] [--only NAME,..] [--debug]
                   start a broker if needed and run the fault-injection suite
                   (mixed, sigkill, close, close-exclusive, broker-kill,
                   broker-kill-exclusive, sigkill-exclusive, hung, memory): a table of
                   produced, handled, acked, dead-lettered, lost and duplicated
                   messages; fails if one is lost, duplicated after a graceful
                   close, handled before the broker's kill and again after it,
                   or close_within(d) takes more than d + 1 s. broker-kill
                   runs only when this command started the broker. --quick: the
                   first five with 3,000 messages each; --debug: a debug build
  broker start     start the standalone broker (returns once it answers)
  broker stop      stop the broker that `broker start` started
  broker status    tell whether a broker answers (exit code 0) or not (1)

environment:
  PULSAR_URL                 broker service URL (default pulsar://127.0.0.1:6650)
  PULSAR_WEB_URL             broker admin/web URL (default http://<PULSAR_URL host>:8080)
  PULSAR_START_TIMEOUT_SECS  how long `broker start` waits for the broker (default 180)
  PULSAR_JAVA_OPTS           extra JVM options for the broker
  XTASK_TEST_TIMEOUT_SECS    limit for each `cargo test` run of `cargo xtask test` (default 2400)
  XTASK_BENCH_TIMEOUT_SECS   limit for the comparison run of `cargo xtask bench` (default 3600)
  JAVA_HOME                  Java 17+ to run the broker with (default: `java` on PATH)
  XTASK_BROKER_DIR           where a broker xtask starts keeps its pid file, log, data and
                             config (default target/), e.g. for a second broker on other ports
";

/// How long a long-running command may take, build included, so that a
/// hung test or benchmark fails with a message instead of eating its
/// whole time budget: a default, overridden by an environment variable.
#[derive(Clone, Copy)]
pub struct Deadline {
    variable: &'static str,
    default_secs: u64,
}

/// For each `cargo test` run of `cargo xtask test`.
const TEST_DEADLINE: Deadline = Deadline {
    variable: "XTASK_TEST_TIMEOUT_SECS",
    default_secs: 40 * 60,
};

/// For the comparison run of `cargo xtask bench` (a cold build of the
/// benchmarks takes about 10 minutes of it).
pub const BENCH_DEADLINE: Deadline = Deadline {
    variable: "XTASK_BENCH_TIMEOUT_SECS",
    default_secs: 60 * 60,
};

impl Deadline {
    fn limit(self) -> Duration {
        let secs = std::env::var(self.variable)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(self.default_secs);
        Duration::from_secs(secs)
    }
}

/// Paths of the workspace that xtask reads and writes.
pub struct Paths {
    pub root: PathBuf,
    pub target: PathBuf,
    pub pid_file: PathBuf,
    pub log_file: PathBuf,
    pub data_dir: PathBuf,
    /// tests/broker/standalone.conf with the ports xtask was asked for.
    pub effective_conf: PathBuf,
    pub broker_pom: PathBuf,
    pub broker_conf: PathBuf,
}

impl Paths {
    fn new() -> Paths {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask lives inside the workspace")
            .to_path_buf();
        let target = root.join("target");
        // The broker's own files: in target/ unless XTASK_BROKER_DIR names
        // another directory (for a second broker beside the usual one).
        let state = std::env::var_os("XTASK_BROKER_DIR")
            .filter(|dir| !dir.is_empty())
            .map_or_else(|| target.clone(), |dir| root.join(dir));
        Paths {
            pid_file: state.join("pulsar.pid"),
            log_file: state.join("pulsar.log"),
            data_dir: state.join("pulsar-data"),
            effective_conf: state.join("pulsar-standalone.conf"),
            broker_pom: root.join("tests/broker/pom.xml"),
            broker_conf: root.join("tests/broker/standalone.conf"),
            root,
            target,
        }
    }
}

pub fn info(msg: &str) {
    eprintln!("[xtask] {msg}");
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Runs a command with inherited stdio and returns its exit status.
pub fn run_status(cmd: &mut Command) -> Result<ExitStatus, String> {
    cmd.status()
        .map_err(|e| format!("cannot run `{}`: {e}", describe(cmd)))
}

/// Runs a command with inherited stdio; an unsuccessful exit is an error.
pub fn run_checked(cmd: &mut Command) -> Result<(), String> {
    let status = run_status(cmd)?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed ({status})", describe(cmd)))
    }
}

/// Runs a command with inherited stdio; if it has not finished by its
/// deadline, terminates it and every process below it (a hung test binary
/// included) and reports that as an error.
pub fn run_with_deadline(cmd: &mut Command, deadline: Deadline) -> Result<ExitStatus, String> {
    let limit = deadline.limit();
    let what = describe(cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run `{what}`: {e}"))?;
    let begun = Instant::now();
    loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("`{what}`: {e}"))? {
            return Ok(status);
        }
        if begun.elapsed() > limit {
            info(&format!(
                "`{what}` did not finish within {} s ({}); terminating it",
                limit.as_secs(),
                deadline.variable
            ));
            let mut pids = descendants(child.id());
            pids.push(child.id());
            for signal in ["-TERM", "-KILL"] {
                for pid in &pids {
                    let _ = Command::new("kill")
                        .args([signal, &pid.to_string()])
                        .stderr(std::process::Stdio::null())
                        .status();
                }
                let grace = Instant::now();
                while grace.elapsed() < Duration::from_secs(10) {
                    if !matches!(child.try_wait(), Ok(None)) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            let _ = child.wait();
            return Err(format!("`{what}` timed out after {} s", limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// All processes below `root`, from the parent pids in /proc.
fn descendants(root: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // Fields after the parenthesised command: state, ppid, ...
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parent_of.push((pid, ppid));
            }
        }
    }
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parent_of
                .iter()
                .filter(|(_, ppid)| *ppid == parent)
                .map(|(pid, _)| *pid),
        );
        i += 1;
    }
    found.remove(0);
    found
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let paths = Paths::new();
    let result = match args.first().map(String::as_str) {
        Some("test") => cmd_test(&paths, &args[1..]),
        Some("lint") => cmd_lint(&paths),
        Some("bench") => bench::cmd_bench(&paths, &args[1..]),
        Some("chaos") => chaos::cmd_chaos(&paths, &args[1..]),
        Some("demo") => cmd_demo(&paths, args.get(1).map(String::as_str)),
        Some("broker") => match args.get(1).map(String::as_str) {
            Some("start") => cmd_broker_start(&paths),
            Some("stop") => cmd_broker_stop(&paths),
            Some("status") => cmd_broker_status(&paths),
            _ => Err(format!("expected `broker start|stop|status`\n\n{USAGE}")),
        },
        Some("help" | "-h" | "--help") => {
            print!("{USAGE}");
            Ok(())
        }
        _ => Err(format!("unknown or missing command\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("[xtask] error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn cmd_broker_start(paths: &Paths) -> Result<(), String> {
    let addr = BrokerAddr::from_env()?;
    if let Some(started) = broker::ensure_running(paths, &addr)? {
        started.detach();
        info(&format!(
            "pid {} in {}; stop it with `cargo xtask broker stop`",
            broker::read_pid(&paths.pid_file).unwrap_or_default(),
            paths.pid_file.display()
        ));
    }
    println!("{}", addr.service_url);
    Ok(())
}

fn cmd_broker_stop(paths: &Paths) -> Result<(), String> {
    let Some(pid) = broker::read_pid(&paths.pid_file) else {
        info(&format!(
            "no broker started by xtask ({} does not exist); nothing to stop",
            paths.pid_file.display()
        ));
        return Ok(());
    };
    if !broker::is_running(pid) || !broker::is_pulsar_standalone(pid) {
        info(&format!(
            "pid {pid} from {} is not a running Pulsar standalone broker; removing the stale file",
            paths.pid_file.display()
        ));
        let _ = std::fs::remove_file(&paths.pid_file);
        return Ok(());
    }
    info(&format!("stopping the Pulsar broker (pid {pid})"));
    broker::stop_process(pid, None)?;
    let _ = std::fs::remove_file(&paths.pid_file);
    Ok(())
}

fn cmd_broker_status(paths: &Paths) -> Result<(), String> {
    let addr = BrokerAddr::from_env()?;
    let ours = broker::read_pid(&paths.pid_file).map(|pid| {
        let alive = broker::is_running(pid) && broker::is_pulsar_standalone(pid);
        (pid, alive)
    });
    match ours {
        Some((pid, true)) => println!("xtask's broker process: running, pid {pid}"),
        Some((pid, false)) => println!(
            "xtask's broker process: not running (stale pid {pid} in {})",
            paths.pid_file.display()
        ),
        None => println!("xtask's broker process: none"),
    }
    match broker::probe(&addr) {
        Ok(()) => {
            let version = broker::version(&addr).unwrap_or_else(|| "unknown".into());
            println!(
                "broker answers: {} (web {}), version {version}",
                addr.service_url, addr.web_url
            );
            Ok(())
        }
        Err(e) => {
            println!(
                "no broker answers at {} (web {}): {e}",
                addr.service_url, addr.web_url
            );
            Err("broker not answering".into())
        }
    }
}

fn cmd_test(paths: &Paths, extra: &[String]) -> Result<(), String> {
    setup::ensure_protoc()?;
    setup::ensure_openssl()?;
    let python = setup::ensure_python_env(paths)?;
    let addr = BrokerAddr::from_env()?;
    // Dropping `started` stops the broker, on every way out of this function.
    let mut started = broker::ensure_running(paths, &addr)?;
    let (java, java_classpath) = broker::java_client(paths)?;

    let env = [
        ("PULSAR_URL", addr.service_url.clone()),
        ("PULSAR_WEB_URL", addr.web_url.clone()),
        ("PULSAR_DISPATCHER_PYTHON", python.display().to_string()),
        ("PULSAR_DISPATCHER_JAVA", java.display().to_string()),
        ("PULSAR_DISPATCHER_JAVA_CLASSPATH", java_classpath),
    ];
    let mut failures = Vec::new();
    let mut tests = cargo();
    tests.arg("test");
    if extra.is_empty() {
        tests.args(["--workspace", "--all-targets", "--no-fail-fast"]);
    } else {
        tests.args(extra);
    }
    tests.current_dir(&paths.root).envs(env.clone());
    let what = describe(&tests);
    info(&format!("running {what}"));
    match run_with_deadline(&mut tests, TEST_DEADLINE) {
        Ok(status) if status.success() => {}
        Ok(_) => failures.push(what),
        Err(e) => failures.push(e),
    }
    if extra.is_empty() {
        let mut doc = cargo();
        doc.args(["test", "--workspace", "--doc"])
            .current_dir(&paths.root)
            .envs(env);
        info("running cargo test --workspace --doc");
        match run_with_deadline(&mut doc, TEST_DEADLINE) {
            Ok(status) if status.success() => {}
            Ok(_) => failures.push("cargo test --workspace --doc".to_string()),
            Err(e) => failures.push(e),
        }
        // The no-loss contract under faults, on every change.
        info("running the quick fault-injection suite (cargo xtask chaos --quick)");
        let begun = Instant::now();
        if let Err(e) = chaos::run_quick(paths, &addr, &mut started) {
            failures.push(e);
        }
        info(&format!(
            "quick fault-injection suite finished in {:.0} s",
            begun.elapsed().as_secs_f64()
        ));
    }

    if let Some(started) = started {
        started.stop()?;
    }
    if failures.is_empty() {
        info("all tests passed");
        Ok(())
    } else {
        Err(format!("failed: {}", failures.join("; ")))
    }
}

fn cmd_lint(paths: &Paths) -> Result<(), String> {
    let mut failures = Vec::new();
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--check"]);
    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    let mut doc = cargo();
    doc.args(["doc", "--no-deps", "--workspace"])
        .env("RUSTDOCFLAGS", "-D warnings");
    // The private items' docs too: they are the map a newcomer reads the
    // engine by, and a broken link there is a stale one.
    let mut private_doc = cargo();
    private_doc
        .args(["doc", "--no-deps", "--document-private-items"])
        .env("RUSTDOCFLAGS", "-D warnings");
    // Public last, so that target/doc is left with the docs users see.
    for cmd in [&mut fmt, &mut clippy, &mut private_doc, &mut doc] {
        cmd.current_dir(&paths.root);
        let what = describe(cmd);
        info(&format!("running {what}"));
        if !run_status(cmd)?.success() {
            failures.push(what);
        }
    }
    info("checking that no file of src/ depends on one that depends on it");
    for group in layers::cycles(&paths.root.join("src"))? {
        failures.push(format!("an import cycle among {}", group.join(", ")));
    }
    if failures.is_empty() {
        info("lint passed");
        Ok(())
    } else {
        Err(format!("lint failed: {}", failures.join("; ")))
    }
}

/// The partitioned topic of the default demo (`examples/demo.rs`)
/// and its partition count: created before the example runs, as operators do.
const DEMO_PARTITIONED_TOPIC: (&str, u32) = ("demo-orders", 3);

fn cmd_demo(paths: &Paths, which: Option<&str>) -> Result<(), String> {
    let example = match which {
        None => "demo",
        Some("simple") => "simple_dispatcher",
        Some("priority") => "priority_dispatcher",
        Some("observability") => "observability",
        Some(other) => {
            return Err(format!(
                "unknown demo {other:?}: try `simple`, `priority` or `observability`, or none for \
                 the default"
            ))
        }
    };
    setup::ensure_protoc()?;
    let addr = BrokerAddr::from_env()?;
    let started = broker::ensure_running(paths, &addr)?;
    if example == "demo" {
        let (topic, partitions) = DEMO_PARTITIONED_TOPIC;
        if let Err(e) = broker::create_partitioned_topic(&addr.web, topic, partitions) {
            info(&format!(
                "could not create the demo's partitioned topic; the demo runs with `{topic}` as \
                 it is: {e}"
            ));
        }
    }
    let messages = std::env::var("DEMO_MESSAGES").unwrap_or_else(|_| "30".into());
    let log = paths.target.join(format!("demo-{example}.log"));
    let mut run = cargo();
    run.args(["run", "--example", example])
        .current_dir(&paths.root)
        .env("PULSAR_URL", &addr.service_url)
        .env("PULSAR_WEB_URL", &addr.web_url)
        .env("DEMO_MESSAGES", messages)
        .env("DEMO_LOG", &log);
    info(&format!("running examples/{example}.rs"));
    let status = run_status(&mut run);
    if let Some(started) = started {
        started.stop()?;
    }
    let status = status?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("the demo failed ({status})"))
    }
}
