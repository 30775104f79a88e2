//! Proxy clients: in proxy seeds, every follow-up request after a committed reply goes through
//! the drop-in proxy's own code, as a stateless SDK agent sends it. The client keeps its history
//! itself (the stored history it started from, then each answer as it decoded it), adds the
//! results of the calls it was handed (or a new user message) and sends the whole history in
//! the seed's API. What runs is the gateway's: the importer (`turnstile_adapters::import`),
//! `proxy::admit` (structure, validation), `proxy::place` (continuation of the stored
//! conversation, or a fresh one), `proxy::targets_of`, `api::render_targets` and
//! `api::store_rendered_importing` (a fresh conversation's import in its prepare's transaction), the same driver as every other operation, `proxy::hand_to_client`, and
//! the answer machines (`proxy::answer`) over the driver's events. Only the client is the
//! simulation's: building its request, and decoding the answer it got with the adapters' own
//! stream decoders (streamed) or by passing the response's message back into a request, as SDK
//! users do (whole).
//!
//! The checker's part (invariant `proxy_answer`): a request rendered from a legal history is
//! admitted; a successful answer is exactly the committed turn of its operation (text, and every
//! call's id, name and arguments); and the client's history with that answer continues the
//! stored conversation (no fork) unless another request continued it first.
//!
//! The proxy functions it runs are the gateway's own: `admit`, `place`, `targets_of`,
//! `render_targets`/`store_rendered`, `hand_to_client` and the `answer.rs` machines; answers are
//! decoded with the adapters' decoders. That is why the testkit depends on the gateway library.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - under crashes, faults, two replicas and racing copies, a proxied follow-up (the seed's API,
//!   streamed or whole) is admitted, its answer is exactly its operation's committed turn (text,
//!   call ids, names, arguments), a stream that read the commit ends with it, and the client's
//!   history with that answer continues the stored conversation. Enforced in `proxy/mod.rs`
//!   (`admit`, `place`), `proxy/continuation.rs`, `proxy/answer.rs`, `proxy/respond.rs`. Tests:
//!   `testkit` proxy seeds (`proxy.rs`, invariant `proxy_answer`; `seeds.rs` asserts that requests
//!   ran and that streamed and whole answers were each compared),
//!   `planted.rs::a_proxy_answer_missing_a_committed_call_is_caught`; by hand, not a test: red with
//!   `respond::whole` sending `"{}"` for Chat arguments and with `StreamAnswer` ending every stream
//!   in `preview_mismatch` (`docs/reliability.md`).

use crate::plan::FaultKind;
use crate::report::Invariant;
use crate::world::{CONVERSATION_ID, PRIMARY_MODEL, Phase, REPLICAS, World, store};
use serde_json::{Value, json};
use std::sync::Arc;
use turnstile_adapters::Api;
use turnstile_adapters::import::{GeminiCall, import_value};
use turnstile_core::Generation;
use turnstile_core::assemble::{Assembler, AssemblerConfig, Output};
use turnstile_core::digest::Digest;
use turnstile_drive::DriveEvent;
use turnstile_gateway::serve::api::{
    Early, ProviderRendering, Target, render_targets, store_rendered_importing,
};
use turnstile_gateway::serve::config::{Fallback, Mode};
use turnstile_gateway::serve::proxy::answer::{Head, StreamAnswer, WholeAnswer};
use turnstile_gateway::serve::proxy::respond::{Addressee, Part, parts_of};
use turnstile_gateway::serve::proxy::{self, NotAdmitted, Placed, RouteSpec};
use turnstile_store::Ledger as _;

/// The proxy's id prefix for the caller's conversations (no tenants).
pub const PROXY_PREFIX: &str = "proxy-";
/// The failover target's provider name on a proxy route.
const FALLBACK_PROVIDER: &str = "sim-fallback";

/// What a proxied dispatch was rendered with besides its history.
#[derive(Clone)]
pub(crate) struct ProxyRender {
    targets: Vec<Target>,
    max_output_tokens: Option<u64>,
    settings: turnstile_adapters::prepare::Settings,
    resume: bool,
}

