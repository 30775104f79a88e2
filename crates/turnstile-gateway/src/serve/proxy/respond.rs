//! Answers a proxy client in its own wire format, from what the ledger committed.
//!
//! The only content a client ever receives as final is the committed assistant turn. While a
//! generation streams, its text may be forwarded as it arrives (revocable preview, see
//! `proxy::mod`); tool calls, reasoning and every later block are emitted only from the
//! committed turn, whole, so a client never sees half a tool call. Shapes follow the
//! providers' documented responses (sources in `shared/reference/provider-rules.md`; the
//! official Python SDKs parse them in `tests/it/proxy_sdk.rs`):
//!
//! - OpenAI Chat: `chat.completion` / `chat.completion.chunk` + `data: [DONE]`; several text
//!   blocks of one turn become one `content` string joined by a blank line (the API has one
//!   string per message).
//! - OpenAI Responses: a `response` object / named events with `sequence_number`.
//! - Anthropic Messages: a `message` / `message_start` … `message_stop`.
//! - Gemini: `GenerateContentResponse` / `data:` chunks.
//!
//! Errors after the stream started are the provider's own mid-stream error event, which the
//! SDKs raise as an exception.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a streamed Anthropic answer's `message_delta` carries the provider's cumulative usage (cache
//!   counters only when reported). Enforced in `proxy/respond.rs` (`Facts::anthropic_usage`,
//!   `StreamEncoder::known_usage`). Tests:
//!   `proxy.rs::a_streamed_anthropic_answer_reports_the_providers_cumulative_usage…`,
//!   `respond.rs::anthropic_stream_usage_is_the_providers_cumulative_count…`.
//! - a streamed Anthropic answer's `message_start` reports the provider's own start-event usage
//!   (not the admission estimate), cache counters included when reported. Enforced in
//!   `decode/anthropic_messages.rs`, `assemble.rs` (`Usage`), `drive.rs` (`DriveEvent::Usage`),
//!   `proxy/mod.rs::stream_answer` (`opens_with_usage`). Tests:
//!   `proxy.rs::a_streamed_anthropic_answer_reports…`, `proxy_sdk.py::anthropic_streamed_usage`
//!   (both red with the wait removed), `stream/captures.rs::anthropic_cache_counters_are_decoded…`.

use serde_json::{Value, json};
use turnstile_adapters::Api;
use turnstile_core::assemble::Usage;

/// One piece of a committed turn, in the client's terms.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    /// Assistant text.
    Text(String),
    /// A complete tool call.
    Call {
        /// Call id as committed.
        id: String,
        /// Tool name.
        name: String,
        /// Arguments as JSON text.
        arguments: String,
    },
    /// Provider reasoning, passed back only to a client of the same provider.
    Reasoning {
        /// Which provider produced it.
        provider: String,
        /// Readable text, if any.
        text: Option<String>,
        /// Signature (Anthropic thinking).
        signature: Option<String>,
        /// Opaque data (redacted thinking / encrypted content).
        encrypted: Option<String>,
    },
}

/// The parts of a committed v1 assistant turn, in block order.
pub fn parts_of(turn: &Value) -> Vec<Part> {
    let mut parts = Vec::new();
    for block in turn["blocks"].as_array().into_iter().flatten() {
        match block["kind"].as_str() {
            Some("text") => parts.push(Part::Text(block["text"].as_str().unwrap_or("").to_owned())),
            Some("tool_call") => parts.push(Part::Call {
                id: block["call_id"].as_str().unwrap_or("").to_owned(),
                name: block["tool"].as_str().unwrap_or("").to_owned(),
                arguments: match &block["arguments"] {
                    Value::String(text) => text.clone(),
                    other => other.to_string(),
                },
            }),
            Some("reasoning") => parts.push(Part::Reasoning {
                provider: block["provider"].as_str().unwrap_or("").to_owned(),
                text: block["text"].as_str().map(str::to_owned),
                signature: block["signature"].as_str().map(str::to_owned),
                encrypted: block["encrypted"].as_str().map(str::to_owned),
            }),
            _ => {}
        }
    }
    parts
}

/// Token counts and stop reason for the answer.
#[derive(Clone, Debug)]
pub struct Facts {
    /// Prompt tokens (the provider's report, else our admission count).
    pub input_tokens: u64,
    /// Output tokens (the provider's report, else an estimate).
    pub output_tokens: u64,
    /// Normalized stop reason (`end_turn`, `tool_use`, `max_tokens`, …).
    pub stop_reason: String,
    /// Anthropic's prompt-cache counters, when the provider reported them (never invented).
    pub cache: Option<CacheTokens>,
}

