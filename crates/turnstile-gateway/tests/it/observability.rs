//! Issue 51: what an operator sees of the gateway. `/metrics` read with a real Prometheus
//! parser (`prometheus-parse`) and checked by `promtool check metrics` (Debian's `prometheus`
//! package, installed by `scripts/test`); per-attempt evidence in `GET /v1/dispatches/{id}`.

use crate::serve::{Gateway, client, conversation_with_question, sqlite};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};

/// The `/metrics` page.
pub fn metrics_page(gateway: &Gateway) -> String {
    let response = client().get(format!("{}/metrics", gateway.base)).send().unwrap();
    assert_eq!(response.status().as_u16(), 200);
    response.text().unwrap()
}

/// The page parsed by a real exposition-format parser.
fn parse(text: &str) -> prometheus_parse::Scrape {
    prometheus_parse::Scrape::parse(text.lines().map(|line| Ok(line.to_owned()))).unwrap()
}

/// `promtool check metrics` on the page: its exit status and what it said.
fn promtool_check_metrics(text: &str) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`; scripts/test installs it)");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), said)
}

/// The family a sample belongs to (a histogram's `_bucket`/`_sum`/`_count` are its family's).
fn family(name: &str, histograms: &BTreeSet<String>) -> String {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && histograms.contains(base)
        {
            return base.to_owned();
        }
    }
    name.to_owned()
}

/// `# TYPE` lines: family → type.
fn types(text: &str) -> std::collections::BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| {
            let mut words = rest.split_whitespace();
            Some((words.next()?.to_owned(), words.next()?.to_owned()))
        })
        .collect()
}

fn histogram_count(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|sample| sample.metric == name)
        .filter(|sample| {
            labels
                .iter()
                .all(|(key, value)| sample.labels.get(key) == Some(*value))
        })
        .map(|sample| match &sample.value {
            prometheus_parse::Value::Histogram(buckets) => {
                buckets.iter().map(|bucket| bucket.count).fold(0.0, f64::max)
            }
            other => panic!("{name} is not a histogram: {other:?}"),
        })
        .sum()
}

fn counter(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|sample| sample.metric == name)
        .filter(|sample| {
            labels
                .iter()
                .all(|(key, value)| sample.labels.get(key) == Some(*value))
        })
        .map(|sample| match &sample.value {
            prometheus_parse::Value::Counter(value)
            | prometheus_parse::Value::Gauge(value)
            | prometheus_parse::Value::Untyped(value) => *value,
            other => panic!("{name} is not a counter: {other:?}"),
        })
        .sum()
}

/// One dispatch that commits and one refused with a 503, on a gateway of its own.
fn gateway_with_traffic(dir: &tempfile::TempDir, sim: &SimProcess) -> Gateway {
    // A price for m-ok only: a dollar per input token and two per output token (big, so the
    // cost in millionths is exact).
    let prices = "[[prices]]\nprovider = \"sim\"\nmodel = \"m-ok\"\ninput_usd_per_mtok = 1000000.0\n\
                  output_usd_per_mtok = 2000000.0\n";
    let gateway = Gateway::start(dir, &sqlite(dir), sim, prices);
    conversation_with_question(&gateway, "c-ok");
    sim.script("m-ok", json!([{"text": "Sunny in Paris."}]));
    let (status, body) = gateway.post(
        "/v1/conversations/c-ok/dispatch",
        json!({"operation_id": "op-ok", "target": {"provider": "sim", "model": "m-ok", "adapter": "openai-chat@2"}}),
    );
    assert_eq!(status, 200, "{body}");
    conversation_with_question(&gateway, "c-503");
    sim.script(
        "m-503",
        json!([{"text": "never", "faults": {"status": 503, "error_message": "upstream overloaded: try later"}}]),
    );
    let (status, body) = gateway.post(
        "/v1/conversations/c-503/dispatch",
        json!({"operation_id": "op-503", "target": {"provider": "sim", "model": "m-503", "adapter": "openai-chat@2"}}),
    );
    assert_eq!(status, 200, "{body}");
    gateway
}

