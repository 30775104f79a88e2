//! Anthropic Messages request → v1 document: the inverse of `anthropic_messages::render`, for
//! both versions (`document` blocks are accepted whichever version rendered the body).
//!
//! Mapping (Anthropic "Messages" API reference and "Tool use" guide):
//! - top-level `system` (a string, or `text` blocks) → a system turn first, one text block per
//!   system block;
//! - each message → its turns in order. A `user` message holding `tool_result` blocks splits:
//!   a run of consecutive `tool_result` blocks is a tool turn, the other blocks a user turn, in
//!   their order (so text after the results becomes the user turn that follows, and results
//!   after text stay after it, where the validator judges them). Consecutive messages of one
//!   role stay separate turns (both are legal v1; Anthropic merges them itself);
//! - user blocks: `text` → text; `image` (`base64` or `url` source) → image; `document` →
//!   document (`base64` source with its media type, a `text` source as base64 `text/plain`,
//!   `url`), `title` → title;
//! - `tool_result` → tool_result: `call_id` = `tool_use_id`, the envelope of the matched call,
//!   status `error` when `is_error: true` else `success`, content string → one text part
//!   (`""` → none), blocks `text` → text, `image` → image;
//! - assistant blocks (the turn has `generation` 1): `text` → text; `tool_use` → tool_call
//!   with `input` as the arguments object; `thinking` → reasoning (provider `anthropic`,
//!   `signature`, the thinking text unless empty); `redacted_thinking` → reasoning with
//!   `encrypted` = `data`;
//! - `tools[]{name, description, input_schema}` (no `type`, or `type: "custom"`) → v1 tools;
//!   `max_tokens`, `stream`;
//! - generation settings → [`crate::sampling::Sampling`]: `temperature` (0–1), `top_p`,
//!   `top_k`, `stop_sequences`.
//!
//! Refused as `unrepresentable`: server tools (any tool `type` but `custom`), server-tool and
//! MCP blocks (`server_tool_use`, `web_search_tool_result`, `mcp_tool_use`, …), `file` sources,
//! `content` document sources, `search_result` and `container_upload` blocks, any other unknown
//! block type, documents or images inside a tool result other than images, `mcp_servers`,
//! `container`. `cache_control` on a system block, content block, tool result (or its last
//! part) or tool → the v1 `cache` breakpoint of that block or tool (`cache.rs`). Dropped and
//! reported: every other field (`citations`, document `context`, …).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - an Anthropic `thread` (or other server-side state we do not hold) is refused by name and
//!   nothing is sent; the SDK falls back to the whole history. Enforced in
//!   `adapters/src/anthropic_messages/import.rs` (`ImportError::ThreadUnsupported`),
//!   `proxy/mod.rs::serve_ours` (`details.error_code`). Tests:
//!   `gateway/tests/it/proxy.rs::an_anthropic_thread_is_refused…`,
//!   `tests/sdk/proxy_sdk.py::anthropic_tool_runner`.

use crate::import::{Builder, Head, ImportError, Obj, ResultContent, Status, base64_encode, type_name};
use crate::sampling::Sampling;
use serde_json::Value;
use turnstile_core::conversation::{MediaSource, Role};

pub(crate) fn import(mut top: Obj, builder: &mut Builder) -> Result<Head, ImportError> {
    top.refuse(
        "mcp_servers",
        "MCP servers called by Anthropic (server-side tools)",
    )?;
    top.refuse("container", "a code-execution container (server-side state)")?;
    top.refuse(
        "context_management",
        "context edits applied by Anthropic (server-side state)",
    )?;
    if top.has("thread") {
        return Err(ImportError::ThreadUnsupported {
            path: "thread".into(),
        });
    }
    let model = top.required_string("model")?;
    let stream = top.bool("stream")?.unwrap_or(false);
    let max_output_tokens = top.u64("max_tokens")?;
    let sampling = Sampling {
        temperature: top.f64("temperature")?,
        top_p: top.f64("top_p")?,
        top_k: top.count("top_k", false)?,
        stop: top.strings("stop_sequences", false)?,
        ..Sampling::default()
    };
    if let Some(tools) = top.array("tools")? {
        for (path, pattern, value) in top.elements("tools", tools) {
            tool(Obj::new(value, path, pattern)?, builder)?;
        }
    }
    match top.take("system") {
        None => {}
        Some(Value::String(text)) => {
            builder.begin(Role::System, false, "system".into());
            builder.text(Role::System, text)?;
            builder.end()?;
        }
        Some(Value::Array(blocks)) => {
            builder.begin(Role::System, false, "system".into());
            for (path, pattern, value) in top.elements("system", blocks) {
                let mut block = Obj::new(value, path, pattern)?;
                let kind = block.required_string("type")?;
                if kind != "text" {
                    return Err(ImportError::unrepresentable(
                        block.path_of("type"),
                        format!("system block type {kind:?}"),
                    ));
                }
                let text = block.required_string("text")?;
                let mark = cache_control(&mut block, builder)?;
                block.finish(builder);
                builder.text(Role::System, text)?;
                if let Some(mark) = mark {
                    builder.mark_last_block(mark);
                }
            }
            builder.end()?;
        }
        Some(other) => {
            return Err(ImportError::malformed(
                "system",
                format!(
                    "expected a string or an array of text blocks, found {}",
                    type_name(&other)
                ),
            ));
        }
    }
    let messages = top.required_array("messages")?;
    for (path, pattern, value) in top.elements("messages", messages) {
        message(Obj::new(value, path, pattern)?, builder)?;
    }
    let tool_choice = crate::tool_choice::read(crate::registry::Api::AnthropicMessages, &mut top)?;
    let output_format = crate::output_format::read(crate::registry::Api::AnthropicMessages, &mut top)?;
    let mut passthrough = crate::passthrough::Passthrough::default();
    crate::passthrough::read(
        crate::registry::Api::AnthropicMessages,
        &mut top,
        &mut passthrough,
    )?;
    top.finish(builder);
    Ok(Head {
        model,
        stream,
        max_output_tokens,
        sampling,
        tool_choice,
        output_format,
        passthrough,
    })
}

