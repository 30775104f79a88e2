//! The four wire formats the simulator speaks, as documented by each provider (sources in
//! `shared/reference/provider-rules.md`; shapes checked against the captures in
//! `shared/fixtures/provider-streams/` by the gateway's sim tests):
//!
//! - OpenAI Chat Completions streaming: `data: {chat.completion.chunk}` lines, `tool_calls[]`
//!   keyed by `index` with `id`/`name` on the first fragment only, a `finish_reason` chunk, an
//!   optional usage chunk with `choices: []`, then `data: [DONE]`.
//! - OpenAI Responses streaming: named events with a `sequence_number`, output items keyed by
//!   `item_id`/`output_index`, ending in `response.completed`.
//! - Anthropic Messages streaming: `message_start`, `content_block_start|delta|stop` (text and
//!   `input_json_delta`), `ping`, `message_delta` with the stop reason, `message_stop`.
//! - Gemini `streamGenerateContent?alt=sse`: `data: {GenerateContentResponse}` chunks with
//!   whole `functionCall` parts (no ids), the last one carrying `finishReason`.

use super::script::{Reply, ScriptedCall};
use serde_json::{Value, json};

/// Which API a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/chat/completions`.
    OpenAiChat,
    /// `POST /v1/responses`.
    OpenAiResponses,
    /// `POST /v1/messages`.
    Anthropic,
    /// `POST /v1beta/models/{model}:streamGenerateContent`.
    Gemini,
}

/// One SSE event as bytes, with what the fault logic needs to know about it.
#[derive(Clone, Debug)]
pub struct Frame {
    /// The exact bytes, including the blank line that ends the event.
    pub bytes: Vec<u8>,
    /// Part of the stop signal (dropped by `drop_stop`).
    pub stop: bool,
    /// Provider sequence number, where the format has one (Responses).
    pub sequence: Option<u64>,
}

/// Call ids as the reply will carry them (scripted, or generated in the provider's style).
pub fn call_ids(api: Api, reply: &Reply, handle_number: u64) -> Vec<String> {
    reply
        .tool_calls
        .iter()
        .enumerate()
        .map(|(index, call)| match &call.id {
            Some(id) => id.clone(),
            None => match api {
                Api::Anthropic => format!("toolu_sim_{handle_number}_{index}"),
                Api::OpenAiResponses | Api::OpenAiChat => format!("call_sim_{handle_number}_{index}"),
                Api::Gemini => format!("gemini_sim_{handle_number}_{index}"),
            },
        })
        .collect()
}

/// Split text into small deltas on character boundaries (about a word each).
fn text_pieces(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    for (index, ch) in text.char_indices() {
        if ch == ' ' && index > start {
            pieces.push(&text[start..index]);
            start = index;
        }
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

/// Split argument text into fragments of at most 8 bytes, on character boundaries.
fn argument_pieces(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + 8).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        pieces.push(&text[start..end]);
        start = end;
    }
    pieces
}

fn data_frame(payload: &Value, stop: bool) -> Frame {
    Frame {
        bytes: format!("data: {payload}\n\n").into_bytes(),
        stop,
        sequence: None,
    }
}

fn named_frame(event: &str, payload: &Value, stop: bool, sequence: Option<u64>) -> Frame {
    Frame {
        bytes: format!("event: {event}\ndata: {payload}\n\n").into_bytes(),
        stop,
        sequence,
    }
}

/// The order in which tool-call blocks are emitted.
fn call_order(reply: &Reply) -> Vec<usize> {
    let mut order: Vec<usize> = (0..reply.tool_calls.len()).collect();
    if reply.faults.reorder_tool_calls {
        order.reverse();
    }
    order
}

fn usage_tokens(reply: &Reply, prompt_bytes: usize) -> (u64, u64) {
    let output: usize = reply.text.len()
        + reply
            .tool_calls
            .iter()
            .map(|c| c.arguments_text().len())
            .sum::<usize>();
    let output = reply
        .faults
        .usage_output_tokens
        .unwrap_or((output / 4).max(1) as u64);
    ((prompt_bytes / 4).max(1) as u64, output)
}

