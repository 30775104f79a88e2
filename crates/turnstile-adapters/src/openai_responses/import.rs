//! OpenAI Responses request → v1 document: the inverse of `openai_responses::v1::render`.
//! Stateless only: the request must carry the whole history in `input`.
//!
//! Mapping (OpenAPI `CreateResponse` l.36274, `InputItem` l.42322):
//! - `instructions` (a non-empty string) → a system turn first;
//! - `input` as a string → one user turn with one text block;
//! - `message` items (with or without `type`): roles `system` / `developer` → a system turn
//!   (wherever it stands: a late one is the validator's `role_violation`), `user` → a user
//!   turn, `assistant` → an assistant turn. Content string → one text block; parts
//!   `input_text` / `output_text` → text, `refusal` → text, `input_image` → image (data URL →
//!   inline), `input_file` → document (`file_data` data URL or `file_url`; `filename` → title);
//! - `reasoning` items → a reasoning block, provider `openai`, `signature` = the item id
//!   (`rs_…`), `encrypted` = `encrypted_content`, text = its one `summary_text` (several summary
//!   parts cannot be one v1 text without joining them: the text is left out and `input[].summary`
//!   reported as dropped);
//! - `function_call` items → tool_call blocks (`call_id`, `name`, raw `arguments` string; `""`
//!   is `{}`);
//! - consecutive assistant messages, reasoning and function_call items are ONE assistant turn
//!   (`generation` 1), in item order: that is how one assistant turn renders;
//! - consecutive `function_call_output` items → one tool turn; each a tool_result with the
//!   envelope of the call with its `call_id`, status `success` (no status field: a leading
//!   status note part stays text), `output` string → one text part (`""` → none) or parts
//!   `input_text` → text, `input_image` → image;
//! - `tools[]{type: function, name, description, parameters}` → v1 tools;
//!   `max_output_tokens`, `stream`;
//! - generation settings → [`crate::sampling::Sampling`]: `temperature`, `top_p` (the only two
//!   `CreateResponse` has), within the spec's ranges.
//!
//! Refused as `unrepresentable`: `previous_response_id`, `conversation`, `prompt` (stored
//! server-side state: this gateway is stateless), `item_reference` items, every other item type
//! (hosted tool calls, computer use, MCP, custom tools, …), non-function tools, `input_audio`,
//! `file_id` references, files inside tool outputs, unknown part types. Dropped and reported:
//! every other field (`top_logprobs`, `tool_choice`, `parallel_tool_calls`,
//! `reasoning`, `text`, `include`, `store`, `truncation`, `metadata`, `user`, `background`,
//! item `id` / `status` (identifiers of input items:
//! docs/decisions/0058-client-only-request-fields-carried-to-their-own-api.md), non-empty
//! `annotations`, …). Carried per element (`passthrough::ElementField`): a tool's `strict: true`,
//! an `input_image` `detail` other than `auto` (`low`, `high`, `original`); on a
//! `function_call_output` image it is `unrepresentable`.

use crate::import::{Builder, Head, ImportError, Obj, ResultContent, Status, source_from_url, type_name};
use crate::sampling::Sampling;
use serde_json::{Map, Value};
use turnstile_core::conversation::{MediaSource, Role};

