//! OpenAI Chat Completions request → v1 document: the inverse of `openai_chat::render`, for
//! every version at once (a body does not say which produced it): `system` and `developer`,
//! `max_tokens` and `max_completion_tokens`, `file` parts are all accepted.
//!
//! Mapping (OpenAPI `CreateChatCompletionRequest` l.33105, `ChatCompletionRequestMessage`
//! l.31361):
//! - `system` / `developer` message → a system turn, wherever it stands: one after a
//!   non-system turn is the validator's `role_violation`, never moved;
//! - `user` → a user turn. Content string → one text block; parts: `text` → text,
//!   `image_url` → image (a `data:…;base64,` URL becomes inline data, anything else a URL),
//!   `file` with `file_data` → document (the data URL's media type; raw base64 is
//!   `application/pdf`, the only file type Chat takes), `filename` → title;
//! - `assistant` → an assistant turn (`generation` 1): content text parts (and `refusal`, as
//!   text: it is what the model said), then `tool_calls` in order as tool_call blocks whose
//!   `arguments` is the provider's raw string (so invalid JSON is the validator's
//!   `unclosed_arguments`), except `""`, which is the object `{}` as the stream assembler
//!   commits it. Chat cannot interleave text and calls, so text comes first;
//! - a run of consecutive `tool` messages → one tool turn, each a tool_result with `call_id` =
//!   `tool_call_id`, the envelope of the matched call, status `success` (Chat has no status
//!   field; a leading `[tool result status: error]` part stays text), content string → one
//!   text part (`""` → none), parts `text` → text, `image_url` → image;
//! - `tools[]{type: function, function{name, description, parameters}}` → v1 tools (no
//!   parameters → `{"type":"object"}`); `max_completion_tokens` (else `max_tokens`) →
//!   `max_output_tokens`; `stream` → stream;
//! - generation settings → [`crate::sampling::Sampling`]: `temperature`, `top_p`, `stop` (a
//!   string is one stop sequence, an array up to four), `seed`, `presence_penalty`,
//!   `frequency_penalty`, within the ranges of the spec (`invalid_request` outside them).
//!
//! Refused as `unrepresentable`: `n` > 1; `audio`, `modalities` other than `text`; the
//! deprecated `functions`, `function_call` and role `function`; `web_search_options`; tools or
//! tool calls of a type other than `function`; `input_audio` parts; `file_id` references;
//! assistant `audio`; any unknown content part type. Malformed (`invalid_request`): a missing
//! `model` / `messages` / `role` / `tool_call_id`, an unknown role, a field of the wrong type.
//! Carried in their own values: `tool_choice` and `parallel_tool_calls` (`tool_choice.rs`),
//! `response_format` (`output_format.rs`), and the Chat-only fields of `passthrough.rs`
//! (`reasoning_effort`, `service_tier`, `store`, `prompt_cache_key`, `logprobs`, `logit_bias`,
//! `metadata`, `user`, …), and per element (`passthrough::ElementField`): a tool's
//! `function.strict: true`, a message's `name` (system, developer, user, assistant), an image
//! `detail` other than `auto` (`low`, `high`; another value is `invalid_request`). Dropped and
//! reported: every other field (`stream_options`, which shapes our answer to the client and is
//! honoured there, `max_tokens` when `max_completion_tokens` is also given, …).

use crate::import::{Builder, Head, ImportError, Obj, ResultContent, Status, source_from_url, type_name};
use crate::passthrough::ElementKind;
use crate::sampling::Sampling;
use serde_json::{Map, Value};
use turnstile_core::conversation::{MediaSource, Role};

