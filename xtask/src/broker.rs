//! Runs an Apache Pulsar standalone broker from the jars that Maven resolves
//! for `tests/broker/pom.xml`, and checks that a broker really answers.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::http::{self, Endpoint};
use crate::{info, run_status, Paths};

pub const DEFAULT_SERVICE_URL: &str = "pulsar://127.0.0.1:6650";
const DEFAULT_WEB_PORT: u16 = 8080;
const DEFAULT_START_TIMEOUT_SECS: u64 = 180;
const STOP_GRACE: Duration = Duration::from_secs(30);
const MAIN_CLASS: &str = "org.apache.pulsar.PulsarStandaloneStarter";
/// Topic used only to ask the broker for a lookup; never produced to.
const PROBE_TOPIC: &str = "persistent/public/default/xtask-readiness-probe";

/// Where the broker is (or is to be): from `PULSAR_URL` and `PULSAR_WEB_URL`.
#[derive(Clone, Debug)]
pub struct BrokerAddr {
    pub service_url: String,
    pub web_url: String,
    pub service: Endpoint,
    pub web: Endpoint,
}

impl BrokerAddr {
    pub fn from_env() -> Result<BrokerAddr, String> {
        let service_url = non_empty_env("PULSAR_URL").unwrap_or_else(|| DEFAULT_SERVICE_URL.into());
        let service =
            Endpoint::parse(&service_url, 6650).map_err(|e| format!("PULSAR_URL: {e}"))?;
        let web_url = non_empty_env("PULSAR_WEB_URL").unwrap_or_else(|| {
            let host = if service.host.contains(':') {
                format!("[{}]", service.host)
            } else {
                service.host.clone()
            };
            format!("http://{host}:{DEFAULT_WEB_PORT}")
        });
        let web = Endpoint::parse(&web_url, 80).map_err(|e| format!("PULSAR_WEB_URL: {e}"))?;
        let web_url = web_url.trim_end_matches('/').to_string();
        Ok(BrokerAddr {
            service_url,
            web_url,
            service,
            web,
        })
    }
}

fn non_empty_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Checks that a broker answers at `addr`: its service port accepts
/// connections, the admin health check (which produces and consumes a
/// message inside the broker) passes, the `public/default` namespace exists
/// and a topic lookup in it succeeds. Returns what is missing otherwise.
pub fn probe(addr: &BrokerAddr) -> Result<(), String> {
    let short = Duration::from_secs(3);
    addr.service
        .connect(short)
        .map_err(|e| format!("service port {}: {e}", addr.service_url))?;
    let check = |path: &str, timeout: Duration| -> Result<String, String> {
        let resp = http::get(&addr.web, path, timeout)
            .map_err(|e| format!("GET {}{path}: {e}", addr.web_url))?;
        if resp.status == 200 {
            Ok(resp.body)
        } else {
            Err(format!(
                "GET {}{path}: HTTP {} {}",
                addr.web_url,
                resp.status,
                resp.body.trim()
            ))
        }
    };
    check("/admin/v2/brokers/health", Duration::from_secs(15))?;
    let namespaces = check("/admin/v2/namespaces/public", short)?;
    if !namespaces.contains("\"public/default\"") {
        return Err(format!(
            "namespace public/default does not exist (public has {})",
            namespaces.trim()
        ));
    }
    check(
        &format!("/lookup/v2/topic/{PROBE_TOPIC}"),
        Duration::from_secs(10),
    )?;
    Ok(())
}

/// The broker's version as its admin API reports it.
pub fn version(addr: &BrokerAddr) -> Option<String> {
    let resp = http::get(
        &addr.web,
        "/admin/v2/brokers/version",
        Duration::from_secs(3),
    )
    .ok()?;
    (resp.status == 200).then(|| resp.body.trim().trim_matches('"').to_string())
}

