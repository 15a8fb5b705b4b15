//! Helpers shared by the integration tests (`mod common;` in each test file).
//!
//! The tests run against a real Apache Pulsar broker. `cargo xtask test`
//! starts one (or uses the one at `PULSAR_URL`) and sets the environment
//! variables read here. Tests never skip: without a broker they fail with a
//! message that says how to get one.
//!
//! Each test binary uses a subset of these helpers, hence the
//! `allow(dead_code)` on the module's items.
#![allow(dead_code)]

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::convert::Infallible;
use std::future::Future;
use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pulsar_dispatcher::{Dispatcher, Error, Message, SubType, SubscribeOptions};

pub const DEFAULT_PULSAR_URL: &str = "pulsar://127.0.0.1:6650";
pub const DEFAULT_WEB_URL: &str = "http://127.0.0.1:8080";

const HOW_TO_GET_A_BROKER: &str = "run the tests with `cargo xtask test` (starts a broker, runs \
     every test, stops it), or start one with `cargo xtask broker start`, or point PULSAR_URL / \
     PULSAR_WEB_URL at a running broker";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_string())
}

/// `host:port` of a `scheme://host:port/...` URL.
pub fn authority(url: &str) -> String {
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(url);
    rest.split('/').next().unwrap_or(rest).to_string()
}

/// The broker's service URL (`PULSAR_URL`, default `pulsar://127.0.0.1:6650`),
/// after checking once per test binary that the broker answers. Panics with
/// instructions when it does not.
pub fn pulsar_url() -> String {
    static CHECK: OnceLock<Result<(), String>> = OnceLock::new();
    let url = env_or("PULSAR_URL", DEFAULT_PULSAR_URL);
    if let Err(e) = CHECK.get_or_init(|| check_broker(&url)) {
        panic!("no Pulsar broker for the integration tests: {e}\n{HOW_TO_GET_A_BROKER}");
    }
    url
}

/// The broker's admin/web URL (`PULSAR_WEB_URL`, default `http://127.0.0.1:8080`),
/// without a trailing slash.
pub fn web_url() -> String {
    env_or("PULSAR_WEB_URL", DEFAULT_WEB_URL)
        .trim_end_matches('/')
        .to_string()
}

fn check_broker(service_url: &str) -> Result<(), String> {
    let service = authority(service_url);
    connect(&service, Duration::from_secs(3))
        .map_err(|e| format!("cannot connect to {service_url} (PULSAR_URL): {e}"))?;
    let (status, body) = admin_request("GET", "/admin/v2/brokers/health", None)
        .map_err(|e| format!("admin API at {} (PULSAR_WEB_URL): {e}", web_url()))?;
    if status != 200 {
        return Err(format!(
            "health check at {} answered HTTP {status}: {body}",
            web_url()
        ));
    }
    Ok(())
}

fn connect(authority: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    for addr in authority.to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// `METHOD {web_url}{path}` with an optional JSON body; returns the status
/// and the body, whatever the status.
pub fn admin_request(
    method: &str,
    path: &str,
    json_body: Option<&str>,
) -> Result<(u16, String), ureq::Error> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(15)))
        .build()
        .into();
    let url = format!("{}{path}", web_url());
    let mut response = match (method, json_body) {
        ("GET", _) => agent
            .get(&url)
            .header("Accept", "application/json")
            .call()?,
        ("DELETE", _) => agent.delete(&url).call()?,
        ("PUT" | "POST", body) => {
            let request = match method {
                "PUT" => agent.put(&url),
                _ => agent.post(&url),
            };
            match body {
                Some(body) => request
                    .header("Content-Type", "application/json")
                    .send(body)?,
                None => request.send_empty()?,
            }
        }
        _ => panic!("admin_request: unsupported {method}"),
    };
    let status = response.status().as_u16();
    let body = response.body_mut().read_to_string()?;
    Ok((status, body))
}

/// `GET {web_url}{path}`; returns status and body.
pub fn http_get(path: &str) -> Result<(u16, String), ureq::Error> {
    admin_request("GET", path, None)
}

/// A name no other test run has used: `<prefix>-<time>-<pid>-<counter>`.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{nanos:x}-{}-{n}", std::process::id())
}

/// A fresh topic: `persistent://public/default/<prefix>-<unique suffix>`.
pub fn unique_topic(prefix: &str) -> String {
    format!("persistent://public/default/{}", unique_name(prefix))
}

