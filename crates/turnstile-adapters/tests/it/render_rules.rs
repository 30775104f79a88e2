//! An independent checker of each API's documented sequence rules, written from the provider
//! docs and the 400s they quote (`shared/reference/provider-rules.md`), not from the adapter
//! code. It reads the rendered body as plain JSON and returns every rule broken, plus every
//! call, result, text or media the rendering lost compared with the conversation.
//!
//! Run over every golden scenario here and over every random legal graph in
//! `render_props.rs`.

use crate::render_support::{SCENARIOS, load, render_for, strings};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use turnstile_adapters::AdapterId;
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::{RenderOutcome, Rendered};
use turnstile_core::conversation::{Arguments, BlockBody, Conversation, MediaSource, ResultPart};

/// A call or result as found in a body.
struct Call {
    id: Option<String>,
    name: String,
    arguments: Value,
}

struct Output {
    id: Option<String>,
    texts: Vec<String>,
}

/// All problems with one rendering (empty = legal and lossless).
pub fn check(adapter: AdapterId, conversation: &Conversation, rendered: &Rendered) -> Vec<String> {
    let mut problems = Vec::new();
    let body: Value = match serde_json::from_slice(&rendered.body) {
        Ok(body) => body,
        Err(error) => return vec![format!("body is not JSON: {error}")],
    };
    let (calls, outputs) = match adapter.api() {
        Api::OpenaiChat => chat_rules(adapter, &body, &mut problems),
        Api::OpenaiResponses => responses_rules(&body, &mut problems),
        Api::AnthropicMessages => anthropic_rules(&body, &mut problems),
        Api::Gemini => gemini_rules(&body, &mut problems),
    };
    for (name, value) in &rendered.headers {
        let lower = name.to_ascii_lowercase();
        if lower.contains("authorization") || lower.contains("api-key") || lower.contains("token") {
            problems.push(format!("credential-like header {name}: {value}"));
        }
    }
    losses(
        adapter,
        conversation,
        rendered,
        &body,
        &calls,
        &outputs,
        &mut problems,
    );
    problems
}

fn array<'a>(value: &'a Value, key: &str) -> &'a [Value] {
    value
        .get(key)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

fn text_of(value: &Value, key: &str) -> Option<String> {
    value.get(key).and_then(Value::as_str).map(str::to_owned)
}