/// How a client reads its answer.
enum Reading {
    Whole(WholeAnswer),
    Stream { answer: StreamAnswer, opened: bool },
}

/// What a client got.
#[derive(Debug)]
enum Got {
    /// Still reading.
    Reading,
    /// A whole response body.
    Whole(Value),
    /// A stream's bytes (ended with its last frame).
    Stream(Vec<u8>),
    /// An HTTP error (status, code).
    Failed(u16, String),
    /// The connection went away (its replica crashed, or the client left).
    Cut,
}

/// One proxied request and its client.
pub(crate) struct ProxyClient {
    op: String,
    conversation_id: String,
    replica: usize,
    reading: Option<Reading>,
    got: Got,
    /// The history the client sent (a `turnstile.conversation.v1` document).
    sent: Value,
    /// The client follows this request's answer into its next one (the first of a race).
    followed: bool,
    /// The commit was read (its calls handed to the client).
    handed: bool,
    /// The request's follower reads the dispatch's events (none when the client left before a
    /// driver started; over when its hub finished or its process died).
    follower: bool,
    /// The answer machine was given the commit.
    saw_commit: bool,
}

/// A committed turn's text and calls, the way a client reads them (reasoning left out).
fn answer_shape(turn: &Value) -> (String, Vec<(String, String, Value)>) {
    let mut text = String::new();
    let mut calls = Vec::new();
    for part in parts_of(turn) {
        match part {
            Part::Text(piece) => text.push_str(&piece),
            Part::Call { id, name, arguments } => {
                let arguments = serde_json::from_str(&arguments).unwrap_or(Value::String(arguments));
                calls.push((id, name, arguments));
            }
            Part::Reasoning { .. } => {}
        }
    }
    (text, calls)
}

