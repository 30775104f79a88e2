//! OpenAI Chat Completions stream decoder.
//!
//! Wire format (openai-openapi `CreateChatCompletionStreamResponse`, l.33665; recorded in
//! openai-python `.inline-snapshot/external/*.bin`, see shared `provider-streams/openai-chat/`):
//! `data: <chunk>` events with no `event:` field, ended by `data: [DONE]` — or, as many
//! compatible servers do, by the clean end of a live body after choice 0's `finish_reason`
//! (the stop reason is what the seed requires; `EventDecoder::end_of_input`).
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
//! exceed `completion_tokens − reasoning_tokens`. When it does, and the upstream counts as the
//! vendor does ([`super::DecoderOptions::vendor_usage`]: OpenAI's own API, the simulator), some
//! delta arrived twice and the decoder emits a malformed event (the assembler retracts, nothing
//! commits). A compatible server serving an OpenAI model name may count its own way (a LiteLLM
//! alias, vLLM's `--served-model-name`, a mock), so there the mismatch is a
//! [`StreamEvent::Notice`] (a metric and a log line), never a failure. It is
//! one-sided on purpose: hidden tokens (reasoning, tool-call framing) only raise the reported
//! count. Not detectable: a stream without a usage chunk, a model we cannot count exactly
//! (compatible endpoints), and a duplicate small enough to stay under the hidden tokens of a
//! reply with tool calls
//! (`docs/decisions/0048-duplicated-deltas-on-wires-without-sequence-numbers.md`, 2026-12-01).
//!
//! Decoding: every chunk is read into the borrowing [`Chunk`] (no `serde_json::Value`, strings
//! borrowed from the event data when unescaped; `decode/json.rs` says why that reads exactly
//! what a `Value` would). A chunk that does not fit it (an in-stream error, a field of another
//! type than documented) is parsed to a `Value`, and [`Chunk::from_value`] reads the same
//! fields from it with the `Value` rules (a field of the wrong type is absent); both go through
//! one [`Chat::chunk`], so the two paths cannot disagree on what a field means.

use super::json::{RawStr, Str, Templates, json_object};
use super::{Decoder, Emitter, EventDecoder, SseDecoder, provider_error, str_at, u64_at};
use crate::sse::SseEvent;
use serde_json::Value;
use std::borrow::Cow;
use std::collections::BTreeSet;
use turnstile_core::stream::{BlockIndex, BlockStart, Sequenced, StopReason, StreamEvent};

const TEXT_BLOCK: BlockIndex = BlockIndex(0);

sse_decoder!(
    /// Decoder for `openai-chat@*`.
    OpenAiChatDecoder, Chat, Chat::with_options(super::DecoderOptions::VENDOR)
);

impl OpenAiChatDecoder {
    /// A decoder for an upstream described by `options`.
    pub fn with_options(options: super::DecoderOptions) -> OpenAiChatDecoder {
        OpenAiChatDecoder(SseDecoder::with(Chat::with_options(options)))
    }
}

/// Most output bytes kept for the usage cross-check; a longer reply is not checked (the
/// assembler's own `ASSEMBLE_TURN_BYTES_MAX` bounds what can commit).
pub const CHAT_USAGE_CHECK_BYTES_MAX: usize = 4 * 1024 * 1024;

#[derive(Clone, Default)]
pub(crate) struct Chat {
    handle: Option<String>,
    started: BTreeSet<BlockIndex>,
    stopped: bool,
    /// `data: [DONE]` arrived.
    done: bool,
    /// A usage short of the streamed output is a protocol violation (the vendor's own
    /// count), not a notice.
    vendor_usage: bool,
    /// The model the chunks name (the first one that names one).
    model: Option<String>,
    /// Visible output of choice 0 per block key, as received, for the usage cross-check.
    output: std::collections::BTreeMap<BlockIndex, String>,
    output_bytes: usize,
    /// The hot chunks' shapes seen last (see [`Template`]).
    pub(crate) templates: Templates<Template>,
}