/// OpenAI Chat: roles, tool messages right after the assistant message that made the calls,
/// one per call ("An assistant message with 'tool_calls' must be followed by tool messages
/// responding to each 'tool_call_id'"), no orphan tool message ("messages with role 'tool'
/// must be a response to a preceeding message with 'tool_calls'"), ids ≤ 40 characters,
/// arguments a JSON string, tool content text-only.
fn chat_rules(adapter: AdapterId, body: &Value, problems: &mut Vec<String>) -> (Vec<Call>, Vec<Output>) {
    let (system_role, cap_field, wrong_cap) = if adapter == AdapterId::OpenaiChatV1 {
        ("system", "max_tokens", "max_completion_tokens")
    } else {
        ("developer", "max_completion_tokens", "max_tokens")
    };
    if body.get(cap_field).is_none() || body.get(wrong_cap).is_some() {
        problems.push(format!("output cap must be in {cap_field} only"));
    }
    let messages = array(body, "messages");
    if messages.is_empty() {
        problems.push("messages must have at least 1 item".into());
    }
    let mut calls = Vec::new();
    let mut outputs = Vec::new();
    let mut open: Option<(usize, HashSet<String>)> = None;
    for (index, message) in messages.iter().enumerate() {
        let role = text_of(message, "role").unwrap_or_default();
        if role != "tool" {
            if let Some((at, pending)) = open.take() {
                if !pending.is_empty() {
                    problems.push(format!(
                        "messages[{at}]: tool_call_ids without tool messages: {pending:?}"
                    ));
                }
            }
        }
        match role.as_str() {
            "user" => {}
            "system" | "developer" if role == system_role => {}
            "assistant" => {
                let tool_calls = array(message, "tool_calls");
                if message.get("content").is_none() && tool_calls.is_empty() {
                    problems.push(format!(
                        "messages[{index}]: assistant message with neither content nor tool_calls"
                    ));
                }
                let mut pending = HashSet::new();
                for call in tool_calls {
                    let id = text_of(call, "id").unwrap_or_default();
                    if id.is_empty() || id.chars().count() > 40 {
                        problems.push(format!(
                            "messages[{index}]: tool_calls id {id:?} breaks length 1..=40"
                        ));
                    }
                    let function = call.get("function").cloned().unwrap_or(Value::Null);
                    let arguments = match function.get("arguments") {
                        Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
                            Ok(value @ Value::Object(_)) => value,
                            _ => {
                                problems.push(format!(
                                    "messages[{index}]: arguments are not a JSON object string"
                                ));
                                Value::Null
                            }
                        },
                        _ => {
                            problems.push(format!("messages[{index}]: arguments must be a string"));
                            Value::Null
                        }
                    };
                    if !pending.insert(id.clone()) {
                        problems.push(format!("messages[{index}]: duplicate tool call id {id}"));
                    }
                    calls.push(Call {
                        id: Some(id),
                        name: text_of(&function, "name").unwrap_or_default(),
                        arguments,
                    });
                }
                if !pending.is_empty() {
                    open = Some((index, pending));
                }
            }
            "tool" => {
                let id = text_of(message, "tool_call_id").unwrap_or_default();
                let answered = open.as_mut().is_some_and(|(_, pending)| pending.remove(&id));
                match answered {
                    true => {}
                    false => problems.push(format!(
                        "messages[{index}]: tool message {id:?} does not answer the preceding tool_calls"
                    )),
                }
                let texts = match message.get("content") {
                    Some(Value::String(text)) => vec![text.clone()],
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .map(|part| {
                            if text_of(part, "type").as_deref() != Some("text") {
                                problems.push(format!("messages[{index}]: tool content part is not text"));
                            }
                            text_of(part, "text").unwrap_or_default()
                        })
                        .collect(),
                    _ => {
                        problems.push(format!("messages[{index}]: tool message needs content"));
                        Vec::new()
                    }
                };
                outputs.push(Output { id: Some(id), texts });
            }
            other => problems.push(format!("messages[{index}]: role {other:?} not allowed here")),
        }
    }
    if let Some((at, pending)) = open {
        if !pending.is_empty() {
            problems.push(format!(
                "messages[{at}]: tool_call_ids without tool messages: {pending:?}"
            ));
        }
    }
    (calls, outputs)
}

/// OpenAI Responses: every `function_call_output` has an earlier `function_call` with its
/// `call_id` ("No tool call found for function call output with call_id …"), every call has
/// exactly one output ("No tool output found for function call …"), `call_id` 1–64
/// characters, reasoning items carry `id` (required by `ReasoningItem`).
fn responses_rules(body: &Value, problems: &mut Vec<String>) -> (Vec<Call>, Vec<Output>) {
    let mut calls = Vec::new();
    let mut outputs = Vec::new();
    let mut called: HashMap<String, bool> = HashMap::new();
    if body.get("instructions").is_some() && array(body, "input").is_empty() {
        problems.push("empty input".into());
    }
    for (index, item) in array(body, "input").iter().enumerate() {
        match text_of(item, "type").as_deref() {
            Some("message") => {
                let role = text_of(item, "role").unwrap_or_default();
                if !["user", "assistant", "system", "developer"].contains(&role.as_str()) {
                    problems.push(format!("input[{index}]: role {role:?}"));
                }
            }
            Some("function_call") => {
                let id = text_of(item, "call_id").unwrap_or_default();
                if id.is_empty() || id.chars().count() > 64 {
                    problems.push(format!("input[{index}]: call_id {id:?} breaks length 1..=64"));
                }
                if called.insert(id.clone(), false).is_some() {
                    problems.push(format!("input[{index}]: duplicate call_id {id}"));
                }
                let arguments = text_of(item, "arguments")
                    .and_then(|text| serde_json::from_str::<Value>(&text).ok())
                    .filter(Value::is_object)
                    .unwrap_or_else(|| {
                        problems.push(format!("input[{index}]: arguments are not a JSON object string"));
                        Value::Null
                    });
                calls.push(Call {
                    id: Some(id),
                    name: text_of(item, "name").unwrap_or_default(),
                    arguments,
                });
            }
            Some("function_call_output") => {
                let id = text_of(item, "call_id").unwrap_or_default();
                match called.get_mut(&id) {
                    Some(answered @ false) => *answered = true,
                    Some(true) => problems.push(format!("input[{index}]: second output for {id}")),
                    None => problems.push(format!(
                        "input[{index}]: No tool call found for function call output with call_id {id}"
                    )),
                }
                let texts = match item.get("output") {
                    Some(Value::String(text)) => vec![text.clone()],
                    Some(Value::Array(parts)) => {
                        parts.iter().filter_map(|part| text_of(part, "text")).collect()
                    }
                    _ => {
                        problems.push(format!("input[{index}]: output missing"));
                        Vec::new()
                    }
                };
                outputs.push(Output { id: Some(id), texts });
            }
            Some("reasoning") => {
                if item.get("id").is_none() || item.get("summary").is_none() {
                    problems.push(format!("input[{index}]: reasoning item needs id and summary"));
                }
            }
            other => problems.push(format!("input[{index}]: unknown item type {other:?}")),
        }
    }
    for (id, answered) in called {
        if !answered {
            problems.push(format!("No tool output found for function call {id}"));
        }
    }
    (calls, outputs)
}

