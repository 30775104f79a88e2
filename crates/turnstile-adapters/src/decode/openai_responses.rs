//! OpenAI Responses stream decoder.
//!
//! Wire format (openai-openapi `ResponseStreamEvent`, l.60087; recorded in vercel/ai
//! `packages/openai/src/responses/__fixtures__`, see shared `provider-streams/openai-responses/`):
//! `event: <type>` + `data: {"type": <type>, "sequence_number": n, …}`, no `[DONE]`.
//! - Every event has `sequence_number`: it is the dedupe sequence, so a resumed stream
//!   (`GET /v1/responses/{id}?stream=true&starting_after=n`) that overlaps adds nothing twice.
//! - Items are keyed by `output_index`, text parts by (`output_index`, `content_index`).
//! - `function_call_arguments.done` and `output_item.done` carry the complete arguments: the
//!   assembler checks its buffer against them.
//! - The end is `response.completed`, `response.incomplete` (`incomplete_details.reason`) or
//!   `response.failed`; an `error` event comes flat (`code`, `message`, per the spec's
//!   `ResponseErrorEvent`) or nested under `error` (the recorded `error-then-failed` stream).
//!
//! Block keys: `output_index * 1024 + content_index` for text parts, `output_index * 1024` for
//! function calls and reasoning (one item is one or the other, never both). Stateless, so a
//! fresh decoder on a resumed connection keys blocks the same way.

use super::{Decoder, Emitter, EventDecoder, SseDecoder, provider_error, str_at, u64_at};
use crate::sse::SseEvent;
use serde_json::Value;
use std::borrow::Cow;
use turnstile_core::stream::{BlockIndex, BlockStart, Sequenced, StopReason, StreamEvent};

/// Content parts per output item that get a distinct block key.
const PARTS_PER_ITEM_MAX: u64 = 1024;

sse_decoder!(
    /// Decoder for `openai-responses@*`.
    OpenAiResponsesDecoder, Responses, Responses { tool_seen: false }
);

#[derive(Clone)]
pub(crate) struct Responses {
    tool_seen: bool,
}

fn key(payload: &Value, content: bool, out: &mut Emitter) -> Option<BlockIndex> {
    let output_index = u64_at(payload, "output_index");
    let content_index = if content {
        u64_at(payload, "content_index")
    } else {
        Some(0)
    };
    match (output_index, content_index) {
        (Some(output_index), Some(content_index)) if content_index < PARTS_PER_ITEM_MAX => output_index
            .checked_mul(PARTS_PER_ITEM_MAX)
            .and_then(|base| base.checked_add(content_index))
            .map(BlockIndex),
        _ => {
            out.push(StreamEvent::Malformed {
                detail: "an item event without usable output_index/content_index".into(),
            });
            None
        }
    }
}

/// The shape of the hot delta events, parsed without building a `Value` (unknown fields such
/// as `obfuscation` and `logprobs` are skipped, strings are borrowed when unescaped).
#[derive(serde::Deserialize)]
struct Delta<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    sequence_number: Option<u64>,
    output_index: Option<u64>,
    content_index: Option<u64>,
    #[serde(borrow)]
    delta: Cow<'a, str>,
}

fn key_of(output_index: Option<u64>, content_index: Option<u64>) -> Option<BlockIndex> {
    match (output_index, content_index) {
        (Some(output_index), Some(content_index)) if content_index < PARTS_PER_ITEM_MAX => output_index
            .checked_mul(PARTS_PER_ITEM_MAX)
            .and_then(|base| base.checked_add(content_index))
            .map(BlockIndex),
        _ => None,
    }
}

