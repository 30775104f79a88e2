//! A whole JSON answer to a stream request.
//!
//! Some compatible servers ignore `"stream": true` and answer with the complete response as
//! one JSON document (`application/json`). Read as a stream, such a body has no `data:` line:
//! nothing decodes, and the clean end looked like a cut stream, attempt after attempt.
//!
//! [`Sniffing`] wraps an API's stream decoder and looks at the first byte of the body that is
//! not white space: an SSE body begins with a field (`data:`, `event:`, `id:`, `retry:`) or a
//! comment (`:`), never with `{` or `[`, which a JSON document always does. A JSON body is kept
//! whole (bounded) and, only when the body ended cleanly, translated into the events that
//! API's own stream carries for the same answer and fed to the same stream decoder, so every
//! stream rule (call ids, whole argument JSON, stop reasons, limits) holds for it unchanged.
//! A body cut short, over its bound or not JSON commits nothing: a cut body never reaches the
//! translation, and the rest decode as malformed.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - the world's dialects commit exactly what the vendor's stream commits: a Chat body ended
//!   cleanly after its finish reason without `[DONE]`, a whole JSON answer to a stream request
//!   (every prefix commits nothing; a body of another shape is malformed, never a panic), a
//!   compatible upstream's own usage count (a notice, not a violation). Enforced in
//!   `decode/openai_chat.rs` (`end_of_input`, `check_usage` with `DecoderOptions`),
//!   `decode/whole.rs`. Tests: `stream/integrity.rs::an_openai_chat_stream_that_ends_cleanly…`,
//!   `…usage_count_is_a_notice…`, `stream/whole.rs` (all four APIs),
//!   `gateway/tests/it/open_world.rs`, `foreign.rs` (servers we did not write), seeds (`no_done`,
//!   `json_answer`).

use super::{Decoder, StreamApi};
use serde_json::{Value, json};
use std::collections::VecDeque;
use turnstile_core::stream::{Seq, SeqSource, Sequenced, StreamEvent};

/// Largest whole JSON answer kept (the assembler's own bounds apply to what it holds).
pub const WHOLE_BODY_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Most leading white space looked past before the body is taken for a stream.
const LEADING_SPACE_MAX: usize = 64 * 1024;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Only white space so far.
    Undecided,
    /// Server-sent events: everything goes to the stream decoder.
    Stream,
    /// A JSON document, kept until the body ends.
    Json,
}

/// An API's stream decoder that also reads a whole JSON answer.
pub struct Sniffing {
    api: StreamApi,
    inner: Box<dyn Decoder>,
    mode: Mode,
    held: Vec<u8>,
    over: bool,
    extra: VecDeque<Sequenced>,
}

impl Sniffing {
    /// Wrap `inner`, a fresh stream decoder of `api`.
    pub fn new(api: StreamApi, inner: Box<dyn Decoder>) -> Sniffing {
        Sniffing {
            api,
            inner,
            mode: Mode::Undecided,
            held: Vec::new(),
            over: false,
            extra: VecDeque::new(),
        }
    }

    fn malformed(&mut self, detail: String) {
        self.extra.push_back(Sequenced {
            seq: Seq {
                source: SeqSource::Receive,
                number: 0,
                part: 0,
            },
            event: StreamEvent::Malformed { detail },
        });
    }

    /// The body ended (cleanly, or a stored file ended): translate a JSON answer.
    fn finish_json(&mut self) {
        if self.over {
            self.malformed(format!(
                "a whole JSON answer longer than {WHOLE_BODY_BYTES_MAX} bytes"
            ));
            return;
        }
        let Some(answer) = turnstile_core::parse::bounded_value(&self.held) else {
            self.malformed("a JSON answer to a stream request that is not whole JSON".into());
            return;
        };
        self.held = Vec::new();
        let events = match translate(self.api, &answer) {
            Ok(events) => events,
            Err(detail) => {
                self.malformed(detail);
                return;
            }
        };
        self.inner.handle_bytes(&events);
    }
}

impl Decoder for Sniffing {
    fn handle_bytes(&mut self, bytes: &[u8]) {
        match self.mode {
            Mode::Stream => self.inner.handle_bytes(bytes),
            Mode::Json => {
                let room = WHOLE_BODY_BYTES_MAX.saturating_sub(self.held.len());
                if bytes.len() > room {
                    self.over = true;
                }
                self.held.extend_from_slice(&bytes[..bytes.len().min(room)]);
            }
            Mode::Undecided => {
                let first = bytes.iter().find(|byte| !byte.is_ascii_whitespace());
                self.mode = match first {
                    Some(b'{' | b'[') => Mode::Json,
                    Some(_) => Mode::Stream,
                    None if self.held.len() + bytes.len() > LEADING_SPACE_MAX => Mode::Stream,
                    None => {
                        self.held.extend_from_slice(bytes);
                        return;
                    }
                };
                let held = std::mem::take(&mut self.held);
                if self.mode == Mode::Stream {
                    self.inner.handle_bytes(&held);
                }
                self.held = if self.mode == Mode::Json { held } else { Vec::new() };
                self.handle_bytes(bytes);
            }
        }
    }

