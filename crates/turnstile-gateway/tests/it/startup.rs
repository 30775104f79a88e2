//! Issue 55: start-up an operator can act on. The real binary against real failures: a port
//! nothing listens on, a name that does not resolve, a server that never answers, a URL that
//! requires TLS, a PostgreSQL cluster of the test's own that checks passwords (SCRAM), a
//! database that does not exist; the bounded retry at start
//! (`store_connect_retry_ms`) against a store that appears late; one exit status per stage;
//! `--version` with the commit; `--help` with the environment.

use crate::fencing::Relay;
use crate::recovery::wait_for;
use crate::serve::pg_url;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// `cli::Exit`'s statuses for `serve` (docs/operating.md, "Exit statuses of `turnstile serve`").
const EXIT_STORE: i32 = 69;
const EXIT_LISTEN: i32 = 71;
const EXIT_CONFIG: i32 = 78;

/// A `turnstile serve` process whose start-up is watched: stdout (the `listening on` line) and
/// stderr (the log) go to files in `dir`.
struct Start {
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Start {
    fn run(dir: &Path, args: &[&str], config: &str, env: &[(&str, &str)]) -> Start {
        let config_path = dir.join("turnstile.toml");
        std::fs::write(&config_path, config).unwrap();
        let (stdout, stderr) = (dir.join("stdout"), dir.join("stderr"));
        let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        command
            .arg("serve")
            .args(["--config", config_path.to_str().unwrap()])
            .args(args)
            .env_remove("TURNSTILE_STORE")
            .env_remove("TURNSTILE_LISTEN")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap());
        Start {
            child: command.spawn().unwrap(),
            stdout,
            stderr,
        }
    }

    /// The exit status, waiting at most `limit`.
    fn exit(&mut self, limit: Duration) -> ExitStatus {
        wait_for(limit, "turnstile serve to exit", || {
            self.child.try_wait().unwrap()
        })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn listening(&self) -> Option<String> {
        let text = std::fs::read_to_string(&self.stdout).unwrap_or_default();
        text.lines()
            .find(|line| line.contains("listening on"))
            .and_then(|line| line.split_whitespace().find(|word| word.starts_with("http://")))
            .map(str::to_owned)
    }
}

impl Drop for Start {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nothing listens on (bound, then released).
fn refused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Start `serve` on `store` and expect it to exit with `status` and `wording` in its last line.
fn refused_start(store: &str, config: &str, status: i32, wording: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut start = Start::run(
        dir.path(),
        &["--listen", "127.0.0.1:0", "--store", store],
        config,
        &[],
    );
    let exit = start.exit(Duration::from_secs(60));
    let log = start.log();
    assert_eq!(exit.code(), Some(status), "{store}: {log}");
    let last = log.lines().last().unwrap_or_default();
    assert!(last.starts_with("turnstile serve: store "), "{last}");
    for word in wording {
        assert!(last.contains(word), "{store}: {word:?} not in {last:?}");
    }
    assert!(start.listening().is_none());
    log
}

#[test]
fn a_refused_port_is_named_as_refused_and_exits_with_the_store_status() {
    let url = format!(
        "postgres://turnstile:secret@127.0.0.1:{}/turnstile",
        refused_port()
    );
    let log = refused_start(
        &url,
        "",
        EXIT_STORE,
        &[
            "connection refused",
            "nothing listens",
            "Connection refused (os error 111)",
        ],
    );
    assert!(!log.contains("secret"), "the password never appears: {log}");
    assert!(log.contains("turnstile:***@"), "{log}");
}

#[test]
fn an_unknown_host_is_named_as_unknown_and_exits_with_the_store_status() {
    // `.invalid` never resolves (RFC 6761).
    refused_start(
        "postgres://turnstile@db.invalid:5432/turnstile",
        "",
        EXIT_STORE,
        &["unknown host", "does not resolve", "failed to lookup address"],
    );
}

#[test]
fn a_missing_database_is_named_and_exits_with_the_store_status() {
    let mut url = reqwest::Url::parse(&pg_url()).unwrap();
    url.set_path("turnstile_no_such_database");
    refused_start(
        url.as_str(),
        "",
        EXIT_STORE,
        &[
            "database named in the store URL does not exist",
            "turnstile_no_such_database",
        ],
    );
}

#[test]
fn a_server_that_never_answers_is_named_as_a_timeout_and_exits_with_the_store_status() {
    // Accepts the connection and says nothing: a frozen server, or a firewall that drops.
    let port = crate::serve::silent_provider();
    refused_start(
        &format!("postgres://turnstile@127.0.0.1:{port}/turnstile"),
        "store_timeout_ms = 300\n",
        EXIT_STORE,
        &["no answer within store_timeout_ms"],
    );
}

#[test]
fn a_url_that_requires_tls_is_named_as_tls_and_exits_with_the_store_status() {
    // The suite's server speaks no TLS; this build speaks none to PostgreSQL either.
    let mut url = reqwest::Url::parse(&pg_url()).unwrap();
    url.set_query(Some("sslmode=require"));
    refused_start(
        url.as_str(),
        "",
        EXIT_STORE,
        &["TLS: the URL's sslmode or the server's pg_hba.conf requires TLS"],
    );
}

/// A PostgreSQL cluster of this test's own that checks passwords (SCRAM-SHA-256 on loopback
/// TCP), from the server binaries scripts/test's PostgreSQL comes from; stopped on drop. The
/// suite's server trusts every loopback login, so a wrong password needs a server of its own.
struct ScramCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
}

const SCRAM_PASSWORD: &str = "right-horse-battery";

impl ScramCluster {
    fn start() -> ScramCluster {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL's server binaries under /usr/lib/postgresql (scripts/test installs them)")
            .filter_map(|entry| entry.ok().map(|entry| entry.path().join("bin")))
            .filter(|bin| bin.join("initdb").exists())
            .max()
            .expect("an initdb under /usr/lib/postgresql/*/bin");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pw"), SCRAM_PASSWORD).unwrap();
        let cluster = ScramCluster {
            port: refused_port(),
            dir,
            bin,
        };
        // initdb refuses to run as root: as root (CI), the cluster belongs to `postgres`.
        if is_root() {
            let chown = Command::new("chown")
                .args(["-R", "postgres:", cluster.dir.path().to_str().unwrap()])
                .status()
                .unwrap();
            assert!(chown.success());
        }
        let data = cluster.dir.path().join("data");
        cluster.as_owner(&format!(
            "{}/initdb -D {} -U postgres --auth-local=trust --auth-host=scram-sha-256 --pwfile={} \
             -E UTF8 --no-locale",
            cluster.bin.display(),
            data.display(),
            cluster.dir.path().join("pw").display()
        ));
        cluster.as_owner(&format!(
            "{}/pg_ctl -D {} -l {} -w -t 60 -o '-c listen_addresses=127.0.0.1 -p {} -k {} \
             -c fsync=off' start",
            cluster.bin.display(),
            data.display(),
            cluster.dir.path().join("log").display(),
            cluster.port,
            cluster.dir.path().display()
        ));
        cluster
    }

