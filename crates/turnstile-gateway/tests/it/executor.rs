//! Executors on the tool-call ledger over real HTTP (`shared/spec/gateway-api.md`, "Tool-call
//! ledger for executors"): a gateway process on a real SQLite file, or two replicas sharing a
//! real PostgreSQL (one executor on each), the simulator as the provider, two executors with
//! their own holder names. One of them dies mid-call (stops renewing): its call is listed as
//! `expired`, the other claims it with the same idempotency key, the dead one's late renewal and
//! result are refused as stale, and the conversation proceeds. Tenant scoping, strict bodies and
//! the metrics ride along.

use crate::serve::{Gateway, client, pg_url, sqlite};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const TOOLS: &str = r#"[{"name": "charge_card", "input_schema": {"type": "object",
    "properties": {"cents": {"type": "integer"}}, "required": ["cents"], "additionalProperties": false}}]"#;
/// Longest the test waits for the store to list a lease as run out.
const EXPIRY_WAIT_MAX: Duration = Duration::from_secs(10);
/// The executors' working lease: never runs out during the test unless an executor stops.
const WORKING_LEASE_MS: u64 = 60_000;
/// The dying executor's last heartbeat asks for this much, then it is never heard of again.
const LAST_LEASE_MS: u64 = 200;

/// A caller of the gateway's API with a tenant's token.
struct Api<'g> {
    gateway: &'g Gateway,
    token: &'static str,
}

impl Api<'_> {
    fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = client()
            .request(method, format!("{}{path}", self.gateway.base))
            .bearer_auth(self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().unwrap();
        (
            response.status().as_u16(),
            response.json::<Value>().unwrap_or(Value::Null),
        )
    }
    fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, Some(body))
    }
    fn get(&self, path: &str) -> Value {
        let (status, body) = self.send(reqwest::Method::GET, path, None);
        assert_eq!(status, 200, "GET {path}: {body}");
        body
    }
    fn calls(&self, state: &str) -> Vec<Value> {
        self.get(&format!("/v1/tool-calls?state={state}"))["tool_calls"]
            .as_array()
            .unwrap()
            .clone()
    }
}

/// The tool both executors call: a card charge that honours an idempotency key (as payment
/// APIs do), so the effect of a call that ran twice is counted once per key.
#[derive(Default)]
struct ChargeTool {
    charges: HashMap<String, u64>,
    calls: u64,
}

impl ChargeTool {
    fn run(&mut self, idempotency_key: &str, arguments: &Value) -> Value {
        self.calls += 1;
        let cents = arguments["cents"].as_u64().unwrap();
        let charged = *self.charges.entry(idempotency_key.to_owned()).or_insert(cents);
        json!([{"kind": "text", "text": format!("charged {charged} cents")}])
    }
}

/// One executor: list → claim → run with the idempotency key → renew while running → result.
struct Executor<'a> {
    api: &'a Api<'a>,
    holder: &'static str,
}

struct Held {
    call_id: String,
    claim: u64,
    idempotency_key: String,
    arguments: Value,
    lease_expires_at: u64,
}

impl Executor<'_> {
    fn claim(&self, call: &Value) -> Result<Held, (u16, Value)> {
        let call_id = call["call_id"].as_str().unwrap().to_owned();
        let (status, body) = self.api.post(
            &format!("/v1/tool-calls/conv/{call_id}/claim"),
            json!({"holder": self.holder, "lease_ms": WORKING_LEASE_MS}),
        );
        if status != 200 {
            return Err((status, body));
        }
        Ok(Held {
            call_id,
            claim: body["claim"].as_u64().unwrap(),
            idempotency_key: body["idempotency_key"].as_str().unwrap().to_owned(),
            arguments: call["arguments"].clone(),
            lease_expires_at: body["lease_expires_at"].as_u64().unwrap(),
        })
    }

    fn renew(&self, held: &Held, lease_ms: u64) -> (u16, Value) {
        self.api.post(
            &format!("/v1/tool-calls/conv/{}/renew", held.call_id),
            json!({"claim": held.claim, "lease_ms": lease_ms}),
        )
    }

    fn result(&self, held: &Held, content: Value) -> (u16, Value) {
        self.api.post(
            &format!("/v1/tool-calls/conv/{}/result", held.call_id),
            json!({"claim": held.claim, "status": "success", "content": content}),
        )
    }
}