/// Anthropic's prompt-cache counters, as the provider reported them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheTokens {
    /// `cache_creation_input_tokens`.
    pub creation_input_tokens: Option<u64>,
    /// `cache_read_input_tokens`.
    pub read_input_tokens: Option<u64>,
}

impl Facts {
    /// Anthropic's `usage` object: the provider's cumulative counts, cache counters only when
    /// the provider reported them.
    pub fn anthropic_usage(&self) -> Value {
        let mut usage = json!({"input_tokens": self.input_tokens, "output_tokens": self.output_tokens});
        if let Some(cache) = self.cache {
            if let Some(tokens) = cache.creation_input_tokens {
                usage["cache_creation_input_tokens"] = json!(tokens);
            }
            if let Some(tokens) = cache.read_input_tokens {
                usage["cache_read_input_tokens"] = json!(tokens);
            }
        }
        usage
    }
}

impl Facts {
    /// From the commit's facts (`usage`/`stop_reason` of the `Committed` event), falling back
    /// to the manifest's prompt count and a 4-bytes-per-token estimate of the output.
    pub fn from_commit(event: &Value, prompt_tokens: u64, parts: &[Part]) -> Facts {
        let output_bytes: usize = parts
            .iter()
            .map(|part| match part {
                Part::Text(text) => text.len(),
                Part::Call { arguments, name, .. } => arguments.len() + name.len(),
                Part::Reasoning { text, .. } => text.as_ref().map_or(0, String::len),
            })
            .sum();
        Facts {
            input_tokens: event["usage"]["input_tokens"].as_u64().unwrap_or(prompt_tokens),
            output_tokens: event["usage"]["output_tokens"]
                .as_u64()
                .unwrap_or(output_bytes.div_ceil(4) as u64),
            stop_reason: match &event["stop_reason"] {
                Value::String(reason) => reason.clone(),
                _ => "end_turn".into(),
            },
            cache: {
                let creation = event["usage"]["cache_creation_input_tokens"].as_u64();
                let read = event["usage"]["cache_read_input_tokens"].as_u64();
                (creation.is_some() || read.is_some()).then_some(CacheTokens {
                    creation_input_tokens: creation,
                    read_input_tokens: read,
                })
            },
        }
    }
}

fn has_calls(parts: &[Part]) -> bool {
    parts.iter().any(|part| matches!(part, Part::Call { .. }))
}

fn chat_finish(parts: &[Part], facts: &Facts) -> &'static str {
    match facts.stop_reason.as_str() {
        _ if has_calls(parts) => "tool_calls",
        "max_tokens" => "length",
        "content_filter" => "content_filter",
        _ => "stop",
    }
}

fn anthropic_stop(parts: &[Part], facts: &Facts) -> &'static str {
    match facts.stop_reason.as_str() {
        _ if has_calls(parts) => "tool_use",
        "max_tokens" => "max_tokens",
        "stop_sequence" => "stop_sequence",
        "refusal" => "refusal",
        _ => "end_turn",
    }
}

fn gemini_finish(facts: &Facts) -> &'static str {
    match facts.stop_reason.as_str() {
        "max_tokens" => "MAX_TOKENS",
        "content_filter" => "SAFETY",
        _ => "STOP",
    }
}

