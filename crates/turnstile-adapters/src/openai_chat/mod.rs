//! OpenAI Chat Completions (`POST /v1/chat/completions`): the rules shared by every version.
//! A version is a [`ChatVersion`] value (system role, output-cap field, documents); the
//! placement code below is written once.
//!
//! Placement (OpenAPI spec `CreateChatCompletionRequest`, l.33105; rules and the 400s they
//! avoid in `shared/reference/provider-rules.md` §1.1):
//! - system turns become `system` (@1) or `developer` (@2) messages, one per turn, each block
//!   its own text part;
//! - all calls of an assistant turn go in ONE assistant message's `tool_calls`, arguments as a
//!   JSON string (the model's raw text when we have it);
//! - right after it, one `tool` message per call, in call order ("An assistant message with
//!   'tool_calls' must be followed by tool messages responding to each 'tool_call_id'");
//! - tool messages carry text parts only ("For tool messages, only type `text` is supported"),
//!   so an image inside a tool result pauses;
//! - Chat has no reasoning input: reasoning blocks are omitted, and the policy says why.

pub(crate) mod import;
pub mod v1;
pub mod v2;

use crate::call_ids::CallIdRule;
use crate::passthrough::ElementKind;
use crate::registry::AdapterId;
use crate::render::{
    Body, Ctx, Fold, Graph, PauseReason, Reasoning, RenderOptions, Segment, TextContent, Writer, data_url,
    inline_len, reasoning_for, segments_from, status_note, wrap_context,
};
use crate::tokens::{self, Tokenizer};
use serde_json::Value;
use std::sync::OnceLock;
use turnstile_core::conversation::{Arguments, Block, BlockBody, MediaSource, ResultPart, ToolDef, Turn};

/// What differs between Chat versions.
pub(crate) struct ChatVersion {
    pub adapter: AdapterId,
    /// `system` or `developer`.
    pub system_role: &'static str,
    /// `max_tokens` or `max_completion_tokens`.
    pub max_tokens_field: &'static str,
    /// Whether `document` blocks render as `file` parts.
    pub documents: bool,
}

/// Call-id rule: at most 40 characters.
pub(crate) const CALL_ID_RULE: CallIdRule = CallIdRule::LengthMax(40);

pub(crate) const HEADERS: &[(&str, &str)] = crate::registry::JSON_HEADERS;

// Fragment tags.
const TAG_CONTENT_PART: u8 = 1;
const TAG_TOOL_CALL: u8 = 2;
const TAG_TOOL_MESSAGE: u8 = 3;
const TAG_TOOLS: u8 = 4;
/// The string form ([`TextContent::String`]): one text block's text as a JSON string, and a
/// tool message with string content.
const TAG_CONTENT_STRING: u8 = 5;
const TAG_TOOL_MESSAGE_STRING: u8 = 6;