/// One `chat.completion.chunk`: the fields the decoder reads. `error` is only looked at for
/// presence (a chunk with one takes the `Value` path, which reports it).
#[derive(Default)]
struct Chunk<'a> {
    error: Option<super::json::Strict>,
    id: Option<Str<'a>>,
    model: Option<Str<'a>>,
    choices: Option<Vec<Choice<'a>>>,
    usage: Option<Usage>,
    /// Padding (`stream_options.include_obfuscation`): never used, read as a string token
    /// only so that a [`Template`] can let it vary.
    obfuscation: Option<RawStr<'a>>,
}
json_object!(Chunk<'a> { "error" => error, "id" => id, "model" => model, "choices" => choices, "usage" => usage,
    "obfuscation" => obfuscation });

#[derive(Default)]
struct Choice<'a> {
    index: Option<u64>,
    delta: Option<Delta<'a>>,
    finish_reason: Option<Str<'a>>,
}
json_object!(Choice<'a> { "index" => index, "delta" => delta, "finish_reason" => finish_reason });

#[derive(Default)]
struct Delta<'a> {
    content: Option<RawStr<'a>>,
    refusal: Option<Str<'a>>,
    tool_calls: Option<Vec<ToolCall<'a>>>,
}
json_object!(Delta<'a> { "content" => content, "refusal" => refusal, "tool_calls" => tool_calls });

#[derive(Default)]
struct ToolCall<'a> {
    index: Option<u64>,
    id: Option<Str<'a>>,
    function: Option<Function<'a>>,
}
json_object!(ToolCall<'a> { "index" => index, "id" => id, "function" => function });

#[derive(Default)]
struct Function<'a> {
    name: Option<Str<'a>>,
    arguments: Option<RawStr<'a>>,
}
json_object!(Function<'a> { "name" => name, "arguments" => arguments });

#[derive(Default)]
struct Usage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    completion_tokens_details: Option<UsageDetails>,
}
json_object!(Usage { "prompt_tokens" => prompt_tokens, "completion_tokens" => completion_tokens,
    "completion_tokens_details" => completion_tokens_details });

#[derive(Default)]
struct UsageDetails {
    reasoning_tokens: Option<u64>,
}
json_object!(UsageDetails { "reasoning_tokens" => reasoning_tokens });

fn str_of<'a>(value: &'a Value, key: &str) -> Option<Str<'a>> {
    str_at(value, key).map(|text| Str(Cow::Borrowed(text)))
}

