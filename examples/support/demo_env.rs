//! What the runnable examples share when `cargo xtask demo` runs them:
//! where their logs go, a clean start on their subscriptions, and producers
//! for the traffic they publish.

use std::time::Duration;

/// Logs to the file `DEMO_LOG` names, or to stderr; never into stdout,
/// where the examples print their tables. `default_filter` applies unless
/// `RUST_LOG` says otherwise.
pub fn init_logging(default_filter: &str) -> std::io::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter);
    match std::env::var_os("DEMO_LOG") {
        Some(path) => logs
            .with_ansi(false)
            .with_writer(std::sync::Mutex::new(std::fs::File::create(path)?))
            .init(),
        None => logs.with_writer(std::io::stderr).init(),
    }
    Ok(())
}

/// For a demo run only: skips whatever an interrupted earlier run left on
/// each `(topic, subscription)` of `public/default`, so that what the
/// example prints is this run's traffic (through the broker's admin API at
/// `PULSAR_WEB_URL`, default `http://127.0.0.1:8080`; a subscription that
/// does not exist yet is fine).
pub fn skip_leftovers<'a>(subscriptions: impl IntoIterator<Item = (&'a str, &'a str)>) {
    let web = std::env::var("PULSAR_WEB_URL").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(15)))
        .build()
        .into();
    for (topic, subscription) in subscriptions {
        let url = format!(
            "{}/admin/v2/persistent/public/default/{topic}/subscription/{subscription}/skip_all",
            web.trim_end_matches('/')
        );
        match agent.post(&url).send_empty() {
            Ok(response) if response.status().is_success() || response.status() == 404 => {}
            Ok(response) => eprintln!("POST {url}: HTTP {}", response.status()),
            Err(error) => eprintln!("POST {url}: {error}"),
        }
    }
}

/// A producer of `client` for each of `topics`, in order. Each waits for
/// room in the client's queue (100 sends per connection) instead of
/// failing, so an example may queue all its sends before it awaits a
/// receipt.
pub async fn producers<'a>(
    client: &pulsar::Pulsar<pulsar::TokioExecutor>,
    topics: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<pulsar::Producer<pulsar::TokioExecutor>>, pulsar::Error> {
    let mut producers = Vec::new();
    for topic in topics {
        let options = pulsar::ProducerOptions {
            block_queue_if_full: true,
            ..Default::default()
        };
        let producer = client.producer().with_topic(topic).with_options(options);
        producers.push(producer.build().await?);
    }
    Ok(producers)
}
