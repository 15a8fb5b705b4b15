//! Instructions and data-cache misses per message, counted by callgrind:
//! the in-memory workloads the targets compare, each run under `valgrind
//! --tool=callgrind` (`--profile WHAT --messages N`), counting only inside
//! `LocalSet::tick`, where the tasks that do the work run (ours' workers
//! and engine, the spawn floor's tasks, the plain loop's task) and none of
//! the setup (subscribing, sending the backlog). Each workload runs twice,
//! with 50,000 and with 100,000 messages, and the count per message is the
//! difference over the 50,000 more: what each further message costs. A
//! run's fixed costs (the dispatcher's start and shutdown, the metrics it
//! publishes for every subscription then) cancel out; the timed runs leave
//! the shutdown out too, and spread the start over more messages per
//! subscription than 50 (1000 subscriptions, 50,000 messages) would. The
//! counted runs publish metrics only then (see `Workload::counted`), so
//! that how long valgrind takes changes no count. A count moves by about
//! 1% between runs where this machine's times move by 10-30%, so the
//! ratios here say whether a change to the code moved a target, whatever
//! the machine was doing; they sit beside the CPU times, which stay the
//! targets' measure. The data-cache misses come from callgrind's cache
//! simulation, with the caches fixed at [`CACHES`] so that figures from
//! different machines compare; they say where the time of a workload
//! whose instructions barely grow goes. Skipped, with a note, where
//! `valgrind` is missing (`cargo xtask bench` installs it).

use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::{json, Map, Value};

use super::{insert, PROFILE_MESSAGES};

/// The report's name of each count, and the profile it runs.
const PROFILES: [(&str, &str); 8] = [
    ("ours", "ours"),
    ("plain_loop", "plain"),
    ("spawn_floor", "floor"),
    ("ours_k1000", "ours-k1000"),
    ("ours_k1000_l16", "ours-k1000-l16"),
    ("plain_loop_k1000", "plain-k1000"),
    ("ours_keyed", "ours-keyed"),
    ("ours_keyed_unordered", "ours-keyed-unordered"),
];

/// The simulated caches: a first level of 48 KiB (12-way) and a last
/// level of 2 MiB (16-way), 64-byte lines, the data caches of the machine
/// the first cache figures were taken on (docs/benchmarks.md), and a
/// 32 KiB instruction cache.
const CACHES: [&str; 3] = ["--D1=49152,12,64", "--LL=2097152,16,64", "--I1=32768,8,64"];

/// The ratios the targets read, each a count over another.
const RATIOS: [(&str, &str, &str); 6] = [
    ("dispatch_vs_plain_loop_instructions", "ours", "plain_loop"),
    ("dispatch_vs_floor_instructions", "ours", "spawn_floor"),
    ("scaling_1000_vs_1_instructions", "ours_k1000", "ours"),
    (
        "scaling_1000_vs_1_16_levels_instructions",
        "ours_k1000_l16",
        "ours",
    ),
    (
        "plain_loop_scaling_1000_vs_1_instructions",
        "plain_loop_k1000",
        "plain_loop",
    ),
    (
        "key_ordering_vs_unordered_instructions",
        "ours_keyed",
        "ours_keyed_unordered",
    ),
];

/// Counts every profile and adds `instructions_per_msg` and the ratios to
/// the report.
pub fn run(report: &mut Map<String, Value>) {
    if !valgrind_found() {
        eprintln!("instructions: valgrind not found; skipped (cargo xtask bench installs it)");
        return;
    }
    eprintln!("instructions: each workload twice under callgrind (50,000 and 100,000 messages)");
    let exe = std::env::current_exe().expect("the bench binary's path");
    let mut counts = Map::new();
    let mut misses = Map::new();
    for (name, profile) in PROFILES {
        match marginal(&exe, profile) {
            Ok(Marginal { per_msg, per_run }) => {
                super::emit(json!({"bench": "instructions", "profile": profile,
                    "per_msg": per_msg.instructions, "fixed_per_run": per_run.instructions,
                    "first_level_misses_per_msg": per_msg.first_level_misses,
                    "last_level_misses_per_msg": per_msg.last_level_misses}));
                counts.insert(name.to_string(), json!(per_msg.instructions));
                misses.insert(
                    name.to_string(),
                    json!({"first_level": per_msg.first_level_misses,
                        "last_level": per_msg.last_level_misses}),
                );
            }
            Err(error) => eprintln!("instructions: {profile}: {error}"),
        }
    }
    for (ratio, over, under) in RATIOS {
        let of = |name: &str| counts.get(name).and_then(Value::as_f64);
        if let (Some(over), Some(under)) = (of(over), of(under)) {
            insert(report, ratio, over / under);
        }
    }
    insert(report, "instructions_per_msg", Value::Object(counts));
    insert(report, "data_cache_misses_per_msg", Value::Object(misses));
}