/// Creates the partitioned topic `topic` with `partitions` partitions through
/// the admin API at `web`. `topic` is `name` (in `public/default`),
/// `tenant/namespace/name` or `persistent://tenant/namespace/name`. A topic
/// that already exists (HTTP 409) is fine if it has that many partitions.
pub fn create_partitioned_topic(
    web: &Endpoint,
    topic: &str,
    partitions: u32,
) -> Result<(), String> {
    if partitions == 0 {
        return Err(format!(
            "topic `{topic}`: a partitioned topic needs at least one partition"
        ));
    }
    let path = format!("/admin/v2/persistent/{}/partitions", topic_path(topic)?);
    let url = format!("{}{path}", web.base_url());
    let timeout = Duration::from_secs(15);
    let resp = http::request(web, "PUT", &path, Some(&partitions.to_string()), timeout)
        .map_err(|e| format!("PUT {url}: {e}"))?;
    match resp.status {
        200..=299 => Ok(()),
        409 => {
            let existing = http::get(web, &path, timeout).map_err(|e| format!("GET {url}: {e}"))?;
            let found = (existing.status == 200)
                .then(|| json_u64_field(&existing.body, "partitions"))
                .flatten();
            match found {
                Some(n) if n == u64::from(partitions) => Ok(()),
                Some(n) => Err(format!(
                    "topic `{topic}` already exists with {n} partitions, not {partitions} \
                     (PUT {url}: HTTP 409 {})",
                    resp.body.trim()
                )),
                None => Err(format!(
                    "topic `{topic}` already exists (PUT {url}: HTTP 409 {}), and \
                     GET {url} answered HTTP {} {}",
                    resp.body.trim(),
                    existing.status,
                    existing.body.trim()
                )),
            }
        }
        status => Err(format!("PUT {url}: HTTP {status} {}", resp.body.trim())),
    }
}