fn anthropic_id_ok(id: &str) -> bool {
    !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Anthropic Messages: user/assistant only (system is top-level), starting with user, turns
/// merged (no two consecutive same-role messages), the message after tool_use blocks is a
/// user message that STARTS with exactly the matching tool_result blocks ("tool_result blocks
/// must come FIRST"; "`tool_use` ids were found without `tool_result` blocks immediately
/// after"; "unexpected tool_use_id found in tool_result blocks"), ids match
/// `^[a-zA-Z0-9_-]+$`, text blocks are not blank, thinking only in assistant messages.
fn anthropic_rules(body: &Value, problems: &mut Vec<String>) -> (Vec<Call>, Vec<Output>) {
    let mut calls = Vec::new();
    let mut outputs = Vec::new();
    if body.get("max_tokens").and_then(Value::as_u64).is_none() {
        problems.push("max_tokens is required".into());
    }
    let messages = array(body, "messages");
    if messages.is_empty() {
        problems.push("messages must not be empty".into());
    }
    let mut previous_role = String::new();
    let mut pending: Vec<String> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        let role = text_of(message, "role").unwrap_or_default();
        if role != "user" && role != "assistant" {
            problems.push(format!("messages.{index}: role {role:?}"));
        }
        if index == 0 && role != "user" {
            problems.push("messages.0: first message must use the user role".into());
        }
        if role == previous_role {
            problems.push(format!(
                "messages.{index}: consecutive {role} messages were not merged"
            ));
        }
        let content = array(message, "content");
        if content.is_empty() {
            problems.push(format!("messages.{index}: empty content"));
        }
        // Results for the previous assistant message must lead this one.
        let leading_results: Vec<String> = content
            .iter()
            .take_while(|block| text_of(block, "type").as_deref() == Some("tool_result"))
            .map(|block| text_of(block, "tool_use_id").unwrap_or_default())
            .collect();
        if !pending.is_empty() {
            let mut expected = pending.clone();
            let mut got = leading_results.clone();
            expected.sort();
            got.sort();
            if role != "user" || expected != got {
                problems.push(format!(
                    "messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately after: {pending:?} (got {leading_results:?})"
                ));
            }
        } else if !leading_results.is_empty() {
            problems.push(format!(
                "messages.{index}: unexpected tool_use_id found in tool_result blocks"
            ));
        }
        pending.clear();
        for (position, block) in content.iter().enumerate() {
            let kind = text_of(block, "type").unwrap_or_default();
            match kind.as_str() {
                "text" => {
                    if text_of(block, "text").unwrap_or_default().trim().is_empty() {
                        problems.push(format!("messages.{index}.content.{position}: blank text block"));
                    }
                }
                "tool_result" => {
                    if position >= leading_results.len() {
                        problems.push(format!(
                            "messages.{index}.content.{position}: tool_result after other content"
                        ));
                    }
                    let texts = array(block, "content")
                        .iter()
                        .filter_map(|part| text_of(part, "text"))
                        .collect();
                    outputs.push(Output {
                        id: text_of(block, "tool_use_id"),
                        texts,
                    });
                }
                "tool_use" => {
                    if role != "assistant" {
                        problems.push(format!("messages.{index}: tool_use outside an assistant message"));
                    }
                    let id = text_of(block, "id").unwrap_or_default();
                    if !anthropic_id_ok(&id) {
                        problems.push(format!("messages.{index}.content.{position}.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$': {id:?}"));
                    }
                    if !block.get("input").is_some_and(Value::is_object) {
                        problems.push(format!(
                            "messages.{index}.content.{position}: input must be an object"
                        ));
                    }
                    pending.push(id.clone());
                    calls.push(Call {
                        id: Some(id),
                        name: text_of(block, "name").unwrap_or_default(),
                        arguments: block.get("input").cloned().unwrap_or(Value::Null),
                    });
                }
                "thinking" | "redacted_thinking" => {
                    if role != "assistant" {
                        problems.push(format!("messages.{index}: thinking outside an assistant message"));
                    }
                }
                "image" | "document" => {
                    if role != "user" {
                        problems.push(format!("messages.{index}: {kind} outside a user message"));
                    }
                }
                other => problems.push(format!(
                    "messages.{index}.content.{position}: unknown block type {other:?}"
                )),
            }
        }
        previous_role = role;
    }
    if !pending.is_empty() {
        problems.push(format!(
            "the request ends with unanswered tool_use ids {pending:?}"
        ));
    }
    for block in array(body, "system") {
        if text_of(block, "type").as_deref() != Some("text") {
            problems.push("system blocks must be text".into());
        }
    }
    (calls, outputs)
}