fn tool(mut tool: Obj, builder: &mut Builder) -> Result<(), ImportError> {
    match tool.string("type")?.as_deref() {
        None | Some("custom") => {}
        Some(other) => {
            return Err(ImportError::unrepresentable(
                tool.path_of("type"),
                format!("the server tool {other:?} (v1 declares client tools only)"),
            ));
        }
    }
    let name = tool.required_string("name")?;
    let description = tool.string("description")?;
    let schema = match tool.required("input_schema")? {
        schema @ Value::Object(_) => schema,
        other => {
            return Err(ImportError::malformed(
                tool.path_of("input_schema"),
                format!("expected an object, found {}", type_name(&other)),
            ));
        }
    };
    let mark = cache_control(&mut tool, builder)?;
    let path = tool.path().to_owned();
    tool.finish(builder);
    builder.tool(name, description, Some(schema), &path)?;
    if let Some(mark) = mark {
        builder.mark_last_tool(mark);
    }
    Ok(())
}

/// A block's (or tool's) `cache_control` as a v1 `cache` breakpoint: `{"type": "ephemeral",
/// "ttl"?: "5m" | "1h"}` → `{"ttl"?}`. Another type is `unrepresentable`, another TTL
/// malformed (Anthropic answers 400 to it).
fn cache_control(obj: &mut Obj, builder: &mut Builder) -> Result<Option<Value>, ImportError> {
    let path = obj.path_of("cache_control");
    let pattern = obj.pattern_of("cache_control");
    let mut control = match obj.take("cache_control") {
        None | Some(Value::Null) => return Ok(None),
        Some(value) => Obj::new(value, path, pattern)?,
    };
    let kind = control.required_string("type")?;
    if kind != "ephemeral" {
        return Err(ImportError::unrepresentable(
            control.path_of("type"),
            format!("cache_control type {kind:?}"),
        ));
    }
    let mut mark = serde_json::Map::new();
    match control.string("ttl")?.as_deref() {
        None => {}
        Some(ttl @ ("5m" | "1h")) => {
            mark.insert("ttl".into(), ttl.into());
        }
        Some(other) => {
            return Err(ImportError::malformed(
                control.path_of("ttl"),
                format!("cache_control ttl {other:?} is not \"5m\" or \"1h\""),
            ));
        }
    }
    control.finish(builder);
    Ok(Some(Value::Object(mark)))
}

fn message(mut message: Obj, builder: &mut Builder) -> Result<(), ImportError> {
    let role = match message.required_string("role")?.as_str() {
        "user" => Role::User,
        "assistant" => Role::Assistant,
        other => {
            return Err(ImportError::malformed(
                message.path_of("role"),
                format!("unknown role {other:?}"),
            ));
        }
    };
    builder.begin(role, false, message.path().to_owned());
    match message.required("content")? {
        Value::String(text) => builder.text(role, text)?,
        Value::Array(blocks) => {
            for (path, pattern, value) in message.elements("content", blocks) {
                block(Obj::new(value, path, pattern)?, role, builder)?;
            }
        }
        other => {
            return Err(ImportError::malformed(
                message.path_of("content"),
                format!(
                    "expected a string or an array of blocks, found {}",
                    type_name(&other)
                ),
            ));
        }
    }
    builder.end()?;
    message.finish(builder);
    Ok(())
}