impl EventDecoder for Responses {
    fn fast(&mut self, event: &SseEvent, out: &mut Emitter) -> bool {
        let name = event.event.as_str();
        let text = matches!(name, "response.output_text.delta" | "response.refusal.delta");
        let arguments = name == "response.function_call_arguments.delta";
        let reasoning = matches!(
            name,
            "response.reasoning_summary_text.delta" | "response.reasoning_text.delta"
        );
        if !(text || arguments || reasoning) {
            return false;
        }
        // Any surprise (another shape, a type that disagrees with the event name) takes the
        // general path, which reports what is wrong.
        let Ok(delta) = serde_json::from_str::<Delta<'_>>(&event.data) else {
            return false;
        };
        if delta.kind != name {
            return false;
        }
        let content_index = if text { delta.content_index } else { Some(0) };
        let Some(index) = key_of(delta.output_index, content_index) else {
            return false;
        };
        if let Some(number) = delta.sequence_number {
            out.provider_seq(number);
        }
        let fragment = delta.delta.into_owned();
        if text {
            out.push(StreamEvent::TextDelta {
                index,
                text: fragment,
            });
        } else if reasoning {
            out.push(StreamEvent::ReasoningDelta {
                index,
                text: fragment,
            });
        } else if !fragment.is_empty() {
            out.push(StreamEvent::ToolArgsDelta { index, fragment });
        }
        true
    }

    fn event(&mut self, event: &SseEvent, payload: Value, out: &mut Emitter) {
        if let Some(number) = u64_at(&payload, "sequence_number") {
            out.provider_seq(number);
        }
        let kind = str_at(&payload, "type").unwrap_or(event.event.as_str());
        match kind {
            "response.created" | "response.in_progress" | "response.queued" => {
                if let Some(id) = payload
                    .get("response")
                    .and_then(|response| str_at(response, "id"))
                {
                    out.push(StreamEvent::Handle {
                        handle: id.to_owned(),
                    });
                }
            }
            "response.output_item.added" => {
                let item = payload.get("item").unwrap_or(&Value::Null);
                match str_at(item, "type") {
                    Some("function_call") => {
                        let Some(index) = key(&payload, false, out) else {
                            return;
                        };
                        let Some(name) = str_at(item, "name") else {
                            out.push(StreamEvent::Malformed {
                                detail: "a function_call item without a name".into(),
                            });
                            return;
                        };
                        self.tool_seen = true;
                        out.push(StreamEvent::BlockStart {
                            index,
                            block: BlockStart::ToolCall {
                                call_id: str_at(item, "call_id").map(str::to_owned),
                                name: name.to_owned(),
                            },
                        });
                        if let Some(arguments) = str_at(item, "arguments").filter(|text| !text.is_empty()) {
                            out.push(StreamEvent::ToolArgsDelta {
                                index,
                                fragment: arguments.to_owned(),
                            });
                        }
                    }
                    Some("reasoning") => {
                        let Some(index) = key(&payload, false, out) else {
                            return;
                        };
                        out.push(StreamEvent::BlockStart {
                            index,
                            block: BlockStart::Reasoning {
                                provider: "openai".into(),
                            },
                        });
                    }
                    // A message item holds content parts; those are the blocks.
                    Some("message") => {}
                    other => out.push(StreamEvent::Malformed {
                        detail: format!("output item type {other:?} has no v1 block kind"),
                    }),
                }
            }
            "response.content_part.added" => {
                let part_type = payload.get("part").and_then(|part| str_at(part, "type"));
                match part_type {
                    Some("output_text") | Some("refusal") => {
                        let Some(index) = key(&payload, true, out) else {
                            return;
                        };
                        out.push(StreamEvent::BlockStart {
                            index,
                            block: BlockStart::Text,
                        });
                    }
                    other => out.push(StreamEvent::Malformed {
                        detail: format!("content part type {other:?} has no v1 block kind"),
                    }),
                }
            }
            "response.output_text.delta" | "response.refusal.delta" => {
                let Some(index) = key(&payload, true, out) else {
                    return;
                };
                out.push(StreamEvent::TextDelta {
                    index,
                    text: str_at(&payload, "delta").unwrap_or_default().to_owned(),
                });
            }
            "response.content_part.done" => {
                let Some(index) = key(&payload, true, out) else {
                    return;
                };
                out.push(StreamEvent::BlockStop {
                    index,
                    arguments_final: None,
                });
            }
            "response.function_call_arguments.delta" => {
                let Some(index) = key(&payload, false, out) else {
                    return;
                };
                let fragment = str_at(&payload, "delta").unwrap_or_default();
                if !fragment.is_empty() {
                    out.push(StreamEvent::ToolArgsDelta {
                        index,
                        fragment: fragment.to_owned(),
                    });
                }
            }
            "response.function_call_arguments.done" => {
                let Some(index) = key(&payload, false, out) else {
                    return;
                };
                out.push(StreamEvent::BlockStop {
                    index,
                    arguments_final: str_at(&payload, "arguments").map(str::to_owned),
                });
            }
            "response.reasoning_summary_text.delta" | "response.reasoning_text.delta" => {
                let Some(index) = key(&payload, false, out) else {
                    return;
                };
                out.push(StreamEvent::ReasoningDelta {
                    index,
                    text: str_at(&payload, "delta").unwrap_or_default().to_owned(),
                });
            }
            "response.output_item.done" => {
                let item = payload.get("item").unwrap_or(&Value::Null);
                match str_at(item, "type") {
                    Some("function_call") => {
                        let Some(index) = key(&payload, false, out) else {
                            return;
                        };
                        out.push(StreamEvent::BlockStop {
                            index,
                            arguments_final: str_at(item, "arguments").map(str::to_owned),
                        });
                    }
                    Some("reasoning") => {
                        let Some(index) = key(&payload, false, out) else {
                            return;
                        };
                        // The `.done` item is the canonical one: `encrypted_content` "may be
                        // incomplete while the item is in progress" (spec, provider-rules §2.2).
                        if let Some(encrypted) = str_at(item, "encrypted_content") {
                            out.push(StreamEvent::ReasoningSeal {
                                index,
                                signature: None,
                                encrypted: Some(encrypted.to_owned()),
                            });
                        }
                        out.push(StreamEvent::BlockStop {
                            index,
                            arguments_final: None,
                        });
                    }
                    _ => {}
                }
            }
            "response.completed" | "response.incomplete" => {
                let response = payload.get("response").unwrap_or(&Value::Null);
                if let Some(usage) = response.get("usage").filter(|usage| usage.is_object()) {
                    out.push(StreamEvent::Usage {
                        input_tokens: u64_at(usage, "input_tokens"),
                        output_tokens: u64_at(usage, "output_tokens"),
                        cache_creation_input_tokens: None,
                        cache_read_input_tokens: None,
                    });
                }
                let reason = if kind == "response.completed" {
                    if self.tool_seen {
                        StopReason::ToolUse
                    } else {
                        StopReason::EndTurn
                    }
                } else {
                    let details = response.get("incomplete_details").unwrap_or(&Value::Null);
                    match str_at(details, "reason") {
                        Some("max_output_tokens") => StopReason::MaxTokens,
                        Some("content_filter") => StopReason::ContentFilter,
                        other => StopReason::Other(other.unwrap_or("incomplete").to_owned()),
                    }
                };
                out.push(StreamEvent::Stop { reason });
                out.push(StreamEvent::End);
            }
            "response.failed" => {
                let response = payload.get("response").unwrap_or(&Value::Null);
                match response.get("error").filter(|error| error.is_object()) {
                    Some(error) => out.push(provider_error(error)),
                    None => out.push(StreamEvent::ProviderError {
                        code: "response_failed".into(),
                        message: String::new(),
                    }),
                }
            }
            "error" => {
                let error = payload
                    .get("error")
                    .filter(|error| error.is_object())
                    .unwrap_or(&payload);
                out.push(provider_error(error));
            }
            // Text `.done` events repeat what the deltas said; annotations, logprobs and the
            // lifecycle of hosted tools carry nothing for a v1 turn.
            _ => {}
        }
    }
}
