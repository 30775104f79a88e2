//! Anthropic Messages (`POST /v1/messages`): the rules shared by every version; a version is
//! an [`AnthropicVersion`] value.
//!
//! Placement (`shared/reference/provider-rules.md` §3.1, quoting the Anthropic docs and SDK):
//! - system turns go to the top-level `system` array, each block its own text block;
//! - "Consecutive `user` or `assistant` turns in your request will be combined into a single
//!   turn": we merge them ourselves, so the bytes say what the model sees;
//! - all results for one assistant turn go in ONE user message, `tool_result` blocks FIRST
//!   ("In the user message containing tool results, the tool_result blocks must come FIRST in
//!   the content array. Any text must come AFTER all tool results."), in call order; a user
//!   turn that follows merges in after them;
//! - `is_error: true` for error and cancel results (a cancel also gets a status text part);
//! - `tool_use.id` must match `^[a-zA-Z0-9_-]+$`; other ids are mapped;
//! - thinking blocks with their signature (or `redacted_thinking` with its data) go back
//!   unchanged to Anthropic and are omitted for everyone else;
//! - empty or whitespace-only text blocks are rejected by the API ("text content blocks must
//!   contain non-whitespace text"); they carry nothing, so they are left out and the policy
//!   lists them.

pub(crate) mod import;
pub mod v1;
pub mod v2;

use crate::cache;
use crate::call_ids::CallIdRule;
use crate::render::{
    Body, Ctx, Fold, Graph, PauseReason, Reasoning, RenderOptions, RenderOutcome, Segment, Writer,
    inline_len, reasoning_for, segments_from, status_note, wrap_context,
};
use crate::tokens;
use turnstile_core::conversation::{Arguments, Block, BlockBody, MediaSource, ResultPart, ResultStatus};

/// What differs between Messages versions.
pub(crate) struct AnthropicVersion {
    /// Whether `document` blocks render (@2).
    pub documents: bool,
}

pub(crate) const CALL_ID_RULE: CallIdRule = CallIdRule::AsciiWordOrDash;

/// `anthropic-version` is required on every request (Anthropic "Versions" page; SDK
/// `_client.py` sends `2023-06-01`).
pub(crate) const HEADERS: &[(&str, &str)] = crate::registry::ANTHROPIC_HEADERS;

const TAG_SYSTEM: u8 = 1;
const TAG_CONTENT: u8 = 2;
const TAG_RESULT: u8 = 3;
const TAG_TOOLS: u8 = 4;
/// The bytes around the tool list (`,"tools":[` … `]`), counted with the tools.
const TOOLS_WRAPPER_TEXT: &str = ",\"tools\":[]";

#[derive(Clone, Copy, PartialEq, Eq)]
enum MessageRole {
    User = 0,
    Assistant = 1,
}