fn block(mut block: Obj, role: Role, builder: &mut Builder) -> Result<(), ImportError> {
    let kind = block.required_string("type")?;
    let mut mark = cache_control(&mut block, builder)?;
    match kind.as_str() {
        "text" => {
            let text = block.required_string("text")?;
            builder.text(role, text)?;
        }
        "image" => {
            let source = source(&mut block, builder)?;
            builder.image(role, source)?;
        }
        "document" => {
            let source = source(&mut block, builder)?;
            let title = block.string("title")?;
            builder.document(role, source, title)?;
        }
        "tool_result" => {
            // A tool result is a tool turn, whatever message carried it.
            let call_id = block.required_string("tool_use_id")?;
            let status = match block.bool("is_error")? {
                Some(true) => Status::Error,
                _ => Status::Success,
            };
            let (content, part_mark) = result_content(&mut block, builder)?;
            // A breakpoint on a result's last part caches the same prefix as one on the result.
            mark = mark.or(part_mark);
            builder.tool_result(Role::Tool, call_id, None, status, content)?;
        }
        "tool_use" => {
            let call_id = block.required_string("id")?;
            let name = block.required_string("name")?;
            let input = match block.required("input")? {
                input @ Value::Object(_) => input,
                other => {
                    return Err(ImportError::malformed(
                        block.path_of("input"),
                        format!("expected an object, found {}", type_name(&other)),
                    ));
                }
            };
            builder.tool_call(role, call_id, name, input)?;
        }
        "thinking" => {
            let signature = block.required_string("signature")?;
            let text = block.string("thinking")?.filter(|text| !text.is_empty());
            builder.reasoning(role, "anthropic", Some(signature), None, text)?;
        }
        "redacted_thinking" => {
            let data = block.required_string("data")?;
            builder.reasoning(role, "anthropic", None, Some(data), None)?;
        }
        other => {
            return Err(ImportError::unrepresentable(
                block.path_of("type"),
                format!("content block type {other:?}"),
            ));
        }
    }
    block.finish(builder);
    if let Some(mark) = mark {
        builder.mark_last_block(mark);
    }
    Ok(())
}

/// The `source` of an image or document block.
fn source(block: &mut Obj, builder: &mut Builder) -> Result<MediaSource, ImportError> {
    let mut source = block.required_object("source")?;
    let kind = source.required_string("type")?;
    let media = match kind.as_str() {
        "base64" => MediaSource::Base64 {
            media_type: source.required_string("media_type")?,
            data: source.required_string("data")?,
        },
        "url" => MediaSource::Url {
            url: source.required_string("url")?,
            media_type: None,
        },
        "text" => {
            let media_type = source.string("media_type")?;
            if let Some(media_type) = media_type.as_deref()
                && !media_type.starts_with("text/plain")
            {
                return Err(ImportError::malformed(
                    source.path_of("media_type"),
                    "a text source is text/plain",
                ));
            }
            let text = source.required_string("data")?;
            MediaSource::Base64 {
                media_type: "text/plain".into(),
                data: base64_encode(text.as_bytes()),
            }
        }
        "file" => {
            return Err(ImportError::unrepresentable(
                source.path_of("type"),
                "a file_id reference to a file stored at Anthropic",
            ));
        }
        other => {
            return Err(ImportError::unrepresentable(
                source.path_of("type"),
                format!("source type {other:?}"),
            ));
        }
    };
    source.finish(builder);
    Ok(media)
}

/// A result's content parts, and the breakpoint on its last part (a breakpoint on any other
/// part marks a prefix that ends inside the result, which v1 cannot place: `unrepresentable`).
fn result_content(
    block: &mut Obj,
    builder: &mut Builder,
) -> Result<(Vec<ResultContent>, Option<Value>), ImportError> {
    match block.take("content") {
        None => Ok((Vec::new(), None)),
        Some(Value::String(text)) if text.is_empty() => Ok((Vec::new(), None)),
        Some(Value::String(text)) => Ok((vec![ResultContent::Text(text)], None)),
        Some(Value::Array(parts)) => {
            let mut content = Vec::with_capacity(parts.len());
            let mut last_mark = None;
            let count = parts.len();
            for (index, (path, pattern, part)) in block.elements("content", parts).into_iter().enumerate() {
                let mut part = Obj::new(part, path, pattern)?;
                let kind = part.required_string("type")?;
                if let Some(mark) = cache_control(&mut part, builder)? {
                    if index + 1 != count {
                        return Err(ImportError::unrepresentable(
                            part.path_of("cache_control"),
                            "a cache breakpoint inside a tool result before its last part",
                        ));
                    }
                    last_mark = Some(mark);
                }
                match kind.as_str() {
                    "text" => content.push(ResultContent::Text(part.required_string("text")?)),
                    "image" => content.push(ResultContent::Image(source(&mut part, builder)?)),
                    other => {
                        return Err(ImportError::unrepresentable(
                            part.path_of("type"),
                            format!("tool result block type {other:?} (v1 results hold text and images)"),
                        ));
                    }
                }
                part.finish(builder);
            }
            Ok((content, last_mark))
        }
        Some(other) => Err(ImportError::malformed(
            block.path_of("content"),
            format!(
                "expected a string or an array of blocks, found {}",
                type_name(&other)
            ),
        )),
    }
}
