//! Every refusal and every malformed case gives its code and the path of the field concerned
//! (codes and paths are API; messages are not asserted). One table, one `check` helper.

use crate::import_props::import_as;
use serde_json::{Value, json};
use turnstile_adapters::import::import;
use turnstile_adapters::registry::Api;

const UNREPRESENTABLE: &str = "unrepresentable";
const MALFORMED: &str = "invalid_request";
const LIMIT: &str = "limit_exceeded";

fn check(api: Api, body: &[u8], code: &str, path: &str) {
    match import_as(api, body, "m") {
        Ok(imported) => panic!(
            "{api:?} {}: imported, expected {code} at {path:?}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)]),
            imported.document
        ),
        Err(error) => assert_eq!(
            (error.code(), error.path()),
            (code, path),
            "{api:?} {}: {error}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ),
    }
}

fn check_json(api: Api, body: Value, code: &str, path: &str) {
    check(api, &serde_json::to_vec(&body).unwrap(), code, path);
}

fn chat(messages: Value) -> Value {
    json!({"model": "gpt-4o", "messages": messages})
}

#[test]
fn chat_refusals_and_malformed_requests_name_their_field() {
    let user = json!({"role": "user", "content": "hi"});
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            json!({"model": "gpt-4o", "n": 2, "messages": [user]}),
            UNREPRESENTABLE,
            "n",
        ),
        (
            json!({"model": "gpt-4o", "n": 0, "messages": [user]}),
            MALFORMED,
            "n",
        ),
        (
            json!({"model": "gpt-4o", "audio": {"voice": "alloy", "format": "wav"}, "messages": [user]}),
            UNREPRESENTABLE,
            "audio",
        ),
        (
            json!({"model": "gpt-4o", "modalities": ["text", "audio"], "messages": [user]}),
            UNREPRESENTABLE,
            "modalities[1]",
        ),
        (
            json!({"model": "gpt-4o", "functions": [{"name": "f"}], "messages": [user]}),
            UNREPRESENTABLE,
            "functions",
        ),
        (
            json!({"model": "gpt-4o", "tools": [{"type": "custom", "custom": {"name": "grammar"}}], "messages": [user]}),
            UNREPRESENTABLE,
            "tools[0].type",
        ),
        (
            chat(
                json!([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}}]}]),
            ),
            UNREPRESENTABLE,
            "messages[0].content[0].type",
        ),
        (
            chat(json!([{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-abc"}}]}])),
            UNREPRESENTABLE,
            "messages[0].content[0].file.file_id",
        ),
        (
            chat(json!([{"role": "user", "content": [{"type": "video", "video": {}}]}])),
            UNREPRESENTABLE,
            "messages[0].content[0].type",
        ),
        (
            chat(json!([user, {"role": "function", "name": "f", "content": "x"}])),
            UNREPRESENTABLE,
            "messages[1].role",
        ),
        (
            chat(json!([user, {"role": "assistant", "audio": {"id": "audio_1"}}])),
            UNREPRESENTABLE,
            "messages[1].audio",
        ),
        (
            chat(
                json!([user, {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {"name": "g", "input": "x"}}]}]),
            ),
            UNREPRESENTABLE,
            "messages[1].tool_calls[0].type",
        ),
        (json!({"messages": [user]}), MALFORMED, "model"),
        (json!({"model": "gpt-4o"}), MALFORMED, "messages"),
        (
            json!({"model": "gpt-4o", "messages": {"role": "user"}}),
            MALFORMED,
            "messages",
        ),
        (
            json!({"model": "gpt-4o", "messages": [user], "stream": "yes"}),
            MALFORMED,
            "stream",
        ),
        (
            json!({"model": "gpt-4o", "messages": [user], "max_tokens": -1}),
            MALFORMED,
            "max_tokens",
        ),
        (
            chat(json!([{"role": 5, "content": "x"}])),
            MALFORMED,
            "messages[0].role",
        ),
        (
            chat(json!([{"role": "robot", "content": "x"}])),
            MALFORMED,
            "messages[0].role",
        ),
        (chat(json!(["hello"])), MALFORMED, "messages[0]"),
        (
            chat(json!([{"role": "user", "content": 42}])),
            MALFORMED,
            "messages[0].content",
        ),
        (
            chat(json!([{"role": "user", "content": [{"text": "no type"}]}])),
            MALFORMED,
            "messages[0].content[0].type",
        ),
        (
            chat(json!([user, {"role": "tool", "content": "x"}])),
            MALFORMED,
            "messages[1].tool_call_id",
        ),
        (
            chat(
                json!([user, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]),
            ),
            MALFORMED,
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            chat(
                json!([user, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
            ),
            MALFORMED,
            "messages[1].tool_calls[0].id",
        ),
    ];
    for (body, code, path) in cases {
        check_json(Api::OpenaiChat, body, code, path);
    }
    check_json(
        Api::OpenaiChat,
        json!({"model": "gpt-4o", "web_search_options": {"search_context_size": "low"}, "messages": [user]}),
        UNREPRESENTABLE,
        "web_search_options",
    );
}

#[test]
fn responses_refusals_and_malformed_requests_name_their_field() {
    let input = |items: Value| json!({"model": "gpt-4.1", "input": items});
    let user = json!({"role": "user", "content": "hi"});
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            json!({"model": "gpt-4.1", "previous_response_id": "resp_1", "input": [user]}),
            UNREPRESENTABLE,
            "previous_response_id",
        ),
        (
            json!({"model": "gpt-4.1", "conversation": "conv_1", "input": [user]}),
            UNREPRESENTABLE,
            "conversation",
        ),
        (
            json!({"model": "gpt-4.1", "prompt": {"id": "pmpt_1"}, "input": [user]}),
            UNREPRESENTABLE,
            "prompt",
        ),
        (
            json!({"model": "gpt-4.1", "tools": [{"type": "web_search"}], "input": [user]}),
            UNREPRESENTABLE,
            "tools[0].type",
        ),
        (
            json!({"model": "gpt-4.1", "tools": [{"type": "function"}], "input": [user]}),
            MALFORMED,
            "tools[0].name",
        ),
        (
            input(json!([user, {"type": "item_reference", "id": "msg_1"}])),
            UNREPRESENTABLE,
            "input[1].type",
        ),
        (
            input(json!([user, {"type": "web_search_call", "id": "ws_1", "status": "completed"}])),
            UNREPRESENTABLE,
            "input[1].type",
        ),
        (
            input(json!([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])),
            UNREPRESENTABLE,
            "input[0].content[0].type",
        ),
        (
            input(json!([{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}])),
            UNREPRESENTABLE,
            "input[0].content[0].file_id",
        ),
        (
            input(json!([{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}])),
            UNREPRESENTABLE,
            "input[0].content[0].file_id",
        ),
        (
            input(json!([{"role": "user", "content": [{"type": "input_file"}]}])),
            MALFORMED,
            "input[0].content[0]",
        ),
        (
            input(
                json!([user, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_url": "https://x/y.pdf"}]}]),
            ),
            UNREPRESENTABLE,
            "input[2].output[0].type",
        ),
        (
            input(json!([{"type": "reasoning", "summary": []}])),
            MALFORMED,
            "input[0].id",
        ),
        (
            input(
                json!([{"type": "reasoning", "id": "rs_1", "summary": [{"type": "reasoning_text", "text": "x"}]}]),
            ),
            UNREPRESENTABLE,
            "input[0].summary[0].type",
        ),
        (
            input(json!([{"content": "no role, no type"}])),
            MALFORMED,
            "input[0].type",
        ),
        (
            input(json!([{"role": "critic", "content": "x"}])),
            MALFORMED,
            "input[0].role",
        ),
        (input(json!(7)), MALFORMED, "input"),
        (json!({"model": "gpt-4.1"}), MALFORMED, "input"),
        (
            input(
                json!([user, {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]),
            ),
            MALFORMED,
            "input[1].arguments",
        ),
    ];
    for (body, code, path) in cases {
        check_json(Api::OpenaiResponses, body, code, path);
    }
}

#[test]
fn anthropic_refusals_and_malformed_requests_name_their_field() {
    let messages =
        |messages: Value| json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": messages});
    let user = json!({"role": "user", "content": "hi"});
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "tools": [{"type": "web_search_20250305", "name": "web_search"}], "messages": [user]}),
            UNREPRESENTABLE,
            "tools[0].type",
        ),
        (
            json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "tools": [{"name": "f"}], "messages": [user]}),
            MALFORMED,
            "tools[0].input_schema",
        ),
        (
            json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}], "messages": [user]}),
            UNREPRESENTABLE,
            "mcp_servers",
        ),
        (
            json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "container": "container_1", "messages": [user]}),
            UNREPRESENTABLE,
            "container",
        ),
        (
            json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "system": [{"type": "image", "source": {}}], "messages": [user]}),
            UNREPRESENTABLE,
            "system[0].type",
        ),
        (
            json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "system": 3, "messages": [user]}),
            MALFORMED,
            "system",
        ),
        (
            messages(
                json!([user, {"role": "assistant", "content": [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}]}]),
            ),
            UNREPRESENTABLE,
            "messages[1].content[0].type",
        ),
        (
            messages(
                json!([user, {"role": "assistant", "content": [{"type": "mcp_tool_use", "id": "m", "name": "n", "server_name": "s", "input": {}}]}]),
            ),
            UNREPRESENTABLE,
            "messages[1].content[0].type",
        ),
        (
            messages(
                json!([{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "file_1"}}]}]),
            ),
            UNREPRESENTABLE,
            "messages[0].content[0].source.type",
        ),
        (
            messages(
                json!([{"role": "user", "content": [{"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "x"}]}}]}]),
            ),
            UNREPRESENTABLE,
            "messages[0].content[0].source.type",
        ),
        (
            messages(
                json!([{"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t", "content": []}]}]),
            ),
            UNREPRESENTABLE,
            "messages[0].content[0].type",
        ),
        (
            messages(
                json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document", "source": {}}]}]}]),
            ),
            UNREPRESENTABLE,
            "messages[0].content[0].content[0].type",
        ),
        (
            messages(json!([{"role": "system", "content": "x"}])),
            MALFORMED,
            "messages[0].role",
        ),
        (
            messages(json!([{"role": "user"}])),
            MALFORMED,
            "messages[0].content",
        ),
        (
            messages(
                json!([user, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]),
            ),
            MALFORMED,
            "messages[1].content[0].input",
        ),
        (
            messages(
                json!([user, {"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]}]),
            ),
            MALFORMED,
            "messages[1].content[0].signature",
        ),
        (
            messages(
                json!([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]),
            ),
            MALFORMED,
            "messages[0].content[0].source.media_type",
        ),
        (
            messages(
                json!([{"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/html", "data": "<p>"}}]}]),
            ),
            MALFORMED,
            "messages[0].content[0].source.media_type",
        ),
        (json!({"max_tokens": 10, "messages": [user]}), MALFORMED, "model"),
    ];
    for (body, code, path) in cases {
        check_json(Api::AnthropicMessages, body, code, path);
    }
}

#[test]
fn gemini_refusals_and_malformed_requests_name_their_field() {
    let user = json!({"role": "user", "parts": [{"text": "hi"}]});
    let contents = |contents: Value| json!({"contents": contents});
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            json!({"contents": [user], "tools": [{"googleSearch": {}}]}),
            UNREPRESENTABLE,
            "tools[0].googleSearch",
        ),
        (
            json!({"contents": [user], "tools": [{"code_execution": {}}]}),
            UNREPRESENTABLE,
            "tools[0].codeExecution",
        ),
        (
            json!({"contents": [user], "tools": [{"functionDeclarations": [{"name": "f"}], "urlContext": {}}]}),
            UNREPRESENTABLE,
            "tools[0].urlContext",
        ),
        (
            json!({"contents": [user], "cachedContent": "cachedContents/abc"}),
            UNREPRESENTABLE,
            "cachedContent",
        ),
        (
            json!({"contents": [user], "generationConfig": {"candidateCount": 2}}),
            UNREPRESENTABLE,
            "generationConfig.candidateCount",
        ),
        (
            json!({"contents": [user], "generationConfig": {"responseModalities": ["TEXT", "IMAGE"]}}),
            UNREPRESENTABLE,
            "generationConfig.responseModalities[1]",
        ),
        (
            contents(
                json!([{"role": "user", "parts": [{"inlineData": {"mimeType": "audio/wav", "data": "UklGR"}}]}]),
            ),
            UNREPRESENTABLE,
            "contents[0].parts[0].inlineData.mimeType",
        ),
        (
            contents(
                json!([{"role": "user", "parts": [{"file_data": {"mime_type": "video/mp4", "file_uri": "https://x/v.mp4"}}]}]),
            ),
            UNREPRESENTABLE,
            "contents[0].parts[0].fileData.mimeType",
        ),
        (
            contents(
                json!([user, {"role": "model", "parts": [{"executableCode": {"language": "PYTHON", "code": "print(1)"}}]}]),
            ),
            UNREPRESENTABLE,
            "contents[1].parts[0].executableCode",
        ),
        (
            contents(json!([user, {"role": "model", "parts": [{"text": "hmm", "thought": true}]}])),
            UNREPRESENTABLE,
            "contents[1].parts[0].thought",
        ),
        (
            contents(
                json!([user, {"role": "model", "parts": [{"functionCall": {"name": "f"}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {}, "parts": [{"inlineData": {}}]}}]}]),
            ),
            UNREPRESENTABLE,
            "contents[2].parts[0].functionResponse.parts",
        ),
        (
            contents(json!([{"role": "user", "parts": [{"text": "a", "functionCall": {"name": "f"}}]}])),
            MALFORMED,
            "contents[0].parts[0]",
        ),
        (
            contents(
                json!([{"role": "user", "parts": [{"thought_signature": "x", "thoughtSignature": "y"}]}]),
            ),
            MALFORMED,
            "contents[0].parts[0].thought_signature",
        ),
        (
            contents(json!([{"role": "user", "parts": [{}]}])),
            MALFORMED,
            "contents[0].parts[0]",
        ),
        (
            contents(json!([{"role": "system", "parts": [{"text": "x"}]}])),
            MALFORMED,
            "contents[0].role",
        ),
        (
            contents(json!([{"role": "user"}])),
            MALFORMED,
            "contents[0].parts",
        ),
        (
            contents(
                json!([user, {"role": "model", "parts": [{"functionCall": {"name": "f", "args": [1]}}]}]),
            ),
            MALFORMED,
            "contents[1].parts[0].functionCall.args",
        ),
        (
            json!({"systemInstruction": "be brief", "contents": [user]}),
            MALFORMED,
            "systemInstruction",
        ),
        (json!({}), MALFORMED, "contents"),
    ];
    for (body, code, path) in cases {
        check_json(Api::Gemini, body, code, path);
    }
    // The model is in the URL path: without it there is no request.
    let error = import(Api::Gemini, br#"{"contents": []}"#, "c", None).unwrap_err();
    assert_eq!((error.code(), error.path()), (MALFORMED, "model"));
}

