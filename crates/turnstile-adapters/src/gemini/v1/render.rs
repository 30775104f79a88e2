//! `gemini@1`: Gemini API `streamGenerateContent` (`generateContent` without streaming).
//!
//! Placement (`shared/reference/provider-rules.md` §4.1, python-genai `types.py`):
//! - system turns go to `systemInstruction.parts`, each block its own part;
//! - `contents` strictly alternate `user` / `model` ("Please ensure that multiturn requests
//!   alternate between user and model"): consecutive same-role turns are merged;
//! - the results of one model turn are ONE user content with exactly as many
//!   `functionResponse` parts as the model turn had `functionCall` parts, in call order ("the
//!   number of function response parts is equal to the number of function call parts"); a user
//!   turn that follows merges in after them;
//! - ids are optional and absent from recorded streams: calls and responses pair by position
//!   and name, so no id is sent (and none needs mapping);
//! - `functionResponse.response` is `{"output": …}` for success and `{"error": …}` for error
//!   and cancel (the keys the SDK documents);
//! - tool schemas go in `parametersJsonSchema`: the plain `parameters` field takes an OpenAPI
//!   subset that rejects `additionalProperties`, `$ref` and more;
//! - Gemini reasoning blocks carry a `thoughtSignature`, which is returned on the part that
//!   followed it in the model turn (the next block of the same turn: "replay the model's parts
//!   verbatim, with `thoughtSignature` in its original part"), or on an empty text part when
//!   nothing follows, as the model itself sends it; foreign reasoning is omitted;
//! - the request must end with a user content or function responses ("multiturn requests
//!   ends with a user role or a function response"), and a function call turn must follow a
//!   user turn: graphs that break either pause;
//! - images inside tool results have no `functionResponse` form in v1beta: they pause.

use crate::registry::RulesDescriptor;
use crate::render::{
    Body, CONTEXT_WRAPPING, Ctx, Fold, Graph, PauseReason, Reasoning, RenderOptions, RenderOutcome, Segment,
    Writer, inline_len, reasoning_for, segments_from, status_note, wrap_context,
};
use crate::tokens;
use turnstile_core::conversation::{Arguments, Block, BlockBody, MediaSource, ResultPart, ResultStatus};

const HEADERS: &[(&str, &str)] = crate::registry::JSON_HEADERS;

const TAG_PART: u8 = 1;
const TAG_RESPONSE: u8 = 2;
const TAG_TOOLS: u8 = 3;
/// The bytes around the tool list (`,"tools":[{"functionDeclarations":[` … `]}]`), counted
/// with the tools.
const TOOLS_WRAPPER_TEXT: &str = ",\"tools\":[{\"functionDeclarations\":[]}]";

/// Declared rules of `gemini@1`.
pub static RULES: RulesDescriptor = RulesDescriptor {
    adapter: "gemini@1",
    rules_revision: 1,
    endpoint: "POST /v1beta/models/{model}:streamGenerateContent?alt=sse",
    representable_kinds: &[
        "text",
        "image",
        "tool_call",
        "tool_result",
        "context",
        "reasoning",
        "document",
    ],
    unrepresentable_parts: &["tool_result.image"],
    system_placement: "systemInstruction.parts, each block a part",
    max_output_tokens_field: "generationConfig.maxOutputTokens",
    result_placement: "ONE user content per model turn with exactly one functionResponse per functionCall, in call order; strict user/model alternation by merging",
    call_id_rule: "no ids sent; pairing by position",
    reasoning: "gemini thoughtSignature returned on the part that followed it; foreign omitted with policy",
    context_wrapping: CONTEXT_WRAPPING,
    headers: HEADERS,
};

#[derive(Clone, Copy, PartialEq, Eq)]
enum ContentRole {
    User = 0,
    Model = 1,
}