#[test]
fn every_metric_family_has_help_and_type_and_a_dispatch_fills_the_histograms() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_traffic(&dir, &sim);
    let text = metrics_page(&gateway);
    let scrape = parse(&text);
    let types = types(&text);
    let histograms: BTreeSet<String> = types
        .iter()
        .filter(|(_, kind)| kind.as_str() == "histogram")
        .map(|(name, _)| name.clone())
        .collect();
    // Every family on the page has a HELP and a TYPE line, and no sample is untyped.
    let mut families = BTreeSet::new();
    for sample in &scrape.samples {
        let family = family(&sample.metric, &histograms);
        assert!(
            scrape.docs.contains_key(&family),
            "no # HELP for {family}\n{text}"
        );
        assert!(types.contains_key(&family), "no # TYPE for {family}\n{text}");
        // (prometheus-parse reads a histogram's `_sum` and `_count` as untyped samples of
        // their own; the family's TYPE above covers them.)
        assert!(
            family != sample.metric || !matches!(sample.value, prometheus_parse::Value::Untyped(_)),
            "{} is untyped",
            sample.metric
        );
        families.insert(family);
    }
    // The seed's names are unchanged and present.
    for name in [
        "turnstile_validator_rejects_total",
        "turnstile_tool_result_orphans_total",
        "turnstile_tool_result_duplicates_total",
        "turnstile_dispatch_unknown_age_seconds",
        "turnstile_handle_recoveries_total",
        "turnstile_late_blocks_total",
        "turnstile_preview_retractions_total",
        "turnstile_canonical_cas_conflicts_total",
        "turnstile_partial_tool_dispatch_total",
        "turnstile_illegal_sends_total",
        "turnstile_dispatch_transitions_total",
    ] {
        assert!(families.contains(name), "{name} missing\n{text}");
    }
    // Histograms, by provider and model, with real buckets.
    for name in [
        "turnstile_dispatch_duration_seconds",
        "turnstile_attempt_duration_seconds",
        "turnstile_provider_head_latency_seconds",
        "turnstile_time_to_first_preview_seconds",
    ] {
        assert_eq!(
            types.get(name).map(String::as_str),
            Some("histogram"),
            "{name}\n{text}"
        );
    }
    let ok = [("provider", "sim"), ("model", "m-ok")];
    let failed = [("provider", "sim"), ("model", "m-503")];
    assert_eq!(
        histogram_count(
            &scrape,
            "turnstile_dispatch_duration_seconds",
            &[ok[0], ok[1], ("outcome", "committed")]
        ),
        1.0
    );
    assert_eq!(
        histogram_count(
            &scrape,
            "turnstile_dispatch_duration_seconds",
            &[failed[0], failed[1], ("outcome", "failed")]
        ),
        1.0
    );
    assert_eq!(
        histogram_count(&scrape, "turnstile_time_to_first_preview_seconds", &ok),
        1.0
    );
    assert_eq!(
        histogram_count(&scrape, "turnstile_time_to_first_preview_seconds", &failed),
        0.0
    );
    assert_eq!(
        histogram_count(&scrape, "turnstile_provider_head_latency_seconds", &ok),
        1.0
    );
    assert_eq!(
        histogram_count(&scrape, "turnstile_provider_head_latency_seconds", &failed),
        1.0
    );
    assert_eq!(
        histogram_count(&scrape, "turnstile_attempt_duration_seconds", &failed),
        1.0
    );
    // Attempts by provider, model, end and status.
    assert_eq!(
        counter(
            &scrape,
            "turnstile_attempts_total",
            &[ok[0], ok[1], ("end", "committed"), ("status", "200")]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        counter(
            &scrape,
            "turnstile_attempts_total",
            &[failed[0], failed[1], ("status", "503")]
        ),
        1.0,
        "{text}"
    );
    // Tokens from the provider's usage, by tenant (`none`: no tenants configured) and kind,
    // and our own count of the input apart.
    let tokens = [ok[0], ok[1], ("tenant", "none"), ("committed", "true")];
    assert!(
        counter(
            &scrape,
            "turnstile_tokens_total",
            &[tokens[0], tokens[1], tokens[2], tokens[3], ("kind", "output")]
        ) > 0.0,
        "{text}"
    );
    assert!(
        counter(
            &scrape,
            "turnstile_tokens_total",
            &[tokens[0], tokens[1], tokens[2], tokens[3], ("kind", "input")]
        ) > 0.0,
        "{text}"
    );
    assert!(
        counter(
            &scrape,
            "turnstile_estimated_tokens_total",
            &[ok[0], ok[1], ("kind", "input")]
        ) > 0.0,
        "{text}"
    );
    // Cost from the price table: input × 1 + output × 2 dollars, in millionths.
    let input = counter(
        &scrape,
        "turnstile_tokens_total",
        &[tokens[0], tokens[1], ("kind", "input"), tokens[3]],
    );
    let output = counter(
        &scrape,
        "turnstile_tokens_total",
        &[tokens[0], tokens[1], ("kind", "output"), tokens[3]],
    );
    assert_eq!(
        counter(
            &scrape,
            "turnstile_cost_microdollars_total",
            &[ok[0], ok[1], ("tenant", "none"), ("committed", "true")]
        ),
        (input + 2.0 * output) * 1e6,
        "{text}"
    );
    assert_eq!(
        counter(&scrape, "turnstile_cost_microdollars_total", &failed),
        0.0,
        "m-503 has no price"
    );
    // The build.
    let build = scrape
        .samples
        .iter()
        .find(|sample| sample.metric == "turnstile_build_info")
        .unwrap_or_else(|| panic!("no turnstile_build_info\n{text}"));
    assert_eq!(build.labels.get("version"), Some(env!("CARGO_PKG_VERSION")));
    assert!(
        build
            .labels
            .get("commit")
            .is_some_and(|commit| !commit.is_empty())
    );
    // The text log (the default) written to a file carries no colour codes, and has the
    // dispatch lines.
    let log = gateway.log_text();
    assert!(!log.contains('\u{1b}'), "colour codes in a log file:\n{log}");
    assert!(
        log.contains("dispatch ended") && log.contains("operation_id=op-503"),
        "{log}"
    );
    // Prometheus's own linter agrees.
    let (ok, said) = promtool_check_metrics(&text);
    assert!(ok, "promtool check metrics: {said}");
    assert!(
        said.trim().is_empty(),
        "promtool check metrics found problems: {said}"
    );
}