/// The client's next turns after its history's last assistant turn: a result for each of its
/// calls, or a new user message when it made none.
fn client_turns(history: &mut Value) {
    let turns = history["turns"].as_array().cloned().unwrap_or_default();
    let revision = turns.len() as u64;
    let last = turns.last().cloned().unwrap_or(Value::Null);
    let calls: Vec<&Value> = last["blocks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|block| block["kind"] == "tool_call")
        .collect();
    let mut new_turns = Vec::new();
    if calls.is_empty() {
        let id = format!("client-user-{}", revision + 1);
        new_turns.push(json!({"id": id, "role": "user", "revision": revision + 1,
            "blocks": [{"id": format!("{id}-b"), "kind": "text", "text": "And tomorrow?"}]}));
    } else {
        let id = format!("client-results-{}", revision + 1);
        let blocks: Vec<Value> = calls
            .iter()
            .map(|call| {
                let mut result = json!({"id": format!("{}:client-result", call["call_id"].as_str().unwrap_or("")),
                       "kind": "tool_result", "call_id": call["call_id"], "tool": call["tool"],
                       "generation": last["generation"], "status": "success",
                       "content": [{"kind": "text", "text": "18C and sunny"}]});
                let arguments = match &call["arguments"] {
                    Value::String(text) => serde_json::from_str(text).unwrap_or(Value::Null),
                    other => other.clone(),
                };
                if let Some(arguments) = arguments.as_object() {
                    result["args_digest"] = json!(Digest::of_map(arguments).as_str());
                }
                result
            })
            .collect();
        new_turns.push(json!({"id": id, "role": "tool", "revision": revision + 1, "blocks": blocks}));
    }
    if let Some(turns) = history["turns"].as_array_mut() {
        turns.extend(new_turns);
    }
    history["revision"] = json!(turns.len() as u64 + 1);
}

impl World {
    /// The client's history to continue from: what it sent last with the answer it decoded, or
    /// (after a failed or cut answer, or at the first proxied request) the stored history, as a
    /// careful client reloads it.
    fn client_history(&mut self) -> Result<Value, String> {
        if let Some(history) = self.client_history.take() {
            return Ok(history);
        }
        store!(self, conversation(CONVERSATION_ID))
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "no conversation".to_owned())
    }

    /// The next round of a proxy seed: one follow-up request through the proxy (maybe raced by
    /// the same request on the other replica).
    pub(crate) fn proxy_round(&mut self) -> Result<(), String> {
        self.dirty = true;
        let mut history = self.client_history()?;
        client_turns(&mut history);
        let stream = self.rng.chance(0.5);
        let replica = self.rng.index(REPLICAS);
        let replica = self.answering(replica);
        self.proxy_request(&history, stream, replica, true)?;
        if self.phase == Phase::Safety && self.rng.chance(self.plan.race) {
            // Another copy of the request (a second agent process) on the other replica: the
            // stored conversation takes one continuation; the other forks.
            self.report.fault(FaultKind::RacingOperations);
            let other = self.answering((replica + 1) % REPLICAS);
            self.proxy_request(&history, stream, other, false)?;
        }
        Ok(())
    }

    /// The client's request body for `history` in the seed's API, as an SDK sends it.
    fn client_body(&mut self, history: &Value, stream: bool) -> Result<(Value, Option<GeminiCall>), String> {
        let (_, bytes) =
            self.render_document(history.clone(), self.adapter, "client", None, PRIMARY_MODEL)?;
        let mut body: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
        if self.adapter.api() == Api::Gemini {
            echo_gemini_ids(&mut body, history);
            return Ok((
                body,
                Some(GeminiCall {
                    model: PRIMARY_MODEL.to_owned(),
                    stream,
                }),
            ));
        }
        if let Some(object) = body.as_object_mut() {
            object.insert("stream".into(), json!(stream));
            // Server-side state is not a stateless client's (the provider's `store` default).
            object.remove("background");
        }
        Ok((body, None))
    }

    fn proxy_request(
        &mut self,
        history: &Value,
        stream: bool,
        replica: usize,
        followed: bool,
    ) -> Result<(), String> {
        let (body, gemini) = self.client_body(history, stream)?;
        let api = self.adapter.api();
        self.report.proxy_requests += 1;
        self.fresh_next += 1;
        let fresh = format!("{PROXY_PREFIX}sim-{}", self.fresh_next);
        let step = self.step;
        let (imported, conversation) = match proxy::admit(import_value(api, body, &fresh, gemini)) {
            Ok(admitted) => admitted,
            Err(not) => {
                let why = match not {
                    NotAdmitted::NotImportable(error) => format!("not importable: {error}"),
                    NotAdmitted::Unreadable(error) => format!("unreadable: {error}"),
                    NotAdmitted::Waiting(_, pending) => format!("waiting for {pending:?}"),
                    NotAdmitted::Rejected(_, violations) => format!("rejected: {violations:?}"),
                };
                self.report.violate(
                    step,
                    Invariant::ProxyAnswer,
                    format!("a request rendered from a legal history was not admitted: {why}"),
                );
                return Ok(());
            }
        };
        let now = self.local_now(replica);
        self.sync_store_clock();
        let placed = self.rt.block_on(proxy::place(
            self.ledger(),
            api,
            PROXY_PREFIX,
            fresh,
            &imported,
            conversation,
            false,
            now,
        ));
        let Placed {
            conversation_id,
            operation_id,
            conversation,
            import,
        } = match placed {
            Ok(placed) => placed,
            Err(response) => {
                // A store fault, say: the client gets an error and nothing was dispatched.
                self.trace(format!("proxy request refused: {}", response.status()));
                return Ok(());
            }
        };
        if conversation_id != CONVERSATION_ID {
            self.report.proxy_forks += 1;
            self.forks
                .push((conversation_id.clone(), history_len(&imported.document)));
            // The continuation's key is a call this gateway committed: a history without one
            // is a fresh conversation by design.
            let has_call = imported.document["turns"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|turn| turn["blocks"].as_array().into_iter().flatten())
                .any(|block| block["kind"] == "tool_call");
            if followed && has_call {
                let stored = store!(self, conversation(CONVERSATION_ID))
                    .ok()
                    .flatten()
                    .unwrap_or(Value::Null);
                let mut prefix = imported.document.clone();
                let stored_turns = stored["turns"].as_array().map_or(0, Vec::len);
                if let Some(turns) = prefix["turns"].as_array_mut() {
                    turns.truncate(stored_turns);
                }
                prefix["revision"] = json!(stored_turns);
                let differences = turnstile_adapters::import::semantic_diff(&stored, &prefix);
                self.report.violate(
                    step,
                    Invariant::ProxyAnswer,
                    format!(
                        "the client's history (with the answer it was given) does not continue the stored conversation: stored as {conversation_id}; differences {differences:?}"
                    ),
                );
            }
        }
        let mut fallbacks = Vec::new();
        if self.phase == Phase::Safety && self.rng.chance(self.plan.failover) {
            self.report.fault(FaultKind::FailoverTargets);
            fallbacks.push(Fallback {
                provider: FALLBACK_PROVIDER.to_owned(),
                adapter: self.adapter.as_str().to_owned(),
                target_model: Some(crate::world::FALLBACK_MODEL.to_owned()),
            });
        }
        let route = RouteSpec {
            mode: Mode::On,
            mode_label: "on",
            provider: "sim".to_owned(),
            adapter: self.adapter,
            target_model: None,
            original_provider: "sim".to_owned(),
            fallbacks,
            answer: turnstile_gateway::serve::config::AnswerMode::Stream,
            repair_history: false,
            label: "sim/*".to_owned(),
        };
        let targets = proxy::targets_of(&route, &imported.model);
        let settings = proxy::settings_of(&imported);
        // The checker re-renders a proxied dispatch from the stored history with what the
        // request asked for besides it (`check_send`), through the same `render_proxied`.
        let render = ProxyRender {
            targets,
            max_output_tokens: imported.max_output_tokens,
            settings,
            resume: self.provider_recovery().resume_by_handle,
        };
        let rendered = match self.render_proxied(&conversation, &operation_id, &render) {
            Ok(rendered) => rendered,
            Err(why) => {
                self.report.violate(
                    step,
                    Invariant::ProxyAnswer,
                    format!("{operation_id}: an admitted request did not render: {why}"),
                );
                return Ok(());
            }
        };
        self.proxy_renders.insert(operation_id.clone(), render);
        let prompt_tokens = rendered.manifest().body.prompt_tokens;
        let now = self.local_now(replica);
        self.sync_store_clock();
        // As the gateway's `prepare_dispatch`: the prepare begins the first attempt.
        let begin = turnstile_store::BeginAtOnce {
            holder: self.holder(replica),
            lease_ms: crate::world::LEASE_MS,
            target: 0,
        };
        // A fresh conversation is imported in the prepare's transaction, as the gateway does.
        let stored = self.rt.block_on(store_rendered_importing(
            self.ledger(),
            rendered,
            Some(&begin),
            import.as_ref(),
            now,
        ));
        let (record, began) = match stored {
            Ok(Ok(stored)) => stored,
            Ok(Err(refused)) => {
                self.trace(format!("{operation_id}: import refused: {refused:?}"));
                return Ok(());
            }
            Err(error) => {
                self.trace(format!("{operation_id}: prepare refused: {}", error.message()));
                return Ok(());
            }
        };
        self.trace(format!(
            "proxy client ({}) continues {conversation_id} as {operation_id} on replica {replica}",
            if stream { "streamed" } else { "whole" }
        ));
        self.ops.push(operation_id.clone());
        self.ops_in_round += 1;
        let to = Addressee {
            api,
            id: format!("sim-{operation_id}"),
            model: imported.model.clone(),
            created: 0,
            include_usage: false,
            served_by: Vec::new(),
        };
        let reading = if stream {
            Reading::Stream {
                answer: StreamAnswer::new(to, prompt_tokens),
                opened: false,
            }
        } else {
            Reading::Whole(WholeAnswer::new(to, prompt_tokens))
        };
        let leaves = self.phase == Phase::Safety && self.rng.chance(self.plan.client_leaves);
        self.proxy_clients.push(ProxyClient {
            op: operation_id.clone(),
            conversation_id,
            replica,
            reading: if leaves { None } else { Some(reading) },
            got: if leaves { Got::Cut } else { Got::Reading },
            sent: history.clone(),
            followed,
            handed: false,
            follower: !leaves,
            saw_commit: false,
        });
        if leaves {
            // The client went away while its dispatch was being prepared.
            self.report.fault(FaultKind::ClientLeft);
            self.report.disconnects += 1;
            self.trace(format!(
                "{operation_id}: proxy client left before a driver started"
            ));
            return Ok(());
        }
        match began {
            Some(began) => self.drive_begun(replica, record, began.generation, began.idempotency_key),
            None => self.drive_prepared(replica, record),
        }
        Ok(())
    }

    /// What one pump of `replica`'s drivers emitted, in order: each request's follower (the
    /// gateway's one reader per request, over the replica's hub) reads its operation's events.
    /// A follower reads on after its client's answer is done, to the commit, and hands the
    /// committed calls over (`Follower::finish`); before the status line it takes what the hub
    /// already has as `ready` (`next_ready`), here the rest of the batch.
    pub(crate) fn proxy_events(&mut self, replica: usize, batch: Vec<(String, DriveEvent)>) {
        for index in 0..self.proxy_clients.len() {
            let client = &self.proxy_clients[index];
            if client.replica != replica || !client.follower || client.handed && client.reading.is_none() {
                continue;
            }
            let op = client.op.clone();
            let events: Vec<Arc<DriveEvent>> = batch
                .iter()
                .filter(|(from, _)| *from == op)
                .map(|(_, event)| Arc::new(self.as_followed(event)))
                .collect();
            let mut position = 0;
            while position < events.len() {
                let event = events[position].clone();
                position += 1;
                self.follower_read(index, &event);
                let client = &mut self.proxy_clients[index];
                let Some(reading) = client.reading.as_mut() else {
                    continue;
                };
                match reading {
                    Reading::Whole(answer) => {
                        if let Some(body) = answer.push(&event) {
                            client.got = Got::Whole(body);
                            client.reading = None;
                        }
                    }
                    Reading::Stream { answer, opened } => {
                        let frames = if *opened {
                            answer.push(&event)
                        } else {
                            match answer.before_head(event) {
                                Head::Wait => continue,
                                Head::Fail(failure) => {
                                    client.got = Got::Failed(failure.status.as_u16(), failure.code);
                                    client.reading = None;
                                    self.proxy_answered(index);
                                    continue;
                                }
                                Head::Open => {
                                    *opened = true;
                                    let ready = events[position..].to_vec();
                                    position = events.len();
                                    let frames = answer.open(ready.clone());
                                    for event in &ready {
                                        self.follower_read(index, event);
                                    }
                                    let client = &mut self.proxy_clients[index];
                                    client.got = Got::Stream(Vec::new());
                                    frames
                                }
                            }
                        };
                        let client = &mut self.proxy_clients[index];
                        if let Got::Stream(bytes) = &mut client.got {
                            bytes.extend(frames.bytes);
                        }
                        if frames.done {
                            client.reading = None;
                        }
                    }
                }
                if self.proxy_clients[index].reading.is_none() {
                    self.proxy_answered(index);
                }
            }
        }
    }

    /// An event as the follower reads it (the planted defect tampers with the commit here).
    fn as_followed(&self, event: &DriveEvent) -> DriveEvent {
        let mut event = event.clone();
        if self.bugs.proxy_answer_drops_call
            && let DriveEvent::Committed { turn, .. } = &mut event
            && let Some(blocks) = turn["blocks"].as_array_mut()
            && let Some(position) = blocks.iter().rposition(|block| block["kind"] == "tool_call")
        {
            // Planted defect: the answer is built from a commit with its last call left out.
            blocks.remove(position);
        }
        event
    }

    /// The follower read `event`: the first commit hands its calls to the client
    /// (`proxy::hand_to_client`, the gateway's), before the answer that shows them.
    fn follower_read(&mut self, index: usize, event: &DriveEvent) {
        let DriveEvent::Committed { turn, .. } = event else {
            return;
        };
        let client = &mut self.proxy_clients[index];
        client.saw_commit = true;
        if client.handed {
            return;
        }
        client.handed = true;
        let conversation_id = client.conversation_id.clone();
        let turn = turn.clone();
        self.sync_store_clock();
        self.rt.block_on(proxy::hand_to_client(
            self.ledger(),
            &conversation_id,
            &turn,
            turnstile_store::CLIENT_CALL_TIMEOUT_MS_DEFAULT,
        ));
        self.dirty = true;
    }

    /// The events of `op`'s driver on `replica` ended (`cut`: its process died): clients still
    /// reading get the end of their answer (or lose the connection).
    pub(crate) fn proxy_events_end(&mut self, op: Option<&str>, replica: usize, cut: bool) {
        for index in 0..self.proxy_clients.len() {
            let client = &mut self.proxy_clients[index];
            if client.replica != replica || op.is_some_and(|op| op != client.op) {
                continue;
            }
            // The hub finished or the process died: the follower is done too.
            client.follower = false;
            let Some(reading) = client.reading.take() else {
                continue;
            };
            if cut {
                client.got = Got::Cut;
            } else {
                match reading {
                    Reading::Whole(answer) => {
                        let failure = answer.end();
                        client.got = Got::Failed(failure.status.as_u16(), failure.code);
                    }
                    Reading::Stream { mut answer, opened } => {
                        // Events that end before the head open the stream (the gateway's
                        // `stream_answer`), which then ends with `no_commit`.
                        let mut bytes = Vec::new();
                        if !opened {
                            bytes = answer.open(Vec::new()).bytes;
                        }
                        bytes.extend(answer.end().bytes);
                        if let Got::Stream(sent) = &mut client.got {
                            sent.extend(bytes);
                        } else {
                            client.got = Got::Stream(bytes);
                        }
                    }
                }
            }
            self.proxy_answered(index);
        }
    }

    /// A client's answer is complete: decode it as the client does, and check it.
    fn proxy_answered(&mut self, index: usize) {
        let step = self.step;
        let client = &self.proxy_clients[index];
        let op = client.op.clone();
        let decoded = match &client.got {
            Got::Whole(body) => self.decode_whole(body),
            Got::Stream(bytes) => self.decode_stream(&op, bytes),
            Got::Failed(..) | Got::Cut | Got::Reading => None,
        };
        let got = match (&client.got, &decoded) {
            (Got::Failed(status, code), _) => format!("{status} {code}"),
            (Got::Cut, _) => "a cut connection".to_owned(),
            (_, Some(_)) => "an answer".to_owned(),
            (_, None) => "no answer".to_owned(),
        };
        let conversation_id = client.conversation_id.clone();
        let followed = client.followed && conversation_id == CONVERSATION_ID;
        let sent = client.sent.clone();
        let (whole_body, streamed, saw_commit) = (
            matches!(client.got, Got::Whole(_)),
            matches!(client.got, Got::Stream(_)),
            client.saw_commit,
        );
        self.trace(format!("{op}: proxy client got {got}"));
        let committed = store!(self, conversation(&conversation_id))
            .ok()
            .flatten()
            .and_then(|document| {
                document["turns"].as_array().and_then(|turns| {
                    turns
                        .iter()
                        .find(|turn| {
                            turn["id"]
                                .as_str()
                                .is_some_and(|id| id.starts_with(&format!("{op}.g")))
                        })
                        .cloned()
                })
            });
        let Some(turn) = decoded else {
            if whole_body {
                self.report.violate(
                    step,
                    Invariant::ProxyAnswer,
                    format!("{op}: a 200 answer the client cannot read back"),
                );
            }
            // A stream that read the commit ends with it, unless text already forwarded from an
            // earlier, retracted generation disagrees with it (`preview_mismatch`).
            let committed_generation = committed
                .as_ref()
                .and_then(|turn| turn["id"].as_str()?.rsplit_once(".g")?.1.parse::<u64>().ok());
            let other_previewed =
                self.history.previewed.iter().any(|(previewed, generation)| {
                    *previewed == op && Some(*generation) != committed_generation
                });
            if streamed && saw_commit && !other_previewed {
                self.report.violate(
                    step,
                    Invariant::ProxyAnswer,
                    format!("{op}: the stream read the commit and did not end with it"),
                );
            }
            return;
        };
        let Some(committed) = committed else {
            self.report.violate(
                step,
                Invariant::ProxyAnswer,
                format!("{op}: the client was answered with a turn, and none committed"),
            );
            return;
        };
        self.report.proxy_answers += 1;
        if streamed {
            self.report.proxy_streamed_answers += 1;
        }
        let (got, want) = (answer_shape(&turn), answer_shape(&committed));
        if got != want {
            self.report.violate(
                step,
                Invariant::ProxyAnswer,
                format!("{op}: the client's answer {got:?} is not the committed turn {want:?}"),
            );
            return;
        }
        if followed {
            // The client's next request carries this answer as it decoded it.
            let mut history = sent;
            let revision = history["turns"].as_array().map_or(0, Vec::len) as u64 + 1;
            let mut turn = turn;
            turn["id"] = json!(format!("client-answer-{revision}"));
            turn["revision"] = json!(revision);
            if let Some(blocks) = turn["blocks"].as_array_mut() {
                for (position, block) in blocks.iter_mut().enumerate() {
                    block["id"] = json!(format!("client-answer-{revision}-b{position}"));
                }
            }
            if let Some(turns) = history["turns"].as_array_mut() {
                turns.push(turn);
            }
            history["revision"] = json!(revision);
            self.client_history = Some(history);
        }
    }

    /// A whole response's assistant message, as the client passes it back: imported inside a
    /// request of its API, after a user message.
    fn decode_whole(&self, body: &Value) -> Option<Value> {
        let user = "x";
        let (api, request, gemini) = match self.adapter.api() {
            Api::OpenaiChat => (
                Api::OpenaiChat,
                json!({"model": PRIMARY_MODEL, "messages": [{"role": "user", "content": user},
                        body["choices"][0]["message"]]}),
                None,
            ),
            Api::AnthropicMessages => (
                Api::AnthropicMessages,
                json!({"model": PRIMARY_MODEL, "max_tokens": 16, "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": body["content"]}]}),
                None,
            ),
            Api::OpenaiResponses => {
                let mut input = vec![json!({"role": "user", "content": user})];
                input.extend(body["output"].as_array().cloned().unwrap_or_default());
                (
                    Api::OpenaiResponses,
                    json!({"model": PRIMARY_MODEL, "input": input}),
                    None,
                )
            }
            Api::Gemini => (
                Api::Gemini,
                json!({"contents": [{"role": "user", "parts": [{"text": user}]},
                                    body["candidates"][0]["content"]]}),
                Some(GeminiCall {
                    model: PRIMARY_MODEL.to_owned(),
                    stream: false,
                }),
            ),
        };
        let imported = import_value(api, request, "client", gemini).ok()?;
        imported.document["turns"].as_array()?.last().cloned()
    }

    /// A streamed answer, decoded by the adapters' own decoder for the seed's API and assembled.
    fn decode_stream(&self, op: &str, bytes: &[u8]) -> Option<Value> {
        let generation = Generation(1);
        let mut config = AssemblerConfig::new(generation, format!("{op}.client"));
        config.toolset = Some(self.toolset.clone());
        let mut assembler = Assembler::new(config);
        let mut decoder = self.api.decoder();
        decoder.handle_bytes(bytes);
        decoder.handle_end_of_file();
        let mut turn = None;
        while let Some(event) = decoder.poll_event() {
            let _ = assembler.handle_event(generation, event);
        }
        assembler.handle_end_of_input();
        while let Some(output) = assembler.poll_output() {
            if let Output::Commit(offer) = output {
                turn = Some(offer.turn);
            }
        }
        turn
    }
}