/// `tenant/namespace/name` of a persistent topic name in any of the forms
/// Pulsar accepts: `name`, `tenant/namespace/name`, `persistent://...`.
fn topic_path(topic: &str) -> Result<String, String> {
    let rest = match topic.split_once("://") {
        Some(("persistent", rest)) => rest,
        Some(_) => {
            return Err(format!(
                "topic `{topic}`: only persistent:// topics can be created here"
            ))
        }
        None => topic,
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let parts = match parts.as_slice() {
        [name] => vec!["public", "default", name],
        [_, _, _] => parts,
        _ => {
            return Err(format!(
                "topic `{topic}`: expected `name`, `tenant/namespace/name` or \
                 `persistent://tenant/namespace/name`"
            ))
        }
    };
    let valid = |part: &str| {
        !part.is_empty()
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_=:.".contains(c))
    };
    if let Some(bad) = parts.iter().find(|p| !valid(p)) {
        return Err(format!(
            "topic `{topic}`: `{bad}` is empty or has characters other than \
             letters, digits and `-_=:.`"
        ));
    }
    Ok(parts.join("/"))
}

/// The unsigned integer value of the top-level-looking field `"name"` in a
/// small JSON object such as `{"partitions":3}` (enough for the admin API's
/// answers without a JSON library).
pub fn json_u64_field(json: &str, name: &str) -> Option<u64> {
    let key = format!("\"{name}\"");
    let after = &json[json.find(&key)? + key.len()..];
    let value = after.trim_start().strip_prefix(':')?.trim_start();
    let digits = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    value[..digits].parse().ok()
}

/// A broker process that this xtask invocation started. Dropping it stops
/// the broker, so that `cargo xtask test` cleans up on every exit path,
/// panics included; [`StartedBroker::detach`] leaves it running.
pub struct StartedBroker {
    child: Option<Child>,
    pid: u32,
    pid_file: PathBuf,
}

impl StartedBroker {
    /// Leaves the broker running after xtask exits (`cargo xtask broker start`).
    pub fn detach(mut self) {
        self.child = None;
        std::mem::forget(self);
    }

    /// Stops the broker and waits for the process to exit.
    pub fn stop(mut self) -> Result<(), String> {
        self.stop_inner()
    }

    /// The broker's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Kills the broker with SIGKILL, as a crash would (no shutdown hook
    /// runs), waits for the process to exit and removes its pid file, so
    /// that [`start`] can run a new broker on the same data directory.
    pub fn kill(mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let killed = child
            .kill()
            .and_then(|()| child.wait())
            .map_err(|e| format!("killing the broker (pid {}): {e}", self.pid));
        let _ = fs::remove_file(&self.pid_file);
        killed.map(|_| ())
    }

    fn stop_inner(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        info(&format!("stopping the Pulsar broker (pid {})", self.pid));
        let result = stop_process(self.pid, Some(&mut child));
        let _ = fs::remove_file(&self.pid_file);
        result
    }
}

impl Drop for StartedBroker {
    fn drop(&mut self) {
        if let Err(e) = self.stop_inner() {
            eprintln!("[xtask] {e}");
        }
    }
}

/// Makes sure a broker answers at the configured address: uses one that
/// already answers, or starts the standalone broker (only for a loopback
/// address). Returns the started broker, if any.
pub fn ensure_running(paths: &Paths, addr: &BrokerAddr) -> Result<Option<StartedBroker>, String> {
    let why_not = match probe(addr) {
        Ok(()) => {
            let version = version(addr).unwrap_or_else(|| "unknown version".into());
            info(&format!(
                "using the Pulsar broker ({version}) that already answers at {} (web {})",
                addr.service_url, addr.web_url
            ));
            return Ok(None);
        }
        Err(e) => e,
    };
    if !addr.service.is_loopback() || !addr.web.is_loopback() {
        return Err(format!(
            "no Pulsar broker answers at {} (web {}): {why_not}\n\
             xtask starts a broker only on this machine's loopback address; start that broker, \
             or unset PULSAR_URL / PULSAR_WEB_URL to use a local one",
            addr.service_url, addr.web_url
        ));
    }
    if let Some(pid) = read_pid(&paths.pid_file) {
        if is_running(pid) && is_pulsar_standalone(pid) {
            return Err(format!(
                "a broker started by xtask is running (pid {pid}, see {}) but does not answer at {}: \
                 {why_not}\nstop it with `cargo xtask broker stop` and try again",
                paths.pid_file.display(),
                addr.service_url
            ));
        }
        let _ = fs::remove_file(&paths.pid_file);
    }
    start(paths, addr).map(Some)
}

/// Starts the standalone broker at `addr` and waits until it answers
/// (`ensure_running` first checks that none answers there already).
pub fn start(paths: &Paths, addr: &BrokerAddr) -> Result<StartedBroker, String> {
    // (The in-process bookie takes an ephemeral port of its own.)
    for (port, what) in [
        (addr.service.port, "broker service (PULSAR_URL)"),
        (addr.web.port, "broker web service (PULSAR_WEB_URL)"),
    ] {
        if let Err(e) = TcpListener::bind(("127.0.0.1", port)) {
            return Err(format!(
                "cannot start the Pulsar broker: port {port} for the {what} is taken ({e}); \
                 no working Pulsar broker answers at {} (web {})",
                addr.service_url, addr.web_url
            ));
        }
    }
    let java = java_command()?;
    let pulsar_version = pulsar_version(&paths.broker_pom)?;
    let lib_dir = ensure_jars(paths, &pulsar_version)?;
    let conf = write_effective_config(paths, addr)?;
    fs::create_dir_all(&paths.data_dir)
        .map_err(|e| format!("creating {}: {e}", paths.data_dir.display()))?;
    let log = fs::File::create(&paths.log_file)
        .map_err(|e| format!("creating {}: {e}", paths.log_file.display()))?;
    let log_err = log
        .try_clone()
        .map_err(|e| format!("{}: {e}", paths.log_file.display()))?;

    let mut cmd = Command::new(&java);
    cmd.args(jvm_options(paths))
        .arg("-cp")
        .arg(format!("{}/*", lib_dir.display()))
        .arg(MAIN_CLASS)
        .arg("--config")
        .arg(&conf)
        .args(["--no-functions-worker", "--no-stream-storage"])
        .arg("--metadata-dir")
        .arg(paths.data_dir.join("metadata"))
        .arg("--bookkeeper-dir")
        .arg(paths.data_dir.join("bookkeeper"))
        // Never created: its absence keeps standalone on the RocksDB metadata store.
        .arg("--zookeeper-dir")
        .arg(paths.data_dir.join("zookeeper"))
        .current_dir(&paths.data_dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err);

    let timeout = start_timeout();
    info(&format!(
        "starting Apache Pulsar {pulsar_version} standalone at {} (web {}); log: {}; \
         waiting up to {} s",
        addr.service_url,
        addr.web_url,
        paths.log_file.display(),
        timeout.as_secs()
    ));
    let begun = Instant::now();
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", java.display()))?;
    let pid = child.id();
    let broker = StartedBroker {
        child: Some(child),
        pid,
        pid_file: paths.pid_file.clone(),
    };
    fs::write(&paths.pid_file, format!("{pid}\n"))
        .map_err(|e| format!("writing {}: {e}", paths.pid_file.display()))?;
    wait_until_ready(broker, addr, paths, begun, timeout)
}

fn wait_until_ready(
    mut broker: StartedBroker,
    addr: &BrokerAddr,
    paths: &Paths,
    begun: Instant,
    timeout: Duration,
) -> Result<StartedBroker, String> {
    let mut healthy_since: Option<Instant> = None;
    let mut tried_namespace = false;
    let mut last_error;
    loop {
        let exited = broker
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten());
        if let Some(status) = exited {
            broker.child = None;
            let _ = fs::remove_file(&paths.pid_file);
            return Err(format!(
                "the Pulsar broker exited during startup ({status}); last lines of {}:\n{}",
                paths.log_file.display(),
                log_tail(&paths.log_file, 40)
            ));
        }
        // The broker that answers must be ours: another one may have come up
        // on the same ports meanwhile (ours then fails to bind and exits).
        let answered = probe(addr).and_then(|()| {
            if listens_on(broker.pid, addr.service.port) {
                Ok(())
            } else {
                Err(format!(
                    "a broker answers at {}, but it is not the one just started (pid {})",
                    addr.service_url, broker.pid
                ))
            }
        });
        match answered {
            Ok(()) => {
                info(&format!(
                    "Pulsar broker ready after {:.1} s (pid {}): {}",
                    begun.elapsed().as_secs_f64(),
                    broker.pid,
                    addr.service_url
                ));
                return Ok(broker);
            }
            Err(e) => last_error = e,
        }
        // Standalone creates public/default right after the broker starts; if
        // the broker is healthy but the namespace still missing after a
        // while, create it through the admin API.
        if last_error.contains("public/default does not exist") {
            let since = *healthy_since.get_or_insert_with(Instant::now);
            if !tried_namespace && since.elapsed() > Duration::from_secs(20) {
                tried_namespace = true;
                info("namespace public/default is missing; creating it");
                let _ = http::request(
                    &addr.web,
                    "PUT",
                    "/admin/v2/namespaces/public/default",
                    None,
                    Duration::from_secs(10),
                );
            }
        }
        if begun.elapsed() > timeout {
            let _ = broker.stop_inner();
            return Err(format!(
                "the Pulsar broker did not come up within {} s (last check: {last_error}); \
                 last lines of {}:\n{}",
                timeout.as_secs(),
                paths.log_file.display(),
                log_tail(&paths.log_file, 40)
            ));
        }
        thread::sleep(Duration::from_millis(500));
    }
}

