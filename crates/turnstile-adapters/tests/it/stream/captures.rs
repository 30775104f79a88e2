//! Conformance on the recorded captures in shared `fixtures/provider-streams/` (read in place,
//! never copied): each decodes and assembles to the turn its README describes. `.jsonl` files
//! are wrapped as SSE events as that README says. Bedrock is not SSE and has no adapter id, so
//! its three files are not part of this suite.

use super::support::{Ending, Outcome, captures_dir, decode_chunks, feed, finish, outcome, wrap_jsonl};
use serde_json::Value;
use std::path::Path;
use turnstile_adapters::decode::StreamApi;

/// The bytes of a capture as SSE.
pub fn capture_bytes(dir: &Path, relative: &str) -> Vec<u8> {
    let path = dir.join(relative);
    if relative.ends_with(".jsonl") {
        let named = relative.starts_with("anthropic/") || relative.starts_with("openai-responses/");
        wrap_jsonl(&std::fs::read_to_string(path).unwrap(), named)
    } else {
        std::fs::read(path).unwrap()
    }
}

/// A turn summarized as one line per block: `text:…`, `reasoning:<provider>:<sealed by>`,
/// `tool_call:<call_id>:<tool>:<arguments as canonical JSON>`.
pub fn summary(outcome: &Outcome) -> Vec<String> {
    let Outcome::Committed(turn) = outcome else {
        return vec![format!("{outcome:?}")];
    };
    turn["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|block| match block["kind"].as_str().unwrap() {
            "text" => format!("text:{}", block["text"].as_str().unwrap()),
            "reasoning" => format!(
                "reasoning:{}:{}",
                block["provider"].as_str().unwrap(),
                if block.get("signature").is_some() {
                    "signature"
                } else {
                    "encrypted"
                }
            ),
            "tool_call" => {
                let arguments = match &block["arguments"] {
                    Value::String(text) => serde_json::from_str::<Value>(text).unwrap(),
                    other => other.clone(),
                };
                format!(
                    "tool_call:{}:{}:{}",
                    block["call_id"].as_str().unwrap(),
                    block["tool"].as_str().unwrap(),
                    arguments
                )
            }
            other => panic!("unexpected block kind {other}"),
        })
        .collect()
}

