//! Google Gemini `streamGenerateContent?alt=sse` decoder (Gemini API and Vertex AI).
//!
//! Wire format (python-genai `types.py`; recorded in vercel/ai `packages/google/src/__fixtures__`,
//! see shared `provider-streams/gemini/`): `data: <GenerateContentResponse>` events, no event
//! names, no `[DONE]`: the stream ends after the chunk that carries `finishReason`.
//! - `candidates[0].content.parts[]`: `text` (with `thought: true` it is reasoning), and
//!   `functionCall` arriving whole (`name`, `args` object) with **no id** in every recording.
//! - Vertex with `streamFunctionCallArguments`: `{name, willContinue:true}`, then parts of
//!   `{partialArgs:[{jsonPath, stringValue|numberValue|boolValue|nullValue, willContinue?}]}`,
//!   then an empty `functionCall:{}` that closes the call.
//! - `thoughtSignature` may sit on any part; it becomes a `reasoning` block (provider `gemini`)
//!   placed right before the content of that part, so the render side can replay it in place.
//! - `responseId` on every chunk is the handle; `usageMetadata` on every chunk, last one wins.
//!
//! Gemini gives no keys, so block keys are allocated in arrival order; consecutive text parts of
//! one kind extend one block. A call without an id gets `gemini-{responseId}-{n}` (n counts the
//! calls of this response), deterministic for the same bytes
//! (docs/decisions/0019-gemini-call-ids.md).

use super::{Decoder, Emitter, EventDecoder, SseDecoder, provider_error, str_at, u64_at};
use crate::sse::SseEvent;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::borrow::Cow;
use turnstile_core::stream::{BlockIndex, BlockStart, Sequenced, StopReason, StreamEvent};

/// Deepest `jsonPath` accepted in Vertex `partialArgs`.
const PARTIAL_ARGS_PATH_DEPTH_MAX: usize = 32;

sse_decoder!(
    /// Decoder for `gemini@*`.
    GeminiDecoder, Gemini, Gemini::default()
);

#[derive(Clone, Copy, PartialEq, Eq)]
enum OpenKind {
    Text,
    Thought,
}

#[derive(Clone, Default)]
pub(crate) struct Gemini {
    handle: Option<String>,
    key_next: u64,
    /// The text or thought block that consecutive parts extend.
    open_text: Option<(BlockIndex, OpenKind)>,
    /// A Vertex streamed call in progress: its block and the arguments so far.
    streaming_call: Option<(BlockIndex, Map<String, Value>)>,
    calls: u64,
    usage_last: Option<(Option<u64>, Option<u64>)>,
    finished: bool,
    /// The previous event's data, when it carried the cumulative `candidatesTokenCount`.
    data_last: Option<String>,
}

/// A chunk whose parts are all text, parsed without building a `Value`: the hot case. Anything
/// else (a function call, an error, prompt feedback, several candidates, a part without text)
/// takes the general path.
#[derive(serde::Deserialize)]
struct TextChunk<'a> {
    #[serde(borrow)]
    candidates: Option<Vec<TextCandidate<'a>>>,
    #[serde(rename = "usageMetadata")]
    usage: Option<UsageCounts>,
    #[serde(rename = "responseId", borrow)]
    response_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    error: Option<&'a RawValue>,
    #[serde(rename = "promptFeedback", borrow)]
    prompt_feedback: Option<&'a RawValue>,
}

#[derive(serde::Deserialize)]
struct TextCandidate<'a> {
    #[serde(borrow)]
    content: Option<TextContent<'a>>,
    #[serde(rename = "finishReason", borrow)]
    finish_reason: Option<Cow<'a, str>>,
    index: Option<u64>,
}

#[derive(serde::Deserialize)]
struct TextContent<'a> {
    #[serde(borrow)]
    parts: Option<Vec<TextPart<'a>>>,
}

#[derive(serde::Deserialize)]
struct TextPart<'a> {
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    thought: Option<bool>,
    #[serde(rename = "thoughtSignature", borrow)]
    thought_signature: Option<Cow<'a, str>>,
    #[serde(rename = "functionCall", borrow)]
    function_call: Option<&'a RawValue>,
}

#[derive(serde::Deserialize)]
struct UsageCounts {
    #[serde(rename = "promptTokenCount")]
    prompt: Option<u64>,
    #[serde(rename = "candidatesTokenCount")]
    candidates: Option<u64>,
}

