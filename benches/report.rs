//! The comparison run behind `cargo xtask bench`: every figure the design is
//! judged by, measured side by side in one process, printed as JSON lines
//! and as a table of targets, and written to `target/bench-report.json`.
//!
//! `cargo bench --bench report -- [--quick] [--no-e2e] [--out PATH]`
//!
//! - in memory (no-op handlers, messages waiting before the clock starts):
//!   ours, the `spawn_local` floor, the plain receive-handle-ack loop and
//!   the multi-threaded port in turn, wall and CPU time per message, and
//!   the Python original on a fake client; the K × C matrix; scaling to
//!   1000 subscriptions; allocations per message counted by this binary's
//!   global allocator;
//! - latency in memory: arrival to handler start under open-loop load at
//!   10, 50, 80 and 95% of ours' saturation rate, for ours and the port;
//!   idle latency; priority inversions; one dispatcher per core with a
//!   CPU-bound handler;
//! - scheduling and observability in memory (`report/features.rs`): one
//!   pick under each policy, weighted shares at saturation, the lowest
//!   level's longest wait under aging, key ordering against unordered, and
//!   dispatch with a Prometheus recorder or an `info` subscriber installed;
//! - instructions per message (`report/instructions.rs`): ours, the floor,
//!   the plain loop, 1000 subscriptions and key ordering, each workload
//!   under callgrind at two lengths, the count being what a further
//!   message adds, where `valgrind` is installed; `--instructions` runs
//!   this part alone;
//! - on the broker at `PULSAR_URL` (skipped with `--no-e2e`, see
//!   `report/e2e.rs`): ours against a plain `pulsar` consumer loop, the
//!   library's Pulsar transport in a plain loop, and the Python original,
//!   rates, client CPU and allocations per message, publish-to-handler
//!   latency at a fixed rate, and one dispatcher per core.
//!
//! The Python runs need `PULSAR_DISPATCHER_PYTHON` (a Python with
//! `pulsar-client` and `pulsar-dispatcher` 0.1.0); without it they are left
//! out of the report.
//!
//! Run without `--bench` (as `cargo test --all-targets` does), it runs each
//! in-memory workload on a handful of messages and checks what it can:
//! every message acknowledged, no allocation per message in steady state,
//! no priority inversion.
//!
//! `--profile WHAT [--messages N]` runs one workload once (for
//! `valgrind --tool=callgrind`; 50,000 messages unless N says otherwise);
//! the commands table of docs/benchmarks.md lists the workloads.

mod support;

#[path = "report/e2e.rs"]
mod e2e;
#[path = "report/features.rs"]
mod features;
#[path = "report/instructions.rs"]
mod instructions;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use pulsar_dispatcher::{Message, Ordering as MessageOrdering};
use serde_json::{json, Map, Value};

use support::latency::{self, Percentiles};
use support::{mt_port, on_local, Workload};

/// Counts this thread's heap allocations.
struct CountingAllocator;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counter is a thread-local `Cell` with a const initialiser and no
// destructor, so touching it neither allocates nor re-enters.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Heap allocations made by this thread so far.
fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

struct Options {
    quick: bool,
    e2e: bool,
    out: PathBuf,
}

impl Options {
    fn sizes(&self) -> Sizes {
        if self.quick {
            Sizes {
                repeats: 3,
                in_memory: 100_000,
                matrix: 30_000,
                scaling: 100_000,
                python_fake: 10_000,
                python_repeats: 3,
                latency: 60_000,
                idle: 3_000,
                inversion_highs: 1_500,
                per_core: 20_000,
                e2e: 20_000,
                e2e_queue_1: 300,
                python_e2e: 5_000,
                e2e_repeats: 3,
                e2e_latency: 3_000,
                features: features::Sizes {
                    repeats: 3,
                    picks: 200_000,
                    share_window: 20_000,
                    aging_run: Duration::from_millis(500),
                    messages: 100_000,
                },
            }
        } else {
            Sizes {
                repeats: 7,
                in_memory: 300_000,
                matrix: 100_000,
                scaling: 300_000,
                python_fake: 30_000,
                python_repeats: 5,
                latency: 200_000,
                idle: 10_000,
                inversion_highs: 5_000,
                per_core: 60_000,
                e2e: 50_000,
                e2e_queue_1: 400,
                python_e2e: 10_000,
                e2e_repeats: 5,
                e2e_latency: 10_000,
                features: features::Sizes {
                    repeats: 7,
                    picks: 1_000_000,
                    share_window: 100_000,
                    aging_run: Duration::from_secs(2),
                    messages: 300_000,
                },
            }
        }
    }
}

struct Sizes {
    repeats: usize,
    in_memory: usize,
    matrix: usize,
    scaling: usize,
    python_fake: usize,
    python_repeats: usize,
    latency: usize,
    idle: usize,
    inversion_highs: usize,
    per_core: usize,
    e2e: usize,
    e2e_queue_1: usize,
    python_e2e: usize,
    e2e_repeats: usize,
    e2e_latency: usize,
    features: features::Sizes,
}

/// Spin steps of the CPU-bound handler of the per-core benchmark (about
/// 10 µs here) and of each half of the low-priority handler of the
/// inversion benchmark (about 1 µs).
const PER_CORE_WORK: u64 = 5_000;
const LOW_PRIORITY_WORK: u64 = 500;

/// The offered loads of the open-loop benchmark, in percent of ours'
/// saturation rate.
const LOADS: [u32; 4] = [10, 50, 80, 95];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(at) = args.iter().position(|a| a == "--profile") {
        let messages = args
            .iter()
            .position(|a| a == "--messages")
            .and_then(|at| args.get(at + 1))
            .map(|n| n.parse().expect("--messages takes a count"))
            .unwrap_or(PROFILE_MESSAGES);
        profile(
            args.get(at + 1).map(String::as_str).unwrap_or("ours"),
            messages,
        );
        return;
    }
    if args.iter().any(|a| a == "--instructions") {
        // The instruction counts alone: what a change to the code did to
        // them, in half a minute once built.
        let mut report = Map::new();
        instructions::run(&mut report);
        for row in instruction_rows(&Figures(&report)) {
            println!("{:<34} {:>16}  {}", row.name, row.figure, row.comparison);
        }
        return;
    }
    if !args.iter().any(|a| a == "--bench") {
        smoke();
        return;
    }
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|at| args.get(at + 1))
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-report.json")
        });
    let options = Options {
        quick: args.iter().any(|a| a == "--quick"),
        e2e: !args.iter().any(|a| a == "--no-e2e"),
        out,
    };
    let report = run(&options);
    print_table(&report);
    let text = serde_json::to_string_pretty(&report).expect("a JSON report");
    if let Some(dir) = options.out.parent() {
        std::fs::create_dir_all(dir).expect("creating the report's folder");
    }
    std::fs::write(&options.out, text + "\n").expect("writing the report");
    eprintln!("report written to {}", options.out.display());
}

/// Prints one measurement as a JSON line.
fn emit(record: Value) {
    println!("{record}");
}

/// The median of the values that are numbers (the mean of the two middle
/// ones for an even count, rather than the upper one, which would bias a
/// figure of two or four runs upwards); NaN if there is none.
fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|value| !value.is_nan());
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let middle = values.len() / 2;
    if values.len() % 2 == 0 {
        (values[middle - 1] + values[middle]) / 2.0
    } else {
        values[middle]
    }
}

/// Runs `attempt` until `wanted` runs succeed, trying at most twice as
/// often: a run of the Python original fails now and then (the C++ client
/// has been seen to crash on exit), and a median of fewer runs than
/// wanted is a weaker figure. Says so when fewer succeeded.
fn successful_runs<T>(
    wanted: usize,
    what: &str,
    mut attempt: impl FnMut() -> Result<T, String>,
) -> Vec<T> {
    let tries = 2 * wanted;
    let mut runs = Vec::with_capacity(wanted);
    for tried in 1..=tries {
        if runs.len() == wanted {
            break;
        }
        match attempt() {
            Ok(run) => runs.push(run),
            Err(error) => eprintln!("  try {tried} of at most {tries} failed: {error}"),
        }
    }
    if runs.len() < wanted {
        eprintln!(
            "  WARNING: {what}: only {} of the {wanted} runs wanted succeeded in {tries} tries; \
             its figures are the median of those",
            runs.len()
        );
    }
    runs
}

