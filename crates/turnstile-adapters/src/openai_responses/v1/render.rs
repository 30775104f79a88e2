//! `openai-responses@1` (`POST /v1/responses`, OpenAPI `CreateResponse` l.36274).
//!
//! Placement (`shared/reference/provider-rules.md` §2.1):
//! - system turns become `developer` message items (`EasyInputMessage.role`), each block its
//!   own `input_text` part, so nothing is joined into one `instructions` string;
//! - an assistant turn becomes its items in block order: `reasoning` (ours, replayed with its
//!   item id and `encrypted_content`), assistant `message` items, `function_call` items;
//! - right after them, one `function_call_output` per call in call order, paired by
//!   `call_id` ("No tool output found for function call …" / "No tool call found for function
//!   call output …" are the 400s this avoids);
//! - `call_id` is 1–64 characters (`FunctionCallOutputItemParam`), longer ids are mapped.
//!
//! OpenAI reasoning blocks follow this convention (shared with the stream assembler): the
//! block's `signature` holds the reasoning item id (`rs_…`, required by `ReasoningItem`) and
//! `encrypted` its `encrypted_content`. One without both cannot be replayed and is omitted,
//! with the reason in the policy. `include: ["reasoning.encrypted_content"]` is always sent
//! so the next turn gets the encrypted content to replay.

use crate::call_ids::CallIdRule;
use crate::openai_chat::{arguments_text, openai_tool_tokens};
use crate::registry::RulesDescriptor;
use crate::render::{
    Body, CONTEXT_WRAPPING, Ctx, Fold, Graph, Reasoning, RenderOptions, RenderOutcome, Segment, Writer,
    data_url, inline_len, reasoning_for, segments_from, status_note, wrap_context,
};
use crate::tokens;
use turnstile_core::conversation::{Block, BlockBody, MediaSource, ResultPart, Turn};

const HEADERS: &[(&str, &str)] = crate::registry::JSON_HEADERS;
pub(crate) const CALL_ID_RULE: CallIdRule = CallIdRule::LengthMax(64);

const TAG_INPUT_PART: u8 = 1;
const TAG_ASSISTANT_ITEM: u8 = 2;
const TAG_OUTPUT_ITEM: u8 = 3;
const TAG_TOOLS: u8 = 4;

/// Declared rules of `openai-responses@1`.
pub static RULES: RulesDescriptor = RulesDescriptor {
    adapter: "openai-responses@1",
    rules_revision: 1,
    endpoint: "POST /v1/responses",
    representable_kinds: &[
        "text",
        "image",
        "tool_call",
        "tool_result",
        "context",
        "reasoning",
        "document",
    ],
    unrepresentable_parts: &[],
    system_placement: "one developer message item per system turn, each block an input_text part",
    max_output_tokens_field: "max_output_tokens",
    result_placement: "function_call items then one function_call_output per call in call order, paired by call_id; error/cancel as a leading status input_text part",
    call_id_rule: "length 1..=64, else tc_<sha256 hex 32>",
    reasoning: "openai reasoning with item id (signature) and encrypted_content replayed as a reasoning item; foreign or incomplete omitted with policy",
    context_wrapping: CONTEXT_WRAPPING,
    headers: HEADERS,
};