fn valgrind_found() -> bool {
    Command::new("valgrind")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// What callgrind counted in one run, or per message.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Counts {
    instructions: f64,
    /// Data reads and writes that missed the first level.
    first_level_misses: f64,
    /// Data reads and writes that missed the last level.
    last_level_misses: f64,
}

impl Counts {
    /// `figure(self's, other's)` for each of the three figures.
    fn with(self, other: Counts, figure: impl Fn(f64, f64) -> f64) -> Counts {
        Counts {
            instructions: figure(self.instructions, other.instructions),
            first_level_misses: figure(self.first_level_misses, other.first_level_misses),
            last_level_misses: figure(self.last_level_misses, other.last_level_misses),
        }
    }
}

/// A workload's counts split into what each message adds and what a run
/// costs whatever its length.
struct Marginal {
    per_msg: Counts,
    per_run: Counts,
}

/// Counts `profile` at `PROFILE_MESSAGES` and at twice as many.
fn marginal(exe: &Path, profile: &str) -> Result<Marginal, String> {
    let short = count(exe, profile, PROFILE_MESSAGES)?;
    let long = count(exe, profile, 2 * PROFILE_MESSAGES)?;
    Ok(split(short, long, PROFILE_MESSAGES))
}

/// `short` counted over `messages`, `long` over twice as many.
fn split(short: Counts, long: Counts, messages: usize) -> Marginal {
    let messages = messages as f64;
    let per_msg = long.with(short, |long, short| (long - short) / messages);
    // What a run of no messages would count: the short run less its
    // messages' share.
    let per_run = short.with(per_msg, |short, per_msg| {
        (short - per_msg * messages).round()
    });
    Marginal { per_msg, per_run }
}

/// What `profile` runs inside `LocalSet::tick` over `messages`.
fn count(exe: &Path, profile: &str, messages: usize) -> Result<Counts, String> {
    let out = std::env::temp_dir().join(format!(
        "pulsar-dispatcher-callgrind-{}-{profile}-{messages}.out",
        std::process::id()
    ));
    let status = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg("--toggle-collect=*LocalSet::tick*")
        .arg("--cache-sim=yes")
        .args(CACHES)
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(exe)
        .args(["--profile", profile, "--messages", &messages.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|error| format!("running valgrind: {error}"))?;
    let text = std::fs::read_to_string(&out);
    let _ = std::fs::remove_file(&out);
    if !status.success() {
        return Err(format!("valgrind exited with {status}"));
    }
    let text = text.map_err(|error| format!("reading {}: {error}", out.display()))?;
    totals(&text).ok_or_else(|| format!("no events or totals line in {}", out.display()))
}

/// The figures of callgrind's `totals:` line (the events counted while
/// collection was on), named by its `events:` line.
fn totals(text: &str) -> Option<Counts> {
    let line = |prefix: &str| text.lines().find_map(|line| line.strip_prefix(prefix));
    let names = line("events:")?.split_whitespace();
    let figures = line("totals:")?.split_whitespace().map(str::parse::<u64>);
    let mut counts = Counts::default();
    let mut instructions = false;
    for (name, figure) in names.zip(figures) {
        let figure = figure.ok()? as f64;
        match name {
            "Ir" => {
                counts.instructions = figure;
                instructions = true;
            }
            "D1mr" | "D1mw" => counts.first_level_misses += figure,
            "DLmr" | "DLmw" => counts.last_level_misses += figure,
            _ => {}
        }
    }
    instructions.then_some(counts)
}

/// The smoke run's check of the parsing (the bench has no test harness).
pub fn smoke() {
    let text = "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\nsummary: 28679099\n\
                fn=(1)\n0 5\ntotals: 28679099 7 7 1 40 2 1 20 3\n";
    let counted = |instructions, first_level_misses, last_level_misses| Counts {
        instructions,
        first_level_misses,
        last_level_misses,
    };
    assert_eq!(totals(text), Some(counted(28_679_099.0, 42.0, 23.0)));
    assert_eq!(
        totals("events: Ir\ntotals: 15\n"),
        Some(counted(15.0, 0.0, 0.0))
    );
    assert_eq!(totals("events: Ir\n"), None);
    let Marginal { per_msg, per_run } = split(
        counted(1_500.0, 300.0, 30.0),
        counted(2_500.0, 500.0, 50.0),
        100,
    );
    assert_eq!(per_msg, counted(10.0, 2.0, 0.2));
    assert_eq!(per_run, counted(500.0, 100.0, 10.0));
}