impl EventDecoder for Gemini {
    fn fast(&mut self, event: &SseEvent, out: &mut Emitter) -> bool {
        // Gemini chunks carry no sequence number, but each one reports the cumulative
        // `candidatesTokenCount` (see the captures in shared/fixtures/provider-streams/gemini):
        // new output always raises it. A byte-identical repeat of the previous chunk therefore
        // added no token: it is a transport duplicate, and repeating its whole `functionCall`
        // parts would run a tool twice. It is dropped here, before anything is emitted.
        if event.data.contains("\"candidatesTokenCount\"") {
            if self.data_last.as_deref() == Some(event.data.as_str()) {
                return true;
            }
            self.data_last = Some(event.data.clone());
        } else {
            self.data_last = None;
        }
        let Ok(chunk) = serde_json::from_str::<TextChunk<'_>>(&event.data) else {
            return false;
        };
        if chunk.error.is_some() || chunk.prompt_feedback.is_some() || self.finished {
            return false;
        }
        let candidates = chunk.candidates.unwrap_or_default();
        let [candidate] = candidates.as_slice() else {
            return false;
        };
        if candidate.index.unwrap_or(0) != 0 {
            return false;
        }
        let parts = candidate
            .content
            .as_ref()
            .and_then(|content| content.parts.as_deref())
            .unwrap_or_default();
        if parts
            .iter()
            .any(|part| part.text.is_none() || part.function_call.is_some())
        {
            return false;
        }
        if let Some(id) = chunk.response_id.as_deref()
            && self.handle.as_deref() != Some(id)
        {
            self.handle = Some(id.to_owned());
            out.push(StreamEvent::Handle {
                handle: id.to_owned(),
            });
        }
        if let Some(usage) = &chunk.usage {
            let usage = (usage.prompt, usage.candidates);
            if usage != (None, None) && self.usage_last != Some(usage) {
                self.usage_last = Some(usage);
                out.push(StreamEvent::Usage {
                    input_tokens: usage.0,
                    output_tokens: usage.1,
                    cache_creation_input_tokens: None,
                    cache_read_input_tokens: None,
                });
            }
        }
        for part in parts {
            let text = part.text.as_deref().unwrap_or_default();
            self.text_part(
                text,
                part.thought == Some(true),
                part.thought_signature.as_deref(),
                out,
            );
        }
        if let Some(reason) = candidate.finish_reason.as_deref() {
            self.finish(reason, out);
        }
        true
    }

    fn event(&mut self, _event: &SseEvent, chunk: Value, out: &mut Emitter) {
        if let Some(error) = chunk.get("error").filter(|error| error.is_object()) {
            out.push(provider_error(error));
            return;
        }
        if let Some(id) = str_at(&chunk, "responseId")
            && self.handle.as_deref() != Some(id)
        {
            self.handle = Some(id.to_owned());
            out.push(StreamEvent::Handle {
                handle: id.to_owned(),
            });
        }
        if let Some(reason) = chunk
            .get("promptFeedback")
            .and_then(|feedback| str_at(feedback, "blockReason"))
        {
            out.push(StreamEvent::ProviderError {
                code: "prompt_blocked".into(),
                message: reason.to_owned(),
            });
            return;
        }
        if let Some(usage) = chunk.get("usageMetadata") {
            let usage = (
                u64_at(usage, "promptTokenCount"),
                u64_at(usage, "candidatesTokenCount"),
            );
            if usage != (None, None) && self.usage_last != Some(usage) {
                self.usage_last = Some(usage);
                out.push(StreamEvent::Usage {
                    input_tokens: usage.0,
                    output_tokens: usage.1,
                    cache_creation_input_tokens: None,
                    cache_read_input_tokens: None,
                });
            }
        }
        let candidate = chunk
            .get("candidates")
            .and_then(Value::as_array)
            .and_then(|candidates| {
                candidates
                    .iter()
                    .find(|candidate| u64_at(candidate, "index").unwrap_or(0) == 0)
            });
        let Some(candidate) = candidate else { return };
        let parts = candidate
            .get("content")
            .and_then(|content| content.get("parts"))
            .and_then(Value::as_array);
        for part in parts.into_iter().flatten() {
            self.part(part, out);
        }
        if let Some(reason) = str_at(candidate, "finishReason") {
            self.finish(reason, out);
        }
    }
}

impl Gemini {
    fn new_block(&mut self, block: BlockStart, out: &mut Emitter) -> BlockIndex {
        let index = BlockIndex(self.key_next);
        self.key_next += 1;
        out.push(StreamEvent::BlockStart { index, block });
        index
    }

    fn close_text(&mut self, out: &mut Emitter) {
        if let Some((index, _)) = self.open_text.take() {
            out.push(StreamEvent::BlockStop {
                index,
                arguments_final: None,
            });
        }
    }