pub(crate) fn import(mut top: Obj, builder: &mut Builder) -> Result<Head, ImportError> {
    top.refuse(
        "previous_response_id",
        "previous_response_id continues history stored at OpenAI; send the whole history in input",
    )?;
    top.refuse("conversation", "a conversation stored at OpenAI")?;
    top.refuse("prompt", "a prompt template stored at OpenAI")?;
    let model = top.required_string("model")?;
    let stream = top.bool("stream")?.unwrap_or(false);
    let max_output_tokens = top.u64("max_output_tokens")?;
    let sampling = Sampling {
        temperature: top.f64("temperature")?,
        top_p: top.f64("top_p")?,
        ..Sampling::default()
    };
    if let Some(tools) = top.array("tools")? {
        for (path, pattern, value) in top.elements("tools", tools) {
            tool(Obj::new(value, path, pattern)?, builder)?;
        }
    }
    if let Some(instructions) = top.string("instructions")?
        && !instructions.is_empty()
    {
        builder.begin(Role::System, false, "instructions".into());
        builder.text(Role::System, instructions)?;
        builder.end()?;
    }
    match top.required("input")? {
        Value::String(text) => {
            builder.begin(Role::User, false, "input".into());
            builder.text(Role::User, text)?;
            builder.end()?;
        }
        Value::Array(items) => {
            for (path, pattern, value) in top.elements("input", items) {
                item(Obj::new(value, path, pattern)?, builder)?;
            }
        }
        other => {
            return Err(ImportError::malformed(
                "input",
                format!(
                    "expected a string or an array of items, found {}",
                    type_name(&other)
                ),
            ));
        }
    }
    let tool_choice = crate::tool_choice::read(crate::registry::Api::OpenaiResponses, &mut top)?;
    let output_format = crate::output_format::read(crate::registry::Api::OpenaiResponses, &mut top)?;
    let mut passthrough = crate::passthrough::Passthrough::default();
    crate::passthrough::read(crate::registry::Api::OpenaiResponses, &mut top, &mut passthrough)?;
    crate::passthrough::read_responses_include(&mut top, &mut passthrough)?;
    passthrough.take_elements(
        crate::registry::Api::OpenaiResponses,
        std::mem::take(&mut builder.elements),
    );
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
    let kind = tool.required_string("type")?;
    if kind != "function" {
        return Err(ImportError::unrepresentable(
            tool.path_of("type"),
            format!("a {kind:?} tool (v1 declares function tools only)"),
        ));
    }
    let name = tool.required_string("name")?;
    let description = tool.string("description")?;
    let parameters = match tool.take("parameters") {
        None => None,
        Some(schema @ Value::Object(_)) => Some(schema),
        Some(other) => {
            return Err(ImportError::malformed(
                tool.path_of("parameters"),
                format!("expected an object, found {}", type_name(&other)),
            ));
        }
    };
    if tool.bool("strict")? == Some(true) {
        builder.element(
            crate::passthrough::ElementKind::Strict,
            tool.pattern_of("strict"),
            name.clone(),
            Value::Bool(true),
        );
    }
    let path = tool.path().to_owned();
    tool.finish(builder);
    builder.tool(name, description, parameters, &path)
}

fn item(mut item: Obj, builder: &mut Builder) -> Result<(), ImportError> {
    let kind = match item.string("type")? {
        Some(kind) => kind,
        // `EasyInputMessage` may leave out its type.
        None if item.has("role") => "message".into(),
        None => {
            return Err(ImportError::malformed(
                item.path_of("type"),
                "required field is missing",
            ));
        }
    };
    let path = item.path().to_owned();
    match kind.as_str() {
        "message" => message(&mut item, builder, path)?,
        "function_call" => {
            builder.begin(Role::Assistant, true, path);
            let call_id = item.required_string("call_id")?;
            let name = item.required_string("name")?;
            let arguments = match item.required("arguments")? {
                Value::String(text) if text.is_empty() => Value::Object(Map::new()),
                text @ Value::String(_) => text,
                other => {
                    return Err(ImportError::malformed(
                        item.path_of("arguments"),
                        format!("expected a string, found {}", type_name(&other)),
                    ));
                }
            };
            builder.tool_call(Role::Assistant, call_id, name, arguments)?;
            builder.end()?;
        }
        "function_call_output" => {
            builder.begin(Role::Tool, true, path);
            let call_id = item.required_string("call_id")?;
            let content = output(&mut item, builder)?;
            builder.tool_result(Role::Tool, call_id, None, Status::Success, content)?;
            builder.end()?;
        }
        "reasoning" => {
            builder.begin(Role::Assistant, true, path);
            reasoning(&mut item, builder)?;
            builder.end()?;
        }
        "item_reference" => {
            return Err(ImportError::unrepresentable(
                item.path_of("type"),
                "an item_reference to an item stored at OpenAI",
            ));
        }
        other => {
            return Err(ImportError::unrepresentable(
                item.path_of("type"),
                format!("input item type {other:?}"),
            ));
        }
    }
    item.finish(builder);
    Ok(())
}

fn message(item: &mut Obj, builder: &mut Builder, path: String) -> Result<(), ImportError> {
    let role = item.required_string("role")?;
    let (role, merge) = match role.as_str() {
        "system" | "developer" => (Role::System, false),
        "user" => (Role::User, false),
        "assistant" => (Role::Assistant, true),
        other => {
            return Err(ImportError::malformed(
                item.path_of("role"),
                format!("unknown role {other:?}"),
            ));
        }
    };
    builder.begin(role, merge, path);
    match item.required("content")? {
        Value::String(text) => builder.text(role, text)?,
        Value::Array(parts) => {
            for (path, pattern, part) in item.elements("content", parts) {
                content_part(Obj::new(part, path, pattern)?, role, builder)?;
            }
        }
        other => {
            return Err(ImportError::malformed(
                item.path_of("content"),
                format!(
                    "expected a string or an array of parts, found {}",
                    type_name(&other)
                ),
            ));
        }
    }
    builder.end()
}