/// The admin API's path of a topic: `persistent/public/default/foo` for
/// `persistent://public/default/foo` or `foo`, `non-persistent/...` for a
/// non-persistent one.
fn topic_path(topic: &str) -> String {
    if let Some(rest) = topic.strip_prefix("non-persistent://") {
        return format!("non-persistent/{rest}");
    }
    match topic.strip_prefix("persistent://") {
        Some(rest) => format!("persistent/{rest}"),
        None if topic.contains('/') => format!("persistent/{topic}"),
        None => format!("persistent/public/default/{topic}"),
    }
}

/// The kind of topic a test runs on. Topics are created on first use as
/// non-partitioned ones; a partitioned topic is created through the admin
/// API first, as operators do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopicKind {
    Plain,
    Partitioned(u32),
}

impl TopicKind {
    /// The number of partitions, 0 for a plain topic.
    pub fn partitions(self) -> u32 {
        match self {
            TopicKind::Plain => 0,
            TopicKind::Partitioned(n) => n,
        }
    }
}

/// A fresh topic of `kind` (see [`unique_topic`]).
pub fn fresh_topic(prefix: &str, kind: TopicKind) -> String {
    let topic = unique_topic(prefix);
    if let TopicKind::Partitioned(partitions) = kind {
        create_partitioned_topic(&topic, partitions);
    }
    topic
}

/// Unloads `topic`, each partition of a partitioned one, through the admin
/// API, as the broker does when it moves a topic: its consumers reconnect
/// and are given every message not yet acknowledged again. Blocks; call it
/// from `spawn_blocking` inside a runtime.
pub fn unload(topic: &str, kind: TopicKind) {
    for name in partition_names(topic, kind) {
        let path = format!("/admin/v2/{}/unload", topic_path(&name));
        let (status, body) = admin_request("PUT", &path, None)
            .unwrap_or_else(|e| panic!("PUT {}{path}: {e}", web_url()));
        assert_eq!(status, 204, "unloading {name}: {body}");
    }
}

/// Deletes `topic` (a partitioned one with its partitions) through the
/// admin API with `force`, as an operator does while it is consumed: the
/// broker closes its consumers and producers first. Blocks; call it from
/// `spawn_blocking` inside a runtime.
pub fn delete_topic(topic: &str, kind: TopicKind) {
    let which = match kind {
        TopicKind::Plain => "",
        TopicKind::Partitioned(_) => "/partitions",
    };
    let path = format!("/admin/v2/{}{which}?force=true", topic_path(topic));
    let (status, body) = admin_request("DELETE", &path, None)
        .unwrap_or_else(|e| panic!("DELETE {}{path}: {e}", web_url()));
    assert_eq!(status, 204, "deleting {topic}: {body}");
}

/// How many consumers `subscription` has on each partition of `topic` (on
/// the topic itself if it is plain), as the broker reports them; 0 where
/// the topic or the subscription does not exist. Blocks.
pub fn consumers_per_partition(topic: &str, kind: TopicKind, subscription: &str) -> Vec<usize> {
    consumers_by_partition(topic, kind, subscription)
        .iter()
        .map(Vec::len)
        .collect()
}