fn conversation_with_two_calls(api: &Api<'_>, sim: &SimProcess) -> (String, String) {
    let tools: Value = serde_json::from_str(TOOLS).unwrap();
    let (status, _) = api.post(
        "/v1/conversations",
        json!({"conversation_id": "conv", "tools": tools}),
    );
    assert_eq!(status, 201);
    let (status, _) = api.post(
        "/v1/conversations/conv/turns",
        json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user",
               "blocks": [{"id": "u1", "kind": "text", "text": "Pay both invoices."}]}}),
    );
    assert_eq!(status, 200);
    sim.script(
        "exec-model",
        json!([{"text": "Paying.", "tool_calls": [
                   {"name": "charge_card", "arguments": {"cents": 1200}},
                   {"name": "charge_card", "arguments": {"cents": 3400}}]},
               {"text": "Both paid."}]),
    );
    let committed = dispatch(api, "op-1");
    assert_eq!(committed["revision"], 2, "{committed}");
    let ids: Vec<String> = committed["turn"]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|block| block["kind"] == "tool_call")
        .map(|block| block["call_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), 2, "{committed}");
    (ids[0].clone(), ids[1].clone())
}

fn dispatch(api: &Api<'_>, operation_id: &str) -> Value {
    let (status, body) = api.post(
        "/v1/conversations/conv/dispatch",
        json!({"operation_id": operation_id, "stream": false, "max_output_tokens": 256,
               "target": {"provider": "sim", "model": "exec-model", "adapter": "openai-chat@1"}}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "COMMITTED", "{body}");
    body
}

fn listed<'v>(calls: &'v [Value], call_id: &str) -> Option<&'v Value> {
    calls.iter().find(|call| call["call_id"] == call_id)
}

#[test]
fn an_executor_that_dies_mid_call_is_taken_over_with_the_same_key_and_its_late_result_is_refused() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, &tenants("one"));
    executor_dies_mid_call(&sim, [&gateway, &gateway]);
}

/// The same with the two executors on two gateway replicas sharing one PostgreSQL: the lease
/// one replica granted runs out on the store's clock for the other.
#[test]
fn on_two_gateways_sharing_postgresql_an_executor_on_one_takes_over_the_dead_executor_s_call_on_the_other() {
    let url = pg_url();
    let sim = SimProcess::start();
    // Tenant names unique to this run keep its calls apart from earlier runs on the same database.
    let run = format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let first = Gateway::start(
        &dir_a,
        &url,
        &sim,
        &format!("replica_id = \"exec-a-{run}\"\n{}", tenants(&run)),
    );
    let second = Gateway::start(
        &dir_b,
        &url,
        &sim,
        &format!("replica_id = \"exec-b-{run}\"\n{}", tenants(&run)),
    );
    executor_dies_mid_call(&sim, [&first, &second]);
}

fn tenants(run: &str) -> String {
    format!(
        "[[tenants]]\nname = \"acme-{run}\"\ntoken = \"tok-acme\"\n[[tenants]]\nname = \"globex-{run}\"\ntoken = \"tok-globex\"\n"
    )
}

/// A counter summed over the distinct gateways (counters are per process).
fn metric_sum(gateways: [&Gateway; 2], name: &str) -> f64 {
    let first = gateways[0].metric(name);
    if gateways[0].base == gateways[1].base {
        first
    } else {
        first + gateways[1].metric(name)
    }
}