fn content_part(mut part: Obj, role: Role, builder: &mut Builder) -> Result<(), ImportError> {
    let kind = part.required_string("type")?;
    match kind.as_str() {
        "input_text" | "output_text" => {
            let text = part.required_string("text")?;
            builder.text(role, text)?;
        }
        "refusal" => {
            let text = part.required_string("refusal")?;
            builder.text(role, text)?;
        }
        "input_image" => {
            let (source, detail) = input_image(&mut part)?;
            builder.image_with_detail(role, source, detail)?;
        }
        "input_file" => {
            part.refuse("file_id", "a file_id reference to a file stored at OpenAI")?;
            let title = part.string("filename")?;
            let source = match (part.string("file_data")?, part.string("file_url")?) {
                (Some(data), None) => match source_from_url(data.clone(), None) {
                    inline @ MediaSource::Base64 { .. } => inline,
                    MediaSource::Url { .. } => MediaSource::Base64 {
                        media_type: "application/pdf".into(),
                        data,
                    },
                },
                (None, Some(url)) => source_from_url(url, None),
                _ => {
                    return Err(ImportError::malformed(
                        part.path(),
                        "an input_file needs exactly one of file_data and file_url",
                    ));
                }
            };
            builder.document(role, source, title)?;
        }
        "input_audio" => {
            return Err(ImportError::unrepresentable(part.path_of("type"), "audio input"));
        }
        other => {
            return Err(ImportError::unrepresentable(
                part.path_of("type"),
                format!("content part type {other:?}"),
            ));
        }
    }
    part.finish(builder);
    Ok(())
}

/// An `input_image` part: `image_url` (a data URL is inline data), with its `detail` (field
/// path and value) when it is not `auto`; a `file_id` is refused.
fn input_image(part: &mut Obj) -> Result<(MediaSource, Option<(String, String)>), ImportError> {
    part.refuse("file_id", "a file_id reference to a file stored at OpenAI")?;
    let url = part.required_string("image_url")?;
    let detail = match part.string("detail")?.as_deref() {
        None | Some("auto") => None,
        Some(detail @ ("low" | "high" | "original")) => Some((part.pattern_of("detail"), detail.to_owned())),
        Some(other) => {
            return Err(ImportError::malformed(
                part.path_of("detail"),
                format!("unknown image detail {other:?} (auto, low, high or original)"),
            ));
        }
    };
    Ok((source_from_url(url, None), detail))
}

fn output(item: &mut Obj, builder: &mut Builder) -> Result<Vec<ResultContent>, ImportError> {
    match item.required("output")? {
        Value::String(text) if text.is_empty() => Ok(Vec::new()),
        Value::String(text) => Ok(vec![ResultContent::Text(text)]),
        Value::Array(parts) => {
            let mut content = Vec::with_capacity(parts.len());
            for (path, pattern, part) in item.elements("output", parts) {
                let mut part = Obj::new(part, path, pattern)?;
                let kind = part.required_string("type")?;
                match kind.as_str() {
                    "input_text" => content.push(ResultContent::Text(part.required_string("text")?)),
                    "input_image" => {
                        let (source, detail) = input_image(&mut part)?;
                        if detail.is_some() {
                            // A result's image is part of one v1 tool_result block: no place
                            // to carry it.
                            return Err(ImportError::unrepresentable(
                                part.path_of("detail"),
                                "an image detail on a function_call_output image",
                            ));
                        }
                        content.push(ResultContent::Image(source));
                    }
                    other => {
                        return Err(ImportError::unrepresentable(
                            part.path_of("type"),
                            format!("tool output part type {other:?} (v1 results hold text and images)"),
                        ));
                    }
                }
                part.finish(builder);
            }
            Ok(content)
        }
        other => Err(ImportError::malformed(
            item.path_of("output"),
            format!(
                "expected a string or an array of parts, found {}",
                type_name(&other)
            ),
        )),
    }
}

fn reasoning(item: &mut Obj, builder: &mut Builder) -> Result<(), ImportError> {
    let id = item.string("id")?;
    let encrypted = item.string("encrypted_content")?;
    if id.is_none() && encrypted.is_none() {
        return Err(ImportError::malformed(
            item.path_of("id"),
            "a reasoning item needs its id or encrypted_content",
        ));
    }
    let mut text = None;
    if let Some(summary) = item.array("summary")? {
        let count = summary.len();
        for (path, pattern, part) in item.elements("summary", summary) {
            let mut part = Obj::new(part, path, pattern)?;
            let kind = part.required_string("type")?;
            if kind != "summary_text" {
                return Err(ImportError::unrepresentable(
                    part.path_of("type"),
                    format!("reasoning summary part type {kind:?}"),
                ));
            }
            let summary_text = part.required_string("text")?;
            part.finish(builder);
            if count == 1 {
                text = Some(summary_text);
            }
        }
        if count > 1 {
            builder.drop_path(item.pattern_of("summary"));
        }
    }
    builder.reasoning(Role::Assistant, "openai", id, encrypted, text)
}
