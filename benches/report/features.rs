//! The figures of the scheduling policies and of observability, measured
//! in memory: what one pick costs under each policy, how closely weighted
//! shares follow their weights, how long the lowest level waits under
//! aging, what per-key ordering costs, and what a Prometheus recorder or a
//! `tracing` subscriber at `info` adds to dispatch.

use std::time::Duration;

use metrics_exporter_prometheus::PrometheusBuilder;
use pulsar_dispatcher::{Aging, Ordering as MessageOrdering, SchedulingPolicy};
use serde_json::{json, Map, Value};
use tracing::level_filters::LevelFilter;

use super::support::scheduling::{self, AgingSetup, Picks};
use super::support::{self, on_local, Workload};
use super::{allocations, clock_ns, emit, insert, median, ns_per_msg};

/// The weights of the weighted runs, for levels 0, 1, 2, 3.
const WEIGHTS: [u32; 4] = [8, 4, 2, 1];

/// How many distinct keys the keyed runs use.
const KEYS: usize = 64;

/// How large the runs of this section are.
pub struct Sizes {
    pub repeats: usize,
    /// Picks per pure-scheduler run.
    pub picks: usize,
    /// Handler starts counted in the weighted run through the dispatcher.
    pub share_window: usize,
    /// How long the aging run lasts.
    pub aging_run: Duration,
    /// Messages per dispatch run (ordering, metrics, tracing).
    pub messages: usize,
}

fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// The three policies at comparable settings: four levels weighted 8:4:2:1,
/// or aged one point per 10 ms up to three points.
fn policies() -> [(&'static str, SchedulingPolicy); 3] {
    [
        ("strict", SchedulingPolicy::Strict),
        (
            "weighted",
            SchedulingPolicy::Weighted(scheduling::weights(&WEIGHTS)),
        ),
        ("aging", SchedulingPolicy::Aging(Aging::new(100.0, 3))),
    ]
}

fn pick_setup(policy: SchedulingPolicy) -> Picks {
    Picks {
        policy,
        levels: WEIGHTS.len(),
        subscriptions: 16,
        concurrency: 20,
    }
}

/// The aging run: four saturating subscriptions at priority 0, one at
/// priority 10 whose message outranks them after 20 ms of waiting (a tie
/// goes to the better priority, so the largest boost is one point more
/// than the gap), at concurrency 4, handlers busy for 100 µs.
fn aging_setup(run_for: Duration) -> AgingSetup {
    let bound = Duration::from_millis(20);
    let low_priority = 10;
    let max_boost = low_priority + 1;
    AgingSetup {
        aging: Aging::new(max_boost as f64 / bound.as_secs_f64(), max_boost),
        low_priority,
        high_subscriptions: 4,
        concurrency: 4,
        handler_time: Duration::from_micros(100),
        run_for,
    }
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// Ours at K=1, C=20 on `messages`, in ns per message.
fn dispatch_ns(workload: Workload) -> f64 {
    ns_per_msg(on_local(support::ours(workload)), workload.messages)
}

/// Ours with a Prometheus recorder installed on this thread for the run
/// (the recorder is built, not exported: rendering is the scraper's cost).
pub fn with_prometheus<T>(run: impl FnOnce() -> T) -> T {
    let recorder = PrometheusBuilder::new().build_recorder();
    let _installed = metrics::set_default_local_recorder(&recorder);
    run()
}

/// Ours with a `fmt` subscriber at `info`, writing to a sink, installed on
/// this thread for the run.
pub fn with_info_subscriber<T>(run: impl FnOnce() -> T) -> T {
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(LevelFilter::INFO)
        .with_writer(std::io::sink)
        .finish();
    tracing::subscriber::with_default(subscriber, run)
}

pub fn run(sizes: &Sizes, report: &mut Map<String, Value>) {
    picks(sizes, report);
    weighted_shares(sizes, report);
    aging(sizes, report);
    overheads(sizes, report);
}

/// The cost of one pick (release, dispatch, refill) on the pure scheduler
/// under each policy, the policies in turn in each round; and the weighted
/// shares the pure scheduler gives.
fn picks(sizes: &Sizes, report: &mut Map<String, Value>) {
    eprintln!("scheduler: one pick under each policy (16 subscriptions, 4 levels, C=20)");
    let policies = policies();
    let mut samples = vec![Vec::new(); policies.len()];
    for (_, policy) in &policies {
        scheduling::picks(&pick_setup(policy.clone()), sizes.picks / 10, monotonic_ns);
    }
    let mut shares = Vec::new();
    for _ in 0..sizes.repeats {
        for (at, (name, policy)) in policies.iter().enumerate() {
            let run = scheduling::picks(&pick_setup(policy.clone()), sizes.picks, monotonic_ns);
            samples[at].push(run.per_pick);
            if *name == "weighted" {
                shares.push(scheduling::share_error(&run.by_level, &WEIGHTS));
            }
        }
    }
    for ((name, _), samples) in policies.iter().zip(samples) {
        let ns = median(samples);
        emit(json!({"bench": "pick", "policy": name, "picks": sizes.picks, "ns_per_pick": ns}));
        insert(report, &format!("pick_ns_{name}"), ns);
    }
    let error = shares.into_iter().fold(0.0, f64::max);
    insert(report, "weighted_share_max_error_scheduler", error);
}

/// Weighted shares through the dispatcher at saturation.
fn weighted_shares(sizes: &Sizes, report: &mut Map<String, Value>) {
    eprintln!("in memory: weighted shares 8:4:2:1 through the dispatcher at saturation (C=20)");
    let run = on_local(scheduling::weighted_shares(
        &WEIGHTS,
        20,
        sizes.share_window,
    ));
    let error = scheduling::share_error(&run.by_level, &WEIGHTS);
    emit(
        json!({"bench": "weighted_shares", "weights": WEIGHTS, "window": sizes.share_window,
                "by_level": run.by_level, "saturated": run.saturated, "max_error": error}),
    );
    insert(report, "weighted_share_max_error", error);
    insert(report, "weighted_share_saturated", run.saturated);
}

/// The lowest level's longest wait under aging while a better level
/// saturates the dispatcher.
fn aging(sizes: &Sizes, report: &mut Map<String, Value>) {
    eprintln!("in memory: the lowest level's longest wait under aging (bound 20 ms, C=4)");
    let setup = aging_setup(sizes.aging_run);
    let bound = setup.aging.bound().expect("aging with a rate");
    let run = on_local(scheduling::aging_wait(setup));
    emit(
        json!({"bench": "aging", "bound_ms": ms(bound), "run_ms": ms(sizes.aging_run),
                "max_wait_ms": ms(run.max_wait), "p50_wait_ms": ms(run.p50_wait),
                "max_gap_ms": ms(run.max_gap), "low_dispatched": run.low_dispatched,
                "high_dispatched": run.high_dispatched, "saturated": run.saturated}),
    );
    insert(report, "aging_lowest_max_wait_ms", ms(run.max_wait));
    insert(report, "aging_lowest_p50_wait_ms", ms(run.p50_wait));
    insert(report, "aging_lowest_max_gap_ms", ms(run.max_gap));
    insert(report, "aging_bound_ms", ms(bound));
    insert(report, "aging_saturated", run.saturated);
}

/// Key ordering, a Prometheus recorder and an `info` subscriber against
/// plain dispatch, each variant once per round so that drift hits them
/// alike.
fn overheads(sizes: &Sizes, report: &mut Map<String, Value>) {
    eprintln!(
        "in memory: key ordering ({KEYS} keys), a Prometheus recorder, an info subscriber (K=1, C=20)"
    );
    let plain = Workload::new(1, 20, sizes.messages);
    let unordered = plain.keyed(KEYS, MessageOrdering::Unordered);
    let ordered = plain.keyed(KEYS, MessageOrdering::Key);
    let variants: [(&str, &dyn Fn() -> f64); 5] = [
        ("plain", &|| dispatch_ns(plain)),
        ("keyed_unordered", &|| dispatch_ns(unordered)),
        ("keyed_ordered", &|| dispatch_ns(ordered)),
        ("prometheus", &|| with_prometheus(|| dispatch_ns(plain))),
        ("info_subscriber", &|| {
            with_info_subscriber(|| dispatch_ns(plain))
        }),
    ];
    for (_, measure) in &variants {
        measure();
    }
    let mut samples = vec![Vec::new(); variants.len()];
    for _ in 0..sizes.repeats {
        for (at, (_, measure)) in variants.iter().enumerate() {
            samples[at].push(measure());
        }
    }
    let mut detail = Map::new();
    for ((name, _), samples) in variants.iter().zip(samples) {
        let ns = median(samples);
        emit(
            json!({"bench": "variant", "variant": name, "messages": sizes.messages,
                    "ns_per_msg": ns}),
        );
        detail.insert((*name).to_owned(), json!(ns));
    }
    let of = |name: &str| detail[name].as_f64().expect("a figure");
    insert(report, "key_ordering_ns_per_msg", of("keyed_ordered"));
    insert(
        report,
        "key_ordering_vs_unordered",
        of("keyed_ordered") / of("keyed_unordered"),
    );
    insert(report, "metrics_overhead", of("prometheus") / of("plain"));
    insert(
        report,
        "tracing_overhead",
        of("info_subscriber") / of("plain"),
    );
    insert(report, "variants_ns_per_msg", Value::Object(detail));
    let warmup = sizes.messages / 10;
    let allocs = with_prometheus(|| {
        on_local(support::ours_counted(plain, warmup, Some(allocations))).allocs_per_msg
    });
    insert(report, "metrics_allocs_per_msg", allocs.expect("counted"));
    let allocs = on_local(support::ours_counted(ordered, warmup, Some(allocations)))
        .allocs_per_msg
        .expect("counted");
    insert(report, "key_ordering_allocs_per_msg", allocs);
    let allocs = on_local(support::ours_counted(unordered, warmup, Some(allocations)))
        .allocs_per_msg
        .expect("counted");
    insert(report, "keyed_unordered_allocs_per_msg", allocs);
}

/// Each run of this section on a handful of messages, checking what holds
/// whatever the machine: every policy picks, weighted shares follow the
/// weights on the pure scheduler, the lowest level is served under aging,
/// and neither key ordering nor a recorder allocates per message.
pub fn smoke() {
    for (name, policy) in policies() {
        let run = scheduling::picks(&pick_setup(policy), 1_500, monotonic_ns);
        assert_eq!(run.by_level.iter().sum::<u64>(), 1_500, "{name}");
        if name == "weighted" {
            let error = scheduling::share_error(&run.by_level, &WEIGHTS);
            assert!(error < 0.02, "weighted shares {:?}", run.by_level);
        }
        if name == "strict" {
            assert_eq!(run.by_level[1..], [0, 0, 0], "strict serves level 0 only");
        }
    }
    let shares = on_local(scheduling::weighted_shares(&WEIGHTS, 4, 600));
    assert!(shares.saturated, "every level had work throughout");
    assert!(
        shares.by_level.iter().all(|&count| count > 0),
        "every weighted level is served: {:?}",
        shares.by_level
    );
    let aged = on_local(scheduling::aging_wait(aging_setup(Duration::from_millis(
        200,
    ))));
    assert!(aged.saturated, "both levels had work throughout");
    assert!(aged.low_dispatched > 0, "aging serves the lowest level");
    // The in-memory transport copies each keyed message (its key too) for
    // redelivery, so keyed runs allocate once per message whatever the
    // ordering; key ordering itself must add nothing.
    let keyed_allocs = |ordering| {
        let keyed = Workload::new(1, 20, 5_000).keyed(KEYS, ordering);
        on_local(support::ours_counted(keyed, 2_500, Some(allocations)))
            .allocs_per_msg
            .expect("counted")
    };
    let (ordered, unordered) = (
        keyed_allocs(MessageOrdering::Key),
        keyed_allocs(MessageOrdering::Unordered),
    );
    assert!(
        ordered < unordered + 0.01,
        "key ordering allocates per message: {ordered} against {unordered} unordered"
    );
    let counted = with_prometheus(|| {
        on_local(support::ours_counted(
            Workload::new(1, 20, 5_000),
            2_500,
            Some(allocations),
        ))
    });
    assert!(
        counted.allocs_per_msg.expect("counted") < 0.01,
        "a recorder makes dispatch allocate per message: {:?}",
        counted.allocs_per_msg
    );
    assert!(with_info_subscriber(|| dispatch_ns(Workload::new(2, 4, 200))) > 0.0);
}