    fn handle_end_of_input(&mut self) {
        if self.mode == Mode::Json {
            self.finish_json();
        }
        self.inner.handle_end_of_input();
    }

    fn handle_end_of_file(&mut self) {
        if self.mode == Mode::Json {
            self.finish_json();
        }
        self.inner.handle_end_of_file();
    }

    fn poll_event(&mut self) -> Option<Sequenced> {
        self.inner.poll_event().or_else(|| self.extra.pop_front())
    }

    fn fork(&self) -> Box<dyn Decoder> {
        Box::new(Sniffing {
            api: self.api,
            inner: self.inner.fork(),
            mode: self.mode,
            held: self.held.clone(),
            over: self.over,
            extra: self.extra.clone(),
        })
    }
}

/// One SSE event.
fn frame(out: &mut Vec<u8>, event: Option<&str>, data: &Value) {
    if let Some(event) = event {
        out.extend_from_slice(format!("event: {event}\n").as_bytes());
    }
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// The stream `api` sends for `answer`, its whole (non-streaming) response.
fn translate(api: StreamApi, answer: &Value) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    // Every value written into below is an object (serde_json's index assignment panics on
    // anything else); an answer of another shape is no answer.
    if api != StreamApi::Gemini && !answer.is_object() {
        return Err("a JSON answer to a stream request that is not an object".into());
    }
    match api {
        StreamApi::OpenAiChat => chat(&mut out, answer),
        StreamApi::AnthropicMessages => anthropic(&mut out, answer)?,
        StreamApi::Gemini => {
            // `streamGenerateContent` without `alt=sse` answers an array of the same chunks.
            let chunks = match answer {
                Value::Array(chunks) => chunks.iter().collect(),
                chunk => vec![chunk],
            };
            for chunk in chunks {
                frame(&mut out, None, chunk);
            }
        }
        StreamApi::OpenAiResponses => responses(&mut out, answer)?,
    }
    Ok(out)
}

fn chat(out: &mut Vec<u8>, answer: &Value) {
    if answer.get("error").is_some_and(|error| !error.is_null()) {
        frame(out, None, &json!({"error": answer["error"]}));
        return;
    }
    let choice = answer["choices"]
        .as_array()
        .and_then(|choices| {
            choices
                .iter()
                .find(|choice| choice["index"].as_u64().unwrap_or(0) == 0)
        })
        .cloned()
        .unwrap_or(Value::Null);
    let message = &choice["message"];
    let mut delta = serde_json::Map::new();
    let text = match &message["content"] {
        Value::String(text) => Some(text.clone()),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|part| part["text"].as_str())
                .collect::<String>(),
        ),
        _ => None,
    };
    if let Some(text) = text.filter(|text| !text.is_empty()) {
        delta.insert("content".into(), json!(text));
    }
    if let Some(refusal) = message["refusal"].as_str() {
        delta.insert("refusal".into(), json!(refusal));
    }
    if let Some(calls) = message["tool_calls"].as_array() {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(index, call)| {
                json!({"index": index, "id": call["id"], "type": "function",
                       "function": {"name": call["function"]["name"],
                                    "arguments": call["function"]["arguments"]}})
            })
            .collect();
        delta.insert("tool_calls".into(), Value::Array(calls));
    }
    let mut chunk = json!({"id": answer["id"], "object": "chat.completion.chunk", "model": answer["model"],
                           "choices": [{"index": 0, "delta": Value::Object(delta),
                                        "finish_reason": choice["finish_reason"]}]});
    if let Some(usage) = answer.get("usage").filter(|usage| !usage.is_null()) {
        chunk["usage"] = usage.clone();
    }
    frame(out, None, &chunk);
    out.extend_from_slice(b"data: [DONE]\n\n");
}

fn anthropic(out: &mut Vec<u8>, answer: &Value) -> Result<(), String> {
    if answer["type"] == "error" || answer.get("error").is_some_and(|error| !error.is_null()) {
        frame(
            out,
            Some("error"),
            &json!({"type": "error", "error": answer["error"]}),
        );
        return Ok(());
    }
    frame(
        out,
        Some("message_start"),
        &json!({"type": "message_start", "message": {"id": answer["id"], "type": "message",
                "role": "assistant", "model": answer["model"], "content": [],
                "usage": {"input_tokens": answer["usage"]["input_tokens"],
                          "cache_creation_input_tokens": answer["usage"]["cache_creation_input_tokens"],
                          "cache_read_input_tokens": answer["usage"]["cache_read_input_tokens"]}}}),
    );
    for (index, block) in answer["content"].as_array().into_iter().flatten().enumerate() {
        if !block.is_object() {
            return Err(format!("content block {index} of a JSON answer is not an object"));
        }
        let mut start = block.clone();
        let mut deltas = Vec::new();
        match block["type"].as_str() {
            Some("text") => {
                start["text"] = json!("");
                deltas.push(json!({"type": "text_delta", "text": block["text"]}));
            }
            Some("tool_use") => {
                start["input"] = json!({});
                let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                deltas.push(json!({"type": "input_json_delta", "partial_json": input.to_string()}));
            }
            Some("thinking") => {
                start["thinking"] = json!("");
                start["signature"] = json!("");
                deltas.push(json!({"type": "thinking_delta", "thinking": block["thinking"]}));
                if block["signature"].is_string() {
                    deltas.push(json!({"type": "signature_delta", "signature": block["signature"]}));
                }
            }
            _ => {}
        }
        frame(
            out,
            Some("content_block_start"),
            &json!({"type": "content_block_start", "index": index, "content_block": start}),
        );
        for delta in deltas {
            frame(
                out,
                Some("content_block_delta"),
                &json!({"type": "content_block_delta", "index": index, "delta": delta}),
            );
        }
        frame(
            out,
            Some("content_block_stop"),
            &json!({"type": "content_block_stop", "index": index}),
        );
    }
    frame(
        out,
        Some("message_delta"),
        &json!({"type": "message_delta", "delta": {"stop_reason": answer["stop_reason"],
                "stop_sequence": answer["stop_sequence"]},
                "usage": {"output_tokens": answer["usage"]["output_tokens"]}}),
    );
    frame(out, Some("message_stop"), &json!({"type": "message_stop"}));
    Ok(())
}