fn ns_per_msg(elapsed: Duration, messages: usize) -> f64 {
    elapsed.as_nanos() as f64 / messages as f64
}

fn ours_ns(workload: Workload) -> f64 {
    ns_per_msg(on_local(support::ours(workload)), workload.messages)
}

fn floor_ns(concurrency: usize, messages: usize) -> f64 {
    ns_per_msg(on_local(support::floor(concurrency, messages)), messages)
}

fn mt_ns(runtime: &tokio::runtime::Runtime, workload: Workload) -> f64 {
    let ns = ns_per_msg(mt_port::run(runtime, workload), workload.messages);
    let_workers_park();
    ns
}

/// The port's workers spin for a while before they park; give them time,
/// so that they do not compete with the single-threaded run that follows.
fn let_workers_park() {
    std::thread::sleep(Duration::from_millis(100));
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut time = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `time` is a valid, writable timespec for the duration of the
    // call; the clock ids used are supported on every Linux.
    let status = unsafe { libc::clock_gettime(clock, &mut time) };
    if status != 0 {
        return 0;
    }
    time.tv_sec as u64 * 1_000_000_000 + time.tv_nsec as u64
}

/// CPU time used so far by the whole process (every thread), in ns.
fn cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// CPU time used so far by the calling thread, in ns.
fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// Wall time and CPU time per message of one implementation.
#[derive(Default)]
struct Samples {
    wall: Vec<f64>,
    cpu: Vec<f64>,
}

impl Samples {
    fn push(&mut self, wall: f64, cpu: Option<f64>) {
        self.wall.push(wall);
        self.cpu.extend(cpu);
    }

    fn medians(self) -> (f64, f64) {
        (median(self.wall), median(self.cpu))
    }
}

/// Wall and CPU time per message (medians) of the four implementations run
/// side by side.
struct SideBySide {
    ours: (f64, f64),
    floor: (f64, f64),
    plain: (f64, f64),
    mt: (f64, f64),
}

/// Runs ours, the floor, the plain loop and the port in turn, `repeats`
/// times, and returns the medians of each, so that drift on the machine
/// hits all of them alike.
fn side_by_side(sizes: &Sizes, mt_runtime: &tokio::runtime::Runtime) -> SideBySide {
    let messages = sizes.in_memory;
    let workload = Workload::new(1, 20, messages);
    // Warm-up: page in the code and the allocator's arenas.
    ours_ns(workload.messages(20_000));
    floor_ns(20, 20_000);
    on_local(support::plain_loop(20_000));
    mt_ns(mt_runtime, workload.messages(20_000));
    let mut ours = Samples::default();
    let mut floor = Samples::default();
    let mut plain = Samples::default();
    let mut mt = Samples::default();
    for _ in 0..sizes.repeats {
        // The single-threaded runs count their own thread only, so that the
        // port's idle workers do not add to them.
        // Counted from where its clock starts, as the others are.
        let run = on_local(support::ours_counted(workload, 0, Some(thread_cpu_ns)));
        ours.push(ns_per_msg(run.elapsed, messages), run.allocs_per_msg);
        let (elapsed, cpu) = on_local(support::floor_counted(20, messages, 0, Some(thread_cpu_ns)));
        floor.push(ns_per_msg(elapsed, messages), cpu);
        let (elapsed, cpu) = on_local(support::plain_loop_counted(
            1,
            messages,
            0,
            Some(thread_cpu_ns),
        ));
        plain.push(ns_per_msg(elapsed, messages), cpu);
        let (elapsed, cpu) = mt_port::run_counted(mt_runtime, workload, Some(cpu_ns));
        let_workers_park();
        mt.push(ns_per_msg(elapsed, messages), cpu);
    }
    SideBySide {
        ours: ours.medians(),
        floor: floor.medians(),
        plain: plain.medians(),
        mt: mt.medians(),
    }
}

fn insert(report: &mut Map<String, Value>, key: &str, value: impl Into<Value>) {
    report.insert(key.into(), value.into());
}

fn percentiles_json(p: &Percentiles) -> Value {
    json!({"p50_ns": p.p50, "p99_ns": p.p99, "p999_ns": p.p999, "max_ns": p.max,
           "samples": p.count})
}

/// The latencies after the first 5% (the start of a run), as percentiles.
fn steady(latencies: &[u64]) -> Percentiles {
    Percentiles::of(steady_part(latencies))
}

/// A run's latencies without its first 5% (the warm-up).
fn steady_part(latencies: &[u64]) -> &[u64] {
    &latencies[latencies.len() / 20..]
}

fn run(options: &Options) -> Map<String, Value> {
    let sizes = options.sizes();
    let mut report = Map::new();
    insert(&mut report, "quick", options.quick);
    insert(
        &mut report,
        "cores",
        pulsar_dispatcher::per_core::available_cores(),
    );
    let mt_runtime = mt_port::runtime();
    let ours = side_by_side_report(&sizes, &mt_runtime, &mut report);
    python_report(&sizes, ours, &mut report);
    allocations_report(&sizes, &mut report);
    scaling_report(&sizes, &mut report);
    matrix_report(&sizes, &mt_runtime, &mut report);
    latencies(&sizes, &mt_runtime, &mut report);
    drop(mt_runtime);
    inversions_report(&sizes, &mut report);
    per_core_report(&sizes, &mut report);
    features::run(&sizes.features, &mut report);
    instructions::run(&mut report);
    if options.e2e {
        e2e::run(&sizes, &mut report);
    }
    report
}

/// Ours, the spawn floor, the plain loop and the port on one workload
/// (K = 1, C = 20), side by side; returns ours' wall and CPU time per
/// message, which the Python original is compared with.
fn side_by_side_report(
    sizes: &Sizes,
    mt_runtime: &tokio::runtime::Runtime,
    report: &mut Map<String, Value>,
) -> (f64, f64) {
    eprintln!("in memory: ours, floor, plain loop and multi-threaded port (K=1, C=20)");
    let SideBySide {
        ours: (ours, ours_cpu),
        floor: (floor, floor_cpu),
        plain: (plain, plain_cpu),
        mt: (mt, mt_cpu),
    } = side_by_side(sizes, mt_runtime);
    for (bench, ns, cpu) in [
        ("ours", ours, ours_cpu),
        ("floor", floor, floor_cpu),
        ("plain_loop", plain, plain_cpu),
        ("mt_port", mt, mt_cpu),
    ] {
        emit(
            json!({"bench": bench, "subscriptions": 1, "concurrency": 20,
                    "messages": sizes.in_memory, "ns_per_msg": ns, "cpu_ns_per_msg": cpu}),
        );
    }
    insert(report, "dispatch_ns_per_msg", ours);
    insert(report, "spawn_floor_ns_per_msg", floor);
    insert(report, "plain_loop_ns_per_msg", plain);
    insert(report, "mt_port_ns_per_msg", mt);
    insert(report, "dispatch_cpu_ns_per_msg", ours_cpu);
    insert(report, "spawn_floor_cpu_ns_per_msg", floor_cpu);
    insert(report, "plain_loop_cpu_ns_per_msg", plain_cpu);
    insert(report, "mt_port_cpu_ns_per_msg", mt_cpu);
    // CPU time per message is the primary in-memory comparison (the
    // machine's other work inflates wall time, not this thread's CPU
    // time): the ratios the targets judge are CPU ratios, the wall ratios
    // are kept beside them. `dispatch_cpu_vs_*` repeat the CPU ratios under
    // the names earlier reports gave them.
    insert(report, "dispatch_vs_floor", ours_cpu / floor_cpu);
    insert(report, "dispatch_vs_plain_loop", ours_cpu / plain_cpu);
    insert(report, "dispatch_vs_floor_wall", ours / floor);
    insert(report, "dispatch_vs_plain_loop_wall", ours / plain);
    insert(report, "dispatch_cpu_vs_floor", ours_cpu / floor_cpu);
    insert(report, "dispatch_cpu_vs_plain_loop", ours_cpu / plain_cpu);
    insert(report, "mt_port_vs_dispatch", mt / ours);
    insert(report, "mt_port_cpu_vs_dispatch", mt_cpu / ours_cpu);

    (ours, ours_cpu)
}