/// OpenAI's output usage as a real model reports it: the BPE count of everything it generated
/// (text and each call's arguments; the recorded `gpt-4o-length-with-usage` capture reports
/// exactly its text's count), for the tokenizer of `model` (o200k when the catalog does not
/// know it), so the Chat decoder's usage cross-check holds for an honest reply and catches a
/// duplicated one (`decode/openai_chat.rs`). `fallback` when there is no output at all.
fn openai_output_tokens(reply: &Reply, model: &str, fallback: u64) -> u64 {
    if let Some(reported) = reply.faults.usage_output_tokens {
        return reported;
    }
    let tokenizer =
        crate::catalog::exact_openai_tokenizer(model).unwrap_or(crate::tokens::Tokenizer::O200kBase);
    let generated = tokenizer.count(&reply.text)
        + reply
            .tool_calls
            .iter()
            .map(|call| tokenizer.count(&call.arguments_text()))
            .sum::<u64>();
    if generated == 0 { fallback } else { generated }
}

/// Encode a reply as the stream frames of one API.
pub fn frames(
    api: Api,
    reply: &Reply,
    handle: &str,
    model: &str,
    ids: &[String],
    prompt_bytes: usize,
) -> Vec<Frame> {
    let (input_tokens, output_tokens) = usage_tokens(reply, prompt_bytes);
    match api {
        Api::OpenAiChat => {
            let output_tokens = openai_output_tokens(reply, model, output_tokens);
            chat_frames(reply, handle, model, ids, input_tokens, output_tokens)
        }
        Api::OpenAiResponses => {
            let output_tokens = openai_output_tokens(reply, model, output_tokens);
            responses_frames(reply, handle, model, ids, input_tokens, output_tokens)
        }
        Api::Anthropic => anthropic_frames(reply, handle, model, ids, input_tokens, output_tokens),
        Api::Gemini => gemini_frames(reply, handle, model, input_tokens, output_tokens),
    }
}

fn chat_frames(
    reply: &Reply,
    handle: &str,
    model: &str,
    ids: &[String],
    input: u64,
    output: u64,
) -> Vec<Frame> {
    let chunk = |delta: Value, finish: Value| {
        json!({"id": handle, "object": "chat.completion.chunk", "created": 1_764_000_000, "model": model,
               "system_fingerprint": "fp_sim", "choices": [{"index": 0, "delta": delta, "logprobs": null,
               "finish_reason": finish}]})
    };
    let mut frames = vec![data_frame(
        &chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        false,
    )];
    for piece in text_pieces(&reply.text) {
        frames.push(data_frame(&chunk(json!({"content": piece}), Value::Null), false));
    }
    for index in call_order(reply) {
        let call = &reply.tool_calls[index];
        let first = json!({"tool_calls": [{"index": index, "id": ids[index], "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]});
        frames.push(data_frame(&chunk(first, Value::Null), false));
        for piece in argument_pieces(&call.arguments_text()) {
            let delta = json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]});
            frames.push(data_frame(&chunk(delta, Value::Null), false));
        }
    }
    let finish = if reply.tool_calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    };
    frames.push(data_frame(&chunk(json!({}), json!(finish)), true));
    frames.push(data_frame(
        &json!({"id": handle, "object": "chat.completion.chunk", "created": 1_764_000_000, "model": model,
                "choices": [], "usage": {"prompt_tokens": input, "completion_tokens": output,
                "total_tokens": input + output}}),
        false,
    ));
    if !reply.faults.omit_done {
        frames.push(Frame {
            bytes: b"data: [DONE]\n\n".to_vec(),
            stop: true,
            sequence: None,
        });
    }
    frames
}