pub(crate) fn import(mut top: Obj, builder: &mut Builder) -> Result<Head, ImportError> {
    let model = top.required_string("model")?;
    let stream = top.bool("stream")?.unwrap_or(false);
    let max_completion_tokens = top.u64("max_completion_tokens")?;
    let max_tokens = top.u64("max_tokens")?;
    if max_completion_tokens.is_some() && max_tokens.is_some() {
        builder.drop_path("max_tokens".into());
    }
    match top.u64("n")? {
        None | Some(1) => {}
        Some(0) => return Err(ImportError::malformed("n", "n must be at least 1")),
        Some(_) => {
            return Err(ImportError::unrepresentable(
                "n",
                "n > 1 asks for several choices; a v1 assistant turn is one",
            ));
        }
    }
    top.refuse("functions", "the deprecated `functions` list")?;
    top.refuse("function_call", "the deprecated `function_call`")?;
    top.refuse("audio", "audio output")?;
    top.refuse("web_search_options", "server-side web search")?;
    if let Some(modalities) = top.array("modalities")? {
        for (path, _, value) in top.elements("modalities", modalities) {
            match value {
                Value::String(modality) if modality == "text" => {}
                Value::String(_) => {
                    return Err(ImportError::unrepresentable(
                        path,
                        "an output modality other than text",
                    ));
                }
                other => {
                    return Err(ImportError::malformed(
                        path,
                        format!("expected a string, found {}", type_name(&other)),
                    ));
                }
            }
        }
    }
    if let Some(tools) = top.array("tools")? {
        for (path, pattern, value) in top.elements("tools", tools) {
            tool(Obj::new(value, path, pattern)?, builder)?;
        }
    }
    let sampling = Sampling {
        temperature: top.f64("temperature")?,
        top_p: top.f64("top_p")?,
        stop: top.strings("stop", true)?,
        seed: top.i64("seed", false)?,
        presence_penalty: top.f64("presence_penalty")?,
        frequency_penalty: top.f64("frequency_penalty")?,
        ..Sampling::default()
    };
    let messages = top.required_array("messages")?;
    for (path, pattern, value) in top.elements("messages", messages) {
        message(Obj::new(value, path, pattern)?, builder)?;
    }
    let tool_choice = crate::tool_choice::read(crate::registry::Api::OpenaiChat, &mut top)?;
    let output_format = crate::output_format::read(crate::registry::Api::OpenaiChat, &mut top)?;
    let mut passthrough = crate::passthrough::Passthrough::default();
    crate::passthrough::read(crate::registry::Api::OpenaiChat, &mut top, &mut passthrough)?;
    passthrough.take_elements(
        crate::registry::Api::OpenaiChat,
        std::mem::take(&mut builder.elements),
    );
    top.finish(builder);
    Ok(Head {
        model,
        stream,
        max_output_tokens: max_completion_tokens.or(max_tokens),
        sampling,
        tool_choice,
        output_format,
        passthrough,
    })
}

fn tool(mut tool: Obj, builder: &mut Builder) -> Result<(), ImportError> {
    match tool.string("type")?.as_deref() {
        None | Some("function") => {}
        Some(other) => {
            return Err(ImportError::unrepresentable(
                tool.path_of("type"),
                format!("a {other:?} tool (v1 declares function tools only)"),
            ));
        }
    }
    let mut function = tool.required_object("function")?;
    let name = function.required_string("name")?;
    let description = function.string("description")?;
    let parameters = match function.take("parameters") {
        None => None,
        Some(schema @ Value::Object(_)) => Some(schema),
        Some(other) => {
            return Err(ImportError::malformed(
                function.path_of("parameters"),
                format!("expected an object, found {}", type_name(&other)),
            ));
        }
    };
    if function.bool("strict")? == Some(true) {
        builder.element(
            ElementKind::Strict,
            function.pattern_of("strict"),
            name.clone(),
            Value::Bool(true),
        );
    }
    let path = tool.path().to_owned();
    function.finish(builder);
    tool.finish(builder);
    builder.tool(name, description, parameters, &path)
}

fn message(mut message: Obj, builder: &mut Builder) -> Result<(), ImportError> {
    let role = message.required_string("role")?;
    let path = message.path().to_owned();
    // `name` (system, developer, user, assistant messages): carried on the turn it opens.
    let name = match role.as_str() {
        "tool" => None,
        _ => message
            .string("name")?
            .map(|name| (message.pattern_of("name"), name)),
    };
    match role.as_str() {
        "system" | "developer" => {
            builder.begin(Role::System, false, path);
            content(&mut message, Role::System, builder)?;
        }
        "user" => {
            builder.begin(Role::User, false, path);
            content(&mut message, Role::User, builder)?;
        }
        "assistant" => {
            builder.begin(Role::Assistant, false, path);
            assistant(&mut message, builder)?;
        }
        "tool" => {
            builder.begin(Role::Tool, true, path);
            tool_message(&mut message, builder)?;
        }
        "function" => {
            return Err(ImportError::unrepresentable(
                message.path_of("role"),
                "the deprecated function role",
            ));
        }
        other => {
            return Err(ImportError::malformed(
                message.path_of("role"),
                format!("unknown role {other:?}"),
            ));
        }
    }
    builder.end()?;
    if let Some((field, name)) = name {
        let turn = builder.last_turn_id();
        builder.element(ElementKind::Name, field, turn, Value::String(name));
    }
    message.finish(builder);
    Ok(())
}

/// `content` of a system, user or assistant message: a string or an array of parts.
fn content(message: &mut Obj, role: Role, builder: &mut Builder) -> Result<(), ImportError> {
    match message.take("content") {
        None => Ok(()),
        Some(Value::String(text)) => builder.text(role, text),
        Some(Value::Array(parts)) => {
            for (path, pattern, part) in message.elements("content", parts) {
                content_part(Obj::new(part, path, pattern)?, role, builder)?;
            }
            Ok(())
        }
        Some(other) => Err(ImportError::malformed(
            message.path_of("content"),
            format!(
                "expected a string or an array of parts, found {}",
                type_name(&other)
            ),
        )),
    }
}

