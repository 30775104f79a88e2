//! OpenTelemetry traces end to end: `turnstile serve` and `turnstile sim` as processes on
//! loopback, exporting OTLP/HTTP to a receiver in this test process that decodes every body
//! with the published OpenTelemetry protobuf definitions (`opentelemetry-proto` + prost). Each
//! test checks the span tree, the attribute values against what `/v1/dispatches` reports, the
//! `traceparent` the simulator received, and that no key or message text is in any exported
//! byte.

use crate::serve::{Gateway, client, client_events, conversation_with_question, named, sqlite, two_calls};
use crate::sim::SimProcess;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{Span, span::SpanKind, status::StatusCode};
use prost::Message as _;
use serde_json::{Value, json};
use std::io::Read as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Everything the receiver got: raw bodies, and each span with its resource's attributes.
#[derive(Default)]
struct Received {
    bodies: Vec<Vec<u8>>,
    spans: Vec<(Span, Vec<KeyValue>)>,
}

/// An OTLP/HTTP trace receiver on loopback (axum on its own runtime thread), stopped on drop.
struct Collector {
    base: String,
    received: Arc<Mutex<Received>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Collector {
    fn start() -> Collector {
        let received = Arc::new(Mutex::new(Received::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (bound, address) = std::sync::mpsc::channel();
        let state = received.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                bound.send(listener.local_addr().unwrap()).unwrap();
                let app = axum::Router::new()
                    .route("/v1/traces", axum::routing::post(receive))
                    .with_state(state);
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await
                    .unwrap();
            });
        });
        let address = address.recv().unwrap();
        Collector {
            base: format!("http://{address}"),
            received,
            stop: Some(stop),
        }
    }

    /// Wait (bounded) until `done` holds for the spans received so far; the spans then.
    fn wait_for(&self, what: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let spans: Vec<Span> = self
                .received
                .lock()
                .unwrap()
                .spans
                .iter()
                .map(|(span, _)| span.clone())
                .collect();
            if done(&spans) {
                return spans;
            }
            assert!(Instant::now() < deadline, "no {what} within 30 s; got {spans:#?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every byte received so far, concatenated.
    fn bytes(&self) -> Vec<u8> {
        self.received.lock().unwrap().bodies.concat()
    }

    fn resource_of(&self, span_id: &[u8]) -> Vec<KeyValue> {
        let received = self.received.lock().unwrap();
        received
            .spans
            .iter()
            .find(|(span, _)| span.span_id == span_id)
            .map(|(_, resource)| resource.clone())
            .unwrap_or_default()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn receive(
    axum::extract::State(state): axum::extract::State<Arc<Mutex<Received>>>,
    body: axum::body::Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let Ok(request) = ExportTraceServiceRequest::decode(body.as_ref()) else {
        return axum::http::StatusCode::BAD_REQUEST.into_response();
    };
    let mut received = state.lock().unwrap();
    received.bodies.push(body.to_vec());
    for resource_spans in request.resource_spans {
        let resource = resource_spans
            .resource
            .map(|resource| resource.attributes)
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                received.spans.push((span, resource.clone()));
            }
        }
    }
    (
        [("content-type", "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
        .into_response()
}

/// An attribute's value as JSON (strings, ints, bools, arrays).
fn json_of(value: &AnyValue) -> Value {
    match &value.value {
        Some(any_value::Value::StringValue(text)) => json!(text),
        Some(any_value::Value::IntValue(number)) => json!(number),
        Some(any_value::Value::BoolValue(flag)) => json!(flag),
        Some(any_value::Value::DoubleValue(number)) => json!(number),
        Some(any_value::Value::ArrayValue(array)) => Value::Array(array.values.iter().map(json_of).collect()),
        _ => Value::Null,
    }
}

fn attribute_in(attributes: &[KeyValue], key: &str) -> Value {
    attributes
        .iter()
        .find(|attribute| attribute.key == key)
        .and_then(|attribute| attribute.value.as_ref())
        .map_or(Value::Null, json_of)
}

fn attribute(span: &Span, key: &str) -> Value {
    attribute_in(&span.attributes, key)
}

fn event_names(span: &Span) -> Vec<&str> {
    span.events.iter().map(|event| event.name.as_str()).collect()
}

fn hex(bytes: &[u8]) -> String {
    crate::serve::hex(bytes)
}

/// The dispatch span of `operation` and its attempt spans by generation (ascending).
fn tree<'a>(spans: &'a [Span], operation: &str) -> Option<(&'a Span, Vec<&'a Span>)> {
    let dispatch = spans.iter().find(|span| {
        span.kind == SpanKind::Internal as i32
            && attribute(span, "turnstile.operation_id") == json!(operation)
    })?;
    let mut attempts: Vec<&Span> = spans
        .iter()
        .filter(|span| span.parent_span_id == dispatch.span_id && span.kind == SpanKind::Client as i32)
        .collect();
    attempts.sort_by_key(|span| attribute(span, "turnstile.generation").as_i64());
    Some((dispatch, attempts))
}

/// Environment that makes the gateway export to `collector` quickly.
fn otel_env(collector: &Collector) -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.base.clone()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ("OTEL_SERVICE_NAME", "turnstile-under-test".into()),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment.name=test,team=gateway".into(),
        ),
    ]
}