/// (capture, API, how it must end under the file rule, and under the live rule if different).
pub fn cases() -> Vec<(&'static str, StreamApi, Vec<&'static str>)> {
    vec![
        (
            "openai-chat/gpt-4o-parallel-tool-calls.sse",
            StreamApi::OpenAiChat,
            vec![
                r#"tool_call:call_JMW1whyEaYG438VE1OIflxA2:GetWeatherArgs:{"city":"Edinburgh","country":"GB","units":"c"}"#,
                r#"tool_call:call_DNYTawLBoN8fj3KN6qU9N1Ou:get_stock_price:{"exchange":"NASDAQ","ticker":"AAPL"}"#,
            ],
        ),
        // `max_tokens=1`: one text delta, then `length`; text is whole as far as the provider
        // is concerned, so the turn commits
        // (docs/decisions/0017-stream-assembly-when-a-turn-commits.md).
        (
            "openai-chat/gpt-4o-length-with-usage.sse",
            StreamApi::OpenAiChat,
            vec!["text:{\""],
        ),
        (
            "openai-chat/compat-tool-call-index-starts-at-1.sse",
            StreamApi::OpenAiChat,
            vec![
                "text:Reading it.",
                r#"tool_call:toolu_sanitized:read_file:{"path":"a.txt"}"#,
            ],
        ),
        (
            "openai-responses/azure-function-call.jsonl",
            StreamApi::OpenAiResponses,
            vec![r#"tool_call:call_H5DxLSFnsGhiROnUiDHmgyc8:weather:{"location":"San Francisco"}"#],
        ),
        (
            "openai-responses/error-then-failed.jsonl",
            StreamApi::OpenAiResponses,
            vec![r#"Retracted("provider_error")"#],
        ),
        (
            "anthropic/text-then-tool-use.sse",
            StreamApi::AnthropicMessages,
            vec![
                "text:I'll check the current weather in Paris for you.",
                r#"tool_call:toolu_01NRLabsLyVHZPKxbKvkfSMn:get_weather:{"location":"Paris"}"#,
            ],
        ),
        (
            "anthropic/max-tokens-mid-tool-input.sse",
            StreamApi::AnthropicMessages,
            vec![r#"Retracted("max_tokens_in_tool_arguments")"#],
        ),
        (
            "anthropic/tool-no-args.jsonl",
            StreamApi::AnthropicMessages,
            vec![
                "text:I'll update the issue list for you.",
                "tool_call:toolu_01QE1WLsSVp5hy5Q3GmGTmjP:updateIssueList:{}",
            ],
        ),
        (
            "gemini/gemini3-tool-call-thought-signature.jsonl",
            StreamApi::Gemini,
            vec![
                "reasoning:gemini:signature",
                r#"tool_call:gemini-b36LacjwM668nsEP2tbsgQQ-0:weather:{"location":"San Francisco"}"#,
            ],
        ),
        (
            "gemini/vertex-parallel-streamed-function-call-args.jsonl",
            StreamApi::Gemini,
            vec![
                "reasoning:gemini:signature",
                "tool_call:gemini-_vr4aYiWEJnYodAPkujX0QM-0:read_theme:{}",
                r#"tool_call:gemini-_vr4aYiWEJnYodAPkujX0QM-1:read_screen:{"id":"A"}"#,
                r#"tool_call:gemini-_vr4aYiWEJnYodAPkujX0QM-2:read_screen:{"id":"B"}"#,
                r#"tool_call:gemini-_vr4aYiWEJnYodAPkujX0QM-3:read_screen:{"id":"C"}"#,
            ],
        ),
        (
            "gemini/gemini3-text.jsonl",
            StreamApi::Gemini,
            vec![
                "text:There are **3** \"r\"s in strawberry.\n\nst**r**awbe**rr**y",
                "reasoning:gemini:signature",
            ],
        ),
    ]
}

#[test]
fn every_recorded_capture_assembles_to_the_turn_its_readme_describes() {
    let Some(dir) = captures_dir() else { return };
    for (relative, api, expected) in cases() {
        let bytes = capture_bytes(&dir, relative);
        let actual = summary(&outcome(api, &bytes, Ending::File, None));
        assert_eq!(actual, expected, "{relative}");
    }
}

#[test]
fn two_captures_lost_their_final_blank_line_and_live_rules_commit_only_the_chat_one_ended_by_its_finish_reason()
 {
    // WHATWG: an event without its terminating blank line at end of input is discarded. The
    // two stored SSE files end right after their last data line, so on a live connection the
    // end marker never arrives; `turnstile assemble` reads files and completes that last
    // event (see `SseParser::handle_end_of_file`). Anthropic's turn ends only at its
    // `message_stop`, so nothing commits; a Chat body that ended cleanly after its finish
    // reason is complete without `data: [DONE]` (issue 48, item 2), so it commits the same
    // turn as the file.
    let Some(dir) = captures_dir() else { return };
    for relative in [
        "anthropic/text-then-tool-use.sse",
        "openai-chat/compat-tool-call-index-starts-at-1.sse",
    ] {
        let api = if relative.starts_with("anthropic") {
            StreamApi::AnthropicMessages
        } else {
            StreamApi::OpenAiChat
        };
        let bytes = capture_bytes(&dir, relative);
        assert!(
            !bytes.ends_with(b"\n\n"),
            "{relative} now ends with a blank line: update this test"
        );
        let live = outcome(api, &bytes, Ending::Live, None);
        if api == StreamApi::OpenAiChat {
            assert_eq!(
                summary(&live),
                summary(&outcome(api, &bytes, Ending::File, None)),
                "{relative}"
            );
            assert!(matches!(live, Outcome::Committed(_)), "{relative}: {live:?}");
        } else {
            assert_eq!(live, Outcome::Retracted("cut_stream".into()), "{relative}");
        }
        let mut terminated = bytes.clone();
        terminated.extend_from_slice(if bytes.ends_with(b"\n") { b"\n" } else { b"\n\n" });
        assert_eq!(
            summary(&outcome(api, &terminated, Ending::Live, None)),
            summary(&outcome(api, &bytes, Ending::File, None)),
            "{relative}"
        );
    }
}

#[test]
fn the_four_concatenated_responses_each_assemble_and_a_single_assembler_quarantines_the_later_ones() {
    let Some(dir) = captures_dir() else { return };
    let text =
        std::fs::read_to_string(dir.join("openai-responses/reasoning-function-calls-4-steps.jsonl")).unwrap();
    // Split on `response.created`, as the README says.
    let mut streams: Vec<String> = Vec::new();
    for line in text.lines() {
        if line.contains("\"type\":\"response.created\"") {
            streams.push(String::new());
        }
        let current = streams.last_mut().expect("the file starts with response.created");
        current.push_str(line);
        current.push('\n');
    }
    let summaries: Vec<Vec<String>> = streams
        .iter()
        .map(|stream| {
            summary(&outcome(
                StreamApi::OpenAiResponses,
                &wrap_jsonl(stream, true),
                Ending::Live,
                None,
            ))
        })
        .collect();
    assert_eq!(
        summaries,
        vec![
            vec![
                "reasoning:openai:encrypted".to_owned(),
                r#"tool_call:call_AB6AaRZ1FYZB2RwS6A5vbdqn:calculator:{"a":12,"b":7,"op":"add"}"#.to_owned()
            ],
            vec![
                r#"tool_call:call_Q6pW65MUgW9vF59BmItYGos3:calculator:{"a":19,"b":3,"op":"multiply"}"#
                    .to_owned()
            ],
            vec![
                r#"tool_call:call_Zl5vIMnD7dVAjgU6FkhmiCZh:calculator:{"a":57,"b":10,"op":"multiply"}"#
                    .to_owned()
            ],
            vec!["text:The final result is **570**.".to_owned()],
        ]
    );
    // One assembler fed the whole file: the first response commits; every event of the other
    // three handles is quarantined, never merged.
    let mut assembler = super::support::assembler(None);
    let events = decode_chunks(
        StreamApi::OpenAiResponses,
        [wrap_jsonl(&text, true).as_slice()],
        Ending::Live,
    );
    let quarantined = feed(&mut assembler, events);
    assert!(quarantined > 0);
    assert_eq!(summary(&finish(&mut assembler)), summaries[0]);
}

#[test]
fn anthropic_cache_counters_are_decoded_from_a_recorded_stream() {
    use turnstile_core::stream::StreamEvent;
    let dir = captures_dir().expect("TURNSTILE_SHARED must hold fixtures/provider-streams");
    let bytes = capture_bytes(&dir, "anthropic/text-then-tool-use.sse");
    let events = decode_chunks(StreamApi::AnthropicMessages, [&bytes[..]], Ending::File);
    let usage: Vec<(Option<u64>, Option<u64>, Option<u64>, Option<u64>)> = events
        .iter()
        .filter_map(|sequenced| match &sequenced.event {
            StreamEvent::Usage {
                input_tokens,
                output_tokens,
                cache_creation_input_tokens,
                cache_read_input_tokens,
            } => Some((
                *input_tokens,
                *output_tokens,
                *cache_creation_input_tokens,
                *cache_read_input_tokens,
            )),
            _ => None,
        })
        .collect();
    // The capture's `message_start` usage (377 in, both cache counters 0) and `message_delta` (65 out).
    assert_eq!(
        usage,
        [
            (Some(377), Some(1), Some(0), Some(0)),
            (None, Some(65), None, None)
        ]
    );
}