pub(crate) fn render(graph: Graph<'_>, options: &RenderOptions, ctx: &mut Ctx<'_>) -> RenderOutcome {
    let conversation = graph.conversation();
    // A fold over the segments, each written as it comes: a resumed render starts with the
    // body and state kept at a segment start (`Ctx::begin`).
    let (from, mut out, fold) = ctx.begin();
    ctx.pause_unrepresentable_kinds(conversation, from);
    ctx.map_call_ids(conversation, CALL_ID_RULE);
    let tokenizer = ctx.tokenizer;
    let item_tokens = tokenizer.message_overhead();

    if from == 0 {
        out.extend_from_slice(b"{\"model\":");
        crate::render::push_json_string(&mut out, &options.model);
        out.extend_from_slice(b",\"input\":[");
    }
    let mut first_item = fold.written == 0;
    for (start, segment) in segments_from(conversation, from) {
        let fold = Fold {
            written: usize::from(!first_item),
            ..Fold::default()
        };
        ctx.segment_start(start, &out, fold);
        match segment {
            Segment::System(turn) => {
                message_item(turn, "developer", &mut out, &mut first_item, ctx);
                ctx.tokens += item_tokens;
            }
            Segment::User(turn) => {
                message_item(turn, "user", &mut out, &mut first_item, ctx);
                ctx.tokens += item_tokens;
            }
            Segment::Assistant { turn, results } => {
                for block in &turn.blocks {
                    if let Some(reasoning) = reasoning_for(ctx.adapter, &block.body) {
                        match reasoning {
                            Reasoning::Omit { provider, reason } => {
                                ctx.omit(block, provider, reason);
                                continue;
                            }
                            Reasoning::Keep {
                                signature: Some(_),
                                encrypted: Some(_),
                                ..
                            } => {}
                            Reasoning::Keep { .. } => {
                                ctx.omit(block, "openai", "needs_item_id_and_encrypted_content");
                                continue;
                            }
                        }
                    }
                    separator(&mut out, &mut first_item);
                    ctx.tokens += item_tokens;
                    ctx.fragment(&mut out, TAG_ASSISTANT_ITEM, &block.digest, |w| {
                        assistant_item(block, w)
                    });
                }
                for result in results {
                    separator(&mut out, &mut first_item);
                    ctx.tokens += item_tokens;
                    ctx.fragment(&mut out, TAG_OUTPUT_ITEM, &result.digest, |w| {
                        output_item(result, w)
                    });
                }
            }
        }
    }
    out.extend_from_slice(b"],\"max_output_tokens\":");
    out.extend_from_slice(options.max_output_tokens.to_string().as_bytes());
    // Top-level `temperature` and `top_p`: the only generation settings `CreateResponse` has
    // (table in `sampling.rs`).
    options
        .sampling
        .write_fields(crate::registry::Api::OpenaiResponses, &mut out);
    if options.background {
        // Background mode keeps the response server-side (it needs `store`, on by default),
        // so an interrupted stream can be resumed with `starting_after` (provider-rules.md).
        out.extend_from_slice(b",\"background\":true");
    }
    if options.stream {
        out.extend_from_slice(b",\"stream\":true");
    }
    // `reasoning.encrypted_content` always (reasoning is replayed), then the client's own
    // values when it speaks Responses (`passthrough.rs`).
    out.extend_from_slice(b",\"include\":[");
    for (index, value) in crate::passthrough::responses_include(ctx.passthrough())
        .into_iter()
        .enumerate()
    {
        if index > 0 {
            out.push(b',');
        }
        crate::render::push_json_string(&mut out, value);
    }
    out.push(b']');
    if !conversation.tools.is_empty() {
        out.extend_from_slice(b",\"tools\":[");
        // `strict` is false unless the client (same API, `passthrough.rs`) declared the tool
        // strict; such a list is a per-request value, built uncached.
        let strict = crate::openai_chat::strict_tools(ctx, crate::registry::Api::OpenaiResponses);
        let build = |w: &mut Writer| {
            for (index, tool) in conversation.tools.iter().enumerate() {
                if index > 0 {
                    w.raw(",");
                }
                let start = w.out.len();
                w.raw("{\"type\":\"function\",\"name\":").string(&tool.name);
                if let Some(description) = &tool.description {
                    w.raw(",\"description\":").string(description);
                }
                w.raw(",\"parameters\":")
                    .canonical(&tool.input_schema)
                    .raw(if strict.contains(&tool.name) {
                        ",\"strict\":true}"
                    } else {
                        ",\"strict\":false}"
                    });
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
    ctx.tool_choice_fields(crate::registry::Api::OpenaiResponses, &mut out);
    // `text.format` (table in `output_format.rs`).
    ctx.output_format_fields(crate::registry::Api::OpenaiResponses, &mut out);
    // The client's own Responses-only fields, same API only (`passthrough.rs`).
    ctx.passthrough_fields(crate::registry::Api::OpenaiResponses, &mut out);
    out.push(b'}');
    ctx.tokens += tokenizer.request_overhead();
    ctx.finish(
        Body {
            body: out,
            path: crate::registry::Api::OpenaiResponses.request_path(&options.model, options.stream),
        },
        HEADERS,
    )
}

fn separator(out: &mut Vec<u8>, first: &mut bool) {
    if !*first {
        out.push(b',');
    }
    *first = false;
}

fn message_item(turn: &Turn, role: &str, out: &mut Vec<u8>, first_item: &mut bool, ctx: &mut Ctx<'_>) {
    separator(out, first_item);
    out.extend_from_slice(b"{\"type\":\"message\",\"role\":\"");
    out.extend_from_slice(role.as_bytes());
    out.extend_from_slice(b"\",\"content\":[");
    let mut first = true;
    for block in &turn.blocks {
        if !ctx.adapter.represents(block.body.kind()) {
            continue;
        }
        separator(out, &mut first);
        // An image with the client's own `detail` is a per-request fragment: built uncached.
        match crate::openai_chat::image_detail(ctx, crate::registry::Api::OpenaiResponses, block) {
            Some(detail) => {
                ctx.uncached(out, |w| input_part(block, &detail, w));
            }
            None => ctx.fragment(out, TAG_INPUT_PART, &block.digest, |w| {
                input_part(block, "auto", w)
            }),
        }
    }
    out.extend_from_slice(b"]}");
}

fn input_part(block: &Block, detail: &str, w: &mut Writer) {
    match &block.body {
        BlockBody::Text { text } => {
            w.raw("{\"type\":\"input_text\",\"text\":").text(text).raw("}");
        }
        BlockBody::Context { source, trust, text } => {
            let wrapped = wrap_context(source.as_deref(), *trust, text);
            w.raw("{\"type\":\"input_text\",\"text\":")
                .text(&wrapped)
                .raw("}");
        }
        BlockBody::Image { source } => image_part(source, detail, w),
        BlockBody::Document { source, title } => {
            w.raw("{\"type\":\"input_file\"");
            match source {
                MediaSource::Base64 { media_type, data } => {
                    w.raw(",\"filename\":")
                        .text(title.as_deref().unwrap_or("document"))
                        .raw(",\"file_data\":")
                        .string(&data_url(media_type, data));
                }
                MediaSource::Url { url, .. } => {
                    w.raw(",\"file_url\":").string(url);
                }
            }
            w.raw("}").charge(tokens::document_tokens(inline_len(source)));
        }
        _ => {}
    }
}

fn image_part(source: &MediaSource, detail: &str, w: &mut Writer) {
    w.raw("{\"type\":\"input_image\",\"image_url\":");
    match source {
        MediaSource::Base64 { media_type, data } => w.string(&data_url(media_type, data)),
        MediaSource::Url { url, .. } => w.string(url),
    };
    w.raw(",\"detail\":").string(detail).raw("}").charge_image();
}

fn assistant_item(block: &Block, w: &mut Writer) {
    match &block.body {
        BlockBody::Text { text } => {
            w.raw("{\"type\":\"message\",\"role\":\"assistant\",\"content\":")
                .text(text)
                .raw("}");
        }
        BlockBody::ToolCall {
            call_id,
            tool,
            arguments,
        } => {
            let id = crate::call_ids::map(call_id.as_str(), CALL_ID_RULE);
            w.raw("{\"type\":\"function_call\",\"call_id\":")
                .string(&id)
                .raw(",\"name\":")
                .text(tool)
                .raw(",\"arguments\":")
                .text(&arguments_text(arguments))
                .raw("}")
                .charge(3);
        }
        BlockBody::Reasoning {
            signature: Some(item_id),
            encrypted: Some(encrypted),
            text,
            ..
        } => {
            w.raw("{\"type\":\"reasoning\",\"id\":")
                .string(item_id)
                .raw(",\"summary\":[");
            if let Some(text) = text {
                w.raw("{\"type\":\"summary_text\",\"text\":").text(text).raw("}");
            }
            // Encrypted reasoning is decrypted into the context: charge its size as text.
            w.raw("],\"encrypted_content\":")
                .string(encrypted)
                .count(encrypted)
                .raw("}");
        }
        _ => {}
    }
}

fn output_item(result: &Block, w: &mut Writer) {
    let BlockBody::ToolResult {
        call_id,
        status,
        content,
        ..
    } = &result.body
    else {
        return;
    };
    let id = crate::call_ids::map(call_id.as_str(), CALL_ID_RULE);
    w.raw("{\"type\":\"function_call_output\",\"call_id\":")
        .string(&id)
        .raw(",\"output\":");
    let note = status_note(*status);
    if note.is_none() && content.is_empty() {
        w.raw("\"\"}");
        return;
    }
    w.raw("[");
    let mut first = true;
    if let Some(note) = note {
        w.raw("{\"type\":\"input_text\",\"text\":").text(note).raw("}");
        first = false;
    }
    for part in content {
        if !first {
            w.raw(",");
        }
        first = false;
        match part {
            ResultPart::Text(text) => {
                w.raw("{\"type\":\"input_text\",\"text\":").text(text).raw("}");
            }
            ResultPart::Image(source) => image_part(source, "auto", w),
        }
    }
    w.raw("]}");
}