#[test]
fn a_failed_attempt_s_status_error_body_and_request_id_are_in_the_dispatch_view() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_traffic(&dir, &sim);
    // Written off the dispatch's path: poll the view, bounded.
    let view = crate::recovery::wait_for(
        std::time::Duration::from_secs(10),
        "the failed attempt's evidence",
        || {
            let view = gateway.get("/v1/dispatches/op-503");
            view["attempts"][0]["evidence"]
                .as_array()
                .is_some_and(|rows| !rows.is_empty())
                .then_some(view)
        },
    );
    assert_eq!(view["state"], "FAILED", "{view}");
    let evidence = &view["attempts"][0]["evidence"][0];
    assert_eq!(evidence["status"], 503, "{evidence}");
    assert_eq!(evidence["generation"], 1);
    assert_eq!(evidence["request"], "send");
    assert!(
        evidence["error_body"]
            .as_str()
            .is_some_and(|body| body.contains("upstream overloaded: try later")),
        "{evidence}"
    );
    assert_eq!(evidence["error_body_truncated"], false);
    assert!(
        evidence["provider_request_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("req_sim_error_")),
        "{evidence}"
    );
    assert!(evidence["bytes_received"].as_u64().unwrap() > 0);
    assert!(
        evidence["head_ms"].is_u64() && evidence["duration_ms"].is_u64(),
        "{evidence}"
    );
    // The committed attempt's evidence rode in its commit: status, usage, timings.
    let view = gateway.get("/v1/dispatches/op-ok");
    let evidence = &view["attempts"][0]["evidence"];
    assert_eq!(evidence.as_array().map(Vec::len), Some(1), "{view}");
    assert_eq!(evidence[0]["status"], 200, "{view}");
    assert_eq!(evidence[0]["end"], "committed", "{view}");
    assert_eq!(evidence[0]["error_body"], Value::Null);
    assert!(evidence[0]["first_byte_ms"].is_u64(), "{view}");
    // Never a credential.
    let text = serde_json::to_string(&view).unwrap();
    assert!(!text.contains("sk-test-SECRET-KEY-123"));
    // A stream cut mid-answer: its generation's evidence keeps the preview it retracted.
    conversation_with_question(&gateway, "c-cut");
    let words = "Sunny in Paris and mild in Tokyo, with a light breeze all afternoon. ".repeat(4);
    sim.script(
        "m-cut",
        json!([{"text": words, "faults": {"cut_at_byte": 600}}, {"text": "Sunny."}]),
    );
    let (status, body) = gateway.post(
        "/v1/conversations/c-cut/dispatch",
        json!({"operation_id": "op-cut", "target": {"provider": "sim", "model": "m-cut", "adapter": "openai-chat@2"}}),
    );
    assert_eq!(status, 200, "{body}");
    let view = crate::recovery::wait_for(
        std::time::Duration::from_secs(10),
        "the cut attempt's evidence",
        || {
            let view = gateway.get("/v1/dispatches/op-cut");
            view["attempts"][0]["evidence"][0]["retracted_preview"]
                .is_object()
                .then_some(view)
        },
    );
    assert_eq!(view["state"], "COMMITTED", "{view}");
    let cut = &view["attempts"][0]["evidence"][0];
    assert_eq!(cut["status"], 200, "{cut}");
    let retracted = &cut["retracted_preview"];
    assert!(
        retracted["reason"]
            .as_str()
            .is_some_and(|reason| !reason.is_empty()),
        "{cut}"
    );
    assert!(
        retracted["text"]
            .as_str()
            .is_some_and(|text| !text.is_empty() && words.starts_with(text)),
        "{cut}"
    );
}