/// The Python original on a fake client, the median of its runs.
fn python_report(sizes: &Sizes, (ours, ours_cpu): (f64, f64), report: &mut Map<String, Value>) {
    eprintln!("in memory: the Python original on a fake client (K=1, C=20)");
    match python() {
        Some(python) => {
            let wanted = sizes.python_repeats;
            let mut runs = Samples::default();
            for (ns, cpu) in successful_runs(wanted, "the Python original (fake)", || {
                python_fake(&python, 1, 20, sizes.python_fake)
            }) {
                runs.push(ns, cpu);
            }
            let count = runs.wall.len();
            if count > 0 {
                let (ns, cpu) = runs.medians();
                emit(
                    json!({"bench": "python_fake", "subscriptions": 1, "concurrency": 20,
                            "messages": sizes.python_fake, "runs": count,
                            "runs_wanted": wanted, "ns_per_msg": ns, "cpu_ns_per_msg": cpu}),
                );
                insert(report, "python_ref_ns_per_msg", ns);
                insert(report, "python_ref_cpu_ns_per_msg", cpu);
                insert(report, "python_ref_runs", count);
                insert(report, "python_ref_runs_wanted", wanted);
                insert(report, "python_ref_vs_dispatch", ns / ours);
                insert(report, "python_ref_cpu_vs_dispatch", cpu / ours_cpu);
            }
        }
        None => eprintln!("  skipped: PULSAR_DISPATCHER_PYTHON is not set"),
    }
}

/// Allocations per message in steady state: ours, the floor, the plain
/// loop and the scheduler alone.
fn allocations_report(sizes: &Sizes, report: &mut Map<String, Value>) {
    eprintln!("in memory: allocations per message in steady state");
    let allocs = on_local(support::ours_counted(
        Workload::new(1, 20, sizes.in_memory),
        sizes.in_memory / 10,
        Some(allocations),
    ))
    .allocs_per_msg
    .expect("counted");
    let (_, floor_allocs) = on_local(support::floor_counted(
        20,
        sizes.in_memory,
        sizes.in_memory / 10,
        Some(allocations),
    ));
    let floor_allocs = floor_allocs.expect("counted");
    let (_, plain_allocs) = on_local(support::plain_loop_counted(
        1,
        sizes.in_memory,
        sizes.in_memory / 10,
        Some(allocations),
    ));
    let plain_allocs = plain_allocs.expect("counted");
    let scheduler_allocs = scheduler_allocations(sizes.in_memory);
    emit(json!({"bench": "allocations", "ours_per_msg": allocs,
                "floor_per_msg": floor_allocs, "plain_loop_per_msg": plain_allocs,
                "scheduler_per_msg": scheduler_allocs}));
    insert(report, "allocs_per_msg", allocs);
    insert(report, "floor_allocs_per_msg", floor_allocs);
    insert(report, "plain_loop_allocs_per_msg", plain_allocs);
    insert(report, "scheduler_allocs_per_msg", scheduler_allocs);
}

/// Cost per message as subscriptions grow, on 1 and 16 levels, beside the
/// plain loop reading as many topics.
fn scaling_report(sizes: &Sizes, report: &mut Map<String, Value>) {
    eprintln!("in memory: scaling with subscriptions (C=20), and the plain loop over as many");
    let configs: Vec<(usize, usize)> = [1usize, 16]
        .iter()
        .flat_map(|&levels| [1usize, 10, 100, 1000].map(|subs| (levels, subs)))
        .collect();
    let plain_configs = [1usize, 1000];
    // Every configuration once per round, so that drift hits them alike.
    let mut samples = vec![Vec::new(); configs.len()];
    let mut plain_samples = vec![Vec::new(); plain_configs.len()];
    ours_ns(Workload::new(1000, 20, 20_000));
    for _ in 0..sizes.repeats {
        for (at, &(levels, subscriptions)) in configs.iter().enumerate() {
            let workload =
                Workload::new(subscriptions, 20, sizes.scaling).levels(levels.min(subscriptions));
            samples[at].push(ours_ns(workload));
        }
        for (at, &subscriptions) in plain_configs.iter().enumerate() {
            let elapsed = on_local(support::plain_loop_over(subscriptions, sizes.scaling));
            plain_samples[at].push(ns_per_msg(elapsed, sizes.scaling));
        }
    }
    let mut scaling = Map::new();
    for (&(levels, subscriptions), samples) in configs.iter().zip(samples) {
        let ns = median(samples);
        emit(
            json!({"bench": "scaling", "levels": levels, "subscriptions": subscriptions,
                    "messages": sizes.scaling, "ns_per_msg": ns}),
        );
        scaling.insert(format!("levels{levels}_subs{subscriptions}"), json!(ns));
    }
    // The plain loop reads the same backlog, laid out alike: what 1000
    // topics cost before anything is scheduled.
    for (&subscriptions, samples) in plain_configs.iter().zip(plain_samples) {
        let ns = median(samples);
        emit(
            json!({"bench": "scaling_plain_loop", "subscriptions": subscriptions,
                    "messages": sizes.scaling, "ns_per_msg": ns}),
        );
        scaling.insert(format!("plain_loop_subs{subscriptions}"), json!(ns));
    }
    let ns = |key: &str| scaling[key].as_f64().unwrap();
    let ratio = |levels: usize| {
        ns(&format!("levels{levels}_subs1000")) / ns(&format!("levels{levels}_subs1"))
    };
    insert(report, "scaling_1000_vs_1", ratio(1));
    insert(report, "scaling_1000_vs_1_16_levels", ratio(16));
    insert(
        report,
        "plain_loop_scaling_1000_vs_1",
        ns("plain_loop_subs1000") / ns("plain_loop_subs1"),
    );
    // What ours adds to the plain loop per message, with 1000 topics and
    // with one: the dispatcher's own growth, the backlog's cost set aside.
    insert(
        report,
        "scaling_1000_vs_1_beyond_plain_loop",
        (ns("levels1_subs1000") - ns("plain_loop_subs1000"))
            / (ns("levels1_subs1") - ns("plain_loop_subs1")),
    );
    insert(report, "scaling_ns_per_msg", Value::Object(scaling));
}

/// Ours, the port and the floor over subscriptions x concurrency.
fn matrix_report(
    sizes: &Sizes,
    mt_runtime: &tokio::runtime::Runtime,
    report: &mut Map<String, Value>,
) {
    eprintln!("in memory: K x C matrix");
    let mut matrix = Map::new();
    for concurrency in [1usize, 20, 256] {
        let floor = floor_ns(concurrency, sizes.matrix);
        matrix.insert(format!("floor_C{concurrency}"), json!(floor));
        emit(json!({"bench": "floor", "concurrency": concurrency,
                    "messages": sizes.matrix, "ns_per_msg": floor}));
        for subscriptions in [1usize, 10, 100] {
            let workload = Workload::new(subscriptions, concurrency, sizes.matrix);
            let ours = ours_ns(workload);
            let mt = mt_ns(mt_runtime, workload);
            for (bench, ns) in [("ours", ours), ("mt_port", mt)] {
                emit(json!({"bench": bench, "subscriptions": subscriptions,
                            "concurrency": concurrency, "messages": sizes.matrix,
                            "ns_per_msg": ns}));
                matrix.insert(
                    format!("{bench}_K{subscriptions}_C{concurrency}"),
                    json!(ns),
                );
            }
        }
    }
    insert(report, "matrix_ns_per_msg", Value::Object(matrix));
}