pub(crate) fn render(
    version: &ChatVersion,
    graph: Graph<'_>,
    options: &RenderOptions,
    ctx: &mut Ctx<'_>,
) -> crate::render::RenderOutcome {
    debug_assert_eq!(version.adapter, ctx.adapter);
    let conversation = graph.conversation();
    // A fold over the segments, each written as it comes: a resumed render starts with the
    // body and state kept at a segment start (`Ctx::begin`).
    let (from, mut out, fold) = ctx.begin();
    ctx.pause_unrepresentable_kinds(conversation, from);
    ctx.map_call_ids(conversation, CALL_ID_RULE);
    ctx.text_content = options.text_content;
    let tokenizer = ctx.tokenizer;
    let role_tokens = RoleTokens::new(tokenizer, version.system_role);

    if from == 0 {
        let mut w = Writer::new(tokenizer);
        w.raw("{\"model\":").string(&options.model).raw(",\"messages\":[");
        out.append(&mut w.out);
    }
    let mut first_message = fold.written == 0;
    for (start, segment) in segments_from(conversation, from) {
        let fold = Fold {
            written: usize::from(!first_message),
            ..Fold::default()
        };
        ctx.segment_start(start, &out, fold);
        match segment {
            Segment::System(turn) => {
                open_message(&mut out, &mut first_message, version.system_role);
                message_name(turn, &mut out, ctx);
                ctx.tokens += role_tokens.system;
                content_parts(version, turn, &mut out, ctx);
                out.push(b'}');
            }
            Segment::User(turn) => {
                open_message(&mut out, &mut first_message, "user");
                message_name(turn, &mut out, ctx);
                ctx.tokens += role_tokens.user;
                content_parts(version, turn, &mut out, ctx);
                out.push(b'}');
            }
            Segment::Assistant { turn, results } => {
                assistant_message(turn, &mut out, &mut first_message, ctx, role_tokens.assistant);
                for result in results {
                    if !first_message {
                        out.push(b',');
                    }
                    first_message = false;
                    ctx.tokens += role_tokens.tool;
                    tool_message(result, &mut out, ctx);
                }
            }
        }
    }
    out.extend_from_slice(b"],\"");
    out.extend_from_slice(version.max_tokens_field.as_bytes());
    out.extend_from_slice(b"\":");
    out.extend_from_slice(options.max_output_tokens.to_string().as_bytes());
    // Top-level `temperature`, `top_p`, `stop`, `seed`, `presence_penalty`,
    // `frequency_penalty` (`CreateChatCompletionRequest`; table in `sampling.rs`).
    options
        .sampling
        .write_fields(crate::registry::Api::OpenaiChat, &mut out);
    if options.stream {
        out.extend_from_slice(b",\"stream\":true,\"stream_options\":{\"include_usage\":true}");
    }
    if !conversation.tools.is_empty() {
        out.extend_from_slice(b",\"tools\":[");
        // The client's own `function.strict` flags (same API, `passthrough.rs`) make the list a
        // per-request value: built uncached then.
        let strict = strict_tools(ctx, crate::registry::Api::OpenaiChat);
        let build = |w: &mut Writer| {
            for (index, tool) in conversation.tools.iter().enumerate() {
                if index > 0 {
                    w.raw(",");
                }
                let start = w.out.len();
                w.raw("{\"type\":\"function\",\"function\":{\"name\":")
                    .string(&tool.name);
                if let Some(description) = &tool.description {
                    w.raw(",\"description\":").string(description);
                }
                w.raw(",\"parameters\":").canonical(&tool.input_schema);
                if strict.contains(&tool.name) {
                    w.raw(",\"strict\":true");
                }
                w.raw("}}");
                let charge = openai_tool_tokens(w.tokenizer, tool, &w.out[start..]);
                w.charge(charge);
            }
        };
        if strict.is_empty() {
            ctx.fragment(&mut out, TAG_TOOLS, &conversation.toolset_digest, build);
        } else {
            ctx.uncached(&mut out, build);
        }
        out.push(b']');
    }
    // `tool_choice`, `parallel_tool_calls` (table in `tool_choice.rs`).
    ctx.tool_choice_fields(crate::registry::Api::OpenaiChat, &mut out);
    // `response_format` (table in `output_format.rs`).
    ctx.output_format_fields(crate::registry::Api::OpenaiChat, &mut out);
    // The client's own Chat-only fields, same API only (`passthrough.rs`).
    ctx.passthrough_fields(crate::registry::Api::OpenaiChat, &mut out);
    out.push(b'}');
    ctx.tokens += tokenizer.request_overhead();
    let headers = HEADERS;
    ctx.finish(
        Body {
            body: out,
            path: crate::registry::Api::OpenaiChat.request_path(&options.model, options.stream),
        },
        headers,
    )
}

struct RoleTokens {
    system: u64,
    user: u64,
    assistant: u64,
    tool: u64,
}