impl<'a> Chunk<'a> {
    /// The same fields read from a parsed chunk with the `Value` rules: a member of another
    /// type than expected is absent, a choice without a numeric index is choice 0, `usage`
    /// counts only when it is an object.
    fn from_value(chunk: &'a Value) -> Chunk<'a> {
        let choices = chunk.get("choices").and_then(Value::as_array).map(|choices| {
            choices
                .iter()
                .map(|choice| Choice {
                    index: Some(u64_at(choice, "index").unwrap_or(0)),
                    delta: choice.get("delta").map(Delta::from_value),
                    finish_reason: str_of(choice, "finish_reason"),
                })
                .collect()
        });
        let usage = chunk
            .get("usage")
            .filter(|usage| usage.is_object())
            .map(|usage| Usage {
                prompt_tokens: u64_at(usage, "prompt_tokens"),
                completion_tokens: u64_at(usage, "completion_tokens"),
                completion_tokens_details: Some(UsageDetails {
                    reasoning_tokens: usage
                        .get("completion_tokens_details")
                        .and_then(|details| u64_at(details, "reasoning_tokens")),
                }),
            });
        Chunk {
            error: None,
            id: str_of(chunk, "id"),
            model: str_of(chunk, "model"),
            choices,
            usage,
            obfuscation: None,
        }
    }
}

impl<'a> Delta<'a> {
    fn from_value(delta: &'a Value) -> Delta<'a> {
        let tool_calls = delta.get("tool_calls").and_then(Value::as_array).map(|calls| {
            calls
                .iter()
                .map(|call| {
                    let function = call.get("function");
                    ToolCall {
                        index: u64_at(call, "index"),
                        id: str_of(call, "id"),
                        function: Some(Function {
                            name: function.and_then(|function| str_of(function, "name")),
                            arguments: function
                                .and_then(|function| str_at(function, "arguments"))
                                .map(RawStr::from_value),
                        }),
                    }
                })
                .collect()
        });
        Delta {
            content: str_at(delta, "content").map(RawStr::from_value),
            refusal: str_of(delta, "refusal"),
            tool_calls,
        }
    }
}

/// The shape of a hot chunk: one text or argument fragment for choice 0, no finish reason, no
/// usage. A stream's chunks of one kind differ only in that fragment and in the `obfuscation`
/// padding, so the decoder keeps the last few chunks' bytes around those string tokens (the
/// holes) and what the rest of the chunk meant. A chunk whose bytes are a template's pieces
/// with one valid JSON string token in each hole is that chunk with the new strings: the rest of
/// its text is the same, byte for byte, as text the full parse read, and a string token in a
/// string's place leaves every other token where it was. So it means what the full parse would
/// make of it (the property test in this module holds the two paths to one output), without
/// the parse: a prefix and a suffix compare and the strings' own reads.
#[derive(Clone, Debug)]
pub(crate) struct Template {
    id: Option<Box<str>>,
    model: Option<Box<str>>,
    choice_index: Option<u64>,
    /// `None`: the fragment is the delta's `content`; `Some(i)`: tool call `index` i's arguments.
    call: Option<u64>,
}

impl Template {
    /// The template of `chunk` when it is a hot chunk, with its holes (the fragment, then the
    /// padding if any).
    fn of<'c, 'a>(chunk: &'c Chunk<'a>) -> Option<(Template, Vec<&'c RawStr<'a>>)> {
        if chunk.usage.is_some() {
            return None;
        }
        let [choice] = chunk.choices.as_deref()? else {
            return None;
        };
        if choice.finish_reason.is_some() || choice.index.is_some_and(|index| index != 0) {
            return None;
        }
        let delta = choice.delta.as_ref()?;
        if delta.refusal.is_some() {
            return None;
        }
        let (fragment, call) = match (&delta.content, &delta.tool_calls) {
            (Some(content), None) => (content, None),
            (None, Some(calls)) => {
                let [call] = calls.as_slice() else {
                    return None;
                };
                let function = call.function.as_ref()?;
                if call.id.is_some() || function.name.is_some() {
                    return None;
                }
                (function.arguments.as_ref()?, Some(call.index?))
            }
            _ => return None,
        };
        let mut holes = vec![fragment];
        holes.extend(&chunk.obfuscation);
        let template = Template {
            id: chunk.id.as_ref().map(|id| id.as_str().into()),
            model: chunk.model.as_ref().map(|model| model.as_str().into()),
            choice_index: choice.index,
            call,
        };
        Some((template, holes))
    }