fn texts(parts: &[Part]) -> Vec<&str> {
    parts
        .iter()
        .filter_map(|part| match part {
            Part::Text(text) => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

fn arguments_value(arguments: &str) -> Value {
    turnstile_core::parse::bounded_value(arguments.as_bytes()).unwrap_or_else(|| json!({}))
}

fn anthropic_content(parts: &[Part]) -> Vec<Value> {
    parts
        .iter()
        .filter_map(|part| match part {
            Part::Text(text) => Some(json!({"type": "text", "text": text})),
            Part::Call { id, name, arguments } => {
                Some(json!({"type": "tool_use", "id": id, "name": name, "input": arguments_value(arguments)}))
            }
            Part::Reasoning {
                provider,
                text,
                signature,
                encrypted,
            } if provider == "anthropic" => Some(match (signature, encrypted) {
                (_, Some(data)) if text.is_none() => json!({"type": "redacted_thinking", "data": data}),
                _ => json!({"type": "thinking", "thinking": text.clone().unwrap_or_default(),
                            "signature": signature.clone().unwrap_or_default()}),
            }),
            Part::Reasoning { .. } => None,
        })
        .collect()
}

fn responses_output(id: &str, parts: &[Part]) -> Vec<Value> {
    let mut output = Vec::new();
    for (index, part) in parts.iter().enumerate() {
        match part {
            Part::Text(text) => output.push(json!({"id": format!("msg_{id}_{index}"), "type": "message",
                "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]})),
            Part::Call {
                id: call_id,
                name,
                arguments,
            } => output.push(json!({"id": format!("fc_{id}_{index}"), "type": "function_call",
                "status": "completed", "call_id": call_id, "name": name, "arguments": arguments})),
            Part::Reasoning {
                provider,
                encrypted: Some(encrypted),
                ..
            } if provider == "openai" => output.push(json!({"id": format!("rs_{id}_{index}"),
                "type": "reasoning", "summary": [], "encrypted_content": encrypted})),
            Part::Reasoning { .. } => {}
        }
    }
    output
}

fn responses_object(
    id: &str,
    model: &str,
    created: u64,
    status: &str,
    output: Vec<Value>,
    facts: Option<&Facts>,
) -> Value {
    let mut object = json!({"id": id, "object": "response", "created_at": created, "status": status,
        "model": model, "output": output, "parallel_tool_calls": true, "error": null,
        "incomplete_details": null, "tools": [], "tool_choice": "auto", "text": {"format": {"type": "text"}},
        "usage": null});
    if let Some(facts) = facts {
        object["usage"] = json!({"input_tokens": facts.input_tokens, "output_tokens": facts.output_tokens,
            "total_tokens": facts.input_tokens + facts.output_tokens,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}});
        if facts.stop_reason == "max_tokens" {
            object["status"] = json!("incomplete");
            object["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
    }
    object
}

/// Gemini parts. A Gemini thought signature belongs on the part that follows it (the
/// `functionCall` or text part it signs, as the API sends it and as `gemini/v1/render.rs` puts it
/// back): Gemini 3 refuses a history whose function call lost its signature. A readable thought
/// is its own `thought: true` part; a signature with nothing after it rides on an empty text part.
fn gemini_parts(parts: &[Part]) -> Vec<Value> {
    let mut out = Vec::new();
    let mut signature_pending: Option<String> = None;
    for part in parts {
        let mut value = match part {
            Part::Text(text) => json!({"text": text}),
            // `id` is Gemini's optional call id: a client that echoes it in its
            // `functionResponse` pairs results by id, and its follow-up finds the conversation
            // it continues (the renderer pairs by position and sends none).
            Part::Call { id, name, arguments } => {
                json!({"functionCall": {"id": id, "name": name, "args": arguments_value(arguments)}})
            }
            Part::Reasoning {
                provider,
                signature,
                text,
                ..
            } if provider == "gemini" => {
                if let Some(text) = text.as_ref().filter(|text| !text.is_empty()) {
                    out.push(json!({"text": text, "thought": true}));
                }
                signature_pending = signature.clone();
                continue;
            }
            Part::Reasoning { .. } => continue,
        };
        if let Some(signature) = signature_pending.take() {
            value["thoughtSignature"] = json!(signature);
        }
        out.push(value);
    }
    if let Some(signature) = signature_pending {
        out.push(json!({"text": "", "thoughtSignature": signature}));
    }
    out
}

fn gemini_usage(facts: &Facts) -> Value {
    json!({"promptTokenCount": facts.input_tokens, "candidatesTokenCount": facts.output_tokens,
           "totalTokenCount": facts.input_tokens + facts.output_tokens})
}

/// Who the answer is for.
#[derive(Clone, Debug)]
pub struct Addressee {
    /// The client's API.
    pub api: Api,
    /// Response id shown to the client.
    pub id: String,
    /// Model name shown to the client: the one it asked for, until the target that answered
    /// is known ([`Addressee::served_by`]).
    pub model: String,
    /// Unix seconds.
    pub created: u64,
    /// OpenAI Chat `stream_options.include_usage`.
    pub include_usage: bool,
    /// The dispatch's targets in order (the route's, then its fallbacks): the provider and
    /// model each would answer with. Empty when unknown.
    pub served_by: Vec<Answerer>,
}

/// Who answered: one target's provider and model, named in the answer's model field and in
/// the `x-turnstile-provider` / `x-turnstile-model` headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answerer {
    /// The provider entry's name.
    pub provider: String,
    /// The model sent to it.
    pub model: String,
}

impl Answerer {
    /// The response headers that name it.
    pub fn headers(&self) -> [(&'static str, &str); 2] {
        [
            ("x-turnstile-provider", self.provider.as_str()),
            ("x-turnstile-model", self.model.as_str()),
        ]
    }
}

/// The non-streaming response body.
pub fn whole(to: &Addressee, parts: &[Part], facts: &Facts) -> Value {
    match to.api {
        Api::OpenaiChat => {
            let texts = texts(parts);
            let calls: Vec<Value> = parts
                .iter()
                .filter_map(|part| match part {
                    Part::Call {
                        id,
                        name,
                        arguments,
                    } => Some(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})),
                    _ => None,
                })
                .collect();
            let mut message = json!({"role": "assistant",
                "content": if texts.is_empty() { Value::Null } else { json!(texts.join("\n\n")) },
                "refusal": null});
            if !calls.is_empty() {
                message["tool_calls"] = Value::Array(calls);
            }
            json!({"id": to.id, "object": "chat.completion", "created": to.created, "model": to.model,
                   "choices": [{"index": 0, "message": message, "logprobs": null,
                                "finish_reason": chat_finish(parts, facts)}],
                   "usage": {"prompt_tokens": facts.input_tokens, "completion_tokens": facts.output_tokens,
                             "total_tokens": facts.input_tokens + facts.output_tokens}})
        }
        Api::OpenaiResponses => responses_object(
            &to.id,
            &to.model,
            to.created,
            "completed",
            responses_output(&to.id, parts),
            Some(facts),
        ),
        Api::AnthropicMessages => {
            json!({"id": to.id, "type": "message", "role": "assistant", "model": to.model,
                   "content": anthropic_content(parts), "stop_reason": anthropic_stop(parts, facts),
                   "stop_sequence": null, "usage": facts.anthropic_usage()})
        }
        Api::Gemini => {
            json!({"candidates": [{"content": {"role": "model", "parts": gemini_parts(parts)},
                                   "finishReason": gemini_finish(facts), "index": 0}],
                   "usageMetadata": gemini_usage(facts), "modelVersion": to.model, "responseId": to.id})
        }
    }
}

/// A provider-style error body and the status to send it with.
pub fn error_body(api: Api, status: u16, code: &str, message: &str, extra: &Value) -> Value {
    let mut body = match api {
        Api::OpenaiChat | Api::OpenaiResponses => {
            let kind = match status {
                401 => "authentication_error",
                404 => "not_found_error",
                409 => "conflict_error",
                429 => "rate_limit_error",
                400..=499 => "invalid_request_error",
                _ => "server_error",
            };
            json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
        }
        Api::AnthropicMessages => {
            let kind = match status {
                401 => "authentication_error",
                404 => "not_found_error",
                413 => "request_too_large",
                429 => "rate_limit_error",
                400..=499 => "invalid_request_error",
                _ => "api_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": message, "code": code}})
        }
        Api::Gemini => {
            let kind = match status {
                401 => "UNAUTHENTICATED",
                404 => "NOT_FOUND",
                409 => "ABORTED",
                429 => "RESOURCE_EXHAUSTED",
                400..=499 => "INVALID_ARGUMENT",
                503 => "UNAVAILABLE",
                _ => "INTERNAL",
            };
            json!({"error": {"code": status, "message": message, "status": kind, "turnstile_code": code}})
        }
    };
    if let Value::Object(extra) = extra {
        let error = &mut body["error"];
        for (key, value) in extra {
            error[key] = value.clone();
        }
    }
    body
}

/// Why a stream could not be finished from the committed turn.
#[derive(Debug, PartialEq, Eq)]
pub struct PreviewMismatch;

/// The streaming answer, one frame at a time. Call order: [`StreamEncoder::start`] once, then
/// [`StreamEncoder::text`] for forwarded preview text (first block only), then exactly one of
/// [`StreamEncoder::finish`] or [`StreamEncoder::error`].
pub struct StreamEncoder {
    to: Addressee,
    input_tokens: u64,
    /// The provider's own usage, when known before the stream opens (the commit already came).
    known: Option<Facts>,
    /// The usage of the provider's own start event (Anthropic `message_start`), when it came
    /// before the stream opened.
    start_usage: Option<Value>,
    sequence: u64,
    text_open: bool,
    forwarded: String,
}

fn data(payload: &Value) -> Vec<u8> {
    format!("data: {payload}\n\n").into_bytes()
}

fn named(event: &str, payload: &Value) -> Vec<u8> {
    format!("event: {event}\ndata: {payload}\n\n").into_bytes()
}

impl StreamEncoder {
    /// An encoder for `to`; `input_tokens` is the admission count known before dispatch.
    pub fn new(to: Addressee, input_tokens: u64) -> StreamEncoder {
        StreamEncoder {
            to,
            input_tokens,
            known: None,
            start_usage: None,
            sequence: 0,
            text_open: false,
            forwarded: String::new(),
        }
    }

    /// The provider's own usage, known before [`StreamEncoder::start`] (the dispatch committed
    /// before the stream opened): Anthropic's `message_start` reports it instead of the
    /// admission count.
    pub fn known_usage(&mut self, facts: Facts) {
        self.known = Some(facts);
    }

    /// The usage of the provider's start event (the hub's `Usage` report: input and output
    /// tokens, cache counters when reported), known before [`StreamEncoder::start`]:
    /// Anthropic's `message_start` reports it instead of the admission count.
    pub fn start_usage(&mut self, usage: &Usage) {
        let mut out = json!({"input_tokens": usage.input_tokens.unwrap_or(self.input_tokens),
                             "output_tokens": usage.output_tokens.unwrap_or(0)});
        let counters = [
            ("cache_creation_input_tokens", usage.cache_creation_input_tokens),
            ("cache_read_input_tokens", usage.cache_read_input_tokens),
        ];
        for (counter, tokens) in counters {
            if let Some(tokens) = tokens {
                out[counter] = json!(tokens);
            }
        }
        self.start_usage = Some(out);
    }

    /// Whether the opening frame waits for the provider's start event (Anthropic reports the
    /// input count and cache counters in its opening frame).
    pub fn opens_with_usage(&self) -> bool {
        self.to.api == Api::AnthropicMessages && self.known.is_none()
    }

    /// Target `target` answers ([`Addressee::served_by`]): every frame from here on names its
    /// model. Its provider and model, None when the target is unknown (nothing changes).
    pub fn answered_by(&mut self, target: usize) -> Option<Answerer> {
        let answerer = self.to.served_by.get(target)?.clone();
        self.to.model = answerer.model.clone();
        Some(answerer)
    }

    /// Text forwarded so far.
    pub fn forwarded(&self) -> &str {
        &self.forwarded
    }

    fn responses_event(&mut self, kind: &str, mut payload: Value) -> Vec<u8> {
        payload["type"] = json!(kind);
        payload["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        named(kind, &payload)
    }

    fn chat_chunk(&self, delta: Value, finish: Value) -> Value {
        json!({"id": self.to.id, "object": "chat.completion.chunk", "created": self.to.created,
               "model": self.to.model, "choices": [{"index": 0, "delta": delta, "logprobs": null,
               "finish_reason": finish}]})
    }

    fn gemini_chunk(&self, parts: Vec<Value>, finish: Option<&str>, facts: Option<&Facts>) -> Value {
        let mut candidate = json!({"content": {"role": "model", "parts": parts}, "index": 0});
        if let Some(finish) = finish {
            candidate["finishReason"] = json!(finish);
        }
        let mut chunk =
            json!({"candidates": [candidate], "modelVersion": self.to.model, "responseId": self.to.id});
        if let Some(facts) = facts {
            chunk["usageMetadata"] = gemini_usage(facts);
        }
        chunk
    }

    fn message_item_id(&self) -> String {
        format!("msg_{}_0", self.to.id)
    }

    /// The frames that open the answer.
    pub fn start(&mut self) -> Vec<u8> {
        match self.to.api {
            Api::OpenaiChat => {
                data(&self.chat_chunk(json!({"role": "assistant", "content": ""}), Value::Null))
            }
            Api::OpenaiResponses => {
                let object = responses_object(
                    &self.to.id,
                    &self.to.model,
                    self.to.created,
                    "in_progress",
                    Vec::new(),
                    None,
                );
                let mut out = self.responses_event("response.created", json!({"response": object.clone()}));
                out.extend(self.responses_event("response.in_progress", json!({"response": object})));
                out
            }
            Api::AnthropicMessages => {
                // The provider's input count (and cache counters) when the commit came first;
                // otherwise the admission count, the only one known yet (`message_delta` carries
                // the provider's cumulative counts at the end).
                // The provider's own start event when it came first (the usual case: the proxy
                // waits for it, `opens_with_usage`).
                let usage = match (&self.known, &self.start_usage) {
                    (Some(facts), _) => {
                        let mut usage = facts.anthropic_usage();
                        usage["output_tokens"] = json!(0);
                        usage
                    }
                    (None, Some(usage)) => usage.clone(),
                    (None, None) => json!({"input_tokens": self.input_tokens, "output_tokens": 0}),
                };
                let mut out = named(
                    "message_start",
                    &json!({"type": "message_start", "message": {"id": self.to.id, "type": "message",
                        "role": "assistant", "model": self.to.model, "content": [], "stop_reason": null,
                        "stop_sequence": null, "usage": usage}}),
                );
                out.extend(named("ping", &json!({"type": "ping"})));
                out
            }
            // Gemini has no opening frame.
            Api::Gemini => Vec::new(),
        }
    }

    /// Forward preview text of the turn's first block.
    pub fn text(&mut self, delta: &str) -> Vec<u8> {
        if delta.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let opening = !self.text_open;
        self.text_open = true;
        self.forwarded.push_str(delta);
        match self.to.api {
            Api::OpenaiChat => out.extend(data(&self.chat_chunk(json!({"content": delta}), Value::Null))),
            Api::OpenaiResponses => {
                let item_id = self.message_item_id();
                if opening {
                    out.extend(self.responses_event(
                        "response.output_item.added",
                        json!({"output_index": 0, "item": {"id": item_id, "type": "message",
                            "status": "in_progress", "role": "assistant", "content": []}}),
                    ));
                    out.extend(self.responses_event(
                        "response.content_part.added",
                        json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                            "part": {"type": "output_text", "text": "", "annotations": []}}),
                    ));
                }
                out.extend(self.responses_event(
                    "response.output_text.delta",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": delta, "logprobs": []}),
                ));
            }
            Api::AnthropicMessages => {
                if opening {
                    out.extend(named(
                        "content_block_start",
                        &json!({"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}),
                    ));
                }
                out.extend(named(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": delta}}),
                ));
            }
            Api::Gemini => out.extend(data(&self.gemini_chunk(vec![json!({"text": delta})], None, None))),
        }
        out
    }

    /// Close the answer from the committed turn. The forwarded preview must be a prefix of the
    /// turn's first text block; only the rest is sent. Anything else is a mismatch and the
    /// caller ends the stream with [`StreamEncoder::error`] instead.
    pub fn finish(&mut self, parts: &[Part], facts: &Facts) -> Result<Vec<u8>, PreviewMismatch> {
        let mut rest: Vec<Part> = parts.to_vec();
        let mut first_suffix = None;
        if self.text_open {
            match rest.first() {
                Some(Part::Text(text)) if text.starts_with(&self.forwarded) => {
                    first_suffix = Some(text[self.forwarded.len()..].to_owned());
                    rest.remove(0);
                }
                _ => return Err(PreviewMismatch),
            }
        }
        let mut out = Vec::new();
        if let Some(suffix) = first_suffix.as_deref().filter(|suffix| !suffix.is_empty()) {
            out.extend(self.text(suffix));
        }
        match self.to.api {
            Api::OpenaiChat => {
                let mut later_text: Vec<&str> = Vec::new();
                for part in &rest {
                    if let Part::Text(text) = part {
                        later_text.push(text);
                    }
                }
                if !later_text.is_empty() {
                    let mut joined = String::new();
                    if self.text_open {
                        joined.push_str("\n\n");
                    }
                    joined.push_str(&later_text.join("\n\n"));
                    out.extend(data(&self.chat_chunk(json!({"content": joined}), Value::Null)));
                }
                let mut index = 0usize;
                for part in &rest {
                    if let Part::Call { id, name, arguments } = part {
                        out.extend(data(&self.chat_chunk(
                            json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}),
                            Value::Null,
                        )));
                        index += 1;
                    }
                }
                out.extend(data(
                    &self.chat_chunk(json!({}), json!(chat_finish(parts, facts))),
                ));
                if self.to.include_usage {
                    out.extend(data(&json!({"id": self.to.id, "object": "chat.completion.chunk",
                        "created": self.to.created, "model": self.to.model, "choices": [],
                        "usage": {"prompt_tokens": facts.input_tokens, "completion_tokens": facts.output_tokens,
                                  "total_tokens": facts.input_tokens + facts.output_tokens}})));
                }
                out.extend(b"data: [DONE]\n\n");
            }
            Api::OpenaiResponses => {
                let output = responses_output(&self.to.id, parts);
                let mut output_index = 0usize;
                if self.text_open {
                    let item_id = self.message_item_id();
                    let text = self.forwarded.clone();
                    out.extend(self.responses_event(
                        "response.output_text.done",
                        json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
                    ));
                    out.extend(self.responses_event(
                        "response.content_part.done",
                        json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                            "part": {"type": "output_text", "text": text, "annotations": []}}),
                    ));
                    out.extend(self.responses_event(
                        "response.output_item.done",
                        json!({"output_index": 0, "item": output[0].clone()}),
                    ));
                    output_index = 1;
                }
                for item in output.iter().skip(output_index) {
                    let mut added = item.clone();
                    added["status"] = json!("in_progress");
                    if item["type"] == "function_call" {
                        added["arguments"] = json!("");
                    }
                    if item["type"] == "message" {
                        added["content"] = json!([]);
                    }
                    out.extend(self.responses_event(
                        "response.output_item.added",
                        json!({"output_index": output_index, "item": added}),
                    ));
                    if item["type"] == "message" {
                        // The same part and text events a previewed message gets, so SDKs that
                        // assemble text from deltas see every message.
                        let text = item["content"][0]["text"].clone();
                        let item_id = item["id"].clone();
                        out.extend(self.responses_event(
                            "response.content_part.added",
                            json!({"item_id": item_id, "output_index": output_index, "content_index": 0,
                                "part": {"type": "output_text", "text": "", "annotations": []}}),
                        ));
                        out.extend(self.responses_event(
                            "response.output_text.delta",
                            json!({"item_id": item_id, "output_index": output_index, "content_index": 0,
                                "delta": text, "logprobs": []}),
                        ));
                        out.extend(self.responses_event(
                            "response.output_text.done",
                            json!({"item_id": item_id, "output_index": output_index, "content_index": 0,
                                "text": text, "logprobs": []}),
                        ));
                        out.extend(self.responses_event(
                            "response.content_part.done",
                            json!({"item_id": item_id, "output_index": output_index, "content_index": 0,
                                "part": {"type": "output_text", "text": text, "annotations": []}}),
                        ));
                    }
                    if item["type"] == "function_call" {
                        out.extend(self.responses_event(
                            "response.function_call_arguments.delta",
                            json!({"item_id": item["id"], "output_index": output_index, "delta": item["arguments"]}),
                        ));
                        out.extend(self.responses_event(
                            "response.function_call_arguments.done",
                            json!({"item_id": item["id"], "output_index": output_index, "arguments": item["arguments"]}),
                        ));
                    }
                    out.extend(self.responses_event(
                        "response.output_item.done",
                        json!({"output_index": output_index, "item": item}),
                    ));
                    output_index += 1;
                }
                let object = responses_object(
                    &self.to.id,
                    &self.to.model,
                    self.to.created,
                    "completed",
                    output,
                    Some(facts),
                );
                let kind = if object["status"] == "incomplete" {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                out.extend(self.responses_event(kind, json!({"response": object})));
            }
            Api::AnthropicMessages => {
                let mut index = 0usize;
                if self.text_open {
                    out.extend(named(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": 0}),
                    ));
                    index = 1;
                }
                for block in anthropic_content(&rest) {
                    let (start, delta) = match block["type"].as_str() {
                        Some("text") => (
                            json!({"type": "text", "text": ""}),
                            Some(json!({"type": "text_delta", "text": block["text"]})),
                        ),
                        Some("tool_use") => (
                            json!({"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}),
                            Some(
                                json!({"type": "input_json_delta", "partial_json": block["input"].to_string()}),
                            ),
                        ),
                        Some("thinking") => (
                            json!({"type": "thinking", "thinking": ""}),
                            Some(json!({"type": "thinking_delta", "thinking": block["thinking"]})),
                        ),
                        _ => (block.clone(), None),
                    };
                    out.extend(named(
                        "content_block_start",
                        &json!({"type": "content_block_start", "index": index, "content_block": start}),
                    ));
                    if let Some(delta) = delta {
                        out.extend(named(
                            "content_block_delta",
                            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
                        ));
                    }
                    if block["type"] == "thinking" {
                        out.extend(named(
                            "content_block_delta",
                            &json!({"type": "content_block_delta", "index": index,
                                "delta": {"type": "signature_delta", "signature": block["signature"]}}),
                        ));
                    }
                    out.extend(named(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": index}),
                    ));
                    index += 1;
                }
                out.extend(named(
                    "message_delta",
                    &json!({"type": "message_delta", "delta": {"stop_reason": anthropic_stop(parts, facts),
                        "stop_sequence": null}, "usage": facts.anthropic_usage()}),
                ));
                out.extend(named("message_stop", &json!({"type": "message_stop"})));
            }
            Api::Gemini => {
                let chunk = self.gemini_chunk(gemini_parts(&rest), Some(gemini_finish(facts)), Some(facts));
                out.extend(data(&chunk));
            }
        }
        Ok(out)
    }

    /// End the stream with the provider's mid-stream error event.
    pub fn error(&mut self, code: &str, message: &str) -> Vec<u8> {
        match self.to.api {
            Api::OpenaiChat => data(
                &json!({"error": {"message": message, "type": "server_error", "param": null, "code": code}}),
            ),
            Api::OpenaiResponses => {
                let payload = json!({"code": code, "message": message, "param": null,
                    "error": {"type": "server_error", "code": code, "message": message}});
                self.responses_event("error", payload)
            }
            Api::AnthropicMessages => named(
                "error",
                &json!({"type": "error", "error": {"type": "api_error", "message": message, "code": code}}),
            ),
            Api::Gemini => data(
                &json!({"error": {"code": 500, "message": message, "status": "INTERNAL",
                                                  "turnstile_code": code}}),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> Facts {
        Facts {
            input_tokens: 10,
            output_tokens: 5,
            stop_reason: "end_turn".into(),
            cache: None,
        }
    }

    #[test]
    fn anthropic_stream_usage_is_the_providers_cumulative_count_with_its_cache_counters() {
        let committed = json!({"stop_reason": "end_turn", "usage": {"input_tokens": 1234, "output_tokens": 56,
                               "cache_creation_input_tokens": 1000, "cache_read_input_tokens": 0}});
        let parts = vec![Part::Text("Hi.".into())];
        let facts = Facts::from_commit(&committed, 99, &parts);
        // Streaming before the commit: message_start has only the admission count; message_delta
        // the provider's cumulative counts, cache counters included.
        let mut encoder = StreamEncoder::new(to(Api::AnthropicMessages), 99);
        let mut bytes = encoder.start();
        bytes.extend(encoder.text("Hi."));
        bytes.extend(encoder.finish(&parts, &facts).unwrap());
        let streamed = events(&bytes);
        assert_eq!(
            streamed[0].1["message"]["usage"],
            json!({"input_tokens": 99, "output_tokens": 0})
        );
        let delta = streamed.iter().find(|(name, _)| name == "message_delta").unwrap();
        assert_eq!(
            delta.1["usage"],
            json!({"input_tokens": 1234, "output_tokens": 56, "cache_creation_input_tokens": 1000,
                   "cache_read_input_tokens": 0})
        );
        // The commit known before the stream opens: message_start reports the provider's count.
        let mut encoder = StreamEncoder::new(to(Api::AnthropicMessages), 99);
        encoder.known_usage(facts.clone());
        let opened = events(&encoder.start());
        assert_eq!(
            opened[0].1["message"]["usage"],
            json!({"input_tokens": 1234, "output_tokens": 0, "cache_creation_input_tokens": 1000,
                   "cache_read_input_tokens": 0})
        );
        // No cache counters reported: none invented.
        let plain = Facts::from_commit(
            &json!({"usage": {"input_tokens": 7, "output_tokens": 1}}),
            99,
            &parts,
        );
        assert_eq!(
            plain.anthropic_usage(),
            json!({"input_tokens": 7, "output_tokens": 1})
        );
    }

    fn to(api: Api) -> Addressee {
        Addressee {
            api,
            id: "x1".into(),
            model: "m".into(),
            created: 1,
            include_usage: false,
            served_by: Vec::new(),
        }
    }

    fn events(bytes: &[u8]) -> Vec<(String, Value)> {
        String::from_utf8_lossy(bytes)
            .split("\n\n")
            .filter(|chunk| !chunk.trim().is_empty())
            .map(|chunk| {
                let mut name = String::new();
                let mut data = Value::Null;
                for line in chunk.lines() {
                    if let Some(value) = line.strip_prefix("event: ") {
                        name = value.to_owned();
                    } else if let Some(value) = line.strip_prefix("data: ") {
                        data = serde_json::from_str(value).unwrap_or(Value::Null);
                    }
                }
                (name, data)
            })
            .collect()
    }

    #[test]
    fn a_gemini_thought_signature_rides_on_the_part_it_signs() {
        let parts = vec![
            Part::Reasoning {
                provider: "gemini".into(),
                text: None,
                signature: Some("sig-1".into()),
                encrypted: None,
            },
            Part::Call {
                id: "c1".into(),
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into(),
            },
            Part::Reasoning {
                provider: "gemini".into(),
                text: Some("thinking".into()),
                signature: Some("sig-2".into()),
                encrypted: None,
            },
        ];
        let parts = gemini_parts(&parts);
        assert_eq!(
            parts,
            vec![
                json!({"functionCall": {"id": "c1", "name": "get_weather", "args": {"city": "Paris"}}, "thoughtSignature": "sig-1"}),
                json!({"text": "thinking", "thought": true}),
                json!({"text": "", "thoughtSignature": "sig-2"}),
            ]
        );
    }

    #[test]
    fn every_responses_message_item_gets_its_text_events_previewed_or_not() {
        let parts = vec![
            Part::Reasoning {
                provider: "openai".into(),
                text: None,
                signature: None,
                encrypted: Some("enc".into()),
            },
            Part::Text("Hello there.".into()),
        ];
        let mut encoder = StreamEncoder::new(to(Api::OpenaiResponses), 10);
        let mut bytes = encoder.start();
        bytes.extend(encoder.finish(&parts, &facts()).unwrap());
        let events = events(&bytes);
        let deltas: String = events
            .iter()
            .filter(|(name, _)| name == "response.output_text.delta")
            .map(|(_, data)| data["delta"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(deltas, "Hello there.");
        let added = events
            .iter()
            .find(|(name, data)| name == "response.output_item.added" && data["item"]["type"] == "message")
            .unwrap();
        assert_eq!(added.1["item"]["content"], json!([]));
        let sequence: Vec<u64> = events
            .iter()
            .map(|(_, data)| data["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(sequence, (0..sequence.len() as u64).collect::<Vec<_>>());
        let completed = &events.last().unwrap().1["response"];
        assert_eq!(completed["output"][1]["content"][0]["text"], "Hello there.");
        assert_eq!(
            events
                .iter()
                .filter(|(name, _)| name == "response.content_part.done")
                .count(),
            1
        );
    }
}