enum Item<'a> {
    Content(&'a Block),
    Result(&'a Block),
}

/// Write one item into the messages array: into the open message when it has the same role
/// (consecutive same-role turns merged), else closing it and opening a new one. `fold` is the
/// array's state (`Fold::open` the open message's role), kept at each segment start so a
/// render can resume there.
fn push(out: &mut Vec<u8>, fold: &mut Fold, ctx: &mut Ctx<'_>, role: MessageRole, item: Item<'_>) {
    if fold.open == Some(role as u8) {
        out.push(b',');
    } else {
        if fold.open.is_some() {
            out.extend_from_slice(b"]}");
        }
        if fold.written > 0 {
            out.push(b',');
        }
        out.extend_from_slice(match role {
            MessageRole::User => b"{\"role\":\"user\",\"content\":[",
            MessageRole::Assistant => b"{\"role\":\"assistant\",\"content\":[",
        });
        ctx.tokens += ctx.tokenizer.message_overhead();
        fold.written += 1;
        fold.open = Some(role as u8);
    }
    // A cache breakpoint is written in place on the block it marks (`cache.rs`).
    match item {
        Item::Content(block) => {
            let mark = block.cache.as_ref();
            ctx.fragment(out, cache::tag(TAG_CONTENT, mark), &block.digest, |w| {
                content_block(block, w);
                cache::mark_object(&mut w.out, mark);
            })
        }
        Item::Result(block) => {
            let mark = block.cache.as_ref();
            ctx.fragment(out, cache::tag(TAG_RESULT, mark), &block.digest, |w| {
                result_block(block, w);
                cache::mark_object(&mut w.out, mark);
            })
        }
    }
}

fn is_blank(block: &Block) -> bool {
    matches!(&block.body, BlockBody::Text { text } if text.trim().is_empty())
}

/// Render as a fold over the segments: the head (model, settings, the system array), then each
/// segment's items written as they come, then the tail (tools, choice, client fields). A
/// resumed render ([`Ctx::begin`]) starts with the body and state kept at a segment start and
/// folds the segments from there; the system array is in the head, so a render resumes only
/// when no system turn follows the resume point (`render::resumable`).
pub(crate) fn render(
    version: &AnthropicVersion,
    graph: Graph<'_>,
    options: &RenderOptions,
    ctx: &mut Ctx<'_>,
) -> RenderOutcome {
    let conversation = graph.conversation();
    let (from, mut out, mut fold) = ctx.begin();
    ctx.pause_unrepresentable_kinds(conversation, from);
    ctx.map_call_ids(conversation, CALL_ID_RULE);
    let tokenizer = ctx.tokenizer;
    debug_assert_eq!(version.documents, ctx.adapter.represents("document"));

    if from == 0 {
        out.extend_from_slice(b"{\"model\":");
        crate::render::push_json_string(&mut out, &options.model);
        out.extend_from_slice(b",\"max_tokens\":");
        out.extend_from_slice(options.max_output_tokens.to_string().as_bytes());
        // Top-level `temperature`, `top_p`, `top_k`, `stop_sequences` (table in `sampling.rs`).
        options
            .sampling
            .write_fields(crate::registry::Api::AnthropicMessages, &mut out);
        // Every system turn's blocks, in order (blank ones are left out, and the walk below
        // records them in the policy in turn order).
        let system: Vec<&Block> = ctx
            .system_turns(conversation, 0)
            .into_iter()
            .flat_map(|turn| &turn.blocks)
            .filter(|block| !is_blank(block))
            .collect();
        if !system.is_empty() {
            out.extend_from_slice(b",\"system\":[");
            for (index, block) in system.iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                let mark = block.cache.as_ref();
                ctx.fragment(&mut out, cache::tag(TAG_SYSTEM, mark), &block.digest, |w| {
                    content_block(block, w);
                    cache::mark_object(&mut w.out, mark);
                });
            }
            out.push(b']');
            ctx.tokens += tokenizer.message_overhead();
        }
        out.extend_from_slice(b",\"messages\":[");
    }

    for (start, segment) in segments_from(conversation, from) {
        ctx.segment_start(start, &out, fold);
        match segment {
            Segment::System(turn) => {
                for block in &turn.blocks {
                    if is_blank(block) {
                        ctx.omit(block, "", "empty_text_rejected_by_api");
                    }
                }
            }
            Segment::User(turn) => {
                for block in &turn.blocks {
                    if !ctx.adapter.represents(block.body.kind()) {
                        continue;
                    }
                    if is_blank(block) {
                        ctx.omit(block, "", "empty_text_rejected_by_api");
                        continue;
                    }
                    if let BlockBody::Document { source, .. } = &block.body
                        && document_source(source).is_none()
                    {
                        ctx.pause(
                            Some(block),
                            "document.media_type",
                            PauseReason::UnrepresentablePart,
                        );
                        continue;
                    }
                    push(&mut out, &mut fold, ctx, MessageRole::User, Item::Content(block));
                }
            }
            Segment::Assistant { turn, results } => {
                for block in &turn.blocks {
                    if let Some(Reasoning::Omit { provider, reason }) =
                        reasoning_for(ctx.adapter, &block.body)
                    {
                        ctx.omit(block, provider, reason);
                        continue;
                    }
                    if is_blank(block) {
                        ctx.omit(block, "", "empty_text_rejected_by_api");
                        continue;
                    }
                    push(
                        &mut out,
                        &mut fold,
                        ctx,
                        MessageRole::Assistant,
                        Item::Content(block),
                    );
                }
                for result in results {
                    // A results message always starts a new user message: the previous
                    // message is the assistant one holding the calls.
                    push(&mut out, &mut fold, ctx, MessageRole::User, Item::Result(result));
                }
            }
        }
    }
    if fold.written == 0 {
        ctx.pause(None, "messages", PauseReason::UnrepresentableSequence);
    }
    if fold.open.is_some() {
        out.extend_from_slice(b"]}");
    }
    out.push(b']');
    if !conversation.tools.is_empty() {
        out.extend_from_slice(b",\"tools\":[");
        ctx.fragment(&mut out, TAG_TOOLS, &cache::tools_key(conversation), |w| {
            let start = w.out.len();
            for (index, tool) in conversation.tools.iter().enumerate() {
                if index > 0 {
                    w.raw(",");
                }
                w.raw("{\"name\":").string(&tool.name);
                if let Some(description) = &tool.description {
                    w.raw(",\"description\":").string(description);
                }
                w.raw(",\"input_schema\":").canonical(&tool.input_schema);
                if let Some(mark) = &tool.cache {
                    w.raw(",\"cache_control\":")
                        .raw(&cache::anthropic_cache_control(mark));
                }
                w.raw("}");
            }
            // Every byte the tools add to the request is counted, separators and the wrapper
            // around the list included (issue 17: the property test in
            // `tests/it/render_admission.rs` holds the charge against the inserted bytes).
            let written = String::from_utf8_lossy(&w.out[start..]).into_owned();
            let overhead = w.tokenizer.tools_overhead();
            w.count(&written).count(TOOLS_WRAPPER_TEXT).charge(overhead);
        });
        out.push(b']');
    }
    // `tool_choice` (with `disable_parallel_tool_use`; table in `tool_choice.rs`).
    ctx.tool_choice_fields(crate::registry::Api::AnthropicMessages, &mut out);
    // The client's own Anthropic-only fields, same API only (`passthrough.rs`).
    ctx.passthrough_fields(crate::registry::Api::AnthropicMessages, &mut out);
    if options.stream {
        out.extend_from_slice(b",\"stream\":true");
    }
    out.push(b'}');
    ctx.tokens += tokenizer.request_overhead();
    ctx.finish(
        Body {
            body: out,
            path: crate::registry::Api::AnthropicMessages.request_path(&options.model, options.stream),
        },
        HEADERS,
    )
}