impl World {
    /// The request digest of target `target` of proxied operation `op`, re-rendered from the
    /// stored history at `revision` of `conversation_id` (None: not a proxied operation).
    pub(crate) fn rerender_proxied(
        &mut self,
        op: &str,
        conversation_id: &str,
        revision: u64,
        target: u32,
    ) -> Option<Result<String, String>> {
        let render = self.proxy_renders.get(op)?.clone();
        let digest = (|| {
            let document = self.history_at(conversation_id, revision)?;
            let conversation =
                turnstile_core::Conversation::from_value(document).map_err(|e| format!("{e:?}"))?;
            let rendered = self.render_proxied(&conversation, op, &render)?;
            let manifest = if target == 0 {
                rendered.target.into_target().manifest
            } else {
                rendered
                    .fallbacks
                    .into_iter()
                    .nth(target as usize - 1)
                    .ok_or("no such target")?
                    .into_target()
                    .manifest
            };
            Ok::<_, String>(manifest.body.request_digest.as_str().to_owned())
        })();
        Some(digest)
    }

    /// Validate `conversation` and render every target of a proxied dispatch with the gateway's
    /// `render_targets`; why not, as text.
    fn render_proxied(
        &mut self,
        conversation: &turnstile_core::Conversation,
        op: &str,
        render: &ProxyRender,
    ) -> Result<turnstile_gateway::serve::api::Rendered, String> {
        let validated = turnstile_core::Validated::new(conversation)
            .map_err(|violations| format!("the history is rejected: {violations:?}"))?;
        let sequence = turnstile_core::MessageSequence::build(validated);
        let graph = turnstile_adapters::Graph::new(validated, &sequence);
        let resume = render.resume;
        let mut cache = self
            .render_caches
            .of(&conversation.conversation_id)
            .try_lock()
            .map_err(|_| "the world renders one request at a time: its cache is free".to_owned())?;
        match render_targets(
            &self.catalog,
            &mut cache,
            &|_| {
                Some(ProviderRendering {
                    background: resume,
                    text_content: Default::default(),
                })
            },
            &graph,
            op,
            &render.targets,
            render.max_output_tokens,
            &render.settings,
        ) {
            Ok(Ok(rendered)) => Ok(rendered),
            Ok(Err(Early::Waiting(pending))) => Err(format!("waiting for {pending:?}")),
            Ok(Err(Early::Rejected(violations))) => Err(format!("rejected: {violations:?}")),
            Ok(Err(Early::Paused(reason))) => Err(format!("paused: {reason}")),
            Err(error) => Err(error.message().to_owned()),
        }
    }
}

/// A Gemini SDK client echoes the model's content with its `functionCall.id` and answers each
/// call with `functionResponse.id` set to it (google-genai's documented pattern); the provider
/// request our renderer writes pairs by position and carries no ids, so the client's ids are
/// put back on its calls and results, in order.
fn echo_gemini_ids(body: &mut Value, history: &Value) {
    let blocks: Vec<&Value> = history["turns"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|turn| turn["blocks"].as_array().into_iter().flatten())
        .collect();
    let mut calls = blocks.iter().filter(|block| block["kind"] == "tool_call");
    let mut results = blocks.iter().filter(|block| block["kind"] == "tool_result");
    for content in body["contents"].as_array_mut().into_iter().flatten() {
        for part in content["parts"].as_array_mut().into_iter().flatten() {
            if let Some(call) = part.get_mut("functionCall")
                && let Some(block) = calls.next()
            {
                call["id"] = block["call_id"].clone();
            } else if let Some(response) = part.get_mut("functionResponse")
                && let Some(block) = results.next()
            {
                response["id"] = block["call_id"].clone();
            }
        }
    }
}

/// Turns in a document.
fn history_len(document: &Value) -> u64 {
    document["turns"].as_array().map_or(0, Vec::len) as u64
}
