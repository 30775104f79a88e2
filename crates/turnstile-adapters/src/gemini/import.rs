//! Gemini `generateContent` / `streamGenerateContent` request → v1 document: the inverse of
//! `gemini::v1::render`. The model and the method are in the URL path, so the caller passes
//! them ([`crate::import::GeminiCall`]). Field names are read in `camelCase` and in the
//! `snake_case` the REST API also accepts (both spellings of one field at once is malformed).
//!
//! Mapping (Gemini API reference `models.generateContent`, "Function calling" guide):
//! - `systemInstruction.parts` → a system turn first, one block per part;
//! - each content → its turns in order: role `user` (or absent, or the legacy `function`) → a
//!   user turn, `model` → an assistant turn (`generation` 1). A user content holding
//!   `functionResponse` parts splits like an Anthropic one: a run of responses is a tool turn,
//!   other parts a user turn, in their order;
//! - parts: `text` → text; `inlineData` / `fileData` → image for `image/*` (and for
//!   `fileData` without a `mimeType`), document for any other type but audio and video;
//!   `thought: true` with a `thoughtSignature` → reasoning (provider `gemini`, the signature,
//!   the thought text); a `thoughtSignature` on any other part → a reasoning block with that
//!   signature right before the part's own block (the decoder's and renderer's convention); an
//!   empty text part that only carries a signature → just the reasoning block;
//! - `functionCall` → tool_call with `args` as the arguments object (absent → `{}`); its call
//!   id is the part's `id` when given, else `gemini-{turn id}-{n}` (n counts the calls of that
//!   turn from 0, as the decoder counts the calls of a response): deterministic, unique;
//! - `functionResponse` → tool_result matched by `id` when given, else by name, in order, to the
//!   first unanswered call of that name in the assistant turn right before the run of tool
//!   turns; a second response for an answered call takes that call's id (the validator says
//!   `duplicate_result`); one with no call of its name gets `gemini-orphan-{n}` (the validator
//!   says `orphan_result`). `response: {"output": X}` → status `success`, `{"error": X}` →
//!   status `error`, where X a string → one text part (`""` → none), an array of strings → one
//!   text part each, anything else → its canonical JSON text; any other `response` object →
//!   `success` with the object's canonical JSON text as the one part (v1 results hold text);
//! - `tools[].functionDeclarations[]{name, description, parametersJsonSchema | parameters}` →
//!   v1 tools (the schema as given); `generationConfig.maxOutputTokens` → `max_output_tokens`;
//! - `generationConfig.{temperature, topP, topK, stopSequences, seed, presencePenalty,
//!   frequencyPenalty}` (either spelling) → [`crate::sampling::Sampling`]; `topK` and `seed`
//!   also as integral floats (`40.0`), as protobuf's JSON parser takes them.
//!
//! Refused as `unrepresentable`: `cachedContent` (server-side state); tools other than function
//! declarations (`googleSearch`, `codeExecution`, `urlContext`, …, even when empty: `{}`
//! switches them on); `candidateCount` > 1; `responseModalities` other than text; audio and
//! video data; `executableCode`, `codeExecutionResult`, `videoMetadata` parts; a `thought` part
//! without a signature (v1 reasoning needs one); function responses with `parts`. Dropped and
//! reported: every other field (`safetySettings`, `toolConfig`, `labels`, the other
//! `generationConfig` fields such as `responseLogprobs` or `thinkingConfig`, `response` /
//! `responseJsonSchema` of a declaration, …).

use crate::import::{Builder, GeminiCall, Head, ImportError, Obj, ResultContent, Status, type_name};
use crate::sampling::Sampling;
use serde_json::{Map, Value};
use turnstile_core::conversation::{MediaSource, Role};

/// The calls of the assistant turn the current run of tool turns answers.
#[derive(Default)]
struct Run {
    calls: Vec<RunCall>,
    orphans: usize,
}

struct RunCall {
    call_id: String,
    tool: String,
    answered: bool,
}

/// The part fields that hold data; a part holds exactly one.
const DATA_FIELDS: &[&str] = &[
    "text",
    "inlineData",
    "fileData",
    "functionCall",
    "functionResponse",
];

