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

#[derive(Clone, Default)]
pub(crate) struct Chat {
    handle: Option<String>,
    started: BTreeSet<BlockIndex>,
    stopped: bool,
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
            });
        }
    }
}

impl Chat {
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