/// The broker's stats of each consumer `subscription` has, per partition
/// of `topic` (the topic itself if it is plain); none where the topic or
/// the subscription does not exist. Blocks.
pub fn consumers_by_partition(
    topic: &str,
    kind: TopicKind,
    subscription: &str,
) -> Vec<Vec<serde_json::Value>> {
    partition_names(topic, kind)
        .iter()
        .map(|name| {
            let path = format!("/admin/v2/{}/stats", topic_path(name));
            let stats: serde_json::Value = match http_get(&path) {
                Ok((200, body)) => serde_json::from_str(&body).unwrap_or_default(),
                _ => serde_json::Value::Null,
            };
            stats["subscriptions"][subscription]["consumers"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect()
}

/// The topics that hold `topic`'s messages: its partitions, or itself.
fn partition_names(topic: &str, kind: TopicKind) -> Vec<String> {
    match kind {
        TopicKind::Plain => vec![topic.to_owned()],
        TopicKind::Partitioned(partitions) => (0..partitions)
            .map(|index| format!("{topic}-partition-{index}"))
            .collect(),
    }
}

/// Resets `subscription`'s cursor on `topic` (every partition of a
/// partitioned one) to the first message published at or after
/// `timestamp_millis`, through the admin API, as an operator does to replay:
/// the broker delivers everything from there again, acked or not. Blocks;
/// call it from `spawn_blocking` inside a runtime.
pub fn reset_cursor(topic: &str, subscription: &str, timestamp_millis: u64) {
    post_reset(topic, subscription, &format!("/{timestamp_millis}"), None);
}

/// Resets `subscription`'s cursor on `topic` (a plain topic, or one
/// partition by its own name) to the entry `ledger:entry`, through the admin
/// API: the broker delivers that entry and everything after it again. Blocks;
/// call it from `spawn_blocking` inside a runtime.
pub fn reset_cursor_to_entry(topic: &str, subscription: &str, ledger: u64, entry: u64) {
    let position = format!(r#"{{"ledgerId":{ledger},"entryId":{entry}}}"#);
    post_reset(topic, subscription, "", Some(&position));
}

/// Posts a cursor reset: to `resetcursor` followed by `suffix`, with `body`.
fn post_reset(topic: &str, subscription: &str, suffix: &str, body: Option<&str>) {
    let path = format!(
        "/admin/v2/{}/subscription/{subscription}/resetcursor{suffix}",
        topic_path(topic)
    );
    let (status, answer) = admin_request("POST", &path, body)
        .unwrap_or_else(|e| panic!("POST {}{path}: {e}", web_url()));
    assert_eq!(status, 204, "resetting {subscription} on {topic}: {answer}");
}

/// Creates the tenant and namespace of `namespace` (`tenant/namespace`) on
/// the standalone cluster through the admin API, unless they exist.
pub fn ensure_namespace(namespace: &str) {
    let (tenant, _) = namespace.split_once('/').expect("tenant/namespace");
    let creations = [
        (
            format!("/admin/v2/tenants/{tenant}"),
            Some(r#"{"allowedClusters":["standalone"]}"#),
        ),
        (format!("/admin/v2/namespaces/{namespace}"), None),
    ];
    for (path, body) in creations {
        let (status, answer) = admin_request("PUT", &path, body)
            .unwrap_or_else(|e| panic!("PUT {}{path}: {e}", web_url()));
        // 409: it exists already (an earlier run). Two tests creating it at
        // once can get a 500 ("version mismatch") for the second: it exists
        // then too.
        if status == 204 || status == 409 {
            continue;
        }
        let exists = get_until(&path, 50, |status, _| status == 200).is_ok();
        assert!(exists, "PUT {path}: HTTP {status}: {answer}");
    }
}

/// Creates `topic` with `partitions` partitions through the admin API.
pub fn create_partitioned_topic(topic: &str, partitions: u32) {
    set_partitions("PUT", topic, partitions);
}

/// Raises the number of partitions of the partitioned `topic` to
/// `partitions` through the admin API, as an operator does under load.
pub fn add_partitions(topic: &str, partitions: u32) {
    set_partitions("POST", topic, partitions);
}

/// `PUT` (create) or `POST` (raise) the partition count of `topic`.
fn set_partitions(method: &str, topic: &str, partitions: u32) {
    let path = format!("/admin/v2/{}/partitions", topic_path(topic));
    let (status, body) = admin_request(method, &path, Some(&partitions.to_string()))
        .unwrap_or_else(|e| panic!("{method} {}{path}: {e}", web_url()));
    assert!(
        (200..300).contains(&status),
        "{method} {partitions} partitions of {topic}: HTTP {status}: {body}"
    );
}

/// How many partitions the broker says `topic` has (0: not partitioned).
pub fn partition_count(topic: &str) -> u64 {
    let path = format!("/admin/v2/{}/partitions", topic_path(topic));
    let (status, body) = http_get(&path).unwrap_or_else(|e| panic!("GET {}{path}: {e}", web_url()));
    assert_eq!(status, 200, "GET {}{path}: {body}", web_url());
    let metadata: serde_json::Value = serde_json::from_str(&body).expect("partition metadata JSON");
    metadata["partitions"].as_u64().unwrap_or(0)
}

/// The base topic of a partition name (`t` for `t-partition-2`), or the
/// name itself.
pub fn base_topic(name: &str) -> &str {
    match name.rsplit_once("-partition-") {
        Some((base, index)) if index.parse::<u32>().is_ok() => base,
        _ => name,
    }
}

/// Whether `name` is `topic` itself or, for a partitioned topic, one of its
/// partitions.
pub fn is_topic_or_partition(name: &str, topic: &str, kind: TopicKind) -> bool {
    match kind {
        TopicKind::Plain => name == topic,
        TopicKind::Partitioned(_) => base_topic(name) == topic && name != topic,
    }
}

/// The topic's stats JSON from the admin API: `.../stats`, or for a
/// partitioned topic `.../partitioned-stats`, which adds its partitions up.
pub fn topic_stats(topic: &str) -> serde_json::Value {
    let which = if partition_count(topic) > 0 {
        "partitioned-stats"
    } else {
        "stats"
    };
    let path = format!("/admin/v2/{}/{which}", topic_path(topic));
    let (status, body) = http_get(&path).unwrap_or_else(|e| panic!("GET {}{path}: {e}", web_url()));
    assert_eq!(status, 200, "GET {}{path}: {body}", web_url());
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("stats of {topic} are not JSON: {e}"))
}

/// Runs each named test body (a `fn(TopicKind)`) on a plain topic and on a
/// topic of three partitions, as `<name>::plain` and `<name>::partitioned`.
#[macro_export]
macro_rules! on_plain_and_partitioned_topics {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn plain() {
                    super::$name($crate::common::TopicKind::Plain)
                }
                #[test]
                fn partitioned() {
                    super::$name($crate::common::TopicKind::Partitioned(3))
                }
            }
        )*
    };
}

/// Counters of one subscription, as the broker reports them.
#[derive(Clone, Debug)]
pub struct SubscriptionStats {
    /// Messages not yet acknowledged on the subscription (delivered or not).
    pub msg_backlog: u64,
    /// Messages the broker has dispatched to the subscription's consumers
    /// (redeliveries included).
    pub msg_out_counter: u64,
    /// Messages dispatched to consumers and not yet acknowledged.
    pub unacked_messages: u64,
    /// Consumers connected to the subscription.
    pub consumers: usize,
    /// The whole subscription object, for anything else.
    pub raw: serde_json::Value,
}

/// The stats of `subscription` on `topic` (full or short topic name).
/// Panics if the topic has no such subscription. A short blocking HTTP call;
/// see [`wait_for_stats`] for use from async code.
pub fn subscription_stats(topic: &str, subscription: &str) -> SubscriptionStats {
    let stats = topic_stats(topic);
    let sub = stats
        .get("subscriptions")
        .and_then(|s| s.get(subscription))
        .unwrap_or_else(|| {
            panic!(
                "topic {topic} has no subscription {subscription}; its subscriptions: {}",
                stats
                    .get("subscriptions")
                    .unwrap_or(&serde_json::Value::Null)
            )
        })
        .clone();
    let count = |field: &str| sub.get(field).and_then(|v| v.as_u64()).unwrap_or(0);
    SubscriptionStats {
        msg_backlog: count("msgBacklog"),
        msg_out_counter: count("msgOutCounter"),
        unacked_messages: count("unackedMessages"),
        consumers: sub
            .get("consumers")
            .and_then(|c| c.as_array())
            .map_or(0, |c| c.len()),
        raw: sub,
    }
}

/// Polls [`subscription_stats`] until `done` holds or `timeout` passes, and
/// returns the last stats either way (the caller asserts on them).
///
/// Async on purpose: between polls it sleeps with `tokio::time::sleep`, so the
/// `pulsar` crate's tasks on the same (current-thread) runtime keep running.
/// They must: an `ack().await` only queues the ack for the consumer's engine
/// task, and nothing reaches the broker while the thread is blocked. For the
/// same reason, do not call the blocking [`subscription_stats`] in a loop
/// from async code without yielding to the runtime in between.
pub async fn wait_for_stats(
    topic: &str,
    subscription: &str,
    timeout: Duration,
    done: impl Fn(&SubscriptionStats) -> bool,
) -> SubscriptionStats {
    let begun = Instant::now();
    loop {
        // Give the runtime's tasks (acks, flow permits) a turn first.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let stats = subscription_stats(topic, subscription);
        if done(&stats) || begun.elapsed() > timeout {
            return stats;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits up to 10 seconds for `subscription` on `topic` to have no backlog
/// (`msg_backlog == 0`: every message acknowledged) and returns the last
/// stats either way, so the caller still asserts on them. A shorthand for
/// the most common [`wait_for_stats`] call; like it, it yields to the
/// runtime between polls so the `pulsar` crate's tasks run and queued acks
/// reach the broker.
pub async fn wait_for_empty_backlog(topic: &str, subscription: &str) -> SubscriptionStats {
    wait_for_stats(topic, subscription, Duration::from_secs(10), |s| {
        s.msg_backlog == 0
    })
    .await
}

/// The Python interpreter of the test virtualenv (`PULSAR_DISPATCHER_PYTHON`,
/// set by `cargo xtask test`), which has `pulsar-client` installed.
pub fn python() -> PathBuf {
    match std::env::var_os("PULSAR_DISPATCHER_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => panic!(
            "PULSAR_DISPATCHER_PYTHON is not set: it must name a Python with pulsar-client==3.13.0 \
             installed. `cargo xtask test` creates target/pyenv and sets it; to run tests by hand, \
             run `cargo xtask test` once and then export \
             PULSAR_DISPATCHER_PYTHON=$PWD/target/pyenv/bin/python"
        ),
    }
}

/// Publishes `messages` (topic, payload, partition key) with Pulsar's
/// Java client, chunking each into pieces of at most `chunk_bytes`
/// (`tests/interop/ProduceChunked.java`; `PULSAR_DISPATCHER_JAVA` and
/// `PULSAR_DISPATCHER_JAVA_CLASSPATH`, set by `cargo xtask test`, name
/// Java and the broker's jars). Payloads are one line of text each.
pub async fn produce_chunked_with_java(
    chunk_bytes: usize,
    messages: Vec<(String, String, Option<String>)>,
) {
    produce_chunked_and_compressed_with_java(chunk_bytes, "NONE", messages).await
}

/// [`produce_chunked_with_java`], each message compressed with
/// `compression` (a Java `CompressionType`: `LZ4`, `ZLIB`, `ZSTD`,
/// `SNAPPY`) before it is chunked, as the Java client does.
pub async fn produce_chunked_and_compressed_with_java(
    chunk_bytes: usize,
    compression: &str,
    messages: Vec<(String, String, Option<String>)>,
) {
    let java = required_env("PULSAR_DISPATCHER_JAVA");
    let classpath = required_env("PULSAR_DISPATCHER_JAVA_CLASSPATH");
    let script = interop_script("ProduceChunked.java");
    let args = [
        pulsar_url(),
        chunk_bytes.to_string(),
        compression.to_owned(),
    ];
    let input: String = messages
        .iter()
        .map(|(topic, payload, key)| match key {
            Some(key) => format!("{topic}\t{payload}\t{key}\n"),
            None => format!("{topic}\t{payload}\n"),
        })
        .collect();
    let mut java_command = Command::new(java);
    java_command
        .arg("-cp")
        .arg(classpath)
        .arg(script)
        .args(args);
    run_peer(java_command, input).await;
}

fn required_env(name: &str) -> String {
    match std::env::var(name) {
        Ok(value) if !value.is_empty() => value,
        _ => panic!(
            "{name} is not set: `cargo xtask test` sets it; to run tests by hand, run \
             `cargo xtask test` once and export what it sets (see the README)"
        ),
    }
}

/// Path of a script under `tests/interop/`.
pub fn interop_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/interop")
        .join(name)
}

/// Milliseconds since the Unix epoch, the unit of Pulsar's event and
/// delivery times.
pub fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

/// Runs `fut` the way the library runs: on a tokio `current_thread` runtime
/// inside a `LocalSet`. Panics if it takes longer than `limit`, so that a
/// broken broker or client fails the test instead of hanging it.
pub fn run_local<F: Future>(limit: Duration, fut: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a current_thread runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        match tokio::time::timeout(limit, fut).await {
            Ok(out) => out,
            Err(_) => panic!("test did not finish within {limit:?}"),
        }
    })
}