fn responses_output(reply: &Reply, ids: &[String], handle: &str) -> Vec<Value> {
    let mut output = Vec::new();
    if !reply.text.is_empty() {
        output.push(json!({"id": format!("msg_{handle}"), "type": "message", "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": reply.text, "annotations": []}]}));
    }
    for (index, call) in reply.tool_calls.iter().enumerate() {
        output.push(
            json!({"id": format!("fc_{handle}_{index}"), "type": "function_call", "status": "completed",
                           "call_id": ids[index], "name": call.name, "arguments": call.arguments_text()}),
        );
    }
    output
}

/// The Responses API response object (also the non-streaming body and the resume target).
pub fn responses_object(
    reply: &Reply,
    handle: &str,
    model: &str,
    ids: &[String],
    status: &str,
    usage: (u64, u64),
) -> Value {
    let output = if status == "completed" {
        responses_output(reply, ids, handle)
    } else {
        Vec::new()
    };
    json!({"id": handle, "object": "response", "created_at": 1_764_000_000, "status": status, "model": model,
           "output": output, "parallel_tool_calls": true, "error": null, "incomplete_details": null,
           "usage": if status == "completed" {
               json!({"input_tokens": usage.0, "output_tokens": usage.1, "total_tokens": usage.0 + usage.1})
           } else { Value::Null }})
}

fn responses_frames(
    reply: &Reply,
    handle: &str,
    model: &str,
    ids: &[String],
    input: u64,
    output: u64,
) -> Vec<Frame> {
    let mut frames = Vec::new();
    let mut sequence = 0u64;
    let mut push = |frames: &mut Vec<Frame>, kind: &str, mut payload: Value, stop: bool| {
        payload["type"] = json!(kind);
        payload["sequence_number"] = json!(sequence);
        frames.push(named_frame(kind, &payload, stop, Some(sequence)));
        sequence += 1;
    };
    let usage = (input, output);
    push(
        &mut frames,
        "response.created",
        json!({"response": responses_object(reply, handle, model, ids, "in_progress", usage)}),
        false,
    );
    push(
        &mut frames,
        "response.in_progress",
        json!({"response": responses_object(reply, handle, model, ids, "in_progress", usage)}),
        false,
    );
    let mut output_index = 0usize;
    if !reply.text.is_empty() {
        let item_id = format!("msg_{handle}");
        push(
            &mut frames,
            "response.output_item.added",
            json!({"output_index": output_index,
            "item": {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}}),
            false,
        );
        push(
            &mut frames,
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": output_index,
            "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
            false,
        );
        for piece in text_pieces(&reply.text) {
            push(
                &mut frames,
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": output_index,
                "content_index": 0, "delta": piece, "logprobs": []}),
                false,
            );
        }
        push(
            &mut frames,
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": output_index,
            "content_index": 0, "text": reply.text, "logprobs": []}),
            false,
        );
        push(
            &mut frames,
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": output_index,
            "content_index": 0, "part": {"type": "output_text", "text": reply.text, "annotations": []}}),
            false,
        );
        push(
            &mut frames,
            "response.output_item.done",
            json!({"output_index": output_index,
            "item": {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
                     "content": [{"type": "output_text", "text": reply.text, "annotations": []}]}}),
            false,
        );
        output_index += 1;
    }
    for index in call_order(reply) {
        let call: &ScriptedCall = &reply.tool_calls[index];
        let item_id = format!("fc_{handle}_{index}");
        let position = output_index + index;
        let arguments = call.arguments_text();
        push(
            &mut frames,
            "response.output_item.added",
            json!({"output_index": position,
            "item": {"id": item_id, "type": "function_call", "status": "in_progress", "call_id": ids[index],
                     "name": call.name, "arguments": ""}}),
            false,
        );
        for piece in argument_pieces(&arguments) {
            push(
                &mut frames,
                "response.function_call_arguments.delta",
                json!({"item_id": item_id,
                "output_index": position, "delta": piece}),
                false,
            );
        }
        push(
            &mut frames,
            "response.function_call_arguments.done",
            json!({"item_id": item_id,
            "output_index": position, "arguments": arguments}),
            false,
        );
        push(
            &mut frames,
            "response.output_item.done",
            json!({"output_index": position,
            "item": {"id": item_id, "type": "function_call", "status": "completed", "call_id": ids[index],
                     "name": call.name, "arguments": arguments}}),
            false,
        );
    }
    push(
        &mut frames,
        "response.completed",
        json!({"response": responses_object(reply, handle, model, ids, "completed", usage)}),
        true,
    );
    frames
}