/// Low-priority messages dispatched while a high-priority one waited, and
/// the high-priority wait beyond the next permit release.
fn inversions_report(sizes: &Sizes, report: &mut Map<String, Value>) {
    eprintln!("in memory: priority inversions (C=4, low-priority backlog, random high arrivals)");
    let found = on_local(latency::inversions(
        sizes.inversion_highs,
        LOW_PRIORITY_WORK,
    ));
    let excess = Percentiles::of(&found.excess_wait);
    let wait = Percentiles::of(&found.wait);
    emit(
        json!({"bench": "priority_inversion", "high_messages": found.high_messages,
                "low_messages": found.low_messages, "inversions": found.inversions,
                "low_ran_dry": found.low_ran_dry,
                "excess_wait": percentiles_json(&excess), "wait": percentiles_json(&wait)}),
    );
    insert(report, "priority_inversions", found.inversions);
    insert(report, "high_priority_excess_wait_p50_ns", excess.p50);
    insert(report, "high_priority_excess_wait_p99_ns", excess.p99);
    insert(
        report,
        "priority_inversion_detail",
        json!({"high_messages": found.high_messages, "low_messages": found.low_messages,
               "low_ran_dry": found.low_ran_dry, "excess_wait": percentiles_json(&excess),
               "wait": percentiles_json(&wait)}),
    );
}

/// Samples of `measure(1)` and `measure(2)`, `repeats` of each, the pair
/// taken in alternating order so that drift hits both alike.
fn one_and_two(repeats: usize, mut measure: impl FnMut(usize) -> f64) -> (Vec<f64>, Vec<f64>) {
    let (mut one, mut two) = (Vec::new(), Vec::new());
    for repeat in 0..repeats {
        if repeat % 2 == 1 {
            two.push(measure(2));
        }
        one.push(measure(1));
        if repeat % 2 == 0 {
            two.push(measure(2));
        }
    }
    (one, two)
}

/// One dispatcher per core in memory, 1 against 2.
fn per_core_report(sizes: &Sizes, report: &mut Map<String, Value>) {
    eprintln!("in memory: one dispatcher per core, 1 and 2, CPU-bound handler (~10 us)");
    latency::per_core(1, sizes.per_core / 10, PER_CORE_WORK);
    let rate = |dispatchers| {
        let elapsed = latency::per_core(dispatchers, sizes.per_core, PER_CORE_WORK);
        sizes.per_core as f64 / elapsed.as_secs_f64()
    };
    let (one, two) = one_and_two(sizes.repeats.min(5), rate);
    let (one, two) = (median(one), median(two));
    for (cores, rate) in [(1, one), (2, two)] {
        emit(json!({"bench": "per_core_mem", "dispatchers": cores,
                    "messages": sizes.per_core, "msgs_per_s": rate}));
    }
    insert(report, "per_core_mem_1_msgs_per_s", one);
    insert(report, "per_core_mem_2_msgs_per_s", two);
    insert(report, "per_core_mem_2_vs_1", two / one);
}

/// The open-loop latency benchmarks, ours and the port, and idle latency.
fn latencies(sizes: &Sizes, mt_runtime: &tokio::runtime::Runtime, report: &mut Map<String, Value>) {
    eprintln!("in memory: ours' backlog and sustained rates with the arrival loop on its thread");
    on_local(latency::ours_backlog_rate(sizes.latency / 4));
    let backlog_rate = median(
        (0..3)
            .map(|_| on_local(latency::ours_backlog_rate(sizes.latency)))
            .collect(),
    );
    let saturation = median(
        (0..3)
            .map(|_| {
                on_local(latency::ours_sustained_rate(
                    backlog_rate,
                    sizes.latency / 4,
                    latency::SUSTAINED_RATE_STEPS,
                ))
            })
            .collect(),
    );
    emit(
        json!({"bench": "saturation", "messages": sizes.latency, "msgs_per_s": saturation,
                "backlog_msgs_per_s": backlog_rate}),
    );
    insert(report, "saturation_msgs_per_s", saturation);
    insert(report, "backlog_msgs_per_s", backlog_rate);
    let mut detail = Map::new();
    detail.insert("saturation_msgs_per_s".into(), json!(saturation));
    detail.insert("backlog_msgs_per_s".into(), json!(backlog_rate));

    eprintln!("in memory: idle latency, ours and the port");
    let ours_idle = Percentiles::of(&on_local(latency::ours_idle(sizes.idle)));
    let port_idle = Percentiles::of(&mt_port::idle(mt_runtime, sizes.idle));
    let_workers_park();
    for (bench, p) in [("ours", &ours_idle), ("mt_port", &port_idle)] {
        emit(
            json!({"bench": "idle_latency", "impl": bench, "messages": sizes.idle,
                    "latency": percentiles_json(p)}),
        );
        detail.insert(format!("{bench}_idle"), percentiles_json(p));
    }
    insert(report, "idle_latency_p50_ns", ours_idle.p50);
    insert(report, "idle_latency_p99_ns", ours_idle.p99);
    insert(report, "mt_port_idle_latency_p50_ns", port_idle.p50);

    let stalls = latency::stalls(Duration::from_secs(1));
    emit(
        json!({"bench": "machine_stalls", "per_second": stalls.per_second,
                "gap_p50_ns": stalls.gap_p50_ns, "gap_max_ns": stalls.gap_max_ns,
                "lost_fraction": stalls.lost_fraction,
                "timer_ticks_per_second": stalls.timer_ticks_per_second,
                "on_tick_share": stalls.on_tick_share}),
    );
    insert(report, "machine_stalls_per_s", stalls.per_second);
    insert(report, "machine_stall_p50_ns", stalls.gap_p50_ns);
    insert(report, "machine_stall_lost_fraction", stalls.lost_fraction);
    if let Some(ticks) = stalls.timer_ticks_per_second {
        insert(report, "machine_timer_ticks_per_s", ticks);
    }
    if let Some(share) = stalls.on_tick_share {
        insert(report, "machine_stalls_on_tick_share", share);
    }
    // What those stalls alone leave of the latency target: a consumer that
    // costs exactly ours' sustained time per message and loses nothing
    // else, offered 80% of that rate.
    let ideal = Percentiles::of(&stalls.trace.ideal_consumer(
        Duration::from_secs_f64(1.0 / (saturation * 0.8)),
        Duration::from_secs_f64(1.0 / saturation),
    ));
    emit(json!({"bench": "ideal_consumer", "load_pct": 80, "latency": percentiles_json(&ideal)}));
    detail.insert("ideal_consumer_80pct".into(), percentiles_json(&ideal));
    insert(report, "ideal_consumer_latency_p99_ns_at_80pct", ideal.p99);

    // How long the port's open-loop rounds take, all loads together (with
    // their warm-ups and the pause after each): what pooling its rounds as
    // ours' are pooled costs the run.
    let mut port_seconds = 0.0;
    for load in LOADS {
        let rate = saturation * f64::from(load) / 100.0;
        let interval = Duration::from_secs_f64(1.0 / rate);
        eprintln!(
            "in memory: open-loop arrivals at {load}% ({rate:.0} msg/s): ours, the plain loop, the port"
        );
        let pooled = pooled_open_loop(mt_runtime, interval, sizes.latency, sizes.repeats);
        let (ours, plain, port) = (
            Percentiles::of(&pooled.ours),
            Percentiles::of(&pooled.plain),
            Percentiles::of(&pooled.port),
        );
        port_seconds += pooled.port_seconds;
        detail.insert(
            format!("ours_{load}pct_kept_up"),
            json!(pooled.ours_kept_up == sizes.repeats),
        );
        detail.insert(
            format!("ours_{load}pct_rounds_kept_up"),
            json!(pooled.ours_kept_up),
        );
        for (bench, p, rounds) in [
            ("ours", &ours, sizes.repeats),
            ("plain_loop", &plain, sizes.repeats),
            ("mt_port", &port, sizes.repeats),
        ] {
            emit(
                json!({"bench": "open_loop_latency", "impl": bench, "load_pct": load,
                        "offered_msgs_per_s": rate, "messages": sizes.latency,
                        "rounds": rounds, "latency": percentiles_json(p)}),
            );
            detail.insert(format!("{bench}_{load}pct"), percentiles_json(p));
        }
        match load {
            50 => {
                insert(report, "latency_p50_ns_at_50pct", ours.p50);
                insert(report, "latency_p99_ns_at_50pct", ours.p99);
                insert(report, "plain_loop_latency_p99_ns_at_50pct", plain.p99);
                insert(report, "mt_port_latency_p99_ns_at_50pct", port.p99);
            }
            80 => {
                insert(report, "plain_loop_latency_p99_ns_at_80pct", plain.p99);
                insert(report, "latency_p99_ns_at_80pct", ours.p99);
                insert(report, "latency_p999_ns_at_80pct", ours.p999);
                insert(report, "mt_port_latency_p99_ns_at_80pct", port.p99);
            }
            _ => {}
        }
    }
    emit(
        json!({"bench": "mt_port_open_loop_time", "rounds": sizes.repeats,
                "seconds": port_seconds}),
    );
    detail.insert("mt_port_open_loop_seconds".into(), json!(port_seconds));
    // The load point the report used before the sustained rate: 80% of
    // the backlog rate, at which ours queued for the whole of runs 11 to
    // 13; kept to compare with them.
    let rate = backlog_rate * 0.8;
    eprintln!("in memory: open-loop arrivals at 80% of the backlog rate ({rate:.0} msg/s): ours");
    let (lateness, _) = on_local(latency::ours_open_loop(
        Duration::from_secs_f64(1.0 / rate),
        sizes.latency,
    ));
    let ours = steady(&lateness);
    detail.insert(
        "ours_80pct_of_backlog_kept_up".into(),
        json!(latency::kept_up(&lateness)),
    );
    detail.insert("ours_80pct_of_backlog".into(), percentiles_json(&ours));
    insert(report, "latency_p99_ns_at_80pct_of_backlog_rate", ours.p99);
    insert(report, "latency_ns", Value::Object(detail));
}