/// A dispatcher on the test broker with the default options, in an `Rc`
/// so that [`start`] can run it while the test holds it.
pub async fn dispatcher() -> std::rc::Rc<pulsar_dispatcher::Dispatcher> {
    dispatcher_with(pulsar_dispatcher::Dispatcher::builder()).await
}

/// A dispatcher on the test broker, as `builder` says.
pub async fn dispatcher_with(
    builder: pulsar_dispatcher::DispatcherBuilder,
) -> std::rc::Rc<pulsar_dispatcher::Dispatcher> {
    let url = pulsar_url();
    let dispatcher = builder
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("connecting a dispatcher to {url}: {e}"));
    std::rc::Rc::new(dispatcher)
}

/// A `pulsar` client for the test broker on the current (tokio) runtime.
pub async fn client() -> pulsar::Pulsar<pulsar::TokioExecutor> {
    let url = pulsar_url();
    pulsar::Pulsar::builder(url.clone(), pulsar::TokioExecutor)
        .build()
        .await
        .unwrap_or_else(|e| panic!("connecting to {url}: {e}"))
}

/// Publishes `messages` to `topic` with the official Python client, batched
/// or not, each a JSON object as `tests/interop/produce.py` reads it (a
/// `payload`, optionally a `partition_key`, properties and so on); returns
/// the script's result.
pub async fn produce_with_python(
    topic: &str,
    messages: Vec<serde_json::Value>,
    batching: bool,
) -> serde_json::Value {
    let request = serde_json::json!({
        "service_url": pulsar_url(),
        "topic": topic,
        "batching": batching,
        "messages": messages,
    });
    run_interop("produce.py", request).await
}