fn start_timeout() -> Duration {
    let secs = non_empty_env("PULSAR_START_TIMEOUT_SECS")
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(DEFAULT_START_TIMEOUT_SECS);
    Duration::from_secs(secs)
}

fn jvm_options(paths: &Paths) -> Vec<String> {
    let mut opts: Vec<String> = [
        "-Xms256m",
        "-Xmx2g",
        "-XX:MaxDirectMemorySize=1g",
        "-XX:+UseG1GC",
        "-Dio.netty.tryReflectionSetAccessible=true",
        "-Dpulsar.allocator.exit_on_oom=true",
        // Opened the way Pulsar's own launch script opens them on Java 17+,
        // for Netty's direct memory and the broker's JVM metrics.
        "--add-opens=java.base/java.nio=ALL-UNNAMED",
        "--add-opens=java.base/jdk.internal.misc=ALL-UNNAMED",
        "--add-opens=java.base/java.io=ALL-UNNAMED",
        "--add-opens=java.base/java.util.zip=ALL-UNNAMED",
        "--add-opens=java.base/sun.net=ALL-UNNAMED",
        "--add-opens=java.base/jdk.internal.platform=ALL-UNNAMED",
        "--add-opens=java.management/sun.management=ALL-UNNAMED",
        "--add-opens=jdk.management/com.sun.management.internal=ALL-UNNAMED",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    opts.push(format!(
        "-Dlog4j.configurationFile={}",
        paths.root.join("tests/broker/log4j2.xml").display()
    ));
    if let Some(extra) = non_empty_env("PULSAR_JAVA_OPTS") {
        opts.extend(extra.split_whitespace().map(str::to_string));
    }
    opts
}

/// Java and the broker's classpath (which holds Pulsar's Java client), for
/// the tests' Java peer: the jars are resolved if they are missing, also
/// when the tests use a broker that was already running.
pub fn java_client(paths: &Paths) -> Result<(PathBuf, String), String> {
    let java = java_command()?;
    let lib_dir = ensure_jars(paths, &pulsar_version(&paths.broker_pom)?)?;
    Ok((java, format!("{}/*", lib_dir.display())))
}

/// `$JAVA_HOME/bin/java` or `java` on PATH, checked to be Java 17 or newer.
fn java_command() -> Result<PathBuf, String> {
    let java = match non_empty_env("JAVA_HOME") {
        Some(home) => Path::new(&home).join("bin/java"),
        None => PathBuf::from("java"),
    };
    let out = Command::new(&java).arg("-version").output().map_err(|e| {
        format!(
            "cannot run `{}` ({e}): the Pulsar broker needs Java 17 or newer \
                 (e.g. `apt-get install openjdk-17-jre-headless`)",
            java.display()
        )
    })?;
    let text = String::from_utf8_lossy(&out.stderr);
    let version = text.split('"').nth(1).unwrap_or("").to_string();
    let mut parts = version.split(['.', '-', '+']);
    let major: u32 = match parts.next().and_then(|p| p.parse().ok()) {
        Some(1) => parts.next().and_then(|p| p.parse().ok()).unwrap_or(0),
        Some(n) => n,
        None => 0,
    };
    if major < 17 {
        return Err(format!(
            "`{} -version` reports {:?}; the Pulsar broker needs Java 17 or newer \
             (set JAVA_HOME to one)",
            java.display(),
            text.lines().next().unwrap_or("")
        ));
    }
    Ok(java)
}

/// The `pulsar.version` property of the broker POM.
pub fn pulsar_version(pom: &Path) -> Result<String, String> {
    let text = fs::read_to_string(pom).map_err(|e| format!("reading {}: {e}", pom.display()))?;
    let start = text
        .find("<pulsar.version>")
        .map(|i| i + "<pulsar.version>".len())
        .ok_or_else(|| format!("{} has no <pulsar.version>", pom.display()))?;
    let len = text[start..]
        .find("</pulsar.version>")
        .ok_or_else(|| format!("{}: unclosed <pulsar.version>", pom.display()))?;
    Ok(text[start..start + len].trim().to_string())
}

/// Copies the broker's runtime classpath to `target/pulsar-lib/<version>`
/// with Maven, once: a stamp holding the POM it came from marks a complete
/// copy, so later starts run no Maven at all. Downloads land in ~/.m2.
fn ensure_jars(paths: &Paths, version: &str) -> Result<PathBuf, String> {
    let lib_dir = paths.target.join("pulsar-lib").join(version);
    let stamp = lib_dir.join(".resolved-from-pom.xml");
    let pom_text = fs::read_to_string(&paths.broker_pom)
        .map_err(|e| format!("reading {}: {e}", paths.broker_pom.display()))?;
    if fs::read_to_string(&stamp).ok().as_deref() == Some(pom_text.as_str()) {
        return Ok(lib_dir);
    }
    if lib_dir.exists() {
        fs::remove_dir_all(&lib_dir).map_err(|e| format!("clearing {}: {e}", lib_dir.display()))?;
    }
    fs::create_dir_all(&paths.target).map_err(|e| format!("{}: {e}", paths.target.display()))?;
    let maven_log = paths.target.join("pulsar-maven.log");
    info(&format!(
        "resolving the Pulsar {version} broker jars with Maven (first start only; \
         a few minutes when ~/.m2 is empty); log: {}",
        maven_log.display()
    ));
    let log = fs::File::create(&maven_log).map_err(|e| format!("{}: {e}", maven_log.display()))?;
    let log_err = log.try_clone().map_err(|e| e.to_string())?;
    let mut cmd = Command::new("mvn");
    cmd.args(["-B", "--no-transfer-progress", "-f"])
        .arg(&paths.broker_pom)
        .arg("dependency:copy-dependencies")
        .arg(format!("-DoutputDirectory={}", lib_dir.display()))
        .arg("-DincludeScope=runtime")
        .current_dir(&paths.root)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err);
    let status = cmd.status().map_err(|e| {
        format!("cannot run `mvn` ({e}): Maven is needed to fetch the Pulsar broker (apt-get install maven)")
    })?;
    if !status.success() {
        return Err(format!(
            "Maven could not resolve the Pulsar broker ({status}); last lines of {}:\n{}",
            maven_log.display(),
            log_tail(&maven_log, 30)
        ));
    }
    let jars = fs::read_dir(&lib_dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".jar"))
                .count()
        })
        .unwrap_or(0);
    if jars == 0 {
        return Err(format!("Maven copied no jars to {}", lib_dir.display()));
    }
    fs::write(&stamp, pom_text).map_err(|e| format!("{}: {e}", stamp.display()))?;
    info(&format!("{jars} jars in {}", lib_dir.display()));
    Ok(lib_dir)
}