fn responses(out: &mut Vec<u8>, answer: &Value) -> Result<(), String> {
    // Only a finished response is a whole answer: any other status (queued, in_progress,
    // cancelled, none) would read as a stop the provider never gave.
    let terminal = match answer["status"].as_str() {
        Some("completed") => "response.completed",
        Some("incomplete") => "response.incomplete",
        Some("failed") => "response.failed",
        _ if answer.get("error").is_some_and(|error| !error.is_null()) => "error",
        other => {
            return Err(format!(
                "a Responses JSON answer with status {other:?} is not finished"
            ));
        }
    };
    let mut sequence = 0u64;
    let mut event = |out: &mut Vec<u8>, name: &str, data: Value| {
        let mut data = match data {
            Value::Object(map) => map,
            other => {
                let mut map = serde_json::Map::new();
                map.insert("message".into(), other);
                map
            }
        };
        data.insert("type".into(), json!(name));
        data.insert("sequence_number".into(), json!(sequence));
        sequence += 1;
        frame(out, Some(name), &Value::Object(data));
    };
    if terminal == "error" {
        event(out, "error", answer["error"].clone());
        return Ok(());
    }
    let mut started = answer.clone();
    started["status"] = json!("in_progress");
    started["output"] = json!([]);
    event(out, "response.created", json!({"response": started}));
    for (output_index, item) in answer["output"].as_array().into_iter().flatten().enumerate() {
        if !item.is_object() {
            return Err(format!(
                "output item {output_index} of a JSON answer is not an object"
            ));
        }
        let mut added = item.clone();
        match item["type"].as_str() {
            Some("message") => added["content"] = json!([]),
            Some("function_call") => added["arguments"] = json!(""),
            Some("reasoning") => added["summary"] = json!([]),
            _ => {}
        }
        event(
            out,
            "response.output_item.added",
            json!({"output_index": output_index, "item": added}),
        );
        match item["type"].as_str() {
            Some("message") => {
                for (content_index, part) in item["content"].as_array().into_iter().flatten().enumerate() {
                    if !part.is_object() {
                        return Err(format!(
                            "content part {content_index} of a JSON answer is not an object"
                        ));
                    }
                    let kind = part["type"].as_str().unwrap_or("");
                    let (field, delta_event) = match kind {
                        "refusal" => ("refusal", "response.refusal.delta"),
                        _ => ("text", "response.output_text.delta"),
                    };
                    let mut empty = part.clone();
                    empty[field] = json!("");
                    event(
                        out,
                        "response.content_part.added",
                        json!({"output_index": output_index, "content_index": content_index,
                               "item_id": item["id"], "part": empty}),
                    );
                    event(
                        out,
                        delta_event,
                        json!({"output_index": output_index, "content_index": content_index,
                               "item_id": item["id"], "delta": part[field]}),
                    );
                    event(
                        out,
                        "response.content_part.done",
                        json!({"output_index": output_index, "content_index": content_index,
                               "item_id": item["id"], "part": part}),
                    );
                }
            }
            Some("function_call") => {
                event(
                    out,
                    "response.function_call_arguments.delta",
                    json!({"output_index": output_index, "item_id": item["id"], "delta": item["arguments"]}),
                );
                event(
                    out,
                    "response.function_call_arguments.done",
                    json!({"output_index": output_index, "item_id": item["id"], "arguments": item["arguments"]}),
                );
            }
            Some("reasoning") => {
                for (summary_index, part) in item["summary"].as_array().into_iter().flatten().enumerate() {
                    event(
                        out,
                        "response.reasoning_summary_text.delta",
                        json!({"output_index": output_index, "summary_index": summary_index,
                               "item_id": item["id"], "delta": part["text"]}),
                    );
                }
            }
            _ => {}
        }
        event(
            out,
            "response.output_item.done",
            json!({"output_index": output_index, "item": item}),
        );
    }
    event(out, terminal, json!({"response": answer}));
    Ok(())
}