/// Runs a script of tests/interop with the test virtualenv's Python, passing
/// `request` as JSON on stdin, and returns the JSON of its `RESULT` line.
pub async fn run_interop(script: &str, request: serde_json::Value) -> serde_json::Value {
    let mut python_command = Command::new(python());
    python_command.arg(interop_script(script));
    run_peer(python_command, request.to_string()).await
}

/// Runs an interop peer (`command`), writing `input` to its stdin, and
/// returns the JSON of its `RESULT` line; panics, with its output, if it
/// fails. Runs on tokio's blocking pool so the runtime's tasks keep
/// running.
async fn run_peer(mut command: Command, input: String) -> serde_json::Value {
    tokio::task::spawn_blocking(move || {
        let what = format!("{command:?}");
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("running {what}: {e}"));
        child
            .stdin
            .take()
            .expect("piped stdin")
            .write_all(input.as_bytes())
            .expect("writing the peer's input");
        let out = child.wait_with_output().expect("waiting for the peer");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{what} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        );
        let line = stdout
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("RESULT "))
            .unwrap_or_else(|| panic!("no RESULT line from {what}:\n{stdout}"));
        serde_json::from_str(line).expect("RESULT is JSON")
    })
    .await
    .expect("interop peer thread")
}

/// Publishes `messages` to `topic` and waits for the broker's receipts. A
/// send waits for room in the crate's outbound queue (100 sends) instead
/// of failing, as the dispatcher's own producers do.
pub async fn publish(topic: &str, messages: impl IntoIterator<Item = pulsar::producer::Message>) {
    publish_with(topic, pulsar::ProducerOptions::default(), messages).await
}