    /// The chunk the full parse makes of this template with `fragment` in its hole.
    fn chunk<'t>(&'t self, fragment: Str<'t>) -> Chunk<'t> {
        let borrowed = |text: &'t str| Str(Cow::Borrowed(text));
        let fragment = Some(RawStr {
            raw: None,
            value: fragment,
        });
        let delta = match self.call {
            None => Delta {
                content: fragment,
                ..Delta::default()
            },
            Some(index) => Delta {
                tool_calls: Some(vec![ToolCall {
                    index: Some(index),
                    id: None,
                    function: Some(Function {
                        name: None,
                        arguments: fragment,
                    }),
                }]),
                ..Delta::default()
            },
        };
        Chunk {
            error: None,
            id: self.id.as_deref().map(borrowed),
            model: self.model.as_deref().map(borrowed),
            choices: Some(vec![Choice {
                index: self.choice_index,
                delta: Some(delta),
                finish_reason: None,
            }]),
            usage: None,
            obfuscation: None,
        }
    }
}

impl Chat {
    fn with_options(options: super::DecoderOptions) -> Chat {
        Chat {
            vendor_usage: options.vendor_usage,
            ..Chat::default()
        }
    }
}

impl EventDecoder for Chat {
    fn fast(&mut self, event: &SseEvent, out: &mut Emitter) -> bool {
        let data = event.data.as_str();
        // Taken out for the call: `Chat::chunk` needs the rest of `self`.
        let mut templates = std::mem::take(&mut self.templates);
        let hit = templates
            .read(data)
            .map(|(template, fragment)| self.chunk(template.chunk(fragment), out));
        self.templates = templates;
        if hit.is_some() {
            return true;
        }
        let Ok(chunk) = serde_json::from_str::<Chunk<'_>>(data) else {
            return false;
        };
        if chunk.error.is_some() {
            return false;
        }
        if let Some((template, holes)) = Template::of(&chunk) {
            self.templates.keep(data, &holes, template);
        }
        self.chunk(chunk, out);
        true
    }

    fn non_json(&mut self, event: &SseEvent, out: &mut Emitter) {
        if event.data.trim() == "[DONE]" {
            self.done = true;
            out.push(StreamEvent::End);
        } else {
            out.push(StreamEvent::Malformed {
                detail: "a chunk whose data is not JSON".into(),
            });
        }
    }

    /// `data: [DONE]` is OpenAI's marker, not a rule of the format: many compatible servers end
    /// the body after the chunk with `finish_reason` (and usage). A body that ended cleanly
    /// after choice 0's finish reason is complete; one cut before it still has no stop and is
    /// retracted. The stop reason, which the seed requires, is what decides.
    fn end_of_input(&mut self, out: &mut Emitter) {
        if self.stopped && !self.done {
            self.done = true;
            out.push(StreamEvent::End);
        }
    }

    fn event(&mut self, _event: &SseEvent, chunk: Value, out: &mut Emitter) {
        if let Some(error) = chunk.get("error").filter(|error| !error.is_null()) {
            out.push(provider_error(error));
            return;
        }
        self.chunk(Chunk::from_value(&chunk), out);
    }
}

impl Chat {
    /// One chunk without an error: handle, then choice 0's deltas and finish reason (every
    /// entry of index 0, in order), then usage.
    fn chunk(&mut self, chunk: Chunk<'_>, out: &mut Emitter) {
        if self.model.is_none()
            && let Some(model) = &chunk.model
        {
            self.model = Some(model.as_str().to_owned());
        }
        if let Some(id) = &chunk.id
            && self.handle.as_deref() != Some(id.as_str())
        {
            self.handle = Some(id.as_str().to_owned());
            out.push(StreamEvent::Handle {
                handle: id.as_str().to_owned(),
            });
        }
        for choice in chunk.choices.into_iter().flatten() {
            if choice.index.unwrap_or(0) != 0 {
                continue;
            }
            if let Some(delta) = choice.delta {
                self.delta(delta, out);
            }
            if let Some(reason) = &choice.finish_reason {
                self.finish(reason.as_str(), out);
            }
        }
        if let Some(usage) = &chunk.usage {
            out.push(StreamEvent::Usage {
                input_tokens: usage.prompt_tokens,
                output_tokens: usage.completion_tokens,
                cache_creation_input_tokens: None,
                cache_read_input_tokens: None,
            });
            self.check_usage(usage, out);
        }
    }

    /// Keep a visible fragment for the usage cross-check (see the module docs).
    fn keep(&mut self, index: BlockIndex, fragment: &str) {
        self.output_bytes = self.output_bytes.saturating_add(fragment.len());
        if self.output_bytes <= CHAT_USAGE_CHECK_BYTES_MAX {
            self.output.entry(index).or_default().push_str(fragment);
        }
    }