/// Executor A works through `gateways[0]`, executor B (and the other tenant) through
/// `gateways[1]`.
fn executor_dies_mid_call(sim: &SimProcess, gateways: [&Gateway; 2]) {
    let acme = Api {
        gateway: gateways[0],
        token: "tok-acme",
    };
    let acme_b = Api {
        gateway: gateways[1],
        token: "tok-acme",
    };
    let globex = Api {
        gateway: gateways[1],
        token: "tok-globex",
    };
    let (first, second) = conversation_with_two_calls(&acme, sim);
    let mut tool = ChargeTool::default();
    let a = Executor {
        api: &acme,
        holder: "executor-a",
    };
    let b = Executor {
        api: &acme_b,
        holder: "executor-b",
    };

    // Another tenant sees none of it and can touch none of it.
    assert!(globex.calls("ready").is_empty());
    let (status, body) = globex.post(
        &format!("/v1/tool-calls/conv/{first}/claim"),
        json!({"holder": "intruder"}),
    );
    assert_eq!((status, body["error"]["code"].clone()), (404, json!("not_found")));

    // A claims the first call, starts the charge, renews while it runs ... and dies after its
    // last heartbeat.
    let ready = acme.calls("ready");
    assert_eq!(ready.len(), 2);
    let mine = listed(&ready, &first).unwrap();
    assert_eq!(
        (mine["claims"].clone(), mine["claim_expires_at"].clone()),
        (json!(0), Value::Null)
    );
    let held_by_a = a.claim(mine).unwrap();
    assert_eq!(held_by_a.claim, 1);
    let _ = tool.run(&held_by_a.idempotency_key, &held_by_a.arguments);
    let (status, renewed) = a.renew(&held_by_a, WORKING_LEASE_MS);
    assert_eq!(status, 200, "{renewed}");
    assert_eq!(renewed["claim"], 1);
    assert!(renewed["lease_expires_at"].as_u64().unwrap() >= held_by_a.lease_expires_at);
    for (status, body) in [
        globex.post(&format!("/v1/tool-calls/conv/{first}/renew"), json!({"claim": 1})),
        globex.post(
            &format!("/v1/tool-calls/conv/{first}/release"),
            json!({"claim": 1}),
        ),
    ] {
        assert_eq!((status, body["error"]["code"].clone()), (404, json!("not_found")));
    }

    // B meanwhile: the first call is A's while A's lease runs; B runs the second one whole.
    let ready = acme.calls("ready");
    assert!(listed(&ready, &first).is_none());
    let claimed = acme.calls("claimed");
    let theirs = listed(&claimed, &first).unwrap();
    assert_eq!(theirs["holder"], "executor-a");
    assert_eq!(theirs["claims"], 1);
    assert!(theirs["claim_expires_at"].as_u64().is_some());
    let (status, refused) = b.claim(theirs).err().unwrap();
    assert_eq!(
        (
            status,
            refused["error"]["code"].clone(),
            refused["error"]["state"].clone()
        ),
        (409, json!("unavailable"), json!("claimed"))
    );
    let held = b.claim(listed(&ready, &second).unwrap()).unwrap();
    let content = tool.run(&held.idempotency_key, &held.arguments);
    assert_eq!(b.renew(&held, WORKING_LEASE_MS).0, 200);
    let (status, appended) = b.result(&held, content);
    assert_eq!((status, appended["revision"].clone()), (200, json!(3)));

    // A's last heartbeat; then nothing more from A.
    assert_eq!(a.renew(&held_by_a, LAST_LEASE_MS).0, 200);
    let deadline = Instant::now() + EXPIRY_WAIT_MAX;
    let expired = loop {
        if let Some(call) = listed(&acme.calls("expired"), &first) {
            break call.clone();
        }
        assert!(Instant::now() < deadline, "A's claim never expired");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(expired["state"], "expired");
    assert_eq!(expired["claims"], 1);
    assert_eq!(expired["holder"], "executor-a");
    assert_eq!(expired["idempotency_key"], json!(held_by_a.idempotency_key));
    assert!(listed(&acme.calls("claimed"), &first).is_none());

    // Too late to renew: the call was offered again.
    let (status, stale) = a.renew(&held_by_a, WORKING_LEASE_MS);
    assert_eq!(
        (
            status,
            stale["error"]["code"].clone(),
            stale["error"]["state"].clone()
        ),
        (409, json!("stale_claim"), json!("expired"))
    );

    // B takes it over with the same idempotency key: the charge is not made twice.
    let took_over = b.claim(&expired).unwrap();
    assert_eq!(took_over.claim, 2);
    assert_eq!(took_over.idempotency_key, held_by_a.idempotency_key);
    let content = tool.run(&took_over.idempotency_key, &took_over.arguments);
    assert_eq!(b.renew(&took_over, WORKING_LEASE_MS).0, 200);

    // A comes back from the dead with its result: refused; B's is accepted, once.
    let (status, stale) = a.result(&held_by_a, json!([{"kind": "text", "text": "charged by A"}]));
    assert_eq!(
        (status, stale["error"]["code"].clone()),
        (409, json!("stale_claim"))
    );
    let (status, appended) = b.result(&took_over, content.clone());
    assert_eq!((status, appended["revision"].clone()), (200, json!(4)));
    let (status, again) = b.result(&took_over, content);
    assert_eq!(
        (status, again["error"]["code"].clone()),
        (409, json!("duplicate_result"))
    );
    assert_eq!(tool.calls, 3, "the first call ran twice (at-least-once)");
    assert_eq!(tool.charges.len(), 2, "but one charge per call thanks to the key");

    // The conversation proceeds: the next dispatch sees both results, B's for the first call.
    let done = acme.calls("done");
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|call| call["state"] == "done"));
    let next = dispatch(&acme, "op-2");
    assert_eq!(next["revision"], 5);
    let history = acme.get("/v1/conversations/conv");
    let results: Vec<&Value> = history["turns"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|turn| turn["role"] == "tool")
        .flat_map(|turn| turn["blocks"].as_array().unwrap())
        .collect();
    assert_eq!(results.len(), 2);
    let first_result = results
        .iter()
        .find(|block| block["call_id"] == first.as_str())
        .unwrap();
    assert_eq!(first_result["content"][0]["text"], "charged 1200 cents");

    // Counted: three claims (one a takeover of an expired lease), four renewals, one stale result.
    for (name, count) in [
        ("turnstile_tool_call_claims_total", 3.0),
        ("turnstile_tool_call_expiries_total", 1.0),
        ("turnstile_tool_call_renewals_total", 4.0),
        ("turnstile_tool_result_stale_total", 1.0),
        ("turnstile_tool_call_releases_total", 0.0),
        ("turnstile_tool_result_duplicates_total", 1.0),
    ] {
        assert_eq!(metric_sum(gateways, name), count, "{name}");
    }
}