/// [`publish`] in batches of `batch_size` (the `pulsar` crate's batching); a
/// partial batch, such as a partition's last few messages, goes out after
/// 20 ms.
pub async fn publish_batched(
    topic: &str,
    batch_size: u32,
    messages: impl IntoIterator<Item = pulsar::producer::Message>,
) {
    let options = pulsar::ProducerOptions {
        batch_size: Some(batch_size),
        batch_timeout: Some(Duration::from_millis(20)),
        ..Default::default()
    };
    publish_with(topic, options, messages).await
}

/// [`publish`] with the producer's `options` (batching, compression).
pub async fn publish_with(
    topic: &str,
    options: pulsar::ProducerOptions,
    messages: impl IntoIterator<Item = pulsar::producer::Message>,
) {
    let client = client().await;
    let mut producer = client
        .producer()
        .with_topic(topic)
        .with_options(pulsar::ProducerOptions {
            block_queue_if_full: true,
            ..options
        })
        .build()
        .await
        .expect("producer");
    let mut receipts = Vec::new();
    for message in messages {
        receipts.push(producer.send_non_blocking(message).await.expect("send"));
    }
    for receipt in receipts {
        receipt.await.expect("receipt");
    }
}

/// `count` messages with payload `<n>` and partition key `key-<n % keys>`.
pub fn keyed_messages(
    count: usize,
    keys: usize,
) -> impl Iterator<Item = pulsar::producer::Message> {
    (0..count).map(move |n| pulsar::producer::Message {
        payload: n.to_string().into_bytes(),
        partition_key: Some(format!("key-{}", n % keys)),
        ..Default::default()
    })
}

/// The number a message of [`keyed_messages`] carries.
pub fn payload_number(message: &pulsar_dispatcher::Message) -> usize {
    String::from_utf8_lossy(message.payload())
        .parse()
        .expect("a numbered payload")
}

/// Runs `dispatcher` in a task of its own on the current `LocalSet`.
pub fn start(
    dispatcher: &std::rc::Rc<pulsar_dispatcher::Dispatcher>,
) -> tokio::task::JoinHandle<Result<(), pulsar_dispatcher::Error>> {
    let runner = dispatcher.clone();
    tokio::task::spawn_local(async move { runner.run().await })
}