/// Ours', the plain loop's and the port's lateness at one offered rate,
/// over `rounds` runs of `messages` each, taken in turn.
struct PooledOpenLoop {
    /// The steady part of every round of ours, pooled.
    ours: Vec<u64>,
    plain: Vec<u64>,
    port: Vec<u64>,
    /// In how many rounds ours kept up.
    ours_kept_up: usize,
    /// The wall time the port's rounds took, in seconds.
    port_seconds: f64,
}

/// Runs ours, the plain loop and the port in turn, `rounds` times each,
/// and pools the steady part of their rounds (the port as many as the
/// others, so that its p99 rests on as many samples and stalls). A run of 200,000 messages lasts a
/// tenth of a second at these rates, so one stall of the machine of half a
/// millisecond, and the queue it leaves, covers more than a percent of
/// it: pooled rounds let the p99 say how often such stalls come, not
/// whether one fell into a single run.
fn pooled_open_loop(
    mt_runtime: &tokio::runtime::Runtime,
    interval: Duration,
    messages: usize,
    rounds: usize,
) -> PooledOpenLoop {
    let mut pooled = PooledOpenLoop {
        ours: Vec::with_capacity(messages * rounds),
        plain: Vec::with_capacity(messages * rounds),
        port: Vec::with_capacity(messages * rounds),
        ours_kept_up: 0,
        port_seconds: 0.0,
    };
    for _ in 0..rounds {
        let (lateness, _) = on_local(latency::ours_open_loop(interval, messages));
        pooled.ours_kept_up += usize::from(latency::kept_up(&lateness));
        pooled.ours.extend_from_slice(steady_part(&lateness));
        let lateness = on_local(latency::plain_open_loop(interval, messages));
        pooled.plain.extend_from_slice(steady_part(&lateness));
        let began = std::time::Instant::now();
        let lateness = mt_port::open_loop(mt_runtime, interval, messages);
        let_workers_park();
        pooled.port_seconds += began.elapsed().as_secs_f64();
        pooled.port.extend_from_slice(steady_part(&lateness));
    }
    pooled
}

/// Allocations per message of the pure scheduler: insert, pick, release.
fn scheduler_allocations(messages: usize) -> f64 {
    let mut scheduler =
        pulsar_dispatcher::scheduler::Scheduler::new(std::num::NonZeroUsize::new(20).unwrap());
    let keys: Vec<_> = (0..16).map(|i| scheduler.add_subscription(i)).collect();
    let before = allocations();
    for index in 0..messages {
        let key = keys[index % keys.len()];
        scheduler.try_insert(key, index).expect("an empty slot");
        let Some((permit, _)) = scheduler.try_dispatch() else {
            unreachable!("a message and a permit are there");
        };
        scheduler.release(permit);
    }
    (allocations() - before) as f64 / messages as f64
}

fn python() -> Option<PathBuf> {
    std::env::var_os("PULSAR_DISPATCHER_PYTHON")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

fn python_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("benches/python")
        .join(name)
}

/// Runs a Python benchmark script and returns the JSON line it printed.
fn run_python(python: &PathBuf, script: &str, args: &[String]) -> Result<Value, String> {
    let output = Command::new(python)
        .arg(python_script(script))
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "{script} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        ));
    }
    stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .ok_or_else(|| format!("{script} printed no JSON line"))
}

/// One run of the Python original on the fake client: wall and CPU time
/// per message.
fn python_fake(
    python: &PathBuf,
    subscriptions: usize,
    concurrency: usize,
    messages: usize,
) -> Result<(f64, Option<f64>), String> {
    let args = [
        "--subscriptions".to_string(),
        subscriptions.to_string(),
        "--concurrency".into(),
        concurrency.to_string(),
        "--messages".into(),
        messages.to_string(),
    ];
    let value = run_python(python, "fake_client_bench.py", &args)?;
    let ns = value["ns_per_msg"]
        .as_f64()
        .ok_or_else(|| "no ns_per_msg".to_string())?;
    Ok((ns, value["cpu_ns_per_msg"].as_f64()))
}

/// One row of the table: what, the figure, what it is compared with, the
/// target, and whether it is met (`None`: not measured, or no target).
struct Row {
    name: &'static str,
    figure: String,
    comparison: String,
    target: &'static str,
    met: Option<bool>,
}

impl Row {
    /// A row with a target, and whether it is met.
    fn judged(
        name: &'static str,
        figure: String,
        comparison: String,
        target: &'static str,
        met: Option<bool>,
    ) -> Row {
        Row {
            name,
            figure,
            comparison,
            target,
            met,
        }
    }

    /// A row shown for information, with no target.
    fn shown(name: &'static str, figure: String, comparison: String) -> Row {
        Row::judged(name, figure, comparison, "", None)
    }

    fn verdict(&self) -> &'static str {
        match (self.met, self.target.is_empty()) {
            (_, true) => "",
            (Some(true), false) => "met",
            (Some(false), false) => "MISSED",
            (None, false) => "n/a",
        }
    }
}

/// The report's figures, as the table reads them: a figure is missing when
/// its part of the run was skipped, and NaN when it could not be measured.
struct Figures<'a>(&'a Map<String, Value>);

impl Figures<'_> {
    fn number(&self, key: &str) -> Option<f64> {
        self.0.get(key).and_then(Value::as_f64)
    }

    /// The figure under `a` over the one under `b`.
    fn ratio(&self, a: &str, b: &str) -> Option<f64> {
        self.number(a).zip(self.number(b)).map(|(a, b)| a / b)
    }

    /// The figure under `key`, right-aligned, with its unit.
    fn show(&self, key: &str, unit: &str) -> String {
        show(self.number(key), unit)
    }

    /// Whether the figure under `key` passes `test`; `None` if unmeasured.
    fn check(&self, key: &str, test: fn(f64) -> bool) -> Option<bool> {
        self.number(key).filter(|v| !v.is_nan()).map(test)
    }

    /// Whether the figures under `a` and `b` pass `test` together.
    fn both(&self, a: &str, b: &str, test: fn(f64, f64) -> bool) -> Option<bool> {
        self.number(a)
            .zip(self.number(b))
            .filter(|(a, b)| !a.is_nan() && !b.is_nan())
            .map(|(a, b)| test(a, b))
    }
}

fn show(value: Option<f64>, unit: &str) -> String {
    match value {
        Some(v) if v.is_nan() => format!("{:>9} {unit}", "n/a"),
        Some(v) if v >= 100.0 => format!("{v:>9.0} {unit}"),
        Some(v) => format!("{v:>9.2} {unit}"),
        None => format!("{:>9} {unit}", "n/a"),
    }
}