/// Every line of a JSON log, parsed (a line that is not a JSON object fails the test).
fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let value: Value =
                serde_json::from_str(line).unwrap_or_else(|error| panic!("not JSON ({error}): {line}"));
            assert!(value.is_object(), "{line}");
            value
        })
        .collect()
}

fn line_with<'a>(lines: &'a [Value], what: &str, matches: impl Fn(&Value) -> bool) -> &'a Value {
    lines
        .iter()
        .find(|line| matches(line))
        .unwrap_or_else(|| panic!("no line for {what} in\n{lines:#?}"))
}

fn is_trace_id(value: &Value) -> bool {
    value.as_str().is_some_and(|id| {
        id.len() == 32 && id.bytes().all(|byte| byte.is_ascii_hexdigit()) && id != "0".repeat(32)
    })
}

/// The JSON log of a run with a FAILED dispatch, one recovered after a `kill -9`, and a
/// shutdown: one line each, tied to the operation id and the trace id, and nothing else but
/// JSON (no colour codes) on standard error.
#[test]
fn a_json_log_has_one_line_for_a_failed_dispatch_a_recovered_one_and_the_shutdown() {
    let sim = SimProcess::start();
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    let store = sqlite(&dir_a);
    // A collector nobody answers: spans (and their trace ids) exist, their export fails.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let collector = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let config = format!("log_format = \"json\"\notlp_endpoint = \"{collector}\"\n");
    let mut a = Gateway::start(&dir_a, &store, &sim, &config);
    conversation_with_question(&a, "c-failed");
    sim.script("m-failed", json!([{"text": "never", "faults": {"status": 503}}]));
    let (status, body) = a.post(
        "/v1/conversations/c-failed/dispatch",
        json!({"operation_id": "op-failed", "target": {"provider": "sim", "model": "m-failed", "adapter": "openai-chat@2"}}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(a.get("/v1/dispatches/op-failed")["state"], "FAILED");
    // A slow stream, killed mid-way; the next process recovers it with a new generation.
    conversation_with_question(&a, "c-recovered");
    sim.script(
        "m-recovered",
        json!([{"text": "word ".repeat(40), "faults": {"delay_ms": 100}}, {"text": "Recovered: sunny."}]),
    );
    let body = json!({"operation_id": "op-recovered", "stream": true,
                      "target": {"provider": "sim", "model": "m-recovered", "adapter": "openai-chat@2"}});
    let reader = crate::recovery::dispatch_until_preview(&a, "c-recovered", body);
    a.kill();
    drop(reader);
    let mut b = Gateway::start(&dir_b, &store, &sim, &config);
    let dispatch = crate::recovery::terminal(&b, "op-recovered");
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
    b.terminate();
    assert!(
        b.wait_exit(std::time::Duration::from_secs(30)).is_some(),
        "b did not stop"
    );

    let log_a = a.log_text();
    let log_b = b.log_text();
    assert!(
        !log_a.contains('\u{1b}') && !log_b.contains('\u{1b}'),
        "colour codes in a log file"
    );
    let lines_a = json_lines(&log_a);
    let lines_b = json_lines(&log_b);
    fn ended(operation: &'static str) -> impl Fn(&Value) -> bool {
        move |line: &Value| line["message"] == "dispatch ended" && line["operation_id"] == operation
    }
    // The FAILED dispatch: one line, with its attempt's status and the trace id.
    let failed = line_with(&lines_a, "op-failed's end", ended("op-failed"));
    assert_eq!(failed["state"], "FAILED", "{failed}");
    assert_eq!(failed["conversation_id"], "c-failed", "{failed}");
    assert!(is_trace_id(&failed["trace_id"]), "{failed}");
    assert!(
        failed["attempts"]
            .as_str()
            .is_some_and(|attempts| attempts.contains(":503:")),
        "{failed}"
    );
    assert_eq!(lines_a.iter().filter(|line| ended("op-failed")(line)).count(), 1);
    // Its HTTP request, by route, with its status.
    line_with(&lines_a, "the dispatch request", |line| {
        line["target"] == "turnstile::http"
            && line["route"] == "/v1/conversations/{id}/dispatch"
            && line["status"] == 200
    });
    line_with(&lines_a, "the dispatch view request", |line| {
        line["target"] == "turnstile::http" && line["operation_id"] == "op-failed"
    });
    // The next process: its start, the take-over and the recovered dispatch's end, same trace.
    let start = line_with(&lines_b, "the start", |line| line["target"] == "turnstile::start");
    assert_eq!(start["version"], env!("CARGO_PKG_VERSION"), "{start}");
    line_with(&lines_b, "the take-over", |line| {
        line["target"] == "turnstile::recovery" && line["operation_id"] == "op-recovered"
    });
    let recovered = line_with(&lines_b, "op-recovered's end", ended("op-recovered"));
    assert_eq!(recovered["state"], "COMMITTED", "{recovered}");
    assert!(is_trace_id(&recovered["trace_id"]), "{recovered}");
    assert!(
        recovered["output_tokens"]
            .as_u64()
            .is_some_and(|tokens| tokens > 0),
        "{recovered}"
    );
    // The shutdown: what was in flight, and that it stopped.
    line_with(&lines_b, "the shutdown signal", |line| {
        line["target"] == "turnstile::shutdown" && line["in_flight"].is_string()
    });
    line_with(&lines_b, "the stop", |line| {
        line["target"] == "turnstile::shutdown" && line["message"] == "stopped"
    });
}

/// A Prometheus server (Debian's `prometheus`), killed on drop.
struct Prometheus {
    child: std::process::Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Scrape `target` (host:port) every second, with `rules` loaded.
    fn start(target: &str, rules: &std::path::Path) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: [{:?}]\n\
                 scrape_configs:\n  - job_name: turnstile\n    static_configs: [{{targets: [{target:?}]}}]\n",
                rules.display().to_string()
            ),
        )
        .unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("prometheus.log")).unwrap())
            .spawn()
            .expect("prometheus (Debian package `prometheus`; scripts/test installs it)");
        let prometheus = Prometheus {
            child,
            base: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        };
        crate::recovery::wait_for(
            std::time::Duration::from_secs(30),
            "prometheus to be ready",
            || {
                client()
                    .get(format!("{}/-/ready", prometheus.base))
                    .send()
                    .ok()
                    .filter(|response| response.status().is_success())
            },
        );
        prometheus
    }

    /// The value of an instant query's single sample, if it has one.
    fn scalar(&self, query: &str) -> Option<f64> {
        let answer: Value = client()
            .get(
                reqwest::Url::parse_with_params(&format!("{}/api/v1/query", self.base), [("query", query)])
                    .unwrap(),
            )
            .send()
            .ok()?
            .json()
            .ok()?;
        assert_eq!(answer["status"], "success", "{query}: {answer}");
        let result = answer["data"]["result"].as_array()?;
        assert!(result.len() <= 1, "{query}: {answer}");
        result.first()?["value"][1].as_str()?.parse().ok()
    }
}