/// tests/broker/standalone.conf plus the ports asked for by the environment
/// (a later key wins when Java loads properties).
fn write_effective_config(paths: &Paths, addr: &BrokerAddr) -> Result<PathBuf, String> {
    let mut conf = fs::read_to_string(&paths.broker_conf)
        .map_err(|e| format!("reading {}: {e}", paths.broker_conf.display()))?;
    conf.push_str(&format!(
        "\n# --- added by cargo xtask from PULSAR_URL / PULSAR_WEB_URL ---\n\
         brokerServicePort={}\nwebServicePort={}\n",
        addr.service.port, addr.web.port
    ));
    let out = paths.effective_conf.clone();
    if let Some(dir) = out.parent() {
        fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    fs::write(&out, conf).map_err(|e| format!("writing {}: {e}", out.display()))?;
    Ok(out)
}

/// Whether process `pid` holds the listening TCP socket on `port`
/// (from /proc/net/tcp{,6} and the process's file descriptors).
fn listens_on(pid: u32, port: u16) -> bool {
    let port_hex = format!(":{port:04X}");
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address is field 1, state 3 (0A = LISTEN), inode 9.
            if fields.len() > 9 && fields[1].ends_with(&port_hex) && fields[3] == "0A" {
                inodes.push(format!("socket:[{}]", fields[9]));
            }
        }
    }
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        fs::read_link(fd.path())
            .map(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
            .unwrap_or(false)
    })
}