/// Prints the report as a table of figures, each beside its comparison and
/// its target, in the order docs/benchmarks.md discusses them.
fn print_table(report: &Map<String, Value>) {
    let figures = Figures(report);
    let sections = [
        cost_rows(&figures),
        instruction_rows(&figures),
        latency_rows(&figures),
        scheduling_rows(&figures),
        broker_rows(&figures),
    ];
    println!();
    println!(
        "{:<34} {:>16}  {:<40} {:<16} verdict",
        "benchmark", "figure", "comparison", "target"
    );
    println!("{}", "-".repeat(118));
    for row in sections.iter().flatten() {
        println!(
            "{:<34} {:>16}  {:<40} {:<16} {}",
            row.name,
            row.figure,
            row.comparison,
            row.target,
            row.verdict()
        );
    }
    println!();
}

/// In memory: the cost of a message against the baselines, allocations,
/// and how the cost grows with the subscriptions.
fn cost_rows(f: &Figures) -> Vec<Row> {
    vec![
        Row::shown(
            "dispatch, K=1 C=20 (ours), CPU",
            f.show("dispatch_cpu_ns_per_msg", "ns/msg"),
            format!("wall {}", f.show("dispatch_ns_per_msg", "ns/msg")),
        ),
        Row::judged(
            "spawn_local floor, C=20, CPU",
            f.show("spawn_floor_cpu_ns_per_msg", "ns/msg"),
            format!(
                "ours/floor {} (wall {})",
                f.show("dispatch_vs_floor", "x"),
                f.show("dispatch_vs_floor_wall", "x")
            ),
            "ours <= 1.3x",
            f.check("dispatch_vs_floor", |r| r <= 1.3),
        ),
        Row::judged(
            "plain loop (recv/handle/ack), CPU",
            f.show("plain_loop_cpu_ns_per_msg", "ns/msg"),
            format!(
                "ours/plain {} (wall {})",
                f.show("dispatch_vs_plain_loop", "x"),
                f.show("dispatch_vs_plain_loop_wall", "x")
            ),
            "ours <= 1.5x",
            f.check("dispatch_vs_plain_loop", |r| r <= 1.5),
        ),
        Row::judged(
            "multi-threaded port, CPU",
            f.show("mt_port_cpu_ns_per_msg", "ns/msg"),
            format!(
                "port/ours {} (wall {})",
                f.show("mt_port_cpu_vs_dispatch", "x"),
                f.show("mt_port_vs_dispatch", "x")
            ),
            ">= 8x ours",
            f.check("mt_port_cpu_vs_dispatch", |r| r >= 8.0),
        ),
        Row::judged(
            "Python original (fake), CPU",
            f.show("python_ref_cpu_ns_per_msg", "ns/msg"),
            format!(
                "python/ours {} (wall {})",
                f.show("python_ref_cpu_vs_dispatch", "x"),
                f.show("python_ref_vs_dispatch", "x")
            ),
            ">= 100x ours",
            f.check("python_ref_cpu_vs_dispatch", |r| r >= 100.0),
        ),
        Row::judged(
            "allocations per message",
            f.show("allocs_per_msg", "allocs"),
            format!(
                "floor {} plain {}",
                f.show("floor_allocs_per_msg", ""),
                f.show("plain_loop_allocs_per_msg", "")
            ),
            "< 0.01",
            f.check("allocs_per_msg", |a| a < 0.01),
        ),
        Row::judged(
            "1000 subs vs 1, 1 level",
            f.show("scaling_1000_vs_1", "x"),
            format!(
                "plain loop {}, ours beyond it {}",
                f.show("plain_loop_scaling_1000_vs_1", "x").trim_start(),
                f.show("scaling_1000_vs_1_beyond_plain_loop", "x")
                    .trim_start()
            ),
            "<= 1.3x",
            f.check("scaling_1000_vs_1", |r| r <= 1.3),
        ),
        Row::judged(
            "1000 subs vs 1, 16 levels",
            f.show("scaling_1000_vs_1_16_levels", "x"),
            String::new(),
            "<= 1.3x",
            f.check("scaling_1000_vs_1_16_levels", |r| r <= 1.3),
        ),
    ]
}

/// In memory, counted by callgrind (see `report/instructions.rs`): the
/// ratios of the cost rows above in instructions, shown beside the CPU
/// times they do not replace.
fn instruction_rows(f: &Figures) -> Vec<Row> {
    let count = |name: &str| {
        f.0.get("instructions_per_msg")
            .and_then(|counts| counts.get(name))
            .and_then(Value::as_f64)
    };
    // "first/last" level misses of one workload, or "-".
    let misses = |name: &str| {
        let level = |level: &str| {
            f.0.get("data_cache_misses_per_msg")
                .and_then(|misses| misses.get(name))
                .and_then(|misses| misses.get(level))
                .and_then(Value::as_f64)
        };
        match (level("first_level"), level("last_level")) {
            (Some(first), Some(last)) => format!("{first:.2}/{last:.2}"),
            _ => "-".to_string(),
        }
    };
    vec![
        Row::shown(
            "instructions/msg, ours",
            show(count("ours"), "instr"),
            format!(
                "ours/plain {} ours/floor {}",
                f.show("dispatch_vs_plain_loop_instructions", "x")
                    .trim_start(),
                f.show("dispatch_vs_floor_instructions", "x").trim_start()
            ),
        ),
        Row::shown(
            "instructions, 1000 subs vs 1",
            f.show("scaling_1000_vs_1_instructions", "x"),
            format!(
                "16 levels {}, plain loop {}",
                f.show("scaling_1000_vs_1_16_levels_instructions", "x")
                    .trim_start(),
                f.show("plain_loop_scaling_1000_vs_1_instructions", "x")
                    .trim_start()
            ),
        ),
        Row::shown(
            "instructions, key ordering",
            f.show("key_ordering_vs_unordered_instructions", "x"),
            format!(
                "keyed {} unordered {}",
                show(count("ours_keyed"), "").trim(),
                show(count("ours_keyed_unordered"), "").trim()
            ),
        ),
        Row::shown(
            "data cache misses/msg, ours",
            misses("ours"),
            format!(
                "first/last level; 1000 subs {}, plain loop {}, over 1000 topics {}",
                misses("ours_k1000"),
                misses("plain_loop"),
                misses("plain_loop_k1000")
            ),
        ),
    ]
}

/// In memory: latency idle and under open-loop load, priority inversions,
/// and one dispatcher per core.
fn latency_rows(f: &Figures) -> Vec<Row> {
    let p99_over_idle = f.ratio("latency_p99_ns_at_80pct", "idle_latency_p50_ns");
    vec![
        Row::shown(
            "idle latency p50 (ours)",
            f.show("idle_latency_p50_ns", "ns"),
            format!("port {}", f.show("mt_port_idle_latency_p50_ns", "ns")),
        ),
        Row::shown(
            "latency at 50% load p50 / p99",
            f.show("latency_p50_ns_at_50pct", "ns"),
            format!(
                "p99 {} port p99 {}",
                f.show("latency_p99_ns_at_50pct", "ns"),
                f.show("mt_port_latency_p99_ns_at_50pct", "ns")
            ),
        ),
        Row::judged(
            "latency at 80% load p99",
            f.show("latency_p99_ns_at_80pct", "ns"),
            format!("{} idle p50", show(p99_over_idle, "x")),
            "<= 10x idle p50",
            f.both(
                "latency_p99_ns_at_80pct",
                "idle_latency_p50_ns",
                |p99, idle| p99 <= 10.0 * idle,
            ),
        ),
        Row::shown(
            "  plain loop at the same rate, p99",
            f.show("plain_loop_latency_p99_ns_at_80pct", "ns"),
            format!(
                "machine stalls {}/s, p50 {}",
                f.show("machine_stalls_per_s", ""),
                f.show("machine_stall_p50_ns", "ns")
            ),
        ),
        Row::shown(
            "  a consumer costing only the stalls",
            f.show("ideal_consumer_latency_p99_ns_at_80pct", "ns"),
            format!(
                "p99, {} idle p50",
                show(
                    f.ratio(
                        "ideal_consumer_latency_p99_ns_at_80pct",
                        "idle_latency_p50_ns"
                    ),
                    "x"
                )
            ),
        ),
        Row::shown(
            "  kernel timer ticks in that second",
            f.show("machine_timer_ticks_per_s", "/s"),
            format!(
                "share of the stalls in step with them {}",
                f.show("machine_stalls_on_tick_share", "")
            ),
        ),
        Row::judged(
            "  port at the same rate, p99",
            f.show("mt_port_latency_p99_ns_at_80pct", "ns"),
            String::new(),
            "ours below",
            f.both(
                "latency_p99_ns_at_80pct",
                "mt_port_latency_p99_ns_at_80pct",
                |ours, port| ours < port,
            ),
        ),
        Row::judged(
            "priority inversions",
            f.show("priority_inversions", ""),
            format!(
                "excess wait p99 {}",
                f.show("high_priority_excess_wait_p99_ns", "ns")
            ),
            "0",
            f.check("priority_inversions", |n| n == 0.0),
        ),
        Row::judged(
            "per core in memory, 2 vs 1",
            f.show("per_core_mem_2_vs_1", "x"),
            String::new(),
            ">= 1.8x",
            f.check("per_core_mem_2_vs_1", |r| r >= 1.8),
        ),
    ]
}

