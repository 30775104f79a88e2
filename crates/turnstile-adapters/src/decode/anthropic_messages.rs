//! Anthropic Messages stream decoder.
//!
//! Wire format (anthropic-sdk-python `types/raw_message_stream_event.py`,
//! `types/raw_content_block_delta.py`; recorded in `tests/lib/streaming/fixtures/*.txt`, see
//! shared `provider-streams/anthropic/`): `event: <type>` + `data: {"type": <type>, …}`.
//! `message_start` (the `msg_…` handle) → per block `content_block_start{index}`,
//! `content_block_delta{index, delta}` (`text_delta`, `input_json_delta`, `thinking_delta`,
//! `signature_delta`, `citations_delta`), `content_block_stop{index}` → `message_delta`
//! (`stop_reason`, usage) → `message_stop`. `ping` is skipped; `error` is an in-stream error.
//! Unknown fields are ignored (the recorded `tool_use` carries `caller:{…}`).
//!
//! Block keys are the provider's `index`. A content block kind v1 cannot hold (server tools,
//! their results) is a malformed event: it is never dropped or turned into text.

use super::json::{RawStr, Str, Templates, json_object};
use super::{Decoder, Emitter, EventDecoder, SseDecoder, provider_error, str_at, u64_at};
use crate::sse::SseEvent;
use serde_json::Value;
use std::borrow::Cow;
use turnstile_core::stream::{BlockIndex, BlockStart, Sequenced, StopReason, StreamEvent};

sse_decoder!(
    /// Decoder for `anthropic-messages@*`.
    AnthropicDecoder, Anthropic, Anthropic::default()
);

/// What the stream has said once and may not say again. Anthropic events carry no sequence
/// number, so a duplicated `content_block_delta` cannot be told from the model's own words; but
/// a message starts once and each block index stops once, so a second `message_start` or a
/// second `content_block_stop` for an index is a protocol violation (a second
/// `content_block_start` the assembler refuses by itself: "block N started twice").
#[derive(Clone, Default)]
pub(crate) struct Anthropic {
    message_started: bool,
    stopped: std::collections::HashSet<u64>,
    /// The last deltas' shapes (see [`Template`]).
    pub(crate) templates: Templates<Template>,
}

/// What a text or tool-input delta meant besides its fragment: the next delta of the same
/// block whose text is the same but for another valid string in the fragment's place is that
/// delta with that string, read without a parse (`decode/json.rs`, `Templates`).
#[derive(Clone, Debug)]
pub(crate) struct Template {
    index: BlockIndex,
    /// The fragment is `partial_json` (tool input), not `text`.
    tool_input: bool,
}

/// A text or tool-input delta's events.
fn emit(index: BlockIndex, tool_input: bool, fragment: Cow<'_, str>, out: &mut Emitter) {
    if !tool_input {
        out.push(StreamEvent::TextDelta {
            index,
            text: fragment.into_owned(),
        });
    } else if !fragment.is_empty() {
        out.push(StreamEvent::ToolArgsDelta {
            index,
            fragment: fragment.into_owned(),
        });
    }
}

fn index_of(payload: &Value, out: &mut Emitter) -> Option<BlockIndex> {
    let index = u64_at(payload, "index").map(BlockIndex);
    if index.is_none() {
        out.push(StreamEvent::Malformed {
            detail: "a content block event without a numeric index".into(),
        });
    }
    index
}