/// The source object of a document, or None when Anthropic has no form for it: PDFs go as
/// `base64` or `url` sources, `text/plain` as a `text` source holding the decoded text.
fn document_source(source: &MediaSource) -> Option<DocumentSource<'_>> {
    match source {
        MediaSource::Url { url, .. } => Some(DocumentSource::Url(url)),
        MediaSource::Base64 { media_type, data } if media_type == "application/pdf" => {
            Some(DocumentSource::Pdf(data))
        }
        MediaSource::Base64 { media_type, data } if media_type.starts_with("text/plain") => {
            let bytes = crate::render::base64_decode(data)?;
            String::from_utf8(bytes).ok().map(DocumentSource::Text)
        }
        MediaSource::Base64 { .. } => None,
    }
}

enum DocumentSource<'a> {
    Url(&'a str),
    Pdf(&'a str),
    Text(String),
}

fn media_source(source: &MediaSource, w: &mut Writer) {
    match source {
        MediaSource::Base64 { media_type, data } => {
            w.raw("{\"type\":\"base64\",\"media_type\":")
                .string(media_type)
                .raw(",\"data\":")
                .string(data)
                .raw("}");
        }
        MediaSource::Url { url, .. } => {
            w.raw("{\"type\":\"url\",\"url\":").string(url).raw("}");
        }
    }
}

fn content_block(block: &Block, w: &mut Writer) {
    match &block.body {
        BlockBody::Text { text } => {
            w.raw("{\"type\":\"text\",\"text\":").text(text).raw("}");
        }
        BlockBody::Context { source, trust, text } => {
            let wrapped = wrap_context(source.as_deref(), *trust, text);
            w.raw("{\"type\":\"text\",\"text\":").text(&wrapped).raw("}");
        }
        BlockBody::Image { source } => {
            w.raw("{\"type\":\"image\",\"source\":");
            media_source(source, w);
            w.raw("}").charge_image();
        }
        BlockBody::Document { source, title } => {
            w.raw("{\"type\":\"document\",\"source\":");
            match document_source(source) {
                Some(DocumentSource::Url(url)) => {
                    w.raw("{\"type\":\"url\",\"url\":").string(url).raw("}");
                    w.charge(tokens::document_tokens(None));
                }
                Some(DocumentSource::Pdf(data)) => {
                    w.raw("{\"type\":\"base64\",\"media_type\":\"application/pdf\",\"data\":")
                        .string(data)
                        .raw("}");
                    w.charge(tokens::document_tokens(inline_len(source)));
                }
                Some(DocumentSource::Text(text)) => {
                    w.raw("{\"type\":\"text\",\"media_type\":\"text/plain\",\"data\":")
                        .text(&text)
                        .raw("}");
                }
                // Paused in the plan; never reached.
                None => {
                    w.raw("null");
                }
            }
            if let Some(title) = title {
                w.raw(",\"title\":").text(title);
            }
            w.raw("}");
        }
        BlockBody::ToolCall {
            call_id,
            tool,
            arguments,
        } => {
            let id = crate::call_ids::map(call_id.as_str(), CALL_ID_RULE);
            w.raw("{\"type\":\"tool_use\",\"id\":")
                .string(&id)
                .raw(",\"name\":")
                .text(tool);
            w.raw(",\"input\":");
            match arguments {
                // The model's own JSON text, embedded verbatim: validation parsed it as one
                // complete object with nothing after it, so it is a well-formed JSON value.
                Arguments::Closed { raw: Some(raw), .. } => {
                    w.raw(raw).count(raw);
                }
                Arguments::Closed { value, .. } => {
                    let text = turnstile_core::digest::canonical_object_bytes(value);
                    w.count(&String::from_utf8_lossy(&text));
                    w.out.extend_from_slice(&text);
                }
                Arguments::Unclosed { .. } => {
                    w.raw("{}");
                }
            }
            w.raw("}").charge(3);
        }
        BlockBody::Reasoning {
            signature,
            encrypted,
            text,
            ..
        } => match (signature, encrypted) {
            (Some(signature), _) => {
                w.raw("{\"type\":\"thinking\",\"thinking\":")
                    .text(text.as_deref().unwrap_or(""))
                    .raw(",\"signature\":")
                    .string(signature)
                    .raw("}");
            }
            (None, Some(data)) => {
                w.raw("{\"type\":\"redacted_thinking\",\"data\":")
                    .string(data)
                    .count(data)
                    .raw("}");
            }
            // The decoder rejects reasoning with neither.
            (None, None) => {}
        },
        _ => {}
    }
}

fn result_block(block: &Block, w: &mut Writer) {
    let BlockBody::ToolResult {
        call_id,
        status,
        content,
        ..
    } = &block.body
    else {
        return;
    };
    let id = crate::call_ids::map(call_id.as_str(), CALL_ID_RULE);
    w.raw("{\"type\":\"tool_result\",\"tool_use_id\":").string(&id);
    if *status != ResultStatus::Success {
        w.raw(",\"is_error\":true");
    }
    // `is_error` already says "error"; a cancel also says it did not complete.
    let note = match status {
        ResultStatus::Cancel => status_note(*status),
        _ => None,
    };
    let parts: Vec<&ResultPart> = content.iter().filter(|part| !is_blank_part(part)).collect();
    if note.is_some() || !parts.is_empty() {
        w.raw(",\"content\":[");
        let mut first = true;
        if let Some(note) = note {
            w.raw("{\"type\":\"text\",\"text\":").text(note).raw("}");
            first = false;
        }
        for part in parts {
            if !first {
                w.raw(",");
            }
            first = false;
            match part {
                ResultPart::Text(text) => {
                    w.raw("{\"type\":\"text\",\"text\":").text(text).raw("}");
                }
                ResultPart::Image(source) => {
                    w.raw("{\"type\":\"image\",\"source\":");
                    media_source(source, w);
                    w.raw("}").charge_image();
                }
            }
        }
        w.raw("]");
    }
    w.raw("}");
}

fn is_blank_part(part: &ResultPart) -> bool {
    matches!(part, ResultPart::Text(text) if text.trim().is_empty())
}
