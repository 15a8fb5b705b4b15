//! Instructions per message, counted by callgrind: the in-memory workloads
//! the targets compare, each run under `valgrind --tool=callgrind`
//! (`--profile WHAT --messages N`), counting only inside `LocalSet::tick`,
//! where the tasks that do the work run (ours' workers and engine, the
//! spawn floor's tasks, the plain loop's task) and none of the setup
//! (subscribing, sending the backlog). Each workload runs twice, with
//! 50,000 and with 100,000 messages, and the count per message is the
//! difference over the 50,000 more: what each further message costs. A
//! run's fixed costs (the dispatcher's start and shutdown, the metrics it
//! publishes for every subscription then) cancel out; the timed runs leave
//! the shutdown out too, and spread the start over more messages per
//! subscription than 50 (1000 subscriptions, 50,000 messages) would. A
//! count moves by about 1% between runs where this machine's times move
//! by 10-30%, so the ratios here say whether a change to the code moved a
//! target, whatever the machine was doing; they sit beside the CPU times,
//! which stay the targets' measure. Skipped, with a note, where `valgrind`
//! is missing (`cargo xtask bench` installs it).

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
    for (name, profile) in PROFILES {
        match marginal(&exe, profile) {
            Ok(Marginal { per_msg, per_run }) => {
                super::emit(json!({"bench": "instructions", "profile": profile,
                    "per_msg": per_msg, "fixed_per_run": per_run}));
                counts.insert(name.to_string(), json!(per_msg));
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
}

fn valgrind_found() -> bool {
    Command::new("valgrind")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// A workload's count split into what each message adds and what a run
/// costs whatever its length.
struct Marginal {
    per_msg: f64,
    per_run: f64,
}

/// Counts `profile` at `PROFILE_MESSAGES` and at twice as many.
fn marginal(exe: &Path, profile: &str) -> Result<Marginal, String> {
    let short = count(exe, profile, PROFILE_MESSAGES)? as f64;
    let long = count(exe, profile, 2 * PROFILE_MESSAGES)? as f64;
    Ok(split(short, long, PROFILE_MESSAGES))
}

/// `short` counted over `messages`, `long` over twice as many.
fn split(short: f64, long: f64, messages: usize) -> Marginal {
    let per_msg = (long - short) / messages as f64;
    Marginal {
        per_msg,
        per_run: (short - per_msg * messages as f64).round(),
    }
}

/// The instructions `profile` runs inside `LocalSet::tick` over `messages`.
fn count(exe: &Path, profile: &str, messages: usize) -> Result<u64, String> {
    let out = std::env::temp_dir().join(format!(
        "pulsar-dispatcher-callgrind-{}-{profile}-{messages}.out",
        std::process::id()
    ));
    let status = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg("--toggle-collect=*LocalSet::tick*")
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
    totals(&text).ok_or_else(|| format!("no totals line in {}", out.display()))
}

/// The first event's figure on callgrind's `totals:` line (the events
/// counted while collection was on).
fn totals(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix("totals:"))
        .and_then(|figures| figures.split_whitespace().next())
        .and_then(|first| first.parse().ok())
}

/// The smoke run's check of the parsing (the bench has no test harness).
pub fn smoke() {
    let text = "events: Ir\nsummary: 28679099\nfn=(1)\n0 5\ntotals: 28679099\n";
    assert_eq!(totals(text), Some(28_679_099));
    assert_eq!(totals("events: Ir\n"), None);
    let Marginal { per_msg, per_run } = split(1_500.0, 2_500.0, 100);
    assert_eq!((per_msg, per_run), (10.0, 500.0));
}