fn content_part(mut part: Obj, role: Role, builder: &mut Builder) -> Result<(), ImportError> {
    let kind = part.required_string("type")?;
    match kind.as_str() {
        "text" => {
            let text = part.required_string("text")?;
            builder.text(role, text)?;
        }
        "refusal" => {
            let text = part.required_string("refusal")?;
            builder.text(role, text)?;
        }
        "image_url" => {
            let (source, detail) = image_url(&mut part, builder)?;
            builder.image_with_detail(role, source, detail)?;
        }
        "file" => {
            let mut file = part.required_object("file")?;
            file.refuse("file_id", "a file_id reference to a file stored at OpenAI")?;
            let data = file.required_string("file_data")?;
            let title = file.string("filename")?;
            file.finish(builder);
            let source = match source_from_url(data.clone(), None) {
                inline @ MediaSource::Base64 { .. } => inline,
                MediaSource::Url { .. } => MediaSource::Base64 {
                    media_type: "application/pdf".into(),
                    data,
                },
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

/// The `image_url` object of a part, with its `detail` (field path and value) when it is not
/// `auto`.
fn image_url(
    part: &mut Obj,
    builder: &mut Builder,
) -> Result<(MediaSource, Option<(String, String)>), ImportError> {
    let mut image = part.required_object("image_url")?;
    let url = image.required_string("url")?;
    let detail = match image.string("detail")?.as_deref() {
        None | Some("auto") => None,
        Some(detail @ ("low" | "high")) => Some((image.pattern_of("detail"), detail.to_owned())),
        Some(other) => {
            return Err(ImportError::malformed(
                image.path_of("detail"),
                format!("unknown image detail {other:?} (auto, low or high)"),
            ));
        }
    };
    image.finish(builder);
    Ok((source_from_url(url, None), detail))
}

fn assistant(message: &mut Obj, builder: &mut Builder) -> Result<(), ImportError> {
    message.refuse("audio", "a reference to an earlier audio response")?;
    message.refuse("function_call", "the deprecated function_call")?;
    content(message, Role::Assistant, builder)?;
    if let Some(refusal) = message.string("refusal")? {
        builder.text(Role::Assistant, refusal)?;
    }
    let Some(calls) = message.array("tool_calls")? else {
        return Ok(());
    };
    for (path, pattern, value) in message.elements("tool_calls", calls) {
        let mut call = Obj::new(value, path, pattern)?;
        match call.string("type")?.as_deref() {
            None | Some("function") => {}
            Some(other) => {
                return Err(ImportError::unrepresentable(
                    call.path_of("type"),
                    format!("a {other:?} tool call"),
                ));
            }
        }
        let call_id = call.required_string("id")?;
        let mut function = call.required_object("function")?;
        let name = function.required_string("name")?;
        let arguments = match function.required("arguments")? {
            Value::String(text) if text.is_empty() => Value::Object(Map::new()),
            text @ Value::String(_) => text,
            other => {
                return Err(ImportError::malformed(
                    function.path_of("arguments"),
                    format!("expected a string, found {}", type_name(&other)),
                ));
            }
        };
        function.finish(builder);
        call.finish(builder);
        builder.tool_call(Role::Assistant, call_id, name, arguments)?;
    }
    Ok(())
}

fn tool_message(message: &mut Obj, builder: &mut Builder) -> Result<(), ImportError> {
    let call_id = message.required_string("tool_call_id")?;
    let content = match message.required("content")? {
        Value::String(text) if text.is_empty() => Vec::new(),
        Value::String(text) => vec![ResultContent::Text(text)],
        Value::Array(parts) => {
            let mut content = Vec::with_capacity(parts.len());
            for (path, pattern, part) in message.elements("content", parts) {
                let mut part = Obj::new(part, path, pattern)?;
                let kind = part.required_string("type")?;
                match kind.as_str() {
                    "text" => content.push(ResultContent::Text(part.required_string("text")?)),
                    "image_url" => {
                        let (source, detail) = image_url(&mut part, builder)?;
                        if detail.is_some() {
                            // A tool message's image has no place to carry it (Chat answers
                            // such a result with a pause anyway).
                            return Err(ImportError::unrepresentable(
                                part.path_of("image_url.detail"),
                                "an image detail on a tool message's image",
                            ));
                        }
                        content.push(ResultContent::Image(source));
                    }
                    other => {
                        return Err(ImportError::unrepresentable(
                            part.path_of("type"),
                            format!("tool message part type {other:?}"),
                        ));
                    }
                }
                part.finish(builder);
            }
            content
        }
        other => {
            return Err(ImportError::malformed(
                message.path_of("content"),
                format!(
                    "expected a string or an array of parts, found {}",
                    type_name(&other)
                ),
            ));
        }
    };
    builder.tool_result(Role::Tool, call_id, None, Status::Success, content)
}