/// In memory: the scheduling policies, key ordering and the cost of
/// observing the dispatcher.
fn scheduling_rows(f: &Figures) -> Vec<Row> {
    vec![
        Row::shown(
            "pick, strict / weighted / aging",
            f.show("pick_ns_strict", "ns"),
            format!(
                "weighted {} aging {}",
                f.show("pick_ns_weighted", "ns"),
                f.show("pick_ns_aging", "ns")
            ),
        ),
        Row::judged(
            "weighted share max error",
            f.show("weighted_share_max_error", ""),
            format!(
                "scheduler alone {}",
                f.show("weighted_share_max_error_scheduler", "")
            ),
            "<= 0.02",
            f.check("weighted_share_max_error", |e| e <= 0.02),
        ),
        Row::shown(
            "aging: lowest level's max wait",
            f.show("aging_lowest_max_wait_ms", "ms"),
            format!("bound {}", f.show("aging_bound_ms", "ms")),
        ),
        Row::judged(
            "key ordering",
            f.show("key_ordering_ns_per_msg", "ns/msg"),
            format!("vs unordered {}", f.show("key_ordering_vs_unordered", "x")),
            "<= 1.2x",
            f.check("key_ordering_vs_unordered", |r| r <= 1.2),
        ),
        Row::judged(
            "Prometheus recorder installed",
            f.show("metrics_overhead", "x"),
            format!("allocs {}", f.show("metrics_allocs_per_msg", "/msg")),
            "<= 1.10x",
            f.check("metrics_overhead", |r| r <= 1.10),
        ),
        Row::judged(
            "info subscriber installed",
            f.show("tracing_overhead", "x"),
            String::new(),
            "<= 1.05x",
            f.check("tracing_overhead", |r| r <= 1.05),
        ),
    ]
}

/// On the broker: client CPU, rates, allocations and latency against the
/// plain `pulsar` loop and the Python original.
fn broker_rows(f: &Figures) -> Vec<Row> {
    vec![
        Row::judged(
            "e2e client CPU, ours",
            f.show("e2e_cpu_us_per_msg", "us/msg"),
            format!(
                "ours/plain {} (plain {})",
                f.show("e2e_cpu_vs_raw", "x"),
                f.show("e2e_raw_cpu_us_per_msg", "us")
            ),
            "<= 1.1x plain",
            f.check("e2e_cpu_vs_raw", |r| r <= 1.1),
        ),
        Row::shown(
            "  plain loop acking cumulatively",
            f.show("e2e_raw_cumulative_cpu_us_per_msg", "us/msg"),
            format!("ours/it {}", f.show("e2e_cpu_vs_raw_cumulative", "x")),
        ),
        Row::shown(
            "e2e rate, ours (queue 1000)",
            f.show("e2e_msgs_per_s", "msg/s"),
            format!(
                "ours/plain {} python {}",
                f.show("e2e_vs_raw", "x"),
                f.show("e2e_python_msgs_per_s", "msg/s")
            ),
        ),
        Row::shown(
            "e2e client CPU, Python",
            f.show("e2e_python_cpu_us_per_msg", "us/msg"),
            format!(
                "transport loop {}",
                f.show("e2e_transport_cpu_us_per_msg", "us")
            ),
        ),
        Row::shown(
            "e2e allocations per message",
            f.show("e2e_allocs_per_msg", ""),
            format!(
                "transport adds {} plain {}",
                f.show("pulsar_transport_allocs_per_msg", ""),
                f.show("e2e_raw_allocs_per_msg", "")
            ),
        ),
        Row::shown(
            "e2e latency p50 / p99 (ours)",
            f.show("e2e_latency_p50_us", "us"),
            format!(
                "p99 {} plain {} python {}",
                f.show("e2e_latency_p99_us", "us"),
                f.show("e2e_raw_latency_p99_us", "us"),
                f.show("e2e_python_latency_p99_us", "us")
            ),
        ),
        Row::shown(
            "e2e per core, 2 vs 1",
            f.show("per_core_2_vs_1", "x"),
            String::new(),
        ),
    ]
}

/// `cargo test --all-targets` runs this: each workload completes, every
/// message is acknowledged, nothing allocates per message in steady state,
/// no low-priority message overtakes a waiting high-priority one, and the
/// scheduling policies do what they promise.
fn smoke() {
    let workload = Workload::new(3, 4, 200).levels(2);
    assert!(on_local(support::ours(workload)) > Duration::ZERO);
    assert!(on_local(support::floor(4, 200)) > Duration::ZERO);
    assert!(on_local(support::plain_loop(200)) > Duration::ZERO);
    assert!(on_local(support::plain_loop_over(3, 200)) > Duration::ZERO);
    let runtime = mt_port::runtime();
    assert!(mt_port::run(&runtime, workload) > Duration::ZERO);
    // The in-memory broker's event log doubles now and then (one
    // allocation per doubling); nothing else may allocate per message.
    let (_, plain_allocs) = on_local(support::plain_loop_counted(
        1,
        4_000,
        2_000,
        Some(allocations),
    ));
    assert!(
        plain_allocs.expect("counted") < 0.01,
        "the plain loop allocates per message: {plain_allocs:?}"
    );
    let counted = on_local(support::ours_counted(
        Workload::new(1, 20, 5_000),
        2_500,
        Some(allocations),
    ));
    assert!(
        counted.allocs_per_msg.expect("counted") < 0.01,
        "dispatching allocates per message in steady state: {:?}",
        counted.allocs_per_msg
    );
    assert_eq!(scheduler_allocations(1000), 0.0);
    let (lateness, _) = on_local(latency::ours_open_loop(Duration::from_micros(2), 2_000));
    assert_eq!(lateness.len(), 2_000);
    let lateness = on_local(latency::plain_open_loop(Duration::from_micros(2), 2_000));
    assert_eq!(lateness.len(), 2_000);
    // A queue that builds is not keeping up; a few late messages are.
    assert!(!latency::kept_up(
        &(0..1_000).map(|i| i * 1_000).collect::<Vec<_>>()
    ));
    assert!(latency::kept_up(
        &[[500; 90].as_slice(), &[1_000_000; 4], &[500; 6]].concat()
    ));
    // Gaps in step with a 250 Hz tick (counted as 251 over a second) share
    // one phase of it; gaps spread evenly over the period share none.
    let tick = 4_000_000;
    let in_step: Vec<u64> = (0..250).map(|i| i * tick + 30_000 + i % 7).collect();
    assert_eq!(latency::busiest_phase_share(&in_step, 251.0), Some(1.0));
    let spread: Vec<u64> = (0..160).map(|i| i * (tick / 16 + 1)).collect();
    assert_eq!(
        latency::busiest_phase_share(&spread, 250.0),
        Some(1.0 / 16.0)
    );
    assert_eq!(latency::busiest_phase_share(&[], 250.0), None);
    // A consumer at half load loses nothing without gaps; a gap delays the
    // arrival at its start by its whole length, and the queue it leaves
    // drains.
    let (every, service) = (Duration::from_nanos(100), Duration::from_nanos(50));
    let calm = latency::StallTrace::new(Vec::new(), 100_000).ideal_consumer(every, service);
    assert!(calm.len() == 1_000 && calm.iter().all(|&late| late == 0));
    let gap = latency::StallTrace::new(vec![(1_000, 10_000)], 100_000);
    let late = gap.ideal_consumer(every, service);
    assert_eq!(late.len(), 1_000);
    assert_eq!(late[10], 10_000);
    assert_eq!(late.iter().max(), Some(&10_000));
    assert_eq!(late[999], 0);
    let backlog = on_local(latency::ours_backlog_rate(2_000));
    let sustained = on_local(latency::ours_sustained_rate(backlog, 2_000, 2));
    assert!(sustained >= backlog / 3.0 && sustained < backlog);
    assert_eq!(on_local(latency::ours_idle(50)).len(), 50);
    assert_eq!(
        mt_port::open_loop(&runtime, Duration::from_micros(5), 500).len(),
        500
    );
    assert_eq!(mt_port::idle(&runtime, 20).len(), 20);
    latency::check_analysis();
    let found = on_local(latency::inversions(30, 100));
    assert_eq!(
        found.low_ran_dry, 0,
        "the low-priority backlog never ran dry"
    );
    assert_eq!(
        found.inversions, 0,
        "no low-priority message overtook a high one"
    );
    assert!(latency::per_core(2, 200, 10) > Duration::ZERO);
    features::smoke();
    instructions::smoke();
    println!("report: smoke run passed (run with --bench for figures)");
}

