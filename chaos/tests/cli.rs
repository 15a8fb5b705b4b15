//! The `chaos` binary's command line and its outcome mix, without a broker.
//!
//! Also what makes `cargo test --workspace --all-targets` build the binary
//! (`target/debug/chaos`) that `cargo xtask test` runs its quick
//! fault-injection suite with, so that suite compiles nothing of its own.

use std::collections::HashMap;
use std::process::Command;

fn chaos(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args(args)
        .output()
        .expect("running the chaos binary")
}

fn mix(name: &str, count: u64) -> HashMap<String, u64> {
    let out = chaos(&["mix", "--count", &count.to_string(), "--mix", name]);
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|line| {
            let (outcome, n) = line.split_once(' ').unwrap();
            (outcome.to_owned(), n.parse().unwrap())
        })
        .collect()
}

#[test]
fn the_standard_mix_has_the_advertised_shares() {
    let counts = mix("standard", 100_000);
    let share = |outcome: &str| counts[outcome] as f64 / 1000.0;
    // Percentages, within half a point.
    for (outcome, percent) in [
        ("ok", 86.0),
        ("fatal", 2.0),
        ("panic-once", 2.0),
        ("retry-ok", 5.0),
        ("retry-dlq", 5.0),
        ("hang-once", 0.0),
    ] {
        assert!(
            (share(outcome) - percent).abs() < 0.5,
            "{outcome}: {}% (expected about {percent}%)",
            share(outcome)
        );
    }
    assert_eq!(counts.values().sum::<u64>(), 100_000);
}

#[test]
fn the_hang_mix_adds_hung_handlers_and_ok_is_all_fine() {
    let hang = mix("hang", 100_000);
    let percent = hang["hang-once"] as f64 / 1000.0;
    assert!((percent - 3.0).abs() < 0.5, "hang-once: {percent}%");
    let ok = mix("ok", 1000);
    assert_eq!(ok["ok"], 1000);
}

#[test]
fn the_mix_is_the_same_on_every_call() {
    assert_eq!(mix("standard", 5000), mix("standard", 5000));
}

#[test]
fn bad_command_lines_are_refused_with_usage() {
    for args in [&[][..], &["produce", "--count"][..], &["work", "stray"][..]] {
        let out = chaos(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("usage: chaos"),
            "{args:?}: {out:?}"
        );
    }
    let out = chaos(&["mix", "--count", "many"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--count: bad value"));
    let out = chaos(&["explode"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown command"));
}