    /// More visible output than the model generated means a delta arrived twice.
    fn check_usage(&mut self, usage: &Usage, out: &mut Emitter) {
        let Some(reported) = usage.completion_tokens else {
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
            .completion_tokens_details
            .as_ref()
            .and_then(|details| details.reasoning_tokens)
            .unwrap_or(0);
        let visible_max = reported.saturating_sub(reasoning);
        let visible: u64 = self.output.values().map(|text| tokenizer.count(text)).sum();
        if visible > visible_max {
            let detail = format!(
                "the stream carried {visible} tokens of output but the provider reported \
                 {visible_max} generated"
            );
            // Only the vendor's own count proves a delta arrived twice; a compatible server
            // serving an OpenAI model name may count its own way (a LiteLLM alias, vLLM's
            // `--served-model-name`, a mock).
            out.push(if self.vendor_usage {
                StreamEvent::Malformed {
                    detail: format!("{detail}: a delta was delivered more than once"),
                }
            } else {
                StreamEvent::Notice {
                    code: "usage_mismatch".into(),
                    detail,
                }
            });
        }
    }

    fn delta(&mut self, delta: Delta<'_>, out: &mut Emitter) {
        for text in [delta.content.map(|content| content.value), delta.refusal]
            .into_iter()
            .flatten()
        {
            if self.started.insert(TEXT_BLOCK) {
                out.push(StreamEvent::BlockStart {
                    index: TEXT_BLOCK,
                    block: BlockStart::Text,
                });
            }
            self.keep(TEXT_BLOCK, text.as_str());
            out.push(StreamEvent::TextDelta {
                index: TEXT_BLOCK,
                text: text.0.into_owned(),
            });
        }
        for call in delta.tool_calls.into_iter().flatten() {
            let Some(key) = call.index.and_then(|index| index.checked_add(1)) else {
                out.push(StreamEvent::Malformed {
                    detail: "a tool_calls entry without a numeric index".into(),
                });
                continue;
            };
            let index = BlockIndex(key);
            let (name, arguments) = match call.function {
                Some(function) => (function.name, function.arguments),
                None => (None, None),
            };
            if !self.started.contains(&index) {
                let Some(name) = name else {
                    out.push(StreamEvent::Malformed {
                        detail: format!("the first fragment of tool call {} has no name", key - 1),
                    });
                    continue;
                };
                self.started.insert(index);
                out.push(StreamEvent::BlockStart {
                    index,
                    block: BlockStart::ToolCall {
                        call_id: call.id.map(|id| id.0.into_owned()),
                        name: name.0.into_owned(),
                    },
                });
            }
            if let Some(fragment) = arguments
                && !fragment.as_str().is_empty()
            {
                self.keep(index, fragment.as_str());
                out.push(StreamEvent::ToolArgsDelta {
                    index,
                    fragment: fragment.value.0.into_owned(),
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

#[cfg(test)]
mod tests {
    //! The typed fast path against the `Value` path on generated chunks (about a quarter of them
    //! take the fast path, measured when this was written): whatever the text
    //! (repeated keys, `null`s, members of the wrong type, arrays for objects, a lone surrogate
    //! escape or an out-of-range number in an unknown member), a decoder that tries the fast
    //! path first emits exactly what a decoder that only parses `Value`s emits.
    use super::super::json::HOLES;
    use super::*;
    use proptest::prelude::*;

    /// JSON text built by hand, so an object may repeat a key.
    #[derive(Clone, Debug)]
    enum Node {
        Leaf(&'static str),
        Array(Vec<Node>),
        Object(Vec<(&'static str, Node)>),
    }

    impl Node {
        fn write(&self, out: &mut String) {
            match self {
                Node::Leaf(text) => out.push_str(text),
                Node::Array(items) => {
                    out.push('[');
                    for (index, item) in items.iter().enumerate() {
                        if index > 0 {
                            out.push(',');
                        }
                        item.write(out);
                    }
                    out.push(']');
                }
                Node::Object(members) => {
                    out.push('{');
                    for (index, (key, value)) in members.iter().enumerate() {
                        if index > 0 {
                            out.push(',');
                        }
                        out.push_str(key);
                        out.push(':');
                        value.write(out);
                    }
                    out.push('}');
                }
            }
        }
    }

    const LEAVES: &[&str] = &[
        "null",
        "true",
        "0",
        "1",
        "2",
        "-1",
        "1.5",
        "-0",
        "1e400",
        "18446744073709551616",
        "\"\"",
        "\"Hi\"",
        "\"a\\nb\\u00e9\"",
        "\"\\ud800\"",
        "\"{\\\"city\\\":\"",
        "\"stop\"",
        "\"length\"",
        "\"tool_calls\"",
        "\"gpt-4o\"",
        "\"chatcmpl-1\"",
        "\"chatcmpl-2\"",
        "\"get_weather\"",
    ];
    const KEYS: &[&str] = &[
        "\"id\"",
        "\"model\"",
        "\"choices\"",
        "\"index\"",
        "\"delta\"",
        "\"content\"",
        "\"refusal\"",
        "\"tool_calls\"",
        "\"function\"",
        "\"name\"",
        "\"arguments\"",
        "\"finish_reason\"",
        "\"usage\"",
        "\"prompt_tokens\"",
        "\"completion_tokens\"",
        "\"completion_tokens_details\"",
        "\"reasoning_tokens\"",
        "\"error\"",
        "\"object\"",
        "\"created\"",
        "\"\\u0069d\"",
        "\"logprobs\"",
    ];

    fn node() -> impl Strategy<Value = Node> {
        let leaf = prop::sample::select(LEAVES).prop_map(Node::Leaf);
        leaf.prop_recursive(6, 48, 5, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Node::Array),
                prop::collection::vec((prop::sample::select(KEYS), inner), 0..5).prop_map(Node::Object),
            ]
        })
    }

    /// A member's value: mostly one of the documented kind, sometimes anything.
    fn member(valid: &'static [&'static str]) -> impl Strategy<Value = Node> {
        prop_oneof![6 => prop::sample::select(valid).prop_map(Node::Leaf), 1 => node()]
    }

    const TEXTS: &[&str] = &["null", "\"\"", "\"Hi\"", "\"a\\nb\\u00e9\"", "\"{\\\"city\\\":\""];
    const INDEXES: &[&str] = &["null", "0", "0", "1", "2"];
    const REASONS: &[&str] = &["null", "null", "\"stop\"", "\"length\"", "\"tool_calls\""];
    const IDS: &[&str] = &["\"chatcmpl-1\"", "\"chatcmpl-1\"", "\"chatcmpl-2\"", "null"];
    const MODELS: &[&str] = &["\"gpt-4o\"", "\"compat-model\"", "null"];
    const NAMES: &[&str] = &["\"get_weather\"", "null"];

    /// Mostly well-formed chunks (so the fast path is taken), some of them perturbed.
    fn chunk() -> impl Strategy<Value = String> {
        let call = (member(INDEXES), member(IDS), member(NAMES), member(TEXTS)).prop_map(
            |(index, id, name, arguments)| {
                Node::Object(vec![
                    ("\"index\"", index),
                    ("\"id\"", id),
                    ("\"type\"", Node::Leaf("\"function\"")),
                    (
                        "\"function\"",
                        Node::Object(vec![("\"name\"", name), ("\"arguments\"", arguments)]),
                    ),
                ])
            },
        );
        let delta = (
            member(TEXTS),
            prop::collection::vec(call, 0..3),
            member(TEXTS),
            node(),
        )
            .prop_map(|(content, calls, refusal, extra)| {
                Node::Object(vec![
                    ("\"content\"", content),
                    ("\"tool_calls\"", Node::Array(calls)),
                    ("\"refusal\"", refusal),
                    ("\"role\"", extra),
                ])
            });
        let choice =
            (member(INDEXES), delta, member(REASONS), node()).prop_map(|(index, delta, finish, extra)| {
                Node::Object(vec![
                    ("\"index\"", index),
                    ("\"delta\"", delta),
                    ("\"finish_reason\"", finish),
                    ("\"logprobs\"", extra),
                ])
            });
        let usage = member(&[
            "null",
            "{\"prompt_tokens\":3,\"completion_tokens\":1,\"completion_tokens_details\":{\"reasoning_tokens\":0}}",
        ]);
        let shaped = (
            member(IDS),
            member(MODELS),
            prop::collection::vec(choice, 0..3),
            usage,
            node(),
            any::<bool>(),
        )
            .prop_map(|(id, model, choices, usage, extra, error)| {
                let mut members = vec![
                    ("\"id\"", id),
                    ("\"object\"", Node::Leaf("\"chat.completion.chunk\"")),
                    ("\"model\"", model),
                    ("\"choices\"", Node::Array(choices)),
                    ("\"usage\"", usage),
                    ("\"system_fingerprint\"", extra),
                ];
                if error {
                    members.push(("\"error\"", Node::Leaf("null")));
                }
                Node::Object(members)
            });
        prop_oneof![6 => shaped, 1 => node()].prop_map(|node| {
            let mut text = String::new();
            node.write(&mut text);
            text
        })
    }

    fn run(chunks: &[String], fast_first: bool) -> Vec<Sequenced> {
        super::super::decode_events(&mut Chat::default(), "message", chunks, fast_first)
    }

    /// A hot chunk: a text fragment, or tool call `call`'s arguments fragment, with `id`,
    /// and `obfuscation` padding before or after the choices (or none).
    /// `extra` adds a member nobody reads (some of them a `Value` refuses) or repeats one.
    fn hot(
        call: Option<&str>,
        id: &str,
        fragment: &str,
        padding: Option<(&str, bool)>,
        extra: usize,
    ) -> String {
        let delta = match call {
            None => format!("{{\"content\":{fragment}}}"),
            Some(index) => {
                format!(
                    "{{\"tool_calls\":[{{\"function\":{{\"arguments\":{fragment}}},\"index\":{index}}}]}}"
                )
            }
        };
        let choices = format!(
            "\"choices\":[{{\"delta\":{delta},\"finish_reason\":null,\"index\":0,\"logprobs\":null}}]"
        );
        let extra = [
            "",
            ",\"x\":\"\\ud800\"",
            ",\"x\":1e400",
            ",\"usage\":null",
            ",\"obfuscation\":\"again\"",
            ",\"choices\":[]",
            ",\"x\":[1,{\"y\":null}]",
        ][extra % 7];
        let head = format!(
            "\"created\":1,\"id\":{id},\"model\":\"gpt-4o\",\"object\":\"chat.completion.chunk\"{extra}"
        );
        match padding {
            None => format!("{{{choices},{head}}}"),
            Some((padding, true)) => format!("{{\"obfuscation\":{padding},{choices},{head}}}"),
            Some((padding, false)) => format!("{{{choices},{head},\"obfuscation\":{padding}}}"),
        }
    }

    /// Streams of hot chunks that share templates (a few shapes, holes of every kind), with
    /// the other generated chunks between them.
    fn template_stream() -> impl Strategy<Value = Vec<String>> {
        let hot_chunk = (
            prop::sample::select(&[None, Some("0"), Some("0"), Some("1"), Some("-1"), Some("\"0\"")][..]),
            prop::sample::select(&["\"chatcmpl-1\"", "\"chatcmpl-1\"", "\"chatcmpl-2\"", "null"][..]),
            prop::sample::select(HOLES),
            prop::option::of((prop::sample::select(HOLES), any::<bool>())),
            prop_oneof![6 => Just(0usize), 1 => 1usize..7],
        )
            .prop_map(|(call, id, fragment, padding, extra)| hot(call, id, fragment, padding, extra));
        let opening = "{\"choices\":[{\"delta\":{\"tool_calls\":[{\"function\":{\"arguments\":\"\",\"name\":\"f\"},\"id\":\"call_0\",\"index\":0}]},\"index\":0}],\"id\":\"chatcmpl-1\"}".to_owned();
        prop::collection::vec(prop_oneof![8 => hot_chunk, 1 => chunk()], 1..24).prop_map(move |mut chunks| {
            chunks.insert(0, opening.clone());
            chunks
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn the_typed_path_emits_what_the_value_path_emits(chunks in prop::collection::vec(chunk(), 1..6)) {
            prop_assert_eq!(run(&chunks, true), run(&chunks, false), "chunks: {:?}", chunks);
        }

        #[test]
        fn a_chunk_read_through_a_template_emits_what_the_value_path_emits(chunks in template_stream()) {
            prop_assert_eq!(run(&chunks, true), run(&chunks, false), "chunks: {:?}", chunks);
        }
    }

    #[test]
    fn a_streams_hot_chunks_are_read_through_templates_whatever_their_padding() {
        // 3 text fragments and 3 fragments each of two tool calls, every chunk with its own
        // padding, the way OpenAI sends them (`include_obfuscation` is on by default).
        let mut chunks = vec![
            "{\"choices\":[{\"delta\":{\"tool_calls\":[{\"function\":{\"arguments\":\"\",\"name\":\"f\"},\"id\":\"call_0\",\"index\":0},{\"function\":{\"arguments\":\"\",\"name\":\"g\"},\"id\":\"call_1\",\"index\":1}]},\"index\":0}],\"id\":\"chatcmpl-1\"}".to_owned(),
        ];
        let paddings = ["\"nWru1sTmaAzi9O\"", "\"SdSOt\"", "\"a\""];
        for (call, fragments) in [
            (None, ["\"The\"", "\" weather\"", "\" is \\\"mild\\\"\""]),
            (Some("0"), ["\"{\\\"city\\\":\"", "\"\\\"Paris\\\"\"", "\"}\""]),
            (Some("1"), ["\"{\\\"city\\\":\"", "\"\\\"Rome\\\"\"", "\"}\""]),
        ] {
            for (fragment, padding) in fragments.iter().zip(paddings) {
                chunks.push(hot(call, "\"chatcmpl-1\"", fragment, Some((padding, false)), 0));
            }
        }
        let mut chat = Chat::default();
        let mut out = Emitter::default();
        for data in &chunks {
            let event = SseEvent {
                event: "message".into(),
                data: data.clone(),
                id: String::new(),
            };
            out.begin(None);
            assert!(chat.fast(&event, &mut out), "{data}");
        }
        // The first chunk of each kind is parsed; the two after it are read through its template.
        assert_eq!(chat.templates.reads, 6);
        assert_eq!(chat.output[&TEXT_BLOCK], "The weather is \"mild\"");
        assert_eq!(chat.output[&BlockIndex(1)], "{\"city\":\"Paris\"}");
        assert_eq!(chat.output[&BlockIndex(2)], "{\"city\":\"Rome\"}");
        assert_eq!(run(&chunks, true), run(&chunks, false));
    }

    #[test]
    fn recorded_chunks_take_the_typed_path() {
        let data = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","system_fingerprint":"fp","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]},"logprobs":null,"finish_reason":null}]}"#;
        let event = SseEvent {
            event: "message".into(),
            data: data.into(),
            id: String::new(),
        };
        let mut out = Emitter::default();
        assert!(Chat::default().fast(&event, &mut out));
        let lone_surrogate = data.replace("\"fp\"", "\"\\ud800\"");
        let event = SseEvent {
            data: lone_surrogate,
            ..event
        };
        assert!(!Chat::default().fast(&event, &mut out));
    }
}