    fn seal(&mut self, signature: &str, out: &mut Emitter) {
        self.close_text(out);
        let index = self.new_block(
            BlockStart::Reasoning {
                provider: "gemini".into(),
            },
            out,
        );
        out.push(StreamEvent::ReasoningSeal {
            index,
            signature: Some(signature.to_owned()),
            encrypted: None,
        });
        out.push(StreamEvent::BlockStop {
            index,
            arguments_final: None,
        });
    }

    fn part(&mut self, part: &Value, out: &mut Emitter) {
        if self.finished {
            out.push(StreamEvent::Malformed {
                detail: "content after finishReason".into(),
            });
            return;
        }
        let signature = str_at(part, "thoughtSignature");
        if let Some(call) = part.get("functionCall") {
            if let Some(signature) = signature {
                self.seal(signature, out);
            }
            self.function_call(call, out);
            return;
        }
        if let Some(text) = str_at(part, "text") {
            let thought = part.get("thought").and_then(Value::as_bool) == Some(true);
            self.text_part(text, thought, signature, out);
            return;
        }
        if let Some(signature) = signature {
            self.seal(signature, out);
            return;
        }
        out.push(StreamEvent::Malformed {
            detail: "a part kind v1 cannot hold (inline data, code execution, …)".into(),
        });
    }

    fn text_part(&mut self, text: &str, thought: bool, signature: Option<&str>, out: &mut Emitter) {
        let kind = if thought {
            OpenKind::Thought
        } else {
            OpenKind::Text
        };
        if kind == OpenKind::Text {
            // A signature on a text part belongs before that part's text.
            if let Some(signature) = signature {
                self.seal(signature, out);
            }
        }
        if text.is_empty() && kind == OpenKind::Text {
            return;
        }
        let index = match self.open_text {
            Some((index, open)) if open == kind => index,
            _ => {
                self.close_text(out);
                let block = match kind {
                    OpenKind::Text => BlockStart::Text,
                    OpenKind::Thought => BlockStart::Reasoning {
                        provider: "gemini".into(),
                    },
                };
                let index = self.new_block(block, out);
                self.open_text = Some((index, kind));
                index
            }
        };
        match kind {
            OpenKind::Text => out.push(StreamEvent::TextDelta {
                index,
                text: text.to_owned(),
            }),
            OpenKind::Thought => {
                out.push(StreamEvent::ReasoningDelta {
                    index,
                    text: text.to_owned(),
                });
                if let Some(signature) = signature {
                    out.push(StreamEvent::ReasoningSeal {
                        index,
                        signature: Some(signature.to_owned()),
                        encrypted: None,
                    });
                }
            }
        }
    }

    fn function_call(&mut self, call: &Value, out: &mut Emitter) {
        let name = str_at(call, "name");
        let will_continue = call.get("willContinue").and_then(Value::as_bool) == Some(true);
        let partial = call.get("partialArgs").and_then(Value::as_array);
        if name.is_none() {
            // A continuation or the closing `{}` of a Vertex streamed call.
            let Some((index, mut args)) = self.streaming_call.take() else {
                out.push(StreamEvent::Malformed {
                    detail: "a functionCall continuation with no call in progress".into(),
                });
                return;
            };
            for arg in partial.into_iter().flatten() {
                if let Err(detail) = apply_partial_arg(&mut args, arg) {
                    out.push(StreamEvent::Malformed { detail });
                    return;
                }
            }
            let closes = partial.is_none() && !will_continue;
            if closes {
                out.push(StreamEvent::ToolArgsDelta {
                    index,
                    fragment: Value::Object(args).to_string(),
                });
                out.push(StreamEvent::BlockStop {
                    index,
                    arguments_final: None,
                });
            } else {
                self.streaming_call = Some((index, args));
            }
            return;
        }
        let name = name.unwrap_or_default();
        if self.streaming_call.is_some() {
            out.push(StreamEvent::Malformed {
                detail: "a new functionCall while another is still streaming".into(),
            });
            return;
        }
        self.close_text(out);
        let call_id = match str_at(call, "id").filter(|id| !id.is_empty()) {
            Some(id) => id.to_owned(),
            None => format!(
                "gemini-{}-{}",
                self.handle.as_deref().unwrap_or("unknown"),
                self.calls
            ),
        };
        self.calls += 1;
        let index = self.new_block(
            BlockStart::ToolCall {
                call_id: Some(call_id),
                name: name.to_owned(),
            },
            out,
        );
        if will_continue {
            let mut args = Map::new();
            if let Some(Value::Object(given)) = call.get("args") {
                args = given.clone();
            }
            self.streaming_call = Some((index, args));
            return;
        }
        match call.get("args") {
            None | Some(Value::Null) => {}
            Some(Value::Object(args)) if args.is_empty() => {}
            Some(args) => out.push(StreamEvent::ToolArgsDelta {
                index,
                fragment: args.to_string(),
            }),
        }
        out.push(StreamEvent::BlockStop {
            index,
            arguments_final: None,
        });
    }