impl RoleTokens {
    /// Per-message charges. Role-name counts are computed once per process and tokenizer:
    /// re-encoding "assistant" on every message of every render would cost more than the
    /// cached fragments themselves.
    fn new(tokenizer: Tokenizer, system_role: &str) -> RoleTokens {
        static COUNTS: OnceLock<Vec<(Tokenizer, [u64; 5])>> = OnceLock::new();
        let counts = COUNTS.get_or_init(|| {
            [
                Tokenizer::O200kBase,
                Tokenizer::Cl100kBase,
                Tokenizer::AnthropicEstimate,
                Tokenizer::GeminiEstimate,
            ]
            .into_iter()
            .map(|tokenizer| {
                let roles = ["system", "developer", "user", "assistant", "tool"];
                (tokenizer, roles.map(|role| tokenizer.count(role)))
            })
            .collect()
        });
        let counts = counts
            .iter()
            .find(|(known, _)| *known == tokenizer)
            .map(|(_, counts)| *counts)
            .unwrap_or_else(|| {
                ["system", "developer", "user", "assistant", "tool"].map(|role| tokenizer.count(role))
            });
        let overhead = tokenizer.message_overhead();
        RoleTokens {
            system: overhead
                + if system_role == "developer" {
                    counts[1]
                } else {
                    counts[0]
                },
            user: overhead + counts[2],
            assistant: overhead + counts[3],
            tool: overhead + counts[4],
        }
    }
}

fn open_message(out: &mut Vec<u8>, first: &mut bool, role: &str) {
    if !*first {
        out.push(b',');
    }
    *first = false;
    out.extend_from_slice(b"{\"role\":\"");
    out.extend_from_slice(role.as_bytes());
    out.extend_from_slice(b"\"");
}

/// The names of the tools the client declared `strict: true` (same API only).
pub(crate) fn strict_tools(ctx: &Ctx<'_>, api: crate::registry::Api) -> Vec<String> {
    let passthrough = ctx.passthrough();
    if !passthrough.has_elements(api, ElementKind::Strict) {
        return Vec::new();
    }
    passthrough
        .elements
        .iter()
        .filter(|element| element.kind == ElementKind::Strict)
        .map(|element| element.on.clone())
        .collect()
}

/// The client's image `detail` for `block` (same API only, `passthrough.rs`).
pub(crate) fn image_detail(ctx: &Ctx<'_>, api: crate::registry::Api, block: &Block) -> Option<String> {
    let id = block.id.as_deref()?;
    let detail = ctx.passthrough().element(api, ElementKind::Detail, id)?;
    detail.as_str().map(str::to_owned)
}

/// `,"name":…` of a message whose client gave the participant a name (same API only).
fn message_name(turn: &Turn, out: &mut Vec<u8>, ctx: &mut Ctx<'_>) {
    let Some(id) = turn.id.as_deref() else {
        return;
    };
    let Some(Value::String(name)) = ctx
        .passthrough()
        .element(crate::registry::Api::OpenaiChat, ElementKind::Name, id)
        .cloned()
    else {
        return;
    };
    out.extend_from_slice(b",\"name\":");
    crate::render::push_json_string(out, &name);
    ctx.tokens += ctx.tokenizer.count(&name);
}

/// The model-visible text of a text or context block (None: another kind).
fn block_text(block: &Block) -> Option<std::borrow::Cow<'_, str>> {
    match &block.body {
        BlockBody::Text { text } => Some(std::borrow::Cow::Borrowed(text.as_str())),
        BlockBody::Context { source, trust, text } => Some(std::borrow::Cow::Owned(wrap_context(
            source.as_deref(),
            *trust,
            text,
        ))),
        _ => None,
    }
}

/// `,"content":"…"` of a message whose `blocks` are all text ([`TextContent::String`]): one
/// block is its cached fragment; more are joined by a newline, built uncached (the joined
/// string is not a function of one block's digest).
fn content_string(blocks: &[&Block], out: &mut Vec<u8>, ctx: &mut Ctx<'_>) {
    out.extend_from_slice(b",\"content\":");
    match blocks {
        [block] => ctx.fragment(out, TAG_CONTENT_STRING, &block.digest, |w| {
            if let Some(text) = block_text(block) {
                w.text(&text);
            }
        }),
        _ => {
            let texts: Vec<_> = blocks.iter().filter_map(|block| block_text(block)).collect();
            let joined = texts.join("\n");
            let _ = ctx.uncached(out, |w| {
                w.text(&joined);
            });
        }
    }
}