/// Gemini: user/model only, strictly alternating ("multiturn requests alternate between user
/// and model"), function responses right after the function call turn with the same count
/// ("the number of function response parts is equal to the number of function call parts"),
/// a function call turn after a user turn, the request ending with a user turn, tool schemas
/// in `parametersJsonSchema`.
fn gemini_rules(body: &Value, problems: &mut Vec<String>) -> (Vec<Call>, Vec<Output>) {
    let mut calls = Vec::new();
    let mut outputs = Vec::new();
    let contents = array(body, "contents");
    if contents.is_empty() {
        problems.push("contents must not be empty".into());
    }
    let mut previous_role = String::new();
    let mut pending_names: Vec<String> = Vec::new();
    for (index, content) in contents.iter().enumerate() {
        let role = text_of(content, "role").unwrap_or_default();
        if role != "user" && role != "model" {
            problems.push(format!("contents[{index}]: role {role:?}"));
        }
        if role == previous_role {
            problems.push(format!(
                "contents[{index}]: Please ensure that multiturn requests alternate between user and model."
            ));
        }
        let parts = array(content, "parts");
        if parts.is_empty() {
            problems.push(format!("contents[{index}]: empty parts"));
        }
        let response_names: Vec<String> = parts
            .iter()
            .filter_map(|part| part.get("functionResponse"))
            .map(|response| text_of(response, "name").unwrap_or_default())
            .collect();
        if !pending_names.is_empty() {
            if response_names.len() != pending_names.len() {
                problems.push(format!("contents[{index}]: Please ensure that the number of function response parts is equal to the number of function call parts of the function call turn."));
            } else if response_names != pending_names {
                problems.push(format!(
                    "contents[{index}]: responses {response_names:?} not in call order {pending_names:?}"
                ));
            }
            let leading = parts
                .iter()
                .take_while(|part| part.get("functionResponse").is_some())
                .count();
            if leading != response_names.len() {
                problems.push(format!(
                    "contents[{index}]: function responses must lead the content"
                ));
            }
        } else if !response_names.is_empty() {
            problems.push(format!("contents[{index}]: Please ensure that function response turn comes immediately after a function call turn."));
        }
        pending_names.clear();
        for part in parts {
            if let Some(call) = part.get("functionCall") {
                if role != "model" {
                    problems.push(format!("contents[{index}]: functionCall outside a model turn"));
                }
                if index == 0 {
                    problems.push("Please ensure that function call turn comes immediately after a user turn or after a function response turn.".into());
                }
                let name = text_of(call, "name").unwrap_or_default();
                pending_names.push(name.clone());
                if !call.get("args").is_some_and(Value::is_object) {
                    problems.push(format!("contents[{index}]: functionCall args must be an object"));
                }
                calls.push(Call {
                    id: None,
                    name,
                    arguments: call.get("args").cloned().unwrap_or(Value::Null),
                });
            }
            if let Some(response) = part.get("functionResponse") {
                let response_object = response.get("response").cloned().unwrap_or(Value::Null);
                let Value::Object(map) = &response_object else {
                    problems.push(format!(
                        "contents[{index}]: functionResponse.response must be an object"
                    ));
                    continue;
                };
                let mut texts = Vec::new();
                for value in map.values() {
                    strings(value, &mut texts);
                }
                outputs.push(Output { id: None, texts });
            }
        }
        previous_role = role;
    }
    if previous_role != "user" {
        problems.push(
            "Please ensure that multiturn requests ends with a user role or a function response.".into(),
        );
    }
    for tools in array(body, "tools") {
        for declaration in array(tools, "functionDeclarations") {
            if declaration.get("parameters").is_some() || declaration.get("parametersJsonSchema").is_none() {
                problems.push("tool schemas must go in parametersJsonSchema".into());
            }
        }
    }
    (calls, outputs)
}

