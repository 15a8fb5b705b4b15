//! Criterion suites for the dispatcher on the in-memory transport, with
//! no-op handlers, side by side with the `spawn_local` floor and the
//! multi-threaded port (`support/mt_port.rs`).
//!
//! `cargo bench --bench dispatch` runs them (HTML reports land in
//! `target/criterion/`); `cargo bench --bench dispatch -- latency` runs one
//! group. One criterion iteration is one message: the reported time is the
//! cost per message and the throughput is messages per second.
//!
//! Groups:
//! - `latency`: a message becoming available → its handler starting, on an
//!   idle dispatcher; the floor's is `spawn_local` → task start; and
//!   `ours_open_loop_50pct`: the mean lateness (handler start minus the
//!   message's due time) under open-loop arrivals at half of ours'
//!   saturation rate (the percentiles are in `report`).
//! - `scheduler`: the pure scheduler alone: pick the best of K full slots,
//!   return the permit, refill the slot.
//! - `throughput`: N messages through K = 1, 10, 100 subscriptions at
//!   concurrency C = 1, 20, 256, for ours, the floor (no subscriptions) and
//!   the multi-threaded port, and the plain receive-handle-ack loop.
//! - `scaling`: cost per message at 1, 10, 100, 1000 subscriptions spread over
//!   1 and over 16 priority levels (C = 20).

mod support;

use std::num::NonZeroUsize;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pulsar_dispatcher::scheduler::Scheduler;
use tokio::task::LocalSet;

use support::{mt_port, on_local, Workload};

fn latency(c: &mut Criterion) {
    let mut group = c.benchmark_group("latency");
    group.throughput(Throughput::Elements(1));
    let ours = support::OursLatency::new();
    group.bench_function("ours", |b| b.iter_custom(|iters| ours.measure(iters)));
    let runtime = support::current_thread();
    let local = LocalSet::new();
    group.bench_function("floor", |b| {
        b.iter_custom(|iters| support::floor_latency(&runtime, &local, iters))
    });
    let mt = mt_port::MtLatency::new();
    group.bench_function("mt_port", |b| b.iter_custom(|iters| mt.measure(iters)));
    drop(mt);
    let saturation = on_local(support::latency::ours_saturation(50_000));
    let interval = Duration::from_secs_f64(2.0 / saturation);
    group.bench_function("ours_open_loop_50pct", |b| {
        b.iter_custom(|iters| {
            let (lateness, _) = on_local(support::latency::ours_open_loop(
                interval,
                iters.max(1) as usize,
            ));
            Duration::from_nanos(lateness.iter().sum())
        })
    });
    group.finish();
}

fn scheduler(c: &mut Criterion) {
    let mut group = c.benchmark_group("scheduler");
    group.throughput(Throughput::Elements(1));
    for subscriptions in [1usize, 1000] {
        for levels in [1usize, 16] {
            let mut scheduler = Scheduler::new(NonZeroUsize::new(20).unwrap());
            let keys: Vec<_> = (0..subscriptions)
                .map(|i| scheduler.add_subscription((i % levels) as i64))
                .collect();
            for (index, key) in keys.iter().enumerate() {
                scheduler.try_insert(*key, index).unwrap();
            }
            let id = BenchmarkId::new(format!("levels{levels}"), subscriptions);
            group.bench_function(id, |b| {
                b.iter(|| {
                    let Some((permit, message)) = scheduler.try_dispatch() else {
                        unreachable!("every slot is full and a permit is free");
                    };
                    let key = permit.subscription();
                    scheduler.release(permit);
                    scheduler.try_insert(key, message).unwrap();
                })
            });
        }
    }
    group.finish();
}

fn throughput(c: &mut Criterion) {
    let mut group = c.benchmark_group("throughput");
    group.throughput(Throughput::Elements(1));
    let mt_runtime = mt_port::runtime();
    group.bench_function("plain_loop", |b| {
        b.iter_custom(|iters| on_local(support::plain_loop(iters as usize)))
    });
    for concurrency in [1usize, 20, 256] {
        group.bench_function(BenchmarkId::new("floor", format!("C{concurrency}")), |b| {
            b.iter_custom(|iters| on_local(support::floor(concurrency, iters as usize)))
        });
        for subscriptions in [1usize, 10, 100] {
            let parameter = format!("K{subscriptions}/C{concurrency}");
            let workload = Workload::new(subscriptions, concurrency, 0);
            group.bench_function(BenchmarkId::new("ours", &parameter), |b| {
                b.iter_custom(|iters| on_local(support::ours(workload.messages(iters as usize))))
            });
            group.bench_function(BenchmarkId::new("mt_port", &parameter), |b| {
                b.iter_custom(|iters| mt_port::run(&mt_runtime, workload.messages(iters as usize)))
            });
        }
    }
    group.finish();
}

fn scaling(c: &mut Criterion) {
    let mut group = c.benchmark_group("scaling");
    group.throughput(Throughput::Elements(1));
    for levels in [1usize, 16] {
        for subscriptions in [1usize, 10, 100, 1000] {
            let workload = Workload::new(subscriptions, 20, 0).levels(levels.min(subscriptions));
            let id = BenchmarkId::new(format!("levels{levels}"), subscriptions);
            group.bench_function(id, |b| {
                b.iter_custom(|iters| on_local(support::ours(workload.messages(iters as usize))))
            });
        }
    }
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = latency, scheduler, throughput, scaling
}
criterion_main!(benches);