/// `,"content":[…]` of a system or user message: each block its own part; or one string when
/// the provider asked for it and every represented block is text.
fn content_parts(version: &ChatVersion, turn: &Turn, out: &mut Vec<u8>, ctx: &mut Ctx<'_>) {
    if ctx.text_content == TextContent::String {
        let texts: Option<Vec<&Block>> = turn
            .blocks
            .iter()
            .filter(|block| ctx.adapter.represents(block.body.kind()))
            .map(|block| block_text(block).map(|_| block))
            .collect();
        if let Some(texts) = texts
            && !texts.is_empty()
        {
            content_string(&texts, out, ctx);
            return;
        }
    }
    out.extend_from_slice(b",\"content\":[");
    let mut first = true;
    for block in &turn.blocks {
        if !ctx.adapter.represents(block.body.kind()) {
            continue;
        }
        if let BlockBody::Document {
            source: MediaSource::Url { .. },
            ..
        } = &block.body
        {
            // Chat `file` parts take `file_data` or `file_id`, never a URL.
            ctx.pause(Some(block), "document.url", PauseReason::UnrepresentablePart);
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        // An image with the client's own `detail` is a per-request fragment: built uncached.
        match image_detail(ctx, crate::registry::Api::OpenaiChat, block) {
            Some(detail) => {
                ctx.uncached(out, |w| content_part(version, block, Some(&detail), w));
            }
            None => ctx.fragment(out, TAG_CONTENT_PART, &block.digest, |w| {
                content_part(version, block, None, w)
            }),
        }
    }
    out.push(b']');
}

fn content_part(version: &ChatVersion, block: &Block, detail: Option<&str>, w: &mut Writer) {
    match &block.body {
        BlockBody::Text { text } => {
            w.raw("{\"type\":\"text\",\"text\":").text(text).raw("}");
        }
        BlockBody::Context { source, trust, text } => {
            let wrapped = wrap_context(source.as_deref(), *trust, text);
            w.raw("{\"type\":\"text\",\"text\":").text(&wrapped).raw("}");
        }
        BlockBody::Image { source } => {
            w.raw("{\"type\":\"image_url\",\"image_url\":{\"url\":");
            match source {
                MediaSource::Base64 { media_type, data } => w.string(&data_url(media_type, data)),
                MediaSource::Url { url, .. } => w.string(url),
            };
            if let Some(detail) = detail {
                w.raw(",\"detail\":").string(detail);
            }
            w.raw("}}").charge_image();
        }
        BlockBody::Document { source, title } if version.documents => {
            // `ChatCompletionRequestMessageContentPartFile`: {type: file, file: {file_data, filename}}.
            let MediaSource::Base64 { media_type, data } = source else {
                return;
            };
            w.raw("{\"type\":\"file\",\"file\":{\"filename\":")
                .text(title.as_deref().unwrap_or("document"))
                .raw(",\"file_data\":")
                .string(&data_url(media_type, data))
                .raw("}}")
                .charge(tokens::document_tokens(inline_len(source)));
        }
        _ => {}
    }
}

fn assistant_message(
    turn: &Turn,
    out: &mut Vec<u8>,
    first_message: &mut bool,
    ctx: &mut Ctx<'_>,
    role_tokens: u64,
) {
    let mut has_text = false;
    let mut has_calls = false;
    for block in &turn.blocks {
        match &block.body {
            BlockBody::Text { .. } => has_text = true,
            BlockBody::ToolCall { .. } => has_calls = true,
            BlockBody::Reasoning { .. } => match reasoning_for(ctx.adapter, &block.body) {
                Some(Reasoning::Omit { provider, reason }) => ctx.omit(block, provider, reason),
                Some(Reasoning::Keep { .. }) => ctx.omit(block, "openai", "chat_has_no_reasoning_input"),
                None => {}
            },
            _ => {}
        }
    }
    if !has_text && !has_calls {
        // Only reasoning, all omitted: an empty assistant message would be a 400.
        return;
    }
    open_message(out, first_message, "assistant");
    message_name(turn, out, ctx);
    ctx.tokens += role_tokens;
    if has_text && ctx.text_content == TextContent::String {
        let texts: Vec<&Block> = turn
            .blocks
            .iter()
            .filter(|block| matches!(block.body, BlockBody::Text { .. }))
            .collect();
        content_string(&texts, out, ctx);
    } else if has_text {
        out.extend_from_slice(b",\"content\":[");
        let mut first = true;
        for block in &turn.blocks {
            if let BlockBody::Text { text } = &block.body {
                if !first {
                    out.push(b',');
                }
                first = false;
                ctx.fragment(out, TAG_CONTENT_PART, &block.digest, |w| {
                    w.raw("{\"type\":\"text\",\"text\":").text(text).raw("}");
                });
            }
        }
        out.push(b']');
    }
    if has_calls {
        out.extend_from_slice(b",\"tool_calls\":[");
        let mut first = true;
        for block in &turn.blocks {
            if let BlockBody::ToolCall {
                call_id,
                tool,
                arguments,
            } = &block.body
            {
                if !first {
                    out.push(b',');
                }
                first = false;
                ctx.fragment(out, TAG_TOOL_CALL, &block.digest, |w| {
                    let id = crate::call_ids::map(call_id.as_str(), CALL_ID_RULE);
                    let arguments = arguments_text(arguments);
                    w.raw("{\"id\":")
                        .string(&id)
                        .raw(",\"type\":\"function\",\"function\":{\"name\":")
                        .text(tool)
                        .raw(",\"arguments\":")
                        .text(&arguments)
                        .raw("}}")
                        .charge(3);
                });
            }
        }
        out.push(b']');
    }
    out.push(b'}');
}

fn tool_message(result: &Block, out: &mut Vec<u8>, ctx: &mut Ctx<'_>) {
    let BlockBody::ToolResult {
        call_id,
        status,
        content,
        ..
    } = &result.body
    else {
        return;
    };
    if content.iter().any(|part| matches!(part, ResultPart::Image(_))) {
        ctx.pause(
            Some(result),
            "tool_result.image",
            PauseReason::UnrepresentablePart,
        );
    }
    let string = ctx.text_content == TextContent::String;
    let tag = if string {
        TAG_TOOL_MESSAGE_STRING
    } else {
        TAG_TOOL_MESSAGE
    };
    ctx.fragment(out, tag, &result.digest, |w| {
        let id = crate::call_ids::map(call_id.as_str(), CALL_ID_RULE);
        w.raw("{\"role\":\"tool\",\"tool_call_id\":")
            .string(&id)
            .count(&id)
            .raw(",\"content\":");
        let note = status_note(*status);
        let texts: Vec<&str> = note
            .into_iter()
            .chain(content.iter().filter_map(|part| match part {
                ResultPart::Text(text) => Some(text.as_str()),
                ResultPart::Image(_) => None,
            }))
            .collect();
        if texts.is_empty() {
            w.raw("\"\"");
        } else if string {
            w.text(&texts.join("\n"));
        } else {
            w.raw("[");
            for (index, text) in texts.iter().enumerate() {
                if index > 0 {
                    w.raw(",");
                }
                w.raw("{\"type\":\"text\",\"text\":").text(text).raw("}");
            }
            w.raw("]");
        }
        w.raw("}");
    });
}

/// Arguments as the JSON text sent: the model's raw text when we have it (byte-exact replay,
/// which also keeps provider prompt caches warm), else the RFC 8785 form of the object.
pub(crate) fn arguments_text(arguments: &Arguments) -> std::borrow::Cow<'_, str> {
    match arguments {
        Arguments::Closed { raw: Some(raw), .. } => std::borrow::Cow::Borrowed(raw.as_str()),
        Arguments::Closed { value, .. } => std::borrow::Cow::Owned(
            String::from_utf8(turnstile_core::digest::canonical_object_bytes(value))
                // Invariant: RFC 8785 output is UTF-8 JSON text.
                .expect("canonical JSON is UTF-8"),
        ),
        // Invariant: validation rejects unclosed arguments, so a Graph never holds them.
        Arguments::Unclosed { raw, .. } => std::borrow::Cow::Borrowed(raw.as_str()),
    }
}