fn dispatch_ok(gateway: &Gateway, conversation: &str) {
    conversation_with_question(gateway, conversation);
    let (status, body) = gateway.post(
        &format!("/v1/conversations/{conversation}/dispatch"),
        json!({"operation_id": format!("op-{conversation}"), "target": {"provider": "sim", "model": "m-ok", "adapter": "openai-chat@2"}}),
    );
    assert_eq!(status, 200, "{body}");
}

/// The repository's ready-made views: the alerting rules pass `promtool check rules` and load
/// into a real Prometheus; every metric the rules and the Grafana dashboard name is one the
/// gateway exports; and that Prometheus, scraping a running gateway, answers `histogram_quantile` over the
/// dispatch duration (cumulative, then as a rate over new traffic).
#[test]
fn a_real_prometheus_scrapes_the_gateway_and_answers_a_dispatch_duration_quantile() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let rules = root.join("deploy/prometheus/turnstile-alerts.yml");
    let dashboard = root.join("deploy/grafana/turnstile-dashboard.json");
    let checked = Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&rules)
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "{}",
        String::from_utf8_lossy(&checked.stdout)
    );
    let dashboard_text = std::fs::read_to_string(&dashboard).unwrap();
    let parsed: Value = serde_json::from_str(&dashboard_text).unwrap();
    assert!(
        parsed["panels"]
            .as_array()
            .is_some_and(|panels| !panels.is_empty())
    );

    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_traffic(&dir, &sim);
    // Every family the gateway describes (a family appears on the page once it has a series;
    // the tidy check that every family on the page is described is the first test's).
    let families: BTreeSet<String> = turnstile_gateway::serve::metrics::HELP
        .iter()
        .map(|(name, _)| (*name).to_owned())
        .collect();
    let named = std::fs::read_to_string(&rules).unwrap() + &dashboard_text;
    let mut checked = 0;
    for word in named.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if !word.starts_with("turnstile_") {
            continue;
        }
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suffix| word.strip_suffix(suffix).filter(|base| families.contains(*base)))
            .unwrap_or(word);
        assert!(
            families.contains(family),
            "{word} is named in deploy/ but not on /metrics"
        );
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} metric names found in deploy/");

    let target = gateway.base.trim_start_matches("http://").to_owned();
    let prometheus = Prometheus::start(&target, &rules);
    let cumulative = "histogram_quantile(0.5, sum by (le) (turnstile_dispatch_duration_seconds_bucket{job=\"turnstile\"}))";
    let median = crate::recovery::wait_for(std::time::Duration::from_secs(30), "a scraped quantile", || {
        prometheus.scalar(cumulative).filter(|value| value.is_finite())
    });
    assert!(median > 0.0 && median <= 600.0, "{median}");
    // New traffic after the first scrapes: the usual dashboard query, a rate over a window.
    for index in 0..3 {
        dispatch_ok(&gateway, &format!("c-more-{index}"));
    }
    let windowed =
        "histogram_quantile(0.95, sum by (le) (rate(turnstile_dispatch_duration_seconds_bucket[1m])))";
    let p95 = crate::recovery::wait_for(
        std::time::Duration::from_secs(30),
        "a quantile of the rate",
        || prometheus.scalar(windowed).filter(|value| value.is_finite()),
    );
    assert!(p95 > 0.0 && p95 <= 600.0, "{p95}");
    // The rules loaded and are evaluated (none fires on this healthy gateway but the 503's).
    let rules_answer: Value = client()
        .get(format!("{}/api/v1/rules", prometheus.base))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let loaded = rules_answer["data"]["groups"][0]["rules"]
        .as_array()
        .map_or(0, Vec::len);
    assert_eq!(loaded, 6, "{rules_answer}");
}