    fn finish(&mut self, reason: &str, out: &mut Emitter) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.close_text(out);
        // A Vertex call still streaming stays open: the assembler will not commit it.
        let reason = match reason {
            "STOP" if self.calls > 0 => StopReason::ToolUse,
            "STOP" => StopReason::EndTurn,
            "MAX_TOKENS" => StopReason::MaxTokens,
            "SAFETY"
            | "RECITATION"
            | "BLOCKLIST"
            | "PROHIBITED_CONTENT"
            | "SPII"
            | "IMAGE_SAFETY"
            | "IMAGE_PROHIBITED_CONTENT"
            | "IMAGE_RECITATION" => StopReason::ContentFilter,
            other => StopReason::Other(other.to_owned()),
        };
        out.push(StreamEvent::Stop { reason });
        // The connection closes after this chunk (provider-rules.md §0 rule 9): it is the end.
        out.push(StreamEvent::End);
    }
}

enum PathStep {
    Key(String),
    Index(usize),
}

fn parse_json_path(path: &str) -> Option<Vec<PathStep>> {
    let mut rest = path.strip_prefix('$')?;
    let mut steps = Vec::new();
    while !rest.is_empty() {
        if steps.len() >= PARTIAL_ARGS_PATH_DEPTH_MAX {
            return None;
        }
        if let Some(after) = rest.strip_prefix('.') {
            let end = after.find(['.', '[']).unwrap_or(after.len());
            if end == 0 {
                return None;
            }
            steps.push(PathStep::Key(after[..end].to_owned()));
            rest = &after[end..];
        } else if let Some(after) = rest.strip_prefix("['") {
            let end = after.find("']")?;
            steps.push(PathStep::Key(after[..end].to_owned()));
            rest = &after[end + 2..];
        } else if let Some(after) = rest.strip_prefix('[') {
            let end = after.find(']')?;
            let index: usize = after[..end].parse().ok()?;
            // Arrays grow one element at a time; a far index would be a memory bomb.
            if index > 1 << 16 {
                return None;
            }
            steps.push(PathStep::Index(index));
            rest = &after[end + 1..];
        } else {
            return None;
        }
    }
    Some(steps)
}

/// Apply one Vertex `PartialArg` to the arguments being built. Consecutive `stringValue`s at
/// one path concatenate (that is how a long string streams).
fn apply_partial_arg(args: &mut Map<String, Value>, arg: &Value) -> Result<(), String> {
    let path = str_at(arg, "jsonPath").ok_or("a partialArg without jsonPath")?;
    let steps = parse_json_path(path).ok_or_else(|| format!("unsupported jsonPath {path:?}"))?;
    if steps.is_empty() {
        return Err("jsonPath \"$\" names no argument".into());
    }
    let mut root = Value::Object(std::mem::take(args));
    let result = set_at(&mut root, &steps, arg);
    if let Value::Object(map) = root {
        *args = map;
    }
    result
}

fn set_at(root: &mut Value, steps: &[PathStep], arg: &Value) -> Result<(), String> {
    let mut node = root;
    for step in steps {
        node = child(node, step)?;
    }
    if let Some(text) = str_at(arg, "stringValue") {
        match node {
            Value::String(existing) => existing.push_str(text),
            other => *other = Value::String(text.to_owned()),
        }
    } else if let Some(number) = arg.get("numberValue").filter(|number| number.is_number()) {
        *node = number.clone();
    } else if let Some(flag) = arg.get("boolValue").filter(|flag| flag.is_boolean()) {
        *node = flag.clone();
    } else if arg.get("nullValue").is_some() {
        *node = Value::Null;
    }
    Ok(())
}

fn child<'a>(value: &'a mut Value, step: &PathStep) -> Result<&'a mut Value, String> {
    match step {
        PathStep::Key(key) => {
            if value.is_null() {
                *value = Value::Object(Map::new());
            }
            match value {
                Value::Object(map) => Ok(map.entry(key.clone()).or_insert(Value::Null)),
                _ => Err(format!("jsonPath key {key:?} into a non-object")),
            }
        }
        PathStep::Index(index) => {
            if value.is_null() {
                *value = Value::Array(Vec::new());
            }
            match value {
                Value::Array(items) => {
                    if *index > items.len() {
                        return Err(format!("jsonPath index {index} skips elements"));
                    }
                    if *index == items.len() {
                        items.push(Value::Null);
                    }
                    Ok(&mut items[*index])
                }
                _ => Err(format!("jsonPath index {index} into a non-array")),
            }
        }
    }
}
