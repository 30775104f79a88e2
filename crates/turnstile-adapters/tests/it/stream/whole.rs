//! Issue 48, item 4: a complete JSON answer to a stream request (a server that ignores
//! `"stream": true`) commits exactly the turn the same answer streamed commits, on every API;
//! a body cut short commits nothing.

use super::support::{Ending, Outcome, outcome, toolset};
use serde_json::json;
use turnstile_adapters::decode::StreamApi;
use turnstile_adapters::simulate::script::{Reply, ScriptedCall};
use turnstile_adapters::simulate::wire::{Api, call_ids, frames, whole_body};

fn reply() -> Reply {
    Reply {
        text: "Checking the weather in both cities.".into(),
        tool_calls: vec![
            ScriptedCall {
                id: None,
                name: "get_weather".into(),
                arguments: json!({"city": "Paris"}),
            },
            ScriptedCall {
                id: None,
                name: "get_weather".into(),
                arguments: json!({"city": "Tokyo"}),
            },
        ],
        ..Reply::default()
    }
}

const APIS: [(Api, StreamApi); 4] = [
    (Api::OpenAiChat, StreamApi::OpenAiChat),
    (Api::OpenAiResponses, StreamApi::OpenAiResponses),
    (Api::Anthropic, StreamApi::AnthropicMessages),
    (Api::Gemini, StreamApi::Gemini),
];

#[test]
fn a_whole_json_answer_commits_the_turn_its_stream_commits_on_every_api() {
    let reply = reply();
    for (api, stream_api) in APIS {
        let ids = call_ids(api, &reply, 1);
        let streamed: Vec<u8> = frames(api, &reply, "h-1", "gpt-4o", &ids, 100)
            .into_iter()
            .flat_map(|frame| frame.bytes)
            .collect();
        let whole = whole_body(api, &reply, "h-1", "gpt-4o", &ids, 100).to_string();
        let expected = outcome(stream_api, &streamed, Ending::Live, Some(toolset()));
        assert!(matches!(expected, Outcome::Committed(_)), "{api:?}: {expected:?}");
        // Pretty-printed and with leading white space, as servers send it.
        let pretty = format!(
            "\n  {}",
            serde_json::to_string_pretty(&serde_json::from_str::<serde_json::Value>(&whole).unwrap())
                .unwrap()
        );
        for body in [whole.clone(), pretty] {
            assert_eq!(
                outcome(stream_api, body.as_bytes(), Ending::Live, Some(toolset())),
                expected,
                "{api:?}"
            );
        }
        // Every prefix of the body commits nothing.
        for cut in (0..whole.len()).step_by(7) {
            let got = outcome(
                stream_api,
                &whole.as_bytes()[..cut],
                Ending::Live,
                Some(toolset()),
            );
            assert!(matches!(got, Outcome::Retracted(_)), "{api:?} cut {cut}: {got:?}");
        }
    }
}

#[test]
fn a_json_error_answer_or_junk_is_no_turn() {
    for (_, stream_api) in APIS {
        for body in [
            r#"{"error": {"message": "overloaded", "type": "server_error"}}"#,
            r#"{"not": "an answer"}"#,
            "{ not json",
            "[1, 2",
            // Shapes whose members are not objects (once a panic on index assignment), and a
            // Responses answer that is not finished (once read as a stop).
            r#"{"error": "rate limited"}"#,
            "[{}]",
            "[1]",
            r#"{"status": "completed", "output": [{"type": "message", "content": ["hi"]}]}"#,
            r#"{"status": "completed", "output": ["hi"]}"#,
            r#"{"content": ["hi"], "stop_reason": "end_turn"}"#,
            r#"{"status": "in_progress", "output": [{"type": "message", "id": "m", "content": [{"type": "output_text", "text": "half"}]}]}"#,
        ] {
            let got = outcome(stream_api, body.as_bytes(), Ending::Live, Some(toolset()));
            assert!(
                matches!(got, Outcome::Retracted(_)),
                "{stream_api:?} {body}: {got:?}"
            );
        }
    }
}
