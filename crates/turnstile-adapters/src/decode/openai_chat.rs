//! OpenAI Chat Completions stream decoder.
//!
//! Wire format (openai-openapi `CreateChatCompletionStreamResponse`, l.33665; recorded in
//! openai-python `.inline-snapshot/external/*.bin`, see shared `provider-streams/openai-chat/`):
//! `data: <chunk>` events with no `event:` field, ended by `data: [DONE]`.
//! - `choices[0].delta.content` is text; `delta.refusal` is text too (the model's words).
//! - `delta.tool_calls[].index` is a *key*, not an array position (a compatible endpoint
//!   starts at 1: `compat-tool-call-index-starts-at-1.sse`); `id` and `function.name` come
//!   only with a call's first fragment, later fragments carry `function.arguments` only.
//! - There is no per-call stop: `finish_reason` on the choice closes every block.
//! - With `include_usage`, a last chunk has `choices: []` and `usage`.
//! - A payload with a top-level `error` is an in-stream error (openai-python `_streaming.py`).
//!
//! Block keys: the text block is key 0, tool call `index` i is key i + 1. Only choice 0 is
//! assembled (`n > 1` is not something a conversation turn can hold); other choices are ignored.
//!
//! Duplicated deltas. Chat events carry no sequence number, so a chunk delivered twice (a
//! proxy or SDK bug, the simulator's `duplicate_events`) is two deltas to any decoder. What
//! can be checked is the usage chunk: `completion_tokens` counts every token the model
//! generated, and every byte of visible output (text, refusal, each call's arguments) was
//! generated, so for a model whose tokenizer we have exactly (an OpenAI model the catalog knows,
//! [`crate::catalog::exact_openai_tokenizer`]) the BPE count of the assembled output cannot
//! exceed `completion_tokens − reasoning_tokens`. When it does, some delta arrived twice, and
//! the decoder emits a malformed event (the assembler retracts, nothing commits). It is
//! one-sided on purpose: hidden tokens (reasoning, tool-call framing) only raise the reported
//! count. Not detectable: a stream without a usage chunk, a model we cannot count exactly
//! (compatible endpoints), and a duplicate small enough to stay under the hidden tokens of a
//! reply with tool calls (`docs/decisions.md`, 2026-12-01).

use super::{Decoder, Emitter, EventDecoder, SseDecoder, provider_error, str_at, u64_at};
use crate::sse::SseEvent;
use serde_json::Value;
use std::collections::BTreeSet;
use turnstile_core::stream::{BlockIndex, BlockStart, Sequenced, StopReason, StreamEvent};

const TEXT_BLOCK: BlockIndex = BlockIndex(0);

sse_decoder!(
    /// Decoder for `openai-chat@*`.
    OpenAiChatDecoder, Chat, Chat::default()
);

/// Most output bytes kept for the usage cross-check; a longer reply is not checked (the
/// assembler's own `ASSEMBLE_TURN_BYTES_MAX` bounds what can commit).
pub const CHAT_USAGE_CHECK_BYTES_MAX: usize = 4 * 1024 * 1024;

#[derive(Clone, Default)]
pub(crate) struct Chat {
    handle: Option<String>,
    started: BTreeSet<BlockIndex>,
    stopped: bool,
    /// The model the chunks name (the first one that names one).
    model: Option<String>,
    /// Visible output of choice 0 per block key, as received, for the usage cross-check.
    output: std::collections::BTreeMap<BlockIndex, String>,
    output_bytes: usize,
}

impl EventDecoder for Chat {
    fn non_json(&mut self, event: &SseEvent, out: &mut Emitter) {
        if event.data.trim() == "[DONE]" {
            out.push(StreamEvent::End);
        } else {
            out.push(StreamEvent::Malformed {
                detail: "a chunk whose data is not JSON".into(),
            });
        }
    }

    fn event(&mut self, _event: &SseEvent, chunk: Value, out: &mut Emitter) {
        if let Some(error) = chunk.get("error").filter(|error| !error.is_null()) {
            out.push(provider_error(error));
            return;
        }
        if self.model.is_none()
            && let Some(model) = str_at(&chunk, "model")
        {
            self.model = Some(model.to_owned());
        }
        if let Some(id) = str_at(&chunk, "id")
            && self.handle.as_deref() != Some(id)
        {
            self.handle = Some(id.to_owned());
            out.push(StreamEvent::Handle {
                handle: id.to_owned(),
            });
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            if u64_at(choice, "index").unwrap_or(0) != 0 {
                continue;
            }
            if let Some(delta) = choice.get("delta") {
                self.delta(delta, out);
            }
            if let Some(reason) = str_at(choice, "finish_reason") {
                self.finish(reason, out);
            }
        }
        if let Some(usage) = chunk.get("usage").filter(|usage| usage.is_object()) {
            out.push(StreamEvent::Usage {
                input_tokens: u64_at(usage, "prompt_tokens"),
                output_tokens: u64_at(usage, "completion_tokens"),
                cache_creation_input_tokens: None,
                cache_read_input_tokens: None,
            });
            self.check_usage(usage, out);
        }
    }
}