/// Closes `dispatcher` and waits for its `run` task (from [`start`]),
/// panicking unless the task finished and `run` returned `Ok`. The usual end
/// of a test: a dispatcher that shuts down with an error, or whose run task
/// panicked, fails the test with a message that names the error.
pub async fn close_and_join(
    dispatcher: &pulsar_dispatcher::Dispatcher,
    run: tokio::task::JoinHandle<Result<(), pulsar_dispatcher::Error>>,
) {
    dispatcher.close().await;
    match run.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("the dispatcher's run ended with an error after close: {e} ({e:?})"),
        Err(e) => panic!("the dispatcher's run task did not finish: {e}"),
    }
}

/// Waits, yielding to the runtime, until `done` holds; panics after `limit`.
pub async fn wait_until(what: &str, limit: Duration, done: impl Fn() -> bool) {
    let begun = Instant::now();
    while !done() {
        assert!(begun.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `options` with the crate's consumer options set to start a new
/// subscription at the earliest message, so it takes a backlog published
/// before it existed.
pub fn from_the_start(
    options: pulsar_dispatcher::SubscribeOptions,
) -> pulsar_dispatcher::SubscribeOptions {
    options.consumer_options(
        pulsar::ConsumerOptions::default()
            .with_initial_position(pulsar::consumer::InitialPosition::Earliest),
    )
}

/// A `pulsar` crate consumer of `topic` on the Shared `subscription`,
/// starting at the earliest message, with a receiver queue of `queue`,
/// which the crate also needs as its flow-permit batch size to really bound
/// what it prefetches.
pub async fn shared_consumer(
    client: &pulsar::Pulsar<pulsar::TokioExecutor>,
    topic: &str,
    subscription: &str,
    queue: u32,
) -> pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor> {
    client
        .consumer()
        .with_topic(topic)
        .with_subscription(subscription)
        .with_subscription_type(pulsar::SubType::Shared)
        .with_batch_size(queue)
        .with_options(
            pulsar::ConsumerOptions::default()
                .with_receiver_queue_size(queue)
                .with_initial_position(pulsar::consumer::InitialPosition::Earliest),
        )
        .build()
        .await
        .unwrap_or_else(|e| panic!("subscribing {subscription} to {topic}: {e}"))
}

/// Ten messages on a fresh topic, delivered to a dispatcher with one permit
/// and a consumer queue with room for them all: the first is held in its
/// handler until [`release`](Self::release), the second waits in the
/// subscription's slot, the rest in the consumer's queue. Each handler
/// takes at least 20 ms, so that no two acks are made in one turn of the
/// runtime (in which the `pulsar` crate's tasks could not run between them).
pub struct HeldBacklog {
    pub topic: String,
    pub subscription: String,
    pub dispatcher: Rc<Dispatcher>,
    run: tokio::task::JoinHandle<Result<(), Error>>,
    /// The payload number of each message handled, in order.
    pub handled: Rc<RefCell<Vec<usize>>>,
    released: Rc<Cell<bool>>,
}

impl HeldBacklog {
    /// Subscribes with `subscription_type` to a fresh `kind` topic named
    /// after `prefix`, runs, publishes, and returns once the first message
    /// is held.
    pub async fn start(prefix: &str, kind: TopicKind, subscription_type: SubType) -> Self {
        let topic = fresh_topic(prefix, kind);
        let subscription = unique_name("sub");
        let dispatcher = dispatcher_with(Dispatcher::builder().concurrency(1)).await;
        let handled: Rc<RefCell<Vec<usize>>> = Rc::default();
        let released = Rc::new(Cell::new(false));
        let handler = {
            let (handled, released) = (handled.clone(), released.clone());
            async move |message: &Message| {
                handled.borrow_mut().push(payload_number(message));
                loop {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    if released.get() {
                        break;
                    }
                }
                Ok::<_, Infallible>(())
            }
        };
        let options = SubscribeOptions::new()
            .subscription(&subscription)
            .subscription_type(subscription_type)
            .receiver_queue_size(100);
        dispatcher
            .subscribe(&topic, handler, options)
            .await
            .unwrap();
        let run = start(&dispatcher);
        publish(&topic, keyed_messages(10, 3)).await;
        wait_until(
            &format!("{topic}: the first message"),
            Duration::from_secs(20),
            || handled.borrow().len() == 1,
        )
        .await;
        HeldBacklog {
            topic,
            subscription,
            dispatcher,
            run,
            handled,
            released,
        }
    }

    /// The consumers of a held backlog taken away and refused, on plain
    /// and partitioned topics, Exclusive and Shared: for each, holds a
    /// backlog (see [`start`](Self::start)), allows only another
    /// subscription type on the topic, and runs `take_away(topic, kind)`,
    /// which is to leave the `pulsar` crate's consumers trying to subscribe
    /// again and refused. Then lets the handlers go, waits until the
    /// refusal reaches the dispatcher (a receive error), allows every type
    /// again, waits for the backlog to empty and for a message whose ack
    /// was lost to come back, and asserts each message was handled once.
    /// Returns each case's name and the dispatcher's totals at the end.
    pub async fn through_a_refusal(
        prefix: &str,
        take_away: impl AsyncFn(String, TopicKind),
    ) -> Vec<(String, pulsar_dispatcher::SubscriptionStats)> {
        let mut totals = Vec::new();
        for (kind, subscription_type, other_type) in [
            (TopicKind::Plain, SubType::Exclusive, "Shared"),
            (TopicKind::Plain, SubType::Shared, "Exclusive"),
            (TopicKind::Partitioned(2), SubType::Exclusive, "Shared"),
            (TopicKind::Partitioned(2), SubType::Shared, "Exclusive"),
        ] {
            let case = format!("{kind:?}, {subscription_type:?}");
            let held = HeldBacklog::start(prefix, kind, subscription_type).await;
            let HeldBacklog {
                topic,
                subscription,
                dispatcher,
                ..
            } = &held;
            let allow = |types: Vec<&'static str>| {
                let topic = topic.clone();
                tokio::task::spawn_blocking(move || allow_subscription_types(&topic, &types))
            };
            allow(vec![other_type]).await.unwrap();
            take_away(topic.clone(), kind).await;
            held.release();
            wait_until(
                &format!("{case}: the refusal"),
                Duration::from_secs(20),
                || dispatcher.stats().total().receive_errors > 0,
            )
            .await;
            allow(vec!["Exclusive", "Shared", "Failover", "Key_Shared"])
                .await
                .unwrap();
            let stats = wait_for_stats(topic, subscription, Duration::from_secs(30), |stats| {
                stats.msg_backlog == 0
            })
            .await;
            assert_eq!(stats.msg_backlog, 0, "{case}: every message acked");
            // Time for a message whose ack was lost to come back.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let total = dispatcher.stats().total();
            held.close_each_handled_once(&case).await;
            totals.push((case, total));
        }
        totals
    }

    /// Lets the held handler, and every one after it, finish.
    pub fn release(&self) {
        self.released.set(true);
    }

    /// Closes the dispatcher and asserts each of the ten messages was
    /// handled exactly once.
    pub async fn close_each_handled_once(self, case: &str) {
        close_and_join(&self.dispatcher, self.run).await;
        let mut handled = self.handled.take();
        handled.sort_unstable();
        assert_eq!(handled, (0..10).collect::<Vec<_>>(), "{case}: each once");
    }
}

/// Allows only `types` of subscription on `topic` (a topic policy), as an
/// operator does through the admin API, and waits until the broker answers
/// with it: topic policies travel through a system topic to the broker's
/// cache, which both that answer and a subscribe read; the broker refuses
/// the other types to consumers that subscribe from then on. Blocks; call
/// it from `spawn_blocking`.
pub fn allow_subscription_types(topic: &str, types: &[&str]) {
    let path = format!("/admin/v2/{}/subscriptionTypesEnabled", topic_path(topic));
    let body = serde_json::to_string(types).unwrap();
    let (status, answer) = admin_request("POST", &path, Some(&body)).unwrap();
    assert!(
        (200..300).contains(&status),
        "POST {path}: HTTP {status}: {answer}"
    );
    let wanted: BTreeSet<&str> = types.iter().copied().collect();
    let applied = get_until(&path, 300, |status, answer| {
        let applied: Vec<String> = serde_json::from_str(answer).unwrap_or_default();
        status == 200 && applied.iter().map(String::as_str).collect::<BTreeSet<_>>() == wanted
    });
    if let Err(last) = applied {
        panic!("the broker still answers {last} for {path}, not {types:?}");
    }
}

/// GETs `path` up to `attempts` times, 100 ms apart, until `done` holds of
/// the answer (status, body); `Err` with the last answer (or error) if it
/// never does. Blocks.
fn get_until(path: &str, attempts: u32, done: impl Fn(u16, &str) -> bool) -> Result<(), String> {
    let mut last = String::new();
    for attempt in 0..attempts {
        if attempt > 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
        match http_get(path) {
            Ok((status, answer)) if done(status, &answer) => return Ok(()),
            Ok((status, answer)) => last = format!("HTTP {status}: {answer}"),
            Err(error) => last = format!("GET failed: {error}"),
        }
    }
    Err(last)
}