fn anthropic_frames(
    reply: &Reply,
    handle: &str,
    model: &str,
    ids: &[String],
    input: u64,
    output: u64,
) -> Vec<Frame> {
    let mut frames = vec![
        named_frame(
            "message_start",
            &json!({"type": "message_start", "message": {"id": handle, "type": "message",
            "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input, "output_tokens": 1}}}),
            false,
            None,
        ),
        named_frame("ping", &json!({"type": "ping"}), false, None),
    ];
    let mut block_index = 0usize;
    if !reply.text.is_empty() {
        frames.push(named_frame(
            "content_block_start",
            &json!({"type": "content_block_start", "index": block_index,
            "content_block": {"type": "text", "text": ""}}),
            false,
            None,
        ));
        for piece in text_pieces(&reply.text) {
            frames.push(named_frame(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": block_index,
                "delta": {"type": "text_delta", "text": piece}}),
                false,
                None,
            ));
        }
        frames.push(named_frame(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": block_index}),
            false,
            None,
        ));
        block_index += 1;
    }
    for index in call_order(reply) {
        let call = &reply.tool_calls[index];
        let position = block_index + index;
        frames.push(named_frame(
            "content_block_start",
            &json!({"type": "content_block_start", "index": position,
            "content_block": {"type": "tool_use", "id": ids[index], "name": call.name, "input": {}}}),
            false,
            None,
        ));
        for piece in argument_pieces(&call.arguments_text()) {
            frames.push(named_frame(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": position,
                "delta": {"type": "input_json_delta", "partial_json": piece}}),
                false,
                None,
            ));
        }
        frames.push(named_frame(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": position}),
            false,
            None,
        ));
    }
    let stop_reason = if reply.tool_calls.is_empty() {
        "end_turn"
    } else {
        "tool_use"
    };
    frames.push(named_frame(
        "message_delta",
        &json!({"type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": output}}),
        true,
        None,
    ));
    frames.push(named_frame(
        "message_stop",
        &json!({"type": "message_stop"}),
        true,
        None,
    ));
    frames
}

fn gemini_arguments(call: &ScriptedCall) -> Value {
    match &call.arguments {
        Value::String(text) => {
            serde_json::from_str::<Value>(text).unwrap_or_else(|_| Value::String(text.clone()))
        }
        other => other.clone(),
    }
}

fn gemini_frames(reply: &Reply, handle: &str, model: &str, input: u64, output: u64) -> Vec<Frame> {
    // Like the real API, every chunk reports the cumulative `candidatesTokenCount`, which grows
    // with each chunk of new output (the decoder relies on it to drop transport duplicates).
    let chunk = |parts: Value, finish: Option<&str>, produced: u64| {
        let mut candidate = json!({"content": {"role": "model", "parts": parts}, "index": 0});
        if let Some(reason) = finish {
            candidate["finishReason"] = json!(reason);
        }
        let mut body = json!({"candidates": [candidate], "modelVersion": model, "responseId": handle});
        body["usageMetadata"] = json!({"promptTokenCount": input, "candidatesTokenCount": produced,
                                       "totalTokenCount": input + produced});
        body
    };
    let pieces = text_pieces(&reply.text);
    let order = call_order(reply);
    let chunks_with_output = (pieces.len() + usize::from(!order.is_empty())) as u64;
    let mut produced = 0u64;
    let mut frames = Vec::new();
    for piece in pieces {
        produced += 1;
        frames.push(data_frame(
            &chunk(json!([{"text": piece}]), None, produced),
            false,
        ));
    }
    if !order.is_empty() {
        let parts: Vec<Value> = order
            .iter()
            .map(|&index| {
                let call = &reply.tool_calls[index];
                json!({"functionCall": {"name": call.name, "args": gemini_arguments(call)}})
            })
            .collect();
        produced += 1;
        frames.push(data_frame(&chunk(Value::Array(parts), None, produced), false));
    }
    let total = output.max(chunks_with_output);
    frames.push(data_frame(
        &chunk(json!([{"text": ""}]), Some("STOP"), total),
        true,
    ));
    frames
}