// Ranges and counts as each API documents them (`sampling.rs` cites the pages): what the
// provider itself would answer 400 to is `invalid_request` at the client's own field.
#[test]
fn generation_settings_of_the_wrong_type_or_outside_the_clients_api_range_name_their_field() {
    let chat = |extra: Value| {
        let mut body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let responses = |extra: Value| {
        let mut body = json!({"model": "gpt-4.1", "input": "hi"});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let anthropic = |extra: Value| {
        let mut body = json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let gemini = |config: Value| json!({"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": config});
    let cases: Vec<(Api, Value, &str)> = vec![
        (Api::OpenaiChat, chat(json!({"temperature": 2.5})), "temperature"),
        (
            Api::OpenaiChat,
            chat(json!({"temperature": "0.2"})),
            "temperature",
        ),
        (Api::OpenaiChat, chat(json!({"top_p": -0.1})), "top_p"),
        (
            Api::OpenaiChat,
            chat(json!({"presence_penalty": 3})),
            "presence_penalty",
        ),
        (
            Api::OpenaiChat,
            chat(json!({"frequency_penalty": -2.01})),
            "frequency_penalty",
        ),
        (
            Api::OpenaiChat,
            chat(json!({"stop": ["a", "b", "c", "d", "e"]})),
            "stop",
        ),
        (Api::OpenaiChat, chat(json!({"stop": ["a", 1]})), "stop[1]"),
        (Api::OpenaiChat, chat(json!({"stop": 7})), "stop"),
        (Api::OpenaiChat, chat(json!({"seed": 1.5})), "seed"),
        (
            Api::OpenaiChat,
            chat(json!({"seed": 9223372036854775808u64})),
            "seed",
        ),
        (
            Api::OpenaiResponses,
            responses(json!({"temperature": 2.1})),
            "temperature",
        ),
        (Api::OpenaiResponses, responses(json!({"top_p": 1.5})), "top_p"),
        (
            Api::AnthropicMessages,
            anthropic(json!({"temperature": 1.5})),
            "temperature",
        ),
        (Api::AnthropicMessages, anthropic(json!({"top_p": 2})), "top_p"),
        (Api::AnthropicMessages, anthropic(json!({"top_k": -1})), "top_k"),
        (Api::AnthropicMessages, anthropic(json!({"top_k": 2.5})), "top_k"),
        (
            Api::AnthropicMessages,
            anthropic(json!({"stop_sequences": "END"})),
            "stop_sequences",
        ),
        (
            Api::Gemini,
            gemini(json!({"temperature": 2.5})),
            "generationConfig.temperature",
        ),
        (
            Api::Gemini,
            gemini(json!({"top_p": 1.5})),
            "generationConfig.topP",
        ),
        (Api::Gemini, gemini(json!({"topK": -3})), "generationConfig.topK"),
        (Api::Gemini, gemini(json!({"topK": 2.5})), "generationConfig.topK"),
        (
            Api::Gemini,
            gemini(json!({"topK": 2147483648u64})),
            "generationConfig.topK",
        ),
        (
            Api::Gemini,
            gemini(json!({"seed": 2147483648u64})),
            "generationConfig.seed",
        ),
        (
            Api::Gemini,
            gemini(json!({"stopSequences": ["1", "2", "3", "4", "5", "6"]})),
            "generationConfig.stopSequences",
        ),
        (
            Api::Gemini,
            gemini(json!({"stop_sequences": [true]})),
            "generationConfig.stopSequences[0]",
        ),
        (
            Api::Gemini,
            gemini(json!({"presencePenalty": "high"})),
            "generationConfig.presencePenalty",
        ),
    ];
    for (api, body, path) in cases {
        check_json(api, body, MALFORMED, path);
    }
}

#[test]
fn bodies_that_are_not_json_objects_or_break_a_limit_are_refused_before_any_import() {
    for api in [
        Api::OpenaiChat,
        Api::OpenaiResponses,
        Api::AnthropicMessages,
        Api::Gemini,
    ] {
        check(api, b"", MALFORMED, "");
        check(api, b"{\"model\":", MALFORMED, "");
        check(api, b"[1, 2]", MALFORMED, "");
        check(api, b"\"text\"", MALFORMED, "");
        let deep = format!("{}{}", "[".repeat(65), "]".repeat(65));
        check(api, deep.as_bytes(), LIMIT, "");
        let huge = vec![b' '; turnstile_core::limits::FILE_BYTES_MAX + 1];
        check(api, &huge, LIMIT, "");
    }
    // Blocks per turn, counted while building (the parts of one message are one turn).
    let parts: Vec<Value> = (0..turnstile_core::limits::BLOCKS_PER_TURN_MAX + 1)
        .map(|index| json!({"type": "text", "text": index.to_string()}))
        .collect();
    check_json(
        Api::OpenaiChat,
        chat(json!([{"role": "user", "content": parts}])),
        LIMIT,
        "messages[0]",
    );
    let tools: Vec<Value> = (0..turnstile_core::limits::TOOLS_MAX + 1)
        .map(|index| json!({"name": format!("f{index}"), "input_schema": {"type": "object"}}))
        .collect();
    check_json(
        Api::AnthropicMessages,
        json!({"model": "m", "max_tokens": 1, "tools": tools, "messages": []}),
        LIMIT,
        "tools[512]",
    );
}