/// `content_block_delta`, the hot event, read without building a `Value` (strings borrowed
/// when unescaped). Objects only, the last of repeated keys wins, unknown members checked as
/// strictly as a `Value` checks them (`decode/json.rs`), so whatever this reads, the `Value`
/// path reads the same.
#[derive(Default)]
struct BlockDelta<'a> {
    kind: Option<Str<'a>>,
    index: Option<u64>,
    delta: Option<DeltaBody<'a>>,
}
json_object!(BlockDelta<'a> { "type" => kind, "index" => index, "delta" => delta });

#[derive(Default)]
struct DeltaBody<'a> {
    kind: Option<Str<'a>>,
    text: Option<RawStr<'a>>,
    partial_json: Option<RawStr<'a>>,
}
json_object!(DeltaBody<'a> { "type" => kind, "text" => text, "partial_json" => partial_json });

impl EventDecoder for Anthropic {
    fn fast(&mut self, event: &SseEvent, out: &mut Emitter) -> bool {
        if event.event != "content_block_delta" {
            return false;
        }
        let data = event.data.as_str();
        if let Some((template, fragment)) = self.templates.read(data) {
            emit(template.index, template.tool_input, fragment.0, out);
            return true;
        }
        // Any other shape (thinking, signatures, a type that disagrees with the event name)
        // takes the general path.
        let Ok(delta) = serde_json::from_str::<BlockDelta<'_>>(data) else {
            return false;
        };
        let (Some(kind), Some(index), Some(body)) = (delta.kind, delta.index, delta.delta) else {
            return false;
        };
        if kind.as_str() != "content_block_delta" {
            return false;
        }
        let (fragment, tool_input) = match (body.kind.as_ref().map(Str::as_str), body.text, body.partial_json)
        {
            (Some("text_delta"), Some(text), _) => (text, false),
            (Some("input_json_delta"), _, Some(fragment)) => (fragment, true),
            _ => return false,
        };
        let index = BlockIndex(index);
        self.templates
            .keep(data, &[&fragment], Template { index, tool_input });
        emit(index, tool_input, fragment.value.0, out);
        true
    }

    fn event(&mut self, event: &SseEvent, payload: Value, out: &mut Emitter) {
        let kind = str_at(&payload, "type").unwrap_or(event.event.as_str());
        match kind {
            "message_start" => {
                if std::mem::replace(&mut self.message_started, true) {
                    out.push(StreamEvent::Malformed {
                        detail: "a second message_start".into(),
                    });
                    return;
                }
                let message = payload.get("message").unwrap_or(&Value::Null);
                if let Some(id) = str_at(message, "id") {
                    out.push(StreamEvent::Handle {
                        handle: id.to_owned(),
                    });
                }
                if let Some(usage) = message.get("usage") {
                    out.push(StreamEvent::Usage {
                        input_tokens: u64_at(usage, "input_tokens"),
                        output_tokens: u64_at(usage, "output_tokens"),
                        cache_creation_input_tokens: u64_at(usage, "cache_creation_input_tokens"),
                        cache_read_input_tokens: u64_at(usage, "cache_read_input_tokens"),
                    });
                }
            }
            "content_block_start" => {
                let Some(index) = index_of(&payload, out) else {
                    return;
                };
                let block = payload.get("content_block").unwrap_or(&Value::Null);
                match str_at(block, "type") {
                    Some("text") => {
                        out.push(StreamEvent::BlockStart {
                            index,
                            block: BlockStart::Text,
                        });
                        if let Some(text) = str_at(block, "text").filter(|text| !text.is_empty()) {
                            out.push(StreamEvent::TextDelta {
                                index,
                                text: text.to_owned(),
                            });
                        }
                    }
                    Some("tool_use") => {
                        let Some(name) = str_at(block, "name") else {
                            out.push(StreamEvent::Malformed {
                                detail: "a tool_use block without a name".into(),
                            });
                            return;
                        };
                        out.push(StreamEvent::BlockStart {
                            index,
                            block: BlockStart::ToolCall {
                                call_id: str_at(block, "id").map(str::to_owned),
                                name: name.to_owned(),
                            },
                        });
                        // Streaming starts with `input: {}` and sends the JSON as deltas; a
                        // non-empty start input is whole and is the arguments.
                        if let Some(input) = block.get("input").and_then(Value::as_object)
                            && !input.is_empty()
                        {
                            out.push(StreamEvent::ToolArgsDelta {
                                index,
                                fragment: Value::Object(input.clone()).to_string(),
                            });
                        }
                    }
                    Some("thinking") => {
                        out.push(StreamEvent::BlockStart {
                            index,
                            block: BlockStart::Reasoning {
                                provider: "anthropic".into(),
                            },
                        });
                        if let Some(signature) = str_at(block, "signature").filter(|text| !text.is_empty()) {
                            out.push(StreamEvent::ReasoningSeal {
                                index,
                                signature: Some(signature.to_owned()),
                                encrypted: None,
                            });
                        }
                    }
                    Some("redacted_thinking") => {
                        out.push(StreamEvent::BlockStart {
                            index,
                            block: BlockStart::Reasoning {
                                provider: "anthropic".into(),
                            },
                        });
                        out.push(StreamEvent::ReasoningSeal {
                            index,
                            signature: None,
                            encrypted: str_at(block, "data").map(str::to_owned),
                        });
                    }
                    other => out.push(StreamEvent::Malformed {
                        detail: format!("content block type {other:?} has no v1 block kind"),
                    }),
                }
            }
            "content_block_delta" => {
                let Some(index) = index_of(&payload, out) else {
                    return;
                };
                let delta = payload.get("delta").unwrap_or(&Value::Null);
                match str_at(delta, "type") {
                    Some("text_delta") => out.push(StreamEvent::TextDelta {
                        index,
                        text: str_at(delta, "text").unwrap_or_default().to_owned(),
                    }),
                    Some("input_json_delta") => {
                        let fragment = str_at(delta, "partial_json").unwrap_or_default();
                        if !fragment.is_empty() {
                            out.push(StreamEvent::ToolArgsDelta {
                                index,
                                fragment: fragment.to_owned(),
                            });
                        }
                    }
                    Some("thinking_delta") => out.push(StreamEvent::ReasoningDelta {
                        index,
                        text: str_at(delta, "thinking").unwrap_or_default().to_owned(),
                    }),
                    Some("signature_delta") => out.push(StreamEvent::ReasoningSeal {
                        index,
                        signature: str_at(delta, "signature").map(str::to_owned),
                        encrypted: None,
                    }),
                    // Citations annotate text already received; v1 text has no place for them.
                    Some("citations_delta") => {}
                    other => out.push(StreamEvent::Malformed {
                        detail: format!("delta type {other:?} is not understood"),
                    }),
                }
            }
            "content_block_stop" => {
                let Some(index) = index_of(&payload, out) else {
                    return;
                };
                if self.stopped.len() >= turnstile_core::limits::BLOCKS_PER_TURN_MAX {
                    out.push(StreamEvent::Malformed {
                        detail: "limit exceeded: BLOCKS_PER_TURN_MAX".into(),
                    });
                    return;
                }
                if !self.stopped.insert(index.0) {
                    out.push(StreamEvent::Malformed {
                        detail: format!("content_block_stop for block {} twice", index.0),
                    });
                    return;
                }
                out.push(StreamEvent::BlockStop {
                    index,
                    arguments_final: None,
                });
            }
            "message_delta" => {
                if let Some(usage) = payload.get("usage") {
                    out.push(StreamEvent::Usage {
                        input_tokens: u64_at(usage, "input_tokens"),
                        output_tokens: u64_at(usage, "output_tokens"),
                        cache_creation_input_tokens: u64_at(usage, "cache_creation_input_tokens"),
                        cache_read_input_tokens: u64_at(usage, "cache_read_input_tokens"),
                    });
                }
                let delta = payload.get("delta").unwrap_or(&Value::Null);
                if let Some(reason) = str_at(delta, "stop_reason") {
                    let reason = match reason {
                        "end_turn" => StopReason::EndTurn,
                        "tool_use" => StopReason::ToolUse,
                        "max_tokens" | "model_context_window_exceeded" => StopReason::MaxTokens,
                        "stop_sequence" => StopReason::StopSequence,
                        "refusal" => StopReason::Refusal,
                        other => StopReason::Other(other.to_owned()),
                    };
                    out.push(StreamEvent::Stop { reason });
                }
            }
            "message_stop" => out.push(StreamEvent::End),
            "error" => out.push(provider_error(payload.get("error").unwrap_or(&payload))),
            // `ping` and event types added after this was written carry nothing for the turn.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    //! Deltas read through a template against the `Value` path: whatever string or non-string
    //! token sits where a fragment sat, a decoder that tries templates and the fast path first
    //! emits exactly what a decoder that only parses `Value`s emits.
    use super::super::json::HOLES;
    use super::*;
    use proptest::prelude::*;

    /// A delta; `extra` adds a member nobody reads (some of them a `Value` refuses), a
    /// repeated key, or the array form of the object.
    fn delta(index: &str, tool_input: bool, fragment: &str, extra: usize) -> String {
        let body = if tool_input {
            format!("{{\"type\":\"input_json_delta\",\"partial_json\":{fragment}}}")
        } else {
            format!("{{\"type\":\"text_delta\",\"text\":{fragment}}}")
        };
        match extra {
            1 => format!(
                "{{\"type\":\"content_block_delta\",\"index\":{index},\"delta\":{body},\"x\":[1,{{\"y\":null}}]}}"
            ),
            2 => format!(
                "{{\"type\":\"content_block_delta\",\"index\":{index},\"delta\":{body},\"x\":\"\\ud800\"}}"
            ),
            3 => {
                format!("{{\"type\":\"content_block_delta\",\"index\":{index},\"delta\":{body},\"x\":1e400}}")
            }
            4 => {
                format!("{{\"type\":\"content_block_delta\",\"index\":7,\"delta\":{body},\"index\":{index}}}")
            }
            5 => format!(
                "{{\"type\":\"content_block_delta\",\"index\":{index},\"delta\":{body},\"delta\":null}}"
            ),
            6 => format!("[\"content_block_delta\",{index},[\"text_delta\",{fragment},null]]"),
            7 => format!("{{\"index\":{index},\"delta\":{body}}}"),
            _ => format!("{{\"type\":\"content_block_delta\",\"index\":{index},\"delta\":{body}}}"),
        }
    }

    fn run(datas: &[String], fast_first: bool) -> Vec<Sequenced> {
        super::super::decode_events(
            &mut Anthropic::default(),
            "content_block_delta",
            datas,
            fast_first,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn a_delta_read_through_a_template_emits_what_the_value_path_emits(
            deltas in prop::collection::vec(
                (
                    prop::sample::select(&["0", "0", "1", "-1", "\"0\"", "1e400"][..]),
                    any::<bool>(),
                    prop::sample::select(HOLES),
                    prop_oneof![8 => Just(0usize), 1 => 1usize..8],
                ),
                1..24,
            )
        ) {
            let datas: Vec<String> = deltas
                .iter()
                .map(|(index, tool_input, fragment, extra)| delta(index, *tool_input, fragment, *extra))
                .collect();
            prop_assert_eq!(run(&datas, true), run(&datas, false), "deltas: {:?}", datas);
        }
    }

    #[test]
    fn a_blocks_deltas_after_the_first_are_read_through_its_template() {
        let datas: Vec<String> = [
            (false, "\"The\""),
            (false, "\" weather \\\"mild\\\"\""),
            (true, "\"{\\\"city\\\":\""),
            (true, "\"\\\"Paris\\\"}\""),
            (false, "\"!\""),
        ]
        .iter()
        .map(|(tool_input, fragment)| delta(if *tool_input { "1" } else { "0" }, *tool_input, fragment, 0))
        .collect();
        let mut decoder = Anthropic::default();
        let mut out = Emitter::default();
        for data in &datas {
            let event = SseEvent {
                event: "content_block_delta".into(),
                data: data.clone(),
                id: String::new(),
            };
            out.begin(None);
            assert!(decoder.fast(&event, &mut out), "{data}");
        }
        assert_eq!(decoder.templates.reads, 3);
        assert_eq!(run(&datas, true), run(&datas, false));
    }
}
