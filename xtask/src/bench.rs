//! `cargo xtask bench [--quick] [--criterion]`: the whole comparison in one
//! go.
//!
//! Installs what is missing (protoc, valgrind, the Python virtualenv with
//! the Python original), starts a broker unless one answers, and runs the comparison
//! bench (`cargo bench --bench report`), which measures ours against the
//! `spawn_local` floor, a plain receive-handle-ack loop, the multi-threaded
//! port and the Python original in memory (CPU and wall time per message,
//! open-loop latency, priority inversions, one dispatcher per core) and on
//! the broker (client CPU, rate, allocations and latency against a plain
//! `pulsar` loop and the Python original), prints a table of the targets
//! and writes `target/bench-report.json`. With `--criterion` it then runs,
//! if the comparison succeeded, the criterion suites (`cargo bench --bench
//! dispatch`), whose HTML reports land in
//! `target/criterion/`. Stops the broker if it started one.

use std::time::Instant;

use crate::broker::{self, BrokerAddr};
use crate::{cargo, info, run_status, run_with_deadline, setup, Paths, BENCH_DEADLINE};

pub fn cmd_bench(paths: &Paths, args: &[String]) -> Result<(), String> {
    let mut quick = false;
    let mut criterion = false;
    for arg in args {
        match arg.as_str() {
            "--quick" => quick = true,
            "--criterion" => criterion = true,
            other => {
                return Err(format!(
                    "unknown option `{other}` for bench (expected --quick, --criterion)"
                ))
            }
        }
    }
    let begun = Instant::now();
    setup::ensure_protoc()?;
    // Without it the report leaves its instruction counts out, which is
    // no reason to stop the rest.
    if let Err(missing) = setup::ensure_valgrind() {
        info(&format!("no instruction counts in the report: {missing}"));
    }
    let python = setup::ensure_python_env(paths)?;
    let addr = BrokerAddr::from_env()?;
    // Dropping `started` stops the broker, on every way out of this function.
    let started = broker::ensure_running(paths, &addr)?;
    let report = paths.target.join("bench-report.json");

    let mut run = cargo();
    run.args(["bench", "--bench", "report", "--", "--out"])
        .arg(&report);
    if quick {
        run.arg("--quick");
    }
    run.current_dir(&paths.root)
        .env("PULSAR_URL", &addr.service_url)
        .env("PULSAR_WEB_URL", &addr.web_url)
        .env("PULSAR_DISPATCHER_PYTHON", &python);
    info(&format!(
        "running the comparison{} (build, in-memory runs, broker runs)",
        if quick { " with fewer samples" } else { "" }
    ));
    let mut failures = Vec::new();
    match run_with_deadline(&mut run, BENCH_DEADLINE) {
        Ok(status) if status.success() => {}
        Ok(_) => failures.push("cargo bench --bench report".to_string()),
        Err(e) => failures.push(e),
    }

    if criterion && failures.is_empty() {
        let mut suites = cargo();
        suites
            .args(["bench", "--bench", "dispatch"])
            .current_dir(&paths.root);
        if quick {
            suites.args(["--", "--quick"]);
        }
        info("running the criterion suites (reports in target/criterion/report/index.html)");
        if !run_status(&mut suites)?.success() {
            failures.push("cargo bench --bench dispatch".to_string());
        }
    }

    if let Some(started) = started {
        started.stop()?;
    }
    info(&format!(
        "bench finished in {:.0} s",
        begun.elapsed().as_secs_f64()
    ));
    if failures.is_empty() {
        info(&format!("report: {}", report.display()));
        Ok(())
    } else {
        Err(format!("failed: {}", failures.join("; ")))
    }
}