fn unescape_markup(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&amp;", "&")
}

/// Nothing lost: every call (in order, arguments equal), every result (its texts), every
/// non-blank text, every context text (inside a provenance wrapper), every media payload, and
/// every reasoning block either sent or listed as omitted in the policy.
fn losses(
    adapter: AdapterId,
    conversation: &Conversation,
    rendered: &Rendered,
    body: &Value,
    calls: &[Call],
    outputs: &[Output],
    problems: &mut Vec<String>,
) {
    let mut all = Vec::new();
    strings(body, &mut all);
    let all_set: HashSet<&str> = all.iter().map(String::as_str).collect();
    let mapped: HashMap<&str, &str> = rendered
        .policy
        .call_ids
        .iter()
        .map(|mapping| (mapping.call_id.as_str(), mapping.provider_call_id.as_str()))
        .collect();
    let omitted: HashSet<&str> = rendered
        .policy
        .omitted
        .iter()
        .map(|omission| omission.block.as_str())
        .collect();
    let mut expected_calls = Vec::new();
    let mut expected_results: HashMap<&str, (&str, Vec<&str>)> = HashMap::new();
    for turn in &conversation.turns {
        for block in &turn.blocks {
            let id = block.id.as_deref().unwrap_or("");
            match &block.body {
                BlockBody::Text { text } => {
                    if !all_set.contains(text.as_str()) && !(text.trim().is_empty() && omitted.contains(id)) {
                        problems.push(format!("text of block {id} lost"));
                    }
                }
                BlockBody::Context { text, .. } => {
                    let found = all.iter().any(|candidate| {
                        candidate.starts_with("<context source=")
                            && candidate.ends_with("</context>")
                            && unescape_markup(candidate).contains(text.as_str())
                    });
                    if !found {
                        problems.push(format!("context block {id} lost or not wrapped"));
                    }
                }
                BlockBody::Image { source } | BlockBody::Document { source, .. } => {
                    let needle = match source {
                        MediaSource::Base64 { data, .. } => data.as_str(),
                        MediaSource::Url { url, .. } => url.as_str(),
                    };
                    let plain_text_document = matches!(&block.body, BlockBody::Document { source: MediaSource::Base64 { media_type, .. }, .. } if media_type == "text/plain")
                        && adapter.api() == Api::AnthropicMessages;
                    if !plain_text_document && !all.iter().any(|candidate| candidate.contains(needle)) {
                        problems.push(format!("media of block {id} lost"));
                    }
                }
                BlockBody::ToolCall {
                    call_id,
                    tool,
                    arguments,
                } => {
                    let value = match arguments {
                        Arguments::Closed { value, .. } => Value::Object(value.clone()),
                        Arguments::Unclosed { .. } => Value::Null,
                    };
                    expected_calls.push((call_id.as_str(), tool.as_str(), value));
                }
                BlockBody::ToolResult { call_id, content, .. } => {
                    let texts = content
                        .iter()
                        .filter_map(|part| match part {
                            ResultPart::Text(text) if !text.trim().is_empty() => Some(text.as_str()),
                            _ => None,
                        })
                        .collect();
                    expected_results.insert(call_id.as_str(), (id, texts));
                }
                BlockBody::Reasoning {
                    signature, encrypted, ..
                } => {
                    let sent = signature.as_deref().is_some_and(|s| all_set.contains(s))
                        || encrypted.as_deref().is_some_and(|e| all_set.contains(e));
                    if sent == omitted.contains(id) {
                        problems.push(format!(
                            "reasoning block {id}: sent={sent}, listed as omitted={}",
                            !sent
                        ));
                    }
                }
                _ => {}
            }
        }
    }
    if calls.len() != expected_calls.len() {
        problems.push(format!(
            "{} calls rendered, {} in the graph",
            calls.len(),
            expected_calls.len()
        ));
    }
    for (position, (call_id, tool, arguments)) in expected_calls.iter().enumerate() {
        let Some(call) = calls.get(position) else { break };
        let provider_id = mapped.get(call_id).copied().unwrap_or(call_id);
        if call.id.is_some() && call.id.as_deref() != Some(provider_id) {
            problems.push(format!(
                "call {position} has id {:?}, expected {provider_id:?}",
                call.id
            ));
        }
        if call.name != *tool || call.arguments != *arguments {
            problems.push(format!("call {call_id} changed name or arguments"));
        }
    }
    // Results: by id where the API has ids, else by position in call order.
    let by_id: HashMap<&str, &Output> = outputs
        .iter()
        .filter_map(|o| o.id.as_deref().map(|id| (id, o)))
        .collect();
    if outputs.len() != expected_results.len() {
        problems.push(format!(
            "{} results rendered, {} in the graph",
            outputs.len(),
            expected_results.len()
        ));
    }
    let mut positional = outputs.iter();
    for (call_id, _, _) in &expected_calls {
        let Some((block_id, texts)) = expected_results.get(call_id) else {
            continue;
        };
        let provider_id = mapped.get(call_id).copied().unwrap_or(call_id);
        let output = if by_id.is_empty() {
            positional.next()
        } else {
            by_id.get(provider_id).copied()
        };
        let Some(output) = output else {
            problems.push(format!("result {block_id} for {call_id} lost"));
            continue;
        };
        for text in texts {
            if !output.texts.iter().any(|candidate| candidate == text) {
                problems.push(format!("text {text:?} of result {block_id} lost"));
            }
        }
    }
}