    fn as_owner(&self, command: &str) {
        let output = if is_root() {
            Command::new("su")
                .args(["postgres", "-c", command])
                .stdin(Stdio::null())
                .output()
        } else {
            Command::new("sh")
                .args(["-c", command])
                .stdin(Stdio::null())
                .output()
        }
        .unwrap();
        assert!(
            output.status.success(),
            "{command}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn url(&self, password: &str) -> String {
        format!("postgres://postgres:{password}@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for ScramCluster {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let command = format!(
            "{}/pg_ctl -D {} -m immediate -w stop",
            self.bin.display(),
            data.display()
        );
        let _ = if is_root() {
            Command::new("su").args(["postgres", "-c", &command]).output()
        } else {
            Command::new("sh").args(["-c", &command]).output()
        };
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
        .unwrap_or(false)
}

#[test]
fn a_wrong_password_is_named_as_authentication_and_never_retried() {
    let cluster = ScramCluster::start();
    // A retry window that would be seen: a refusal of credentials ends the start at once.
    let began = Instant::now();
    let log = refused_start(
        &cluster.url("wrong-password"),
        "store_connect_retry_ms = 30000\n",
        EXIT_STORE,
        &[
            "authentication failed",
            "the server refused the user or its password",
            "password authentication failed for user \"postgres\"",
        ],
    );
    assert!(!log.contains("wrong-password"), "{log}");
    assert!(
        !log.contains("trying again"),
        "credentials are not retried: {log}"
    );
    assert!(began.elapsed() < Duration::from_secs(20), "{:?}", began.elapsed());

    // The control: the same cluster with the right password serves.
    let dir = tempfile::tempdir().unwrap();
    let url = cluster.url(SCRAM_PASSWORD);
    let start = Start::run(dir.path(), &["--listen", "127.0.0.1:0", "--store", &url], "", &[]);
    wait_for(Duration::from_secs(60), "the gateway to listen", || {
        start.listening()
    });
}

#[test]
fn a_store_that_appears_within_store_connect_retry_ms_is_waited_for() {
    let port = refused_port();
    let mut url = reqwest::Url::parse(&pg_url()).unwrap();
    let upstream = std::net::ToSocketAddrs::to_socket_addrs(&(
        url.host_str().unwrap().to_owned(),
        url.port().unwrap_or(5432),
    ))
    .unwrap()
    .next()
    .unwrap();
    url.set_host(Some("127.0.0.1")).unwrap();
    url.set_port(Some(port)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let start = Start::run(
        dir.path(),
        &["--listen", "127.0.0.1:0"],
        "store_connect_retry_ms = 60000\n",
        // The store by the environment, as a container or unit passes it.
        &[("TURNSTILE_STORE", url.as_str())],
    );
    // The first attempt was refused and the process waits (its log says so) …
    wait_for(Duration::from_secs(30), "a refused attempt to be logged", || {
        start
            .log()
            .contains("trying again within store_connect_retry_ms")
            .then_some(())
    });
    assert!(start.listening().is_none());
    assert!(start.log().contains("connection refused"), "{}", start.log());
    // … the database appears on that port, and the gateway starts on it.
    let _relay = Relay::start_on(TcpListener::bind(("127.0.0.1", port)).unwrap(), upstream);
    let base = wait_for(Duration::from_secs(30), "the gateway to listen", || {
        start.listening()
    });
    let health = reqwest::blocking::get(format!("{base}/healthz")).unwrap();
    assert_eq!(health.status().as_u16(), 200);
}

#[test]
fn a_store_that_stays_away_past_the_window_ends_the_start_with_the_store_status() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("postgres://postgres@127.0.0.1:{}/turnstile", refused_port());
    let began = Instant::now();
    let mut start = Start::run(
        dir.path(),
        &["--listen", "127.0.0.1:0", "--store", &store],
        "store_connect_retry_ms = 1500\n",
        &[],
    );
    let exit = start.exit(Duration::from_secs(60));
    let log = start.log();
    assert_eq!(exit.code(), Some(EXIT_STORE), "{log}");
    assert!(
        began.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        began.elapsed()
    );
    let retries = log.matches("trying again within store_connect_retry_ms").count();
    assert!(
        retries >= 3,
        "100, 200, 400, 800 ms waits fit 1.5 s: {retries} in {log}"
    );
    assert!(
        log.lines().last().unwrap().contains("connection refused"),
        "{log}"
    );
}

#[test]
fn a_configuration_error_and_a_taken_port_have_their_own_exit_statuses() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("t.db").display());
    let mut start = Start::run(dir.path(), &["--store", &store], "lease_msec = 5\n", &[]);
    assert_eq!(
        start.exit(Duration::from_secs(60)).code(),
        Some(EXIT_CONFIG),
        "{}",
        start.log()
    );
    assert!(
        start.log().contains("unknown field `lease_msec`"),
        "{}",
        start.log()
    );