pub fn read_pid(pid_file: &Path) -> Option<u32> {
    fs::read_to_string(pid_file).ok()?.trim().parse().ok()
}

/// Running, and not a zombie waiting to be reaped.
pub fn is_running(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state follows the parenthesised command name.
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim().chars().next());
            !matches!(state, Some('Z') | Some('X') | None)
        }
        Err(_) => false,
    }
}

pub fn is_pulsar_standalone(pid: u32) -> bool {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).contains(MAIN_CLASS))
        .unwrap_or(false)
}

/// Sends SIGTERM (the broker's shutdown hook closes it cleanly), waits for the
/// process to exit, and sends SIGKILL if it has not after a grace period.
pub fn stop_process(pid: u32, mut child: Option<&mut Child>) -> Result<(), String> {
    let gone = |child: &mut Option<&mut Child>| match child {
        Some(c) => !matches!(c.try_wait(), Ok(None)),
        None => !is_running(pid),
    };
    if gone(&mut child) {
        return Ok(());
    }
    let _ = run_status(Command::new("kill").args(["-TERM", &pid.to_string()]));
    let begun = Instant::now();
    while begun.elapsed() < STOP_GRACE {
        if gone(&mut child) {
            info(&format!(
                "broker (pid {pid}) stopped after {:.1} s",
                begun.elapsed().as_secs_f64()
            ));
            return Ok(());
        }
        thread::sleep(Duration::from_millis(100));
    }
    info(&format!(
        "broker (pid {pid}) still running after {} s; sending SIGKILL",
        STOP_GRACE.as_secs()
    ));
    let _ = run_status(Command::new("kill").args(["-KILL", &pid.to_string()]));
    let begun = Instant::now();
    while begun.elapsed() < Duration::from_secs(10) {
        if gone(&mut child) {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(100));
    }
    Err(format!(
        "broker (pid {pid}) did not exit even after SIGKILL"
    ))
}