fn start_traced(
    dir: &tempfile::TempDir,
    sim: &SimProcess,
    config: &str,
    env: &[(&'static str, String)],
) -> Gateway {
    let env: Vec<(&str, &str)> = env.iter().map(|(name, value)| (*name, value.as_str())).collect();
    Gateway::start_with_env(dir, &sqlite(dir), Some(&sim.base), config, &env).unwrap()
}

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn traceparent() -> String {
    format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01")
}

/// Stream a native dispatch with a caller's `traceparent`; the client events.
fn dispatch_traced(
    gateway: &Gateway,
    conversation: &str,
    operation: &str,
    target: Value,
) -> Vec<(String, Value)> {
    let body = json!({"operation_id": operation, "target": target, "stream": true, "max_output_tokens": 256});
    let response = client()
        .post(format!(
            "{}/v1/conversations/{conversation}/dispatch",
            gateway.base
        ))
        .header("traceparent", traceparent())
        .header("tracestate", "vendor=opaque")
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut text = String::new();
    { response }.read_to_string(&mut text).unwrap();
    client_events(&text)
}

/// The `traceparent` the simulator received on requests whose path contains `path`.
fn sent_traceparents(sim: &SimProcess, path: &str) -> Vec<String> {
    sim.requests()
        .into_iter()
        .filter(|request| request["path"].as_str().is_some_and(|sent| sent.contains(path)))
        .filter_map(|request| request["headers"]["traceparent"].as_str().map(str::to_owned))
        .collect()
}

/// GenAI attributes of a committed attempt (or its dispatch) equal what `/v1/dispatches` says.
fn assert_outcome_matches(span: &Span, dispatch: &Value) {
    let outcome = &dispatch["outcome"];
    assert!(
        outcome["usage"]["output_tokens"]
            .as_u64()
            .is_some_and(|tokens| tokens > 0),
        "{dispatch}"
    );
    assert_eq!(
        attribute(span, "gen_ai.usage.input_tokens"),
        outcome["usage"]["input_tokens"],
        "{span:#?}"
    );
    assert_eq!(
        attribute(span, "gen_ai.usage.output_tokens"),
        outcome["usage"]["output_tokens"],
        "{span:#?}"
    );
    assert_eq!(
        attribute(span, "gen_ai.response.finish_reasons"),
        json!([outcome["stop_reason"]]),
        "{span:#?}"
    );
}

#[test]
fn a_streamed_dispatch_joins_the_callers_trace_with_genai_attributes_and_no_key_or_text() {
    let collector = Collector::start();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_traced(
        &dir,
        &sim,
        &format!(
            "[providers.upstream]\nbase_url = \"{}\"\napi_key_env = \"TURNSTILE_TEST_PROVIDER_KEY\"\n",
            sim.base
        ),
        &otel_env(&collector),
    );
    conversation_with_question(&gateway, "c-trace");
    sim.script(
        "claude-trace",
        json!([{"text": "Sunny in Paris, rain in Tokyo."}]),
    );
    let events = dispatch_traced(
        &gateway,
        "c-trace",
        "op-trace",
        json!({"provider": "upstream", "model": "claude-trace", "adapter": "anthropic-messages@1"}),
    );
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    let spans = collector.wait_for("dispatch span with an attempt", |spans| {
        tree(spans, "op-trace").is_some_and(|(_, attempts)| attempts.len() == 1)
    });
    let (dispatch_span, attempts) = tree(&spans, "op-trace").unwrap();
    let attempt = attempts[0];
    let dispatch = gateway.get("/v1/dispatches/op-trace");

    // Our spans hang under the caller's span, in the caller's trace.
    assert_eq!(hex(&dispatch_span.trace_id), CALLER_TRACE);
    assert_eq!(hex(&dispatch_span.parent_span_id), CALLER_SPAN);
    assert_eq!(dispatch_span.trace_state, "vendor=opaque");
    assert_eq!(attempt.trace_id, dispatch_span.trace_id);
    assert_eq!(dispatch_span.name, "chat claude-trace");

    for span in [dispatch_span, attempt] {
        assert_eq!(attribute(span, "gen_ai.operation.name"), "chat");
        assert_eq!(attribute(span, "gen_ai.provider.name"), "anthropic");
        assert_eq!(attribute(span, "gen_ai.request.model"), "claude-trace");
        assert_eq!(attribute(span, "turnstile.operation_id"), "op-trace");
        assert_eq!(attribute(span, "turnstile.conversation_id"), "c-trace");
        assert_eq!(
            attribute(span, "turnstile.revision"),
            json!(dispatch["manifest"]["conversation_revision"])
        );
        assert_eq!(attribute(span, "turnstile.state"), "COMMITTED");
        assert_eq!(attribute(span, "turnstile.generation"), 1);
        assert_outcome_matches(span, &dispatch);
    }
    assert_eq!(
        attribute(attempt, "gen_ai.response.id"),
        dispatch["attempts"][0]["handle"]
    );
    assert!(
        dispatch["attempts"][0]["handle"]
            .as_str()
            .is_some_and(|handle| handle.starts_with("msg"))
    );
    assert_eq!(attribute(attempt, "http.response.status_code"), 200);
    assert_eq!(
        attempt.status.as_ref().map_or(0, |status| status.code),
        StatusCode::Unset as i32
    );
    let transitions: Vec<Value> = attempt
        .events
        .iter()
        .filter(|event| event.name == "turnstile.transition")
        .map(|event| attribute_in(&event.attributes, "turnstile.to"))
        .collect();
    assert_eq!(
        transitions,
        vec![json!("SENT"), json!("STREAMING")],
        "{attempt:#?}"
    );

    // The resource: the service name and attributes of the standard environment.
    let resource = collector.resource_of(&dispatch_span.span_id);
    assert_eq!(attribute_in(&resource, "service.name"), "turnstile-under-test");
    assert_eq!(attribute_in(&resource, "deployment.environment.name"), "test");

    // The provider got the attempt's context: same trace, the attempt span as parent.
    let sent = sent_traceparents(&sim, "/v1/messages");
    assert_eq!(
        sent,
        vec![format!("00-{CALLER_TRACE}-{}-01", hex(&attempt.span_id))],
        "{:?}",
        sim.requests()
    );

    // Nothing of the key, the question or the answer in any exported byte.
    let exported = String::from_utf8_lossy(&collector.bytes()).into_owned();
    for secret in ["SECRET-KEY", "Weather in Paris", "Sunny in Paris", "Tokyo"] {
        assert!(!exported.contains(secret), "{secret:?} was exported");
    }
    assert!(gateway.metric(r#"turnstile_trace_spans_total{outcome="exported"}"#) >= 2.0);
}

#[test]
fn a_retried_dispatch_has_one_attempt_span_per_generation_and_the_retract_on_the_first() {
    let collector = Collector::start();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_traced(&dir, &sim, "", &otel_env(&collector));
    conversation_with_question(&gateway, "c-retry");
    sim.script(
        "retry",
        json!([two_calls(json!({"cut_at_byte": 700})), two_calls(json!({}))]),
    );
    let events = gateway.dispatch("c-retry", "op-retry", "anthropic-messages@1", "retry");
    assert_eq!(named(&events, "retract").len(), 1, "{events:?}");
    let spans = collector.wait_for("two attempt spans", |spans| {
        tree(spans, "op-retry").is_some_and(|(_, attempts)| attempts.len() == 2)
    });
    let (dispatch_span, attempts) = tree(&spans, "op-retry").unwrap();
    let dispatch = gateway.get("/v1/dispatches/op-retry");
    // A new trace (the client sent no traceparent), both attempts under the dispatch.
    assert!(dispatch_span.parent_span_id.is_empty());
    let first = attempts[0];
    assert_eq!(attribute(first, "turnstile.generation"), 1);
    assert_eq!(attribute(first, "turnstile.state"), "ABANDONED");
    assert!(event_names(first).contains(&"turnstile.retract"), "{first:#?}");
    assert_eq!(
        first.status.as_ref().map(|status| status.code),
        Some(StatusCode::Error as i32)
    );
    assert!(
        attribute(first, "error.type")
            .as_str()
            .is_some_and(|error| !error.is_empty())
    );
    let second = attempts[1];
    assert_eq!(attribute(second, "turnstile.generation"), 2);
    assert_eq!(attribute(second, "turnstile.state"), "COMMITTED");
    assert_eq!(
        attribute(second, "gen_ai.response.id"),
        dispatch["attempts"][1]["handle"]
    );
    assert_eq!(attribute(dispatch_span, "turnstile.generation"), 2);
    assert_eq!(attribute(dispatch_span, "turnstile.state"), "COMMITTED");
    assert_outcome_matches(second, &dispatch);
    assert_outcome_matches(dispatch_span, &dispatch);
    let recoveries: Vec<Value> = dispatch_span
        .events
        .iter()
        .filter(|event| event.name == "turnstile.recovery")
        .map(|event| attribute_in(&event.attributes, "turnstile.recovery.outcome"))
        .collect();
    assert!(
        recoveries.contains(&json!("new_generation")),
        "{dispatch_span:#?}"
    );
    // Each attempt's request carried its own span as parent.
    let sent = sent_traceparents(&sim, "/v1/messages");
    let expected: Vec<String> = attempts
        .iter()
        .map(|attempt| format!("00-{}-{}-01", hex(&attempt.trace_id), hex(&attempt.span_id)))
        .collect();
    assert_eq!(sent, expected);
}

#[test]
fn a_resumed_stream_is_one_attempt_span_with_the_resume_as_its_event() {
    let collector = Collector::start();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_traced(&dir, &sim, "", &otel_env(&collector));
    conversation_with_question(&gateway, "c-resume");
    sim.script(
        "resume",
        json!([two_calls(json!({"disconnect_after_events": 9}))]),
    );
    let events = gateway.dispatch("c-resume", "op-resume", "openai-responses@1", "resume");
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    let spans = collector.wait_for("the dispatch span", |spans| tree(spans, "op-resume").is_some());
    let (dispatch_span, attempts) = tree(&spans, "op-resume").unwrap();
    assert_eq!(attempts.len(), 1, "{spans:#?}");
    let attempt = attempts[0];
    let names = event_names(attempt);
    assert!(names.contains(&"turnstile.resume"), "{attempt:#?}");
    let requests: Vec<Value> = attempt
        .events
        .iter()
        .filter(|event| event.name == "turnstile.connection")
        .map(|event| attribute_in(&event.attributes, "turnstile.request"))
        .collect();
    assert_eq!(requests, vec![json!("send"), json!("resume")]);
    assert_eq!(attribute(attempt, "turnstile.state"), "COMMITTED");
    assert_eq!(attribute(attempt, "gen_ai.provider.name"), "openai");
    let dispatch = gateway.get("/v1/dispatches/op-resume");
    assert_eq!(
        attribute(attempt, "gen_ai.response.id"),
        dispatch["attempts"][0]["handle"]
    );
    assert_outcome_matches(attempt, &dispatch);
    let outcome = dispatch_span
        .events
        .iter()
        .find(|event| event.name == "turnstile.recovery")
        .map(|event| attribute_in(&event.attributes, "turnstile.recovery.outcome"));
    assert_eq!(outcome, Some(json!("resumed")));
    // The resume request carried the same attempt's context as the first send.
    let parent = format!("00-{}-{}-01", hex(&attempt.trace_id), hex(&attempt.span_id));
    assert_eq!(
        sent_traceparents(&sim, "/v1/responses"),
        vec![parent.clone(), parent]
    );
}

#[test]
fn a_dispatch_recovered_after_a_crash_is_traced_by_the_process_that_recovers_it() {
    use std::io::BufRead as _;
    let collector = Collector::start();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir);
    // The config key, not the environment, names the collector here.
    let config = format!("otlp_endpoint = \"{}\"\n", collector.base);
    let env = [("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let mut gateway = Gateway::start_with_env(&dir, &store, Some(&sim.base), &config, &env).unwrap();
    conversation_with_question(&gateway, "c-crash");
    sim.script(
        "crash",
        json!([{"text": "cut by the crash", "faults": {"delay_ms": 150}}, {"text": "after recovery"}]),
    );
    let body = json!({"operation_id": "op-crash", "target": {"provider": "sim", "model": "crash", "adapter": "anthropic-messages@1"}, "stream": true});
    let response = client()
        .post(format!("{}/v1/conversations/c-crash/dispatch", gateway.base))
        .json(&body)
        .send()
        .unwrap();
    let mut reader = std::io::BufReader::new(response);
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap() > 0 && !line.contains("event: preview") {}
    gateway.kill();
    drop(reader);
    let gateway = Gateway::start_with_env(&dir, &store, Some(&sim.base), &config, &env).unwrap();
    let spans = collector.wait_for("the recovering process's dispatch span", |spans| {
        tree(spans, "op-crash").is_some()
    });
    let (dispatch_span, attempts) = tree(&spans, "op-crash").unwrap();
    let dispatch = gateway.get("/v1/dispatches/op-crash");
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
    assert!(
        event_names(dispatch_span).contains(&"turnstile.recovery"),
        "{dispatch_span:#?}"
    );
    let states: Vec<(Value, Value)> = attempts
        .iter()
        .map(|span| {
            (
                attribute(span, "turnstile.generation"),
                attribute(span, "turnstile.state"),
            )
        })
        .collect();
    assert_eq!(
        states,
        vec![(json!(1), json!("ABANDONED")), (json!(2), json!("COMMITTED"))],
        "{spans:#?}"
    );
    assert_outcome_matches(dispatch_span, &dispatch);
    let resource = collector.resource_of(&dispatch_span.span_id);
    assert_eq!(
        attribute_in(&resource, "service.name"),
        "turnstile",
        "the default service name"
    );
}

#[test]
fn a_proxied_request_joins_the_callers_trace_and_its_traceparent_reaches_the_provider() {
    let collector = Collector::start();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_traced(&dir, &sim, "", &otel_env(&collector));
    sim.script("gpt-trace", json!([{"text": "Twelve degrees."}]));
    let body = json!({"model": "gpt-trace", "messages": [{"role": "user", "content": "How warm is Oslo?"}]});
    let response = client()
        .post(format!("{}/v1/chat/completions", gateway.base))
        .header("traceparent", traceparent())
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(response.status(), 200);
    let operation = response.headers()["x-turnstile-operation-id"]
        .to_str()
        .unwrap()
        .to_owned();
    let answer: Value = response.json().unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], "Twelve degrees.");
    let spans = collector.wait_for("the proxied dispatch span", |spans| {
        tree(spans, &operation).is_some_and(|(_, attempts)| attempts.len() == 1)
    });
    let (dispatch_span, attempts) = tree(&spans, &operation).unwrap();
    assert_eq!(hex(&dispatch_span.trace_id), CALLER_TRACE);
    assert_eq!(hex(&dispatch_span.parent_span_id), CALLER_SPAN);
    assert_eq!(attribute(dispatch_span, "gen_ai.provider.name"), "openai");
    assert_eq!(attribute(dispatch_span, "gen_ai.request.model"), "gpt-trace");
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    assert_outcome_matches(dispatch_span, &dispatch);
    assert_eq!(
        attribute(attempts[0], "gen_ai.response.id"),
        dispatch["attempts"][0]["handle"]
    );
    assert_eq!(
        sent_traceparents(&sim, "/v1/chat/completions"),
        vec![format!("00-{CALLER_TRACE}-{}-01", hex(&attempts[0].span_id))]
    );
    let exported = String::from_utf8_lossy(&collector.bytes()).into_owned();
    assert!(
        !exported.contains("Oslo") && !exported.contains("Twelve"),
        "message text was exported"
    );
}

#[test]
fn content_capture_records_the_conventions_messages_only_when_turned_on() {
    let collector = Collector::start();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = start_traced(&dir, &sim, "otlp_capture_content = true\n", &otel_env(&collector));
    conversation_with_question(&gateway, "c-content");
    sim.script("content", json!([{"text": "Sunny in Paris."}]));
    let events = gateway.dispatch("c-content", "op-content", "anthropic-messages@1", "content");
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    let spans = collector.wait_for("the dispatch span", |spans| tree(spans, "op-content").is_some());
    let (dispatch_span, attempts) = tree(&spans, "op-content").unwrap();
    let input: Value = serde_json::from_str(
        attribute(dispatch_span, "gen_ai.input.messages")
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        input,
        json!([{"role": "user", "parts": [{"type": "text", "content": "Weather in Paris and Tokyo?"}]}])
    );
    let output: Value = serde_json::from_str(
        attribute(dispatch_span, "gen_ai.output.messages")
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(output[0]["role"], "assistant");
    assert_eq!(
        output[0]["parts"],
        json!([{"type": "text", "content": "Sunny in Paris."}])
    );
    assert_eq!(
        output[0]["finish_reason"],
        gateway.get("/v1/dispatches/op-content")["outcome"]["stop_reason"]
    );
    // Content goes on the dispatch span only, once.
    assert_eq!(attribute(attempts[0], "gen_ai.input.messages"), Value::Null);
}

#[test]
fn without_an_endpoint_nothing_is_traced_and_no_traceparent_is_sent() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    conversation_with_question(&gateway, "c-off");
    let events = dispatch_traced(
        &gateway,
        "c-off",
        "op-off",
        json!({"provider": "sim", "model": "off", "adapter": "openai-chat@1"}),
    );
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    let requests = sim.requests();
    assert!(!requests.is_empty());
    assert!(
        requests
            .iter()
            .all(|request| request["headers"].get("traceparent").is_none()),
        "{requests:?}"
    );
    let metrics = client()
        .get(format!("{}/metrics", gateway.base))
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(!metrics.contains("turnstile_trace_"), "{metrics}");
}

#[test]
fn the_gateway_keeps_serving_while_the_collector_hangs_and_the_export_queue_stays_bounded() {
    // A collector that takes connections and never answers: every export waits for its
    // timeout, so spans pile up in front of it.
    let hanging = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", hanging.local_addr().unwrap());
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "600000"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "4"),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2"),
        ("OTEL_BSP_SCHEDULE_DELAY", "10"),
    ];
    let gateway = Gateway::start_with_env(&dir, &sqlite(&dir), Some(&sim.base), "", &env).unwrap();
    let dispatches = 12;
    let started = Instant::now();
    for index in 0..dispatches {
        let id = format!("c-down-{index}");
        conversation_with_question(&gateway, &id);
        let events = gateway.dispatch(&id, &format!("op-down-{index}"), "openai-chat@1", "down");
        assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    }
    eprintln!(
        "{dispatches} dispatches with the collector hanging: {:?} ({:?} each)",
        started.elapsed(),
        started.elapsed() / dispatches
    );
    // Every span ended (a dispatch and an attempt span per dispatch) is queued or dropped:
    // nothing was exported, nothing waited, and the queue never held more than its bound.
    let spans = 2.0 * f64::from(dispatches);
    let deadline = Instant::now() + Duration::from_secs(30);
    let (queued, dropped) = loop {
        let queued = gateway.metric("turnstile_trace_queue_spans");
        let dropped = gateway.metric(r#"turnstile_trace_spans_total{outcome="dropped"}"#);
        if queued + dropped >= spans || Instant::now() > deadline {
            break (queued, dropped);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(queued <= 4.0, "{queued} spans queued");
    assert_eq!(
        gateway.metric(r#"turnstile_trace_spans_total{outcome="exported"}"#),
        0.0
    );
    assert_eq!(
        gateway.metric(r#"turnstile_trace_spans_total{outcome="failed"}"#),
        0.0
    );
    assert_eq!(queued + dropped, spans);
    assert!(dropped >= spans - 4.0);
    drop(hanging);
}