/// How many messages a `--profile` run sends (the in-memory workloads),
/// unless `--messages N` says.
const PROFILE_MESSAGES: usize = 50_000;

fn profile(what: &str, messages: usize) {
    if let Some(run) = e2e::profile(what) {
        println!("{run}");
        return;
    }
    let workload = Workload::new(1, 20, messages).counted();
    let elapsed = match what {
        "ours" => on_local(support::ours(workload)),
        "ours-large-future" => on_local(support::ours(workload.large_future())),
        "ours-info" => features::with_info_subscriber(|| on_local(support::ours(workload))),
        "ours-prometheus" => features::with_prometheus(|| on_local(support::ours(workload))),
        "ours-keyed" => on_local(support::ours(workload.keyed(64, MessageOrdering::Key))),
        "ours-keyed-unordered" => on_local(support::ours(
            workload.keyed(64, MessageOrdering::Unordered),
        )),
        "ours-ordered" => on_local(support::ours(
            workload.keyed(0, MessageOrdering::Subscription),
        )),
        scaled if scaled.starts_with("ours-k") => {
            // ours-k<subscriptions>[-l<levels>], e.g. ours-k1000-l16.
            let spec = &scaled["ours-k".len()..];
            let (subscriptions, levels) = spec.split_once("-l").unwrap_or((spec, "1"));
            let parse = |n: &str| {
                n.parse::<usize>()
                    .unwrap_or_else(|_| panic!("bad profile {what}"))
            };
            let workload = Workload::new(parse(subscriptions), 20, messages)
                .levels(parse(levels))
                .counted();
            on_local(support::ours(workload))
        }
        "floor" => on_local(support::floor(20, messages)),
        "plain" => on_local(support::plain_loop(messages)),
        scaled if scaled.starts_with("plain-k") => {
            let subscriptions = scaled["plain-k".len()..]
                .parse()
                .unwrap_or_else(|_| panic!("bad profile {what}"));
            on_local(support::plain_loop_over(subscriptions, messages))
        }
        "mt" => mt_port::run(&mt_port::runtime(), workload),
        "side-by-side" => {
            // The four in-memory implementations, as the report runs them
            // (quick sizes), for a quick check of the ratios.
            let quick = Options {
                quick: true,
                e2e: false,
                out: PathBuf::new(),
            };
            let s = side_by_side(&quick.sizes(), &mt_port::runtime());
            println!(
                "ours {:.0} ns ({:.0} cpu), floor {:.0}, plain {:.0}, port cpu {:.0}: \
                 vs floor {:.2}x, vs plain {:.2}x, port {:.1}x",
                s.ours.0,
                s.ours.1,
                s.floor.1,
                s.plain.1,
                s.mt.1,
                s.ours.1 / s.floor.1,
                s.ours.1 / s.plain.1,
                s.mt.1 / s.ours.1
            );
            return;
        }
        "features" => {
            let mut report = Map::new();
            let quick = Options {
                quick: true,
                e2e: false,
                out: PathBuf::new(),
            };
            features::run(&quick.sizes().features, &mut report);
            println!("{}", Value::Object(report));
            return;
        }
        "idle" => {
            let p = Percentiles::of(&on_local(latency::ours_idle(messages / 10)));
            println!("idle: {p:?}");
            return;
        }
        "lone" => {
            // One message at a time on an idle dispatcher, the sender
            // woken by the handler: the cost of a lone message's path.
            let ours = support::OursLatency::new();
            let total = ours.measure(messages as u64);
            println!("lone: {:?} per message", total / messages as u32);
            return;
        }
        "inversion" => {
            let found = on_local(latency::inversions(2_000, LOW_PRIORITY_WORK));
            println!(
                "inversion: {} inversions, excess wait {:?}",
                found.inversions,
                Percentiles::of(&found.excess_wait)
            );
            return;
        }
        other => {
            if let Some(load) = other.strip_prefix("open-loop-") {
                let load: f64 = load.parse().expect("open-loop-<percent of saturation>");
                // SATURATION=<msg/s> fixes the rate the load is a share of,
                // to compare two builds at the same offered rate.
                let saturation = match std::env::var("SATURATION") {
                    Ok(rate) => rate.parse().expect("SATURATION=<messages per second>"),
                    Err(_) => on_local(latency::ours_saturation(messages)),
                };
                let interval = Duration::from_secs_f64(100.0 / (load * saturation));
                let (lateness, _) = on_local(latency::ours_open_loop(interval, messages));
                if let Ok(path) = std::env::var("LATENESS_DUMP") {
                    let text: Vec<String> = lateness.iter().map(u64::to_string).collect();
                    std::fs::write(path, text.join("\n")).expect("writing the dump");
                }
                println!(
                    "open loop at {load}% of {saturation:.0} msg/s: {:?}",
                    steady(&lateness)
                );
                let plain = on_local(latency::plain_open_loop(interval, messages));
                println!("  the plain loop at the same rate: {:?}", steady(&plain));
                let stalls = latency::stalls(Duration::from_secs(1));
                println!("  machine: {stalls:?}");
                let service = Duration::from_secs_f64(1.0 / saturation);
                let ideal = stalls.trace.ideal_consumer(interval, service);
                println!(
                    "  a consumer costing only the stalls and {service:?} a message: {:?}",
                    Percentiles::of(&ideal)
                );
                return;
            }
            if let Some(burst) = other.strip_prefix("bursts-") {
                let burst: usize = burst.parse().expect("bursts-<messages per burst>");
                let p = Percentiles::of(&on_local(latency::ours_bursts(messages / 10, burst)));
                println!("bursts of {burst}: {p:?}");
                return;
            }
            if let Some(cores) = other.strip_prefix("per-core-") {
                let cores: usize = cores.parse().expect("per-core-<dispatchers>");
                let elapsed = latency::per_core(cores, 20_000, PER_CORE_WORK);
                println!(
                    "per core x{cores}: {:.0} msg/s",
                    20_000.0 / elapsed.as_secs_f64()
                );
                return;
            }
            panic!(
                "unknown profile target {other}; use ours, ours-large-future, ours-k<subs>[-l<levels>] (e.g. ours-k1000-l16), floor, \
                 plain, plain-k<subs>, mt, side-by-side, ours-keyed, ours-keyed-unordered, ours-ordered, ours-info, ours-prometheus, features, idle, lone, bursts-<n>, open-loop-<pct>, inversion, per-core-<n>, e2e-q<N>, \
                 e2e-ours, e2e-raw, e2e-raw-cumulative, e2e-transport or e2e-latency"
            )
        }
    };
    println!(
        "{what}: {:.0} ns/msg (a Message is {} bytes)",
        ns_per_msg(elapsed, messages),
        std::mem::size_of::<Message>()
    );
}