impl Chat {
    /// Keep a visible fragment for the usage cross-check (see the module docs).
    fn keep(&mut self, index: BlockIndex, fragment: &str) {
        self.output_bytes = self.output_bytes.saturating_add(fragment.len());
        if self.output_bytes <= CHAT_USAGE_CHECK_BYTES_MAX {
            self.output.entry(index).or_default().push_str(fragment);
        }
    }

    /// More visible output than the model generated means a delta arrived twice.
    fn check_usage(&mut self, usage: &Value, out: &mut Emitter) {
        let Some(reported) = u64_at(usage, "completion_tokens") else {
            return;
        };
        if self.output_bytes > CHAT_USAGE_CHECK_BYTES_MAX {
            return;
        }
        let Some(tokenizer) = self
            .model
            .as_deref()
            .and_then(crate::catalog::exact_openai_tokenizer)
        else {
            return;
        };
        let reasoning = usage
            .get("completion_tokens_details")
            .and_then(|details| u64_at(details, "reasoning_tokens"))
            .unwrap_or(0);
        let visible_max = reported.saturating_sub(reasoning);
        let visible: u64 = self.output.values().map(|text| tokenizer.count(text)).sum();
        if visible > visible_max {
            out.push(StreamEvent::Malformed {
                detail: format!(
                    "the stream carried {visible} tokens of output but the provider reported \
                     {visible_max} generated: a delta was delivered more than once"
                ),
            });
        }
    }

    fn delta(&mut self, delta: &Value, out: &mut Emitter) {
        for key in ["content", "refusal"] {
            let Some(text) = str_at(delta, key) else {
                continue;
            };
            if self.started.insert(TEXT_BLOCK) {
                out.push(StreamEvent::BlockStart {
                    index: TEXT_BLOCK,
                    block: BlockStart::Text,
                });
            }
            self.keep(TEXT_BLOCK, text);
            out.push(StreamEvent::TextDelta {
                index: TEXT_BLOCK,
                text: text.to_owned(),
            });
        }
        let calls = delta.get("tool_calls").and_then(Value::as_array);
        for call in calls.into_iter().flatten() {
            let Some(key) = u64_at(call, "index").and_then(|index| index.checked_add(1)) else {
                out.push(StreamEvent::Malformed {
                    detail: "a tool_calls entry without a numeric index".into(),
                });
                continue;
            };
            let index = BlockIndex(key);
            let function = call.get("function");
            if !self.started.contains(&index) {
                let Some(name) = function.and_then(|function| str_at(function, "name")) else {
                    out.push(StreamEvent::Malformed {
                        detail: format!("the first fragment of tool call {} has no name", key - 1),
                    });
                    continue;
                };
                self.started.insert(index);
                out.push(StreamEvent::BlockStart {
                    index,
                    block: BlockStart::ToolCall {
                        call_id: str_at(call, "id").map(str::to_owned),
                        name: name.to_owned(),
                    },
                });
            }
            if let Some(fragment) = function.and_then(|function| str_at(function, "arguments"))
                && !fragment.is_empty()
            {
                self.keep(index, fragment);
                out.push(StreamEvent::ToolArgsDelta {
                    index,
                    fragment: fragment.to_owned(),
                });
            }
        }
    }

    fn finish(&mut self, reason: &str, out: &mut Emitter) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        // Chat has no per-call stop event: the finish reason closes every block
        // (provider-rules.md §0 rule 7). Except `length`: the output was cut, and without a
        // per-call stop no tool call can be known whole, so tool blocks stay open and the
        // assembler retracts with `max_tokens_in_tool_arguments`.
        for index in &self.started {
            if reason == "length" && *index != TEXT_BLOCK {
                continue;
            }
            out.push(StreamEvent::BlockStop {
                index: *index,
                arguments_final: None,
            });
        }
        let reason = match reason {
            "stop" => StopReason::EndTurn,
            "length" => StopReason::MaxTokens,
            "tool_calls" | "function_call" => StopReason::ToolUse,
            "content_filter" => StopReason::ContentFilter,
            other => StopReason::Other(other.to_owned()),
        };
        out.push(StreamEvent::Stop { reason });
    }
}