enum Item<'a> {
    Part {
        block: &'a Block,
        signature: Option<&'a str>,
    },
    SignatureOnly(&'a str),
    Response(&'a Block),
}

/// Close the open content (if any), noting whether it was the first and a model turn with
/// calls (the rule `contents.first_function_call_turn` checks).
fn close(out: &mut Vec<u8>, fold: &mut Fold) {
    if fold.open.is_some() {
        if fold.written == 1 {
            fold.first_model_calls = fold.open == Some(ContentRole::Model as u8) && fold.open_calls > 0;
        }
        out.extend_from_slice(b"]}");
        fold.open = None;
    }
}

/// Write one part into the contents array: into the open content when it has the same role
/// (strict alternation by merging), else closing it and opening a new one. `fold` is the
/// array's state, kept at each segment start so a render can resume there.
fn push(out: &mut Vec<u8>, fold: &mut Fold, ctx: &mut Ctx<'_>, role: ContentRole, item: Item<'_>) {
    if fold.open == Some(role as u8) {
        out.push(b',');
    } else {
        close(out, fold);
        if fold.written > 0 {
            out.push(b',');
        }
        out.extend_from_slice(match role {
            ContentRole::User => b"{\"role\":\"user\",\"parts\":[",
            ContentRole::Model => b"{\"role\":\"model\",\"parts\":[",
        });
        ctx.tokens += ctx.tokenizer.message_overhead();
        fold.written += 1;
        fold.open = Some(role as u8);
        fold.open_calls = 0;
    }
    out.push(b'{');
    match item {
        Item::Part { block, signature } => {
            ctx.fragment(out, TAG_PART, &block.digest, |w| part_fields(block, w));
            if let Some(signature) = signature {
                out.extend_from_slice(b",\"thoughtSignature\":");
                crate::render::push_json_string(out, signature);
            }
            if matches!(block.body, BlockBody::ToolCall { .. }) {
                fold.open_calls += 1;
            }
        }
        Item::SignatureOnly(signature) => {
            out.extend_from_slice(b"\"text\":\"\",\"thoughtSignature\":");
            crate::render::push_json_string(out, signature);
        }
        Item::Response(block) => {
            ctx.fragment(out, TAG_RESPONSE, &block.digest, |w| response_fields(block, w));
        }
    }
    out.push(b'}');
}

/// Render as a fold over the segments: each part written as it comes into `contents`, then
/// the tail (the system instruction, tools, settings). A resumed render ([`Ctx::begin`])
/// starts with the body and state kept at a segment start; the system turns before it are
/// kept by index.
pub(crate) fn render(graph: Graph<'_>, options: &RenderOptions, ctx: &mut Ctx<'_>) -> RenderOutcome {
    let conversation = graph.conversation();
    let (from, mut out, mut fold) = ctx.begin();
    ctx.pause_unrepresentable_kinds(conversation, from);
    let tokenizer = ctx.tokenizer;

    if from == 0 {
        out.extend_from_slice(b"{\"contents\":[");
    }
    for (start, segment) in segments_from(conversation, from) {
        ctx.segment_start(start, &out, fold);
        match segment {
            Segment::System(_) => {}
            Segment::User(turn) => {
                for block in &turn.blocks {
                    if ctx.adapter.represents(block.body.kind()) {
                        push(
                            &mut out,
                            &mut fold,
                            ctx,
                            ContentRole::User,
                            Item::Part {
                                block,
                                signature: None,
                            },
                        );
                    }
                }
            }
            Segment::Assistant { turn, results } => {
                let mut signature: Option<&str> = None;
                for block in &turn.blocks {
                    match reasoning_for(ctx.adapter, &block.body) {
                        Some(Reasoning::Omit { provider, reason }) => ctx.omit(block, provider, reason),
                        Some(Reasoning::Keep {
                            signature: Some(next),
                            ..
                        }) => {
                            if let Some(previous) = signature.replace(next) {
                                push(
                                    &mut out,
                                    &mut fold,
                                    ctx,
                                    ContentRole::Model,
                                    Item::SignatureOnly(previous),
                                );
                            }
                        }
                        Some(Reasoning::Keep { .. }) => {
                            ctx.omit(block, "gemini", "gemini_takes_signatures_only")
                        }
                        None => {
                            let signature = signature.take();
                            push(
                                &mut out,
                                &mut fold,
                                ctx,
                                ContentRole::Model,
                                Item::Part { block, signature },
                            );
                        }
                    }
                }
                if let Some(signature) = signature {
                    push(
                        &mut out,
                        &mut fold,
                        ctx,
                        ContentRole::Model,
                        Item::SignatureOnly(signature),
                    );
                }
                for result in results {
                    if let BlockBody::ToolResult { content, .. } = &result.body
                        && content.iter().any(|part| matches!(part, ResultPart::Image(_)))
                    {
                        ctx.pause(
                            Some(result),
                            "tool_result.image",
                            PauseReason::UnrepresentablePart,
                        );
                    }
                    push(
                        &mut out,
                        &mut fold,
                        ctx,
                        ContentRole::User,
                        Item::Response(result),
                    );
                }
            }
        }
    }
    let last = fold.open;
    close(&mut out, &mut fold);
    match last {
        None => ctx.pause(None, "contents", PauseReason::UnrepresentableSequence),
        Some(role) if role == ContentRole::Model as u8 => ctx.pause(
            None,
            "contents.last_model_turn",
            PauseReason::UnrepresentableSequence,
        ),
        Some(_) => {}
    }
    if fold.first_model_calls {
        ctx.pause(
            None,
            "contents.first_function_call_turn",
            PauseReason::UnrepresentableSequence,
        );
    }
    out.push(b']');
    let system: Vec<&Block> = ctx
        .system_turns(conversation, from)
        .into_iter()
        .flat_map(|turn| &turn.blocks)
        .collect();
    if !system.is_empty() {
        out.extend_from_slice(b",\"systemInstruction\":{\"parts\":[");
        for (index, block) in system.iter().enumerate() {
            if index > 0 {
                out.push(b',');
            }
            out.push(b'{');
            ctx.fragment(&mut out, TAG_PART, &block.digest, |w| part_fields(block, w));
            out.push(b'}');
        }
        out.extend_from_slice(b"]}");
        ctx.tokens += tokenizer.message_overhead();
    }
    if !conversation.tools.is_empty() {
        out.extend_from_slice(b",\"tools\":[{\"functionDeclarations\":[");
        ctx.fragment(&mut out, TAG_TOOLS, &conversation.toolset_digest, |w| {
            let start = w.out.len();
            for (index, tool) in conversation.tools.iter().enumerate() {
                if index > 0 {
                    w.raw(",");
                }
                w.raw("{\"name\":").string(&tool.name);
                if let Some(description) = &tool.description {
                    w.raw(",\"description\":").string(description);
                }
                w.raw(",\"parametersJsonSchema\":")
                    .canonical(&tool.input_schema)
                    .raw("}");
            }
            // Every byte the tools add to the request is counted, separators and the wrapper
            // around the list included (issue 17: the property test in
            // `tests/it/render_admission.rs` holds the charge against the inserted bytes).
            let written = String::from_utf8_lossy(&w.out[start..]).into_owned();
            let overhead = w.tokenizer.tools_overhead();
            w.count(&written).count(TOOLS_WRAPPER_TEXT).charge(overhead);
        });
        out.extend_from_slice(b"]}]");
    }
    // `toolConfig.functionCallingConfig` (table in `tool_choice.rs`).
    ctx.tool_choice_fields(crate::registry::Api::Gemini, &mut out);
    // The client's own Gemini-only fields (`safetySettings`, `labels`), same API only.
    ctx.passthrough_fields(crate::registry::Api::Gemini, &mut out);
    out.extend_from_slice(b",\"generationConfig\":{\"maxOutputTokens\":");
    out.extend_from_slice(options.max_output_tokens.to_string().as_bytes());
    // `generationConfig.{temperature, topP, topK, stopSequences, seed, presencePenalty,
    // frequencyPenalty}` (table in `sampling.rs`).
    options
        .sampling
        .write_fields(crate::registry::Api::Gemini, &mut out);
    // `responseMimeType`, `responseSchema` / `responseJsonSchema` (table in `output_format.rs`).
    ctx.output_format_fields(crate::registry::Api::Gemini, &mut out);
    ctx.passthrough_config_fields(crate::registry::Api::Gemini, &mut out);
    out.extend_from_slice(b"}}");
    ctx.tokens += tokenizer.request_overhead();
    let path = crate::registry::Api::Gemini.request_path(&options.model, options.stream);
    ctx.finish(Body { body: out, path }, HEADERS)
}

fn media(source: &MediaSource, w: &mut Writer) {
    match source {
        MediaSource::Base64 { media_type, data } => {
            w.raw("\"inlineData\":{\"mimeType\":")
                .string(media_type)
                .raw(",\"data\":")
                .string(data)
                .raw("}");
        }
        MediaSource::Url { url, media_type } => {
            w.raw("\"fileData\":{");
            if let Some(media_type) = media_type {
                w.raw("\"mimeType\":").string(media_type).raw(",");
            }
            w.raw("\"fileUri\":").string(url).raw("}");
        }
    }
}

/// The fields of one part, without the enclosing braces (a thought signature may be added).
fn part_fields(block: &Block, w: &mut Writer) {
    match &block.body {
        BlockBody::Text { text } => {
            w.raw("\"text\":").text(text);
        }
        BlockBody::Context { source, trust, text } => {
            let wrapped = wrap_context(source.as_deref(), *trust, text);
            w.raw("\"text\":").text(&wrapped);
        }
        BlockBody::Image { source } => {
            media(source, w);
            w.charge_image();
        }
        BlockBody::Document { source, .. } => {
            media(source, w);
            w.charge(tokens::document_tokens(inline_len(source)));
        }
        BlockBody::ToolCall { tool, arguments, .. } => {
            w.raw("\"functionCall\":{\"name\":").text(tool).raw(",\"args\":");
            match arguments {
                // Verbatim model JSON: validation parsed it as one complete object.
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
        _ => {}
    }
}

fn response_fields(block: &Block, w: &mut Writer) {
    let BlockBody::ToolResult {
        tool,
        status,
        content,
        ..
    } = &block.body
    else {
        return;
    };
    let key = match status {
        ResultStatus::Success => "output",
        ResultStatus::Error | ResultStatus::Cancel => "error",
    };
    w.raw("\"functionResponse\":{\"name\":")
        .text(tool)
        .raw(",\"response\":{\"")
        .raw(key)
        .raw("\":");
    let texts: Vec<&str> = status_note(*status)
        .filter(|_| *status == ResultStatus::Cancel)
        .into_iter()
        .chain(content.iter().filter_map(|part| match part {
            ResultPart::Text(text) => Some(text.as_str()),
            ResultPart::Image(_) => None,
        }))
        .collect();
    match texts.as_slice() {
        [] => {
            w.raw("\"\"");
        }
        [one] => {
            w.text(one);
        }
        many => {
            w.raw("[");
            for (index, text) in many.iter().enumerate() {
                if index > 0 {
                    w.raw(",");
                }
                w.text(text);
            }
            w.raw("]");
        }
    }
    w.raw("}}");
}