#[test]
fn executor_bodies_are_strict_leases_are_bounded_and_a_release_needs_the_current_claim() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, &tenants("one"));
    let acme = Api {
        gateway: &gateway,
        token: "tok-acme",
    };
    let (first, _) = conversation_with_two_calls(&acme, &sim);
    let claim_path = format!("/v1/tool-calls/conv/{first}/claim");
    for body in [
        json!({"holder": "x", "lease_ms": 0}),
        json!({"holder": "x", "lease_ms": 600_001}),
        json!({"holder": "x", "lease_ms": "soon"}),
        json!({"holder": "x", "extra": true}),
        json!({"holder": ""}),
        json!({"holder": "a\u{7}b"}),
        json!([1, 2]),
    ] {
        let (status, error) = acme.post(&claim_path, body.clone());
        assert_eq!(
            (status, error["error"]["code"].clone()),
            (422, json!("invalid_request")),
            "{body}"
        );
    }
    // A claim names its holder: an empty body (no bytes at all), `{}` and a lease alone are
    // refused by name, and the call stays ready with no claim counted (issue 49, item 8: an
    // empty body used to be granted claim 1 as holder "executor").
    let (status, error) = acme.send(reqwest::Method::POST, &claim_path, None);
    assert_eq!(
        (
            status,
            error["error"]["code"].clone(),
            error["error"]["field"].clone()
        ),
        (422, json!("invalid_request"), json!("holder")),
        "an empty body: {error}"
    );
    for body in [json!({}), json!({"lease_ms": WORKING_LEASE_MS})] {
        let (status, error) = acme.post(&claim_path, body.clone());
        assert_eq!(
            (
                status,
                error["error"]["code"].clone(),
                error["error"]["field"].clone()
            ),
            (422, json!("invalid_request"), json!("holder")),
            "{body}: {error}"
        );
    }
    assert!(acme.calls("claimed").is_empty(), "a refused body claimed nothing");
    let ready = acme.calls("ready");
    assert_eq!(
        listed(&ready, &first).map(|call| call["claims"].clone()),
        Some(json!(0)),
        "{ready:?}"
    );
    let (status, granted) = acme.post(
        &claim_path,
        json!({"holder": "exec-1", "lease_ms": WORKING_LEASE_MS}),
    );
    assert_eq!(status, 200, "{granted}");
    let claim = granted["claim"].as_u64().unwrap();
    let key = granted["idempotency_key"].as_str().unwrap().to_owned();
    assert_eq!(granted["took_over_expired"], false);
    let renew_path = format!("/v1/tool-calls/conv/{first}/renew");
    let release_path = format!("/v1/tool-calls/conv/{first}/release");
    for (path, body) in [
        (&renew_path, json!({"lease_ms": 10})),
        (&renew_path, json!({"claim": claim, "lease_ms": 0})),
        (&renew_path, json!({"claim": -1})),
        (&release_path, json!({})),
        (&release_path, json!({"claim": claim, "lease_ms": 10})),
    ] {
        let (status, error) = acme.post(path, body.clone());
        assert_eq!(
            (status, error["error"]["code"].clone()),
            (422, json!("invalid_request")),
            "{path} {body}"
        );
    }
    let (status, error) = acme.send(reqwest::Method::GET, &renew_path, None);
    assert_eq!(
        (status, error["error"]["code"].clone()),
        (405, json!("method_not_allowed"))
    );
    let (status, error) = acme.post("/v1/tool-calls/conv/nope/renew", json!({"claim": 1}));
    assert_eq!(
        (status, error["error"]["code"].clone()),
        (404, json!("not_found"))
    );
    let (status, error) = acme.post(&format!("/v1/tool-calls/conv/{first}/bogus"), json!({"claim": 1}));
    assert_eq!(
        (status, error["error"]["code"].clone()),
        (404, json!("not_found"))
    );

    // A release needs the current claim; then the call is ready and the next claim gets the
    // next number and the same key, and the released claim's result is stale.
    let (status, error) = acme.post(&release_path, json!({"claim": claim + 1}));
    assert_eq!(
        (
            status,
            error["error"]["code"].clone(),
            error["error"]["state"].clone()
        ),
        (409, json!("stale_claim"), json!("claimed"))
    );
    let (status, released) = acme.post(&release_path, json!({"claim": claim}));
    assert_eq!((status, released["state"].clone()), (200, json!("ready")));
    let ready = acme.calls("ready");
    let call = listed(&ready, &first).unwrap();
    assert_eq!(
        (call["claims"].clone(), call["claim_expires_at"].clone()),
        (json!(1), Value::Null)
    );
    let (status, error) = acme.post(&release_path, json!({"claim": claim}));
    assert_eq!(
        (
            status,
            error["error"]["code"].clone(),
            error["error"]["state"].clone()
        ),
        (409, json!("stale_claim"), json!("ready"))
    );
    let (status, error) = acme.post(
        &format!("/v1/tool-calls/conv/{first}/result"),
        json!({"claim": claim, "status": "success", "content": []}),
    );
    assert_eq!(
        (status, error["error"]["code"].clone()),
        (409, json!("stale_claim"))
    );
    let (status, again) = acme.post(&claim_path, json!({"holder": "exec-2"}));
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        (again["claim"].clone(), again["idempotency_key"].clone()),
        (json!(claim + 1), json!(key))
    );
    let (status, error) = acme.post(
        &format!("/v1/tool-calls/conv/{first}/result"),
        json!({"claim": claim + 1, "status": "success", "content": [], "note": "x"}),
    );
    assert_eq!(
        (status, error["error"]["code"].clone()),
        (422, json!("invalid_request"))
    );
    // A state that is not one is 422; a query string that cannot be read is 400.
    for (query, expected) in [
        ("state=lost", 422),
        ("state=ready&state=done", 400),
        ("status=ready", 400),
    ] {
        let (status, error) = acme.send(reqwest::Method::GET, &format!("/v1/tool-calls?{query}"), None);
        assert_eq!(
            (status, error["error"]["code"].clone()),
            (expected, json!("invalid_request")),
            "{query}"
        );
    }
    assert_eq!(gateway.metric("turnstile_tool_call_releases_total"), 1.0);
    assert_eq!(gateway.metric("turnstile_tool_result_stale_total"), 1.0);
}