/// The last `lines` lines of a file, for error messages.
pub fn log_tail(path: &Path, lines: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_names_map_to_admin_paths() {
        assert_eq!(topic_path("orders").unwrap(), "public/default/orders");
        assert_eq!(topic_path("acme/shop/orders").unwrap(), "acme/shop/orders");
        assert_eq!(
            topic_path("persistent://public/default/orders").unwrap(),
            "public/default/orders"
        );
        assert!(topic_path("non-persistent://public/default/orders").is_err());
        assert!(topic_path("persistent://public/orders").is_err());
        assert!(topic_path("a/b/c/d").is_err());
        assert!(topic_path("public//orders").is_err());
        assert!(topic_path("").is_err());
        assert!(topic_path("my orders").is_err());
        assert!(topic_path("orders?x=1").is_err());
    }

    #[test]
    fn reads_partition_count() {
        assert_eq!(json_u64_field(r#"{"partitions":3}"#, "partitions"), Some(3));
        assert_eq!(
            json_u64_field(
                r#"{ "partitions" : 12, "deleted": false, "properties": {} }"#,
                "partitions"
            ),
            Some(12)
        );
        assert_eq!(json_u64_field(r#"{"partitions":0}"#, "partitions"), Some(0));
        assert_eq!(json_u64_field(r#"{"other":3}"#, "partitions"), None);
        assert_eq!(json_u64_field("not json", "partitions"), None);
    }

    /// Against the broker at PULSAR_WEB_URL (default http://127.0.0.1:8080):
    /// `cargo test -p xtask -- --ignored`.
    #[test]
    #[ignore = "needs a running Pulsar broker"]
    fn creates_partitioned_topics_on_a_broker() {
        let addr = BrokerAddr::from_env().unwrap();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let topic = format!("xtask-create-partitioned-{nanos}");
        create_partitioned_topic(&addr.web, &topic, 3).unwrap();
        // Again with the same count (HTTP 409 from the broker): fine.
        create_partitioned_topic(
            &addr.web,
            &format!("persistent://public/default/{topic}"),
            3,
        )
        .unwrap();
        let err = create_partitioned_topic(&addr.web, &topic, 4).unwrap_err();
        assert!(err.contains("already exists with 3 partitions"), "{err}");
        let err = create_partitioned_topic(&addr.web, "no-such-tenant/ns/t", 1).unwrap_err();
        assert!(err.contains("HTTP 4"), "{err}");
        let path = format!("/admin/v2/persistent/public/default/{topic}/partitions");
        let _ = http::request(&addr.web, "DELETE", &path, None, Duration::from_secs(15));
    }
}