/// Tokens charged for one OpenAI tool definition: the exact BPE count of the tool's JSON as
/// sent (`rendered`, every byte of it: name, description, the whole `parameters` schema with
/// `$defs`, `allOf`/`anyOf`, nested objects, enums) plus [`OPENAI_TOOL_FRAMING_TOKENS`], and
/// never less than the cookbook formula ([`openai_tool_tokens_cookbook`]).
///
/// Why this bounds what OpenAI charges: the API renders each function into its system prompt
/// as a TypeScript-like declaration whose model-visible strings (names, descriptions, property
/// names, types, enum values, the referenced definitions) all appear in the JSON text as well,
/// where each is wrapped in more syntax (`"key":`, quotes, braces). The framing constant covers
/// the per-function header and footer the cookbook measured (`func_init` 7 + `func_end` 12).
/// The cookbook formula alone counts only name, description and first-level `properties`: a
/// tool with a 438 KB `$defs` block counted 53 tokens under it (issue 17). The bound per
/// provider is recorded in
/// `docs/decisions/0046-tool-schemas-are-counted-as-sent-on-every-adapter.md` (2026-12-01, "tool
/// schemas are counted as sent").
pub(crate) fn openai_tool_tokens(tokenizer: Tokenizer, tool: &ToolDef, rendered: &[u8]) -> u64 {
    // Invariant: the renderer writes UTF-8 JSON (str literals and RFC 8785 output), so this
    // borrows; the lossy path is never taken, and could only over-count (U+FFFD is 1 token+).
    let text = String::from_utf8_lossy(rendered);
    let as_sent = tokenizer.count(&text) + OPENAI_TOOL_FRAMING_TOKENS;
    as_sent.max(openai_tool_tokens_cookbook(tokenizer, tool))
}