pub(crate) fn import(mut top: Obj, call: GeminiCall, builder: &mut Builder) -> Result<Head, ImportError> {
    top.camel_case_keys()?;
    top.refuse(
        "cachedContent",
        "cached content stored at Google (server-side state)",
    )?;
    let mut max_output_tokens = None;
    let mut sampling = Sampling::default();
    let mut output_format = crate::output_format::OutputFormat::default();
    let mut passthrough = crate::passthrough::Passthrough::default();
    if let Some(mut config) = top.object("generationConfig")? {
        config.camel_case_keys()?;
        max_output_tokens = config.u64("maxOutputTokens")?;
        sampling = Sampling {
            temperature: config.f64("temperature")?,
            top_p: config.f64("topP")?,
            top_k: config.count("topK", true)?,
            stop: config.strings("stopSequences", false)?,
            seed: config.i64("seed", true)?,
            presence_penalty: config.f64("presencePenalty")?,
            frequency_penalty: config.f64("frequencyPenalty")?,
        };
        output_format = crate::output_format::read(crate::registry::Api::Gemini, &mut config)?;
        crate::passthrough::read_gemini_config(&mut config, &mut passthrough);
        match config.u64("candidateCount")? {
            None | Some(1) => {}
            Some(0) => {
                return Err(ImportError::malformed(
                    config.path_of("candidateCount"),
                    "candidateCount must be at least 1",
                ));
            }
            Some(_) => {
                return Err(ImportError::unrepresentable(
                    config.path_of("candidateCount"),
                    "several candidates; a v1 assistant turn is one",
                ));
            }
        }
        if let Some(modalities) = config.array("responseModalities")? {
            for (path, _, value) in config.elements("responseModalities", modalities) {
                match value {
                    Value::String(modality) if modality.eq_ignore_ascii_case("text") => {}
                    Value::String(_) => {
                        return Err(ImportError::unrepresentable(
                            path,
                            "a response modality other than text",
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
        config.finish(builder);
    }
    if let Some(tools) = top.array("tools")? {
        for (path, pattern, value) in top.elements("tools", tools) {
            tool(Obj::new(value, path, pattern)?, builder)?;
        }
    }
    let mut run = Run::default();
    if let Some(mut system) = top.object("systemInstruction")? {
        system.camel_case_keys()?;
        // The API ignores the role of a system instruction.
        let _ = system.take("role");
        builder.begin(Role::System, false, system.path().to_owned());
        let parts = system.required_array("parts")?;
        for (path, pattern, value) in system.elements("parts", parts) {
            part(Obj::new(value, path, pattern)?, Role::System, &mut run, builder)?;
        }
        builder.end()?;
        system.finish(builder);
    }
    let contents = top.required_array("contents")?;
    for (path, pattern, value) in top.elements("contents", contents) {
        let mut content = Obj::new(value, path, pattern)?;
        content.camel_case_keys()?;
        let role = match content.string("role")?.as_deref() {
            // Older API versions sent function responses under the role `function`.
            None | Some("user") | Some("function") => Role::User,
            Some("model") => Role::Assistant,
            Some(other) => {
                return Err(ImportError::malformed(
                    content.path_of("role"),
                    format!("unknown role {other:?}"),
                ));
            }
        };
        builder.begin(role, false, content.path().to_owned());
        let parts = content.required_array("parts")?;
        for (path, pattern, value) in content.elements("parts", parts) {
            part(Obj::new(value, path, pattern)?, role, &mut run, builder)?;
        }
        builder.end()?;
        content.finish(builder);
    }
    let tool_choice = crate::tool_choice::read(crate::registry::Api::Gemini, &mut top)?;
    crate::passthrough::read(crate::registry::Api::Gemini, &mut top, &mut passthrough)?;
    top.finish(builder);
    Ok(Head {
        model: call.model,
        stream: call.stream,
        max_output_tokens,
        sampling,
        tool_choice,
        output_format,
        passthrough,
    })
}

fn tool(mut tool: Obj, builder: &mut Builder) -> Result<(), ImportError> {
    tool.camel_case_keys()?;
    if let Some(declarations) = tool.array("functionDeclarations")? {
        for (path, pattern, value) in tool.elements("functionDeclarations", declarations) {
            let mut declaration = Obj::new(value, path, pattern)?;
            declaration.camel_case_keys()?;
            let name = declaration.required_string("name")?;
            let description = declaration.string("description")?;
            let json_schema = declaration.take("parametersJsonSchema");
            let openapi_schema = declaration.take("parameters");
            let schema = match (json_schema, openapi_schema) {
                (Some(_), Some(_)) => {
                    return Err(ImportError::malformed(
                        declaration.path_of("parameters"),
                        "both parameters and parametersJsonSchema are given",
                    ));
                }
                (Some(schema), None) | (None, Some(schema)) => Some(schema),
                (None, None) => None,
            };
            if let Some(schema) = &schema
                && !schema.is_object()
            {
                return Err(ImportError::malformed(
                    declaration.path_of("parameters"),
                    format!("expected an object, found {}", type_name(schema)),
                ));
            }
            let path = declaration.path().to_owned();
            declaration.finish(builder);
            builder.tool(name, description, schema, &path)?;
        }
    }
    // Every other tool field switches on a tool Google runs, even when it is `{}`.
    if let Some(key) = tool.keys().into_iter().next() {
        return Err(ImportError::unrepresentable(
            tool.path_of(&key),
            format!("the server-side tool {key:?}"),
        ));
    }
    Ok(())
}

fn part(mut part: Obj, role: Role, run: &mut Run, builder: &mut Builder) -> Result<(), ImportError> {
    part.camel_case_keys()?;
    part.refuse("executableCode", "code executed by Google")?;
    part.refuse("codeExecutionResult", "code executed by Google")?;
    part.refuse("videoMetadata", "video input")?;
    let data_fields: Vec<&str> = DATA_FIELDS.iter().copied().filter(|key| part.has(key)).collect();
    if data_fields.len() > 1 {
        return Err(ImportError::malformed(
            part.path(),
            format!(
                "a part holds one of text, inlineData, fileData, functionCall, functionResponse; this one has {data_fields:?}"
            ),
        ));
    }
    let signature = part.string("thoughtSignature")?;
    if part.bool("thought")? == Some(true) {
        let Some(signature) = signature else {
            return Err(ImportError::unrepresentable(
                part.path_of("thought"),
                "a thought without a thoughtSignature (v1 reasoning needs a signature)",
            ));
        };
        let text = part.string("text")?.filter(|text| !text.is_empty());
        builder.reasoning(role, "gemini", Some(signature), None, text)?;
        part.finish(builder);
        return Ok(());
    }
    let signed = signature.is_some();
    if let Some(signature) = signature {
        builder.reasoning(role, "gemini", Some(signature), None, None)?;
    }
    match data_fields.first().copied() {
        Some("text") => {
            let text = part.required_string("text")?;
            // An empty text part is how a signature with nothing after it is carried.
            if !(signed && text.is_empty()) {
                builder.text(role, text)?;
            }
        }
        Some("inlineData") => {
            let mut inline = part.required_object("inlineData")?;
            inline.camel_case_keys()?;
            let media_type = inline.required_string("mimeType")?;
            let data = inline.required_string("data")?;
            let path = inline.path_of("mimeType");
            inline.finish(builder);
            media(role, MediaSource::Base64 { media_type, data }, path, builder)?;
        }
        Some("fileData") => {
            let mut file = part.required_object("fileData")?;
            file.camel_case_keys()?;
            let media_type = file.string("mimeType")?;
            let url = file.required_string("fileUri")?;
            let path = file.path_of("mimeType");
            file.finish(builder);
            media(role, MediaSource::Url { url, media_type }, path, builder)?;
        }
        Some("functionCall") => {
            let mut call = part.required_object("functionCall")?;
            call.camel_case_keys()?;
            let name = call.required_string("name")?;
            let id = call.string("id")?.filter(|id| !id.is_empty());
            let args = match call.take("args") {
                None => Value::Object(Map::new()),
                Some(args @ Value::Object(_)) => args,
                Some(other) => {
                    return Err(ImportError::malformed(
                        call.path_of("args"),
                        format!("expected an object, found {}", type_name(&other)),
                    ));
                }
            };
            call.finish(builder);
            builder.place(role)?;
            let call_id =
                id.unwrap_or_else(|| format!("gemini-{}-{}", builder.turn_id(), builder.turn_call_count()));
            builder.tool_call(role, call_id, name, args)?;
        }
        Some(_) => {
            let mut response = part.required_object("functionResponse")?;
            response.camel_case_keys()?;
            response.refuse("parts", "multimodal function response parts")?;
            let name = response.required_string("name")?;
            let id = response.string("id")?.filter(|id| !id.is_empty());
            let body = match response.required("response")? {
                Value::Object(map) => map,
                other => {
                    return Err(ImportError::malformed(
                        response.path_of("response"),
                        format!("expected an object, found {}", type_name(&other)),
                    ));
                }
            };
            response.finish(builder);
            if builder.last_role() != Some(Role::Tool) {
                // A new run of tool turns answers the assistant turn right before it, if any.
                run.calls = builder
                    .last_assistant_calls()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(call_id, tool)| RunCall {
                        call_id,
                        tool,
                        answered: false,
                    })
                    .collect();
            }
            let call_id = match_call(run, id, &name);
            let (status, content) = response_content(body);
            builder.tool_result(Role::Tool, call_id, Some(name), status, content)?;
        }
        None if signed => {}
        None => {
            return Err(ImportError::malformed(
                part.path(),
                "a part needs text, inlineData, fileData, functionCall or functionResponse",
            ));
        }
    }
    part.finish(builder);
    Ok(())
}

/// Image for `image/*` (or no media type), refused for audio and video, else a document.
fn media(role: Role, source: MediaSource, path: String, builder: &mut Builder) -> Result<(), ImportError> {
    let media_type = match &source {
        MediaSource::Base64 { media_type, .. } => Some(media_type.as_str()),
        MediaSource::Url { media_type, .. } => media_type.as_deref(),
    };
    match media_type {
        None => builder.image(role, source),
        Some(kind) if kind.starts_with("image/") => builder.image(role, source),
        Some(kind) if kind.starts_with("audio/") || kind.starts_with("video/") => Err(
            ImportError::unrepresentable(path, format!("{kind} data (v1 holds images and documents)")),
        ),
        Some(_) => builder.document(role, source, None),
    }
}

/// The call a function response answers: by id, else the first unanswered call of its name in
/// the run's assistant turn, else (all answered) the first of its name, else an orphan id.
fn match_call(run: &mut Run, id: Option<String>, name: &str) -> String {
    if let Some(id) = id {
        if let Some(call) = run.calls.iter_mut().find(|call| call.call_id == id) {
            call.answered = true;
        }
        return id;
    }
    if let Some(call) = run
        .calls
        .iter_mut()
        .find(|call| !call.answered && call.tool == name)
    {
        call.answered = true;
        return call.call_id.clone();
    }
    if let Some(call) = run.calls.iter().find(|call| call.tool == name) {
        return call.call_id.clone();
    }
    run.orphans += 1;
    format!("gemini-orphan-{}", run.orphans)
}

/// Status and content of a `functionResponse.response` object.
fn response_content(response: Map<String, Value>) -> (Status, Vec<ResultContent>) {
    if response.len() == 1 {
        if let Some(output) = response.get("output") {
            return (Status::Success, texts(output));
        }
        if let Some(error) = response.get("error") {
            return (Status::Error, texts(error));
        }
    }
    (
        Status::Success,
        vec![ResultContent::Text(canonical(&Value::Object(response)))],
    )
}

fn texts(value: &Value) -> Vec<ResultContent> {
    match value {
        Value::String(text) if text.is_empty() => Vec::new(),
        Value::String(text) => vec![ResultContent::Text(text.clone())],
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(Value::as_str)
            .map(|text| ResultContent::Text(text.to_owned()))
            .collect(),
        other => vec![ResultContent::Text(canonical(other))],
    }
}

fn canonical(value: &Value) -> String {
    String::from_utf8_lossy(&turnstile_core::digest::canonical_bytes(value)).into_owned()
}