/// The non-streaming response body of one API.
pub fn whole_body(
    api: Api,
    reply: &Reply,
    handle: &str,
    model: &str,
    ids: &[String],
    prompt_bytes: usize,
) -> Value {
    let (input, output) = usage_tokens(reply, prompt_bytes);
    let output = match api {
        Api::OpenAiChat | Api::OpenAiResponses => openai_output_tokens(reply, model, output),
        Api::Anthropic | Api::Gemini => output,
    };
    match api {
        Api::OpenAiChat => {
            let tool_calls: Vec<Value> = reply
                .tool_calls
                .iter()
                .enumerate()
                .map(|(i, call)| {
                    json!({"id": ids[i], "type": "function",
                                        "function": {"name": call.name, "arguments": call.arguments_text()}})
                })
                .collect();
            let mut message = json!({"role": "assistant", "content": if reply.text.is_empty() { Value::Null } else { json!(reply.text) },
                                     "refusal": null});
            if !tool_calls.is_empty() {
                message["tool_calls"] = Value::Array(tool_calls);
            }
            json!({"id": handle, "object": "chat.completion", "created": 1_764_000_000, "model": model,
                   "choices": [{"index": 0, "message": message, "logprobs": null,
                                "finish_reason": if reply.tool_calls.is_empty() { "stop" } else { "tool_calls" }}],
                   "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output}})
        }
        Api::OpenAiResponses => responses_object(reply, handle, model, ids, "completed", (input, output)),
        Api::Anthropic => {
            let mut content = Vec::new();
            if !reply.text.is_empty() {
                content.push(json!({"type": "text", "text": reply.text}));
            }
            for (i, call) in reply.tool_calls.iter().enumerate() {
                content.push(json!({"type": "tool_use", "id": ids[i], "name": call.name, "input": gemini_arguments(call)}));
            }
            json!({"id": handle, "type": "message", "role": "assistant", "model": model, "content": content,
                   "stop_reason": if reply.tool_calls.is_empty() { "end_turn" } else { "tool_use" },
                   "stop_sequence": null, "usage": {"input_tokens": input, "output_tokens": output}})
        }
        Api::Gemini => {
            let mut parts = Vec::new();
            if !reply.text.is_empty() {
                parts.push(json!({"text": reply.text}));
            }
            for call in &reply.tool_calls {
                parts.push(json!({"functionCall": {"name": call.name, "args": gemini_arguments(call)}}));
            }
            json!({"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
                   "usageMetadata": {"promptTokenCount": input, "candidatesTokenCount": output,
                                     "totalTokenCount": input + output},
                   "modelVersion": model, "responseId": handle})
        }
    }
}

/// The provider-style error body for an HTTP status.
pub fn error_body(api: Api, status: u16) -> Value {
    let message = format!("simulated error {status}");
    match api {
        Api::OpenAiChat | Api::OpenAiResponses => {
            let kind = match status {
                429 => "rate_limit_error",
                400..=499 => "invalid_request_error",
                _ => "server_error",
            };
            json!({"error": {"message": message, "type": kind, "param": null, "code": null}})
        }
        Api::Anthropic => {
            let kind = match status {
                429 => "rate_limit_error",
                529 => "overloaded_error",
                400..=499 => "invalid_request_error",
                _ => "api_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": message}})
        }
        Api::Gemini => {
            let kind = match status {
                429 => "RESOURCE_EXHAUSTED",
                400..=499 => "INVALID_ARGUMENT",
                503 => "UNAVAILABLE",
                _ => "INTERNAL",
            };
            json!({"error": {"code": status, "message": message, "status": kind}})
        }
    }
}