    // A scheme this build does not know, and a PostgreSQL URL that does not parse (review
    // finding: it exited with the store status, so a unit restarted it for ever).
    for url in ["mysql://db/x", "postgres://user@127.0.0.1:notaport/db"] {
        let dir = tempfile::tempdir().unwrap();
        let mut start = Start::run(dir.path(), &["--store", url], "", &[]);
        assert_eq!(
            start.exit(Duration::from_secs(60)).code(),
            Some(EXIT_CONFIG),
            "{url}: {}",
            start.log()
        );
    }

    // Two tenants with one token (or one name twice): refused at start, since the first would
    // answer for both (review finding).
    for tenants in [
        "[[tenants]]\nname = \"a-b\"\ntoken = \"same\"\n[[tenants]]\nname = \"a_b\"\ntoken = \"same\"\n",
        "[[tenants]]\nname = \"a\"\ntoken = \"one\"\n[[tenants]]\nname = \"a\"\ntoken = \"two\"\n",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = format!("sqlite:{}", dir.path().join("t.db").display());
        let mut start = Start::run(dir.path(), &["--store", &store], tenants, &[]);
        assert_eq!(
            start.exit(Duration::from_secs(60)).code(),
            Some(EXIT_CONFIG),
            "{tenants}: {}",
            start.log()
        );
        assert!(
            start.log().contains("same token") || start.log().contains("named twice"),
            "{}",
            start.log()
        );
    }

    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("t.db").display());
    let mut start = Start::run(dir.path(), &["--listen", &address, "--store", &store], "", &[]);
    assert_eq!(
        start.exit(Duration::from_secs(60)).code(),
        Some(EXIT_LISTEN),
        "{}",
        start.log()
    );
    assert!(
        start.log().contains(&format!("listen on {address}")),
        "{}",
        start.log()
    );
}

#[test]
fn version_names_the_commit_and_help_lists_the_environment() {
    let version = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(version.status.success());
    let version = String::from_utf8(version.stdout).unwrap();
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(head.status.success(), "the tests run in a git checkout");
    let head = String::from_utf8(head.stdout).unwrap();
    assert_eq!(
        version.trim(),
        format!("turnstile {} (commit {})", env!("CARGO_PKG_VERSION"), head.trim())
    );

    let help = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    assert!(!help.contains("(later)"), "{help}");
    for variable in [
        "TURNSTILE_CONFIG",
        "TURNSTILE_STORE",
        "RUST_LOG",
        "NO_COLOR",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ] {
        assert!(help.contains(variable), "{variable} not in {help}");
    }
    for status in ["78", "69", "71"] {
        assert!(help.contains(status), "{status} not in {help}");
    }
    let serve_help = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let serve_help = String::from_utf8(serve_help.stdout).unwrap();
    assert!(serve_help.contains("[env: TURNSTILE_STORE"), "{serve_help}");
}