#[test]
fn every_golden_scenario_passes_the_rule_checker_or_pauses() {
    let mut failures = Vec::new();
    for name in SCENARIOS {
        let conversation = load(name);
        for adapter in AdapterId::ALL {
            if let RenderOutcome::Rendered(rendered) = render_for(&conversation, adapter) {
                for problem in check(adapter, &conversation, &rendered) {
                    failures.push(format!("{name} × {adapter}: {problem}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_checker_catches_a_missing_tool_message() {
    let conversation = load("parallel_split_out_of_order");
    let RenderOutcome::Rendered(mut rendered) = render_for(&conversation, AdapterId::OpenaiChatV1) else {
        panic!("renders");
    };
    let mut body: Value = serde_json::from_slice(&rendered.body).unwrap();
    body["messages"].as_array_mut().unwrap().pop();
    rendered.body = serde_json::to_vec(&body).unwrap();
    let problems = check(AdapterId::OpenaiChatV1, &conversation, &rendered);
    assert!(
        problems.iter().any(|p| p.contains("without tool messages")),
        "{problems:?}"
    );
}

#[test]
fn the_checker_catches_text_before_anthropic_tool_results() {
    let conversation = load("error_cancel");
    let RenderOutcome::Rendered(mut rendered) = render_for(&conversation, AdapterId::AnthropicMessagesV1)
    else {
        panic!("renders");
    };
    let mut body: Value = serde_json::from_slice(&rendered.body).unwrap();
    let content = body["messages"][2]["content"].as_array_mut().unwrap();
    let text = content.pop().unwrap();
    content.insert(0, text);
    rendered.body = serde_json::to_vec(&body).unwrap();
    let problems = check(AdapterId::AnthropicMessagesV1, &conversation, &rendered);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("without `tool_result` blocks")),
        "{problems:?}"
    );
}

#[test]
fn the_checker_catches_a_gemini_response_count_mismatch() {
    let conversation = load("parallel_split_out_of_order");
    let RenderOutcome::Rendered(mut rendered) = render_for(&conversation, AdapterId::GeminiV1) else {
        panic!("renders");
    };
    let mut body: Value = serde_json::from_slice(&rendered.body).unwrap();
    body["contents"][2]["parts"].as_array_mut().unwrap().pop();
    rendered.body = serde_json::to_vec(&body).unwrap();
    let problems = check(AdapterId::GeminiV1, &conversation, &rendered);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("number of function response parts")),
        "{problems:?}"
    );
}