/// Tokens added per function definition beyond its JSON text: the cookbook's `func_init` (7)
/// plus `func_end` (12), measured by OpenAI on gpt-4o-family models.
pub const OPENAI_TOOL_FRAMING_TOKENS: u64 = 7 + 12;

/// Tool-definition tokens per the OpenAI cookbook (§7 of `How_to_count_tokens_with_tiktoken`):
/// `func_init + len(name:description) + prop_init + Σ(prop_key + enum costs +
/// len(name:type:description)) + func_end`, with the gpt-4o constants (func_init 7, prop_init
/// 3, prop_key 3, enum_init −3, enum_item 3, func_end 12). It ignores everything but
/// first-level `properties` (nested schemas only partly), so it is only a floor here: see
/// [`openai_tool_tokens`].
fn openai_tool_tokens_cookbook(tokenizer: Tokenizer, tool: &ToolDef) -> u64 {
    use serde_json::Value;
    let description = tool.description.as_deref().unwrap_or("").trim_end_matches('.');
    let mut tokens = 7 + tokenizer.count(&format!("{}:{}", tool.name, description));
    if let Some(Value::Object(properties)) = tool.input_schema.get("properties") {
        if !properties.is_empty() {
            tokens += 3;
        }
        for (key, schema) in properties {
            tokens += 3;
            let kind = schema.get("type").and_then(Value::as_str).unwrap_or("object");
            let property_description = schema
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or("")
                .trim_end_matches('.');
            if let Some(Value::Array(items)) = schema.get("enum") {
                tokens = tokens.saturating_sub(3);
                for item in items {
                    tokens += 3 + tokenizer.count(&item.to_string());
                }
            }
            tokens += tokenizer.count(&format!("{key}:{kind}:{property_description}"));
            let nested = schema.get("properties").is_some()
                || schema.get("items").is_some()
                || schema.get("anyOf").is_some()
                || schema.get("oneOf").is_some()
                || schema.get("$ref").is_some();
            if nested {
                let text = turnstile_core::digest::canonical_bytes(schema);
                tokens += tokenizer.count(&String::from_utf8_lossy(&text));
            }
        }
    }
    tokens + 12
}
