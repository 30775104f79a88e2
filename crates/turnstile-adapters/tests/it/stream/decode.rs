//! Decoders + assembler on the hand-written fixtures: `check(input, expected)` per file, any
//! split of the bytes gives the same events, and each API's documented quirks.

use super::support::{Ending, Outcome, Rng, decode_chunks, outcome, own_fixtures, random_chunks, toolset};
use proptest::prelude::*;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::stream::{SeqSource, StreamEvent};
use turnstile_core::{Conversation, Verdict, validate};

fn check(api: StreamApi, name: &str, bytes: &[u8], expected: &Outcome) {
    for ending in [Ending::Live, Ending::File] {
        let actual = outcome(api, bytes, ending, Some(toolset()));
        assert_eq!(&actual, expected, "{name} ({ending:?})");
    }
}

#[test]
fn every_hand_written_fixture_assembles_to_its_expected_outcome() {
    let fixtures = own_fixtures();
    assert!(fixtures.len() >= 16, "fixtures went missing: {}", fixtures.len());
    for (api, name, bytes, expected) in &fixtures {
        check(*api, name, bytes, expected);
    }
}

#[test]
fn committed_fixture_turns_revalidate_as_v1_history() {
    for (_, name, _, expected) in own_fixtures() {
        let Outcome::Committed(turn) = expected else {
            continue;
        };
        let tools: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(super::support::data_dir().join("tools-weather.json")).unwrap(),
        )
        .unwrap();
        let mut turn = turn.clone();
        turn["revision"] = 2.into();
        let file = serde_json::json!({
            "format": "turnstile.conversation.v1", "conversation_id": "c-1", "revision": 2,
            "tools": tools,
            "turns": [{"id": "u", "revision": 1, "role": "user", "blocks": [{"id": "u.1", "kind": "text", "text": "hi"}]}, turn],
        });
        let verdict = validate(&Conversation::from_value(file).unwrap());
        assert!(
            matches!(verdict, Verdict::Ready | Verdict::Waiting { .. }),
            "{name}: the committed turn does not re-validate: {verdict:?}"
        );
    }
}

#[test]
fn the_provider_handle_is_surfaced_by_the_first_event_that_carries_it() {
    let cases: [(StreamApi, &[u8], &str); 4] = [
        (StreamApi::OpenAiChat, b"data: {\"id\":\"chatcmpl-X\",\"choices\":[]}\n\n", "chatcmpl-X"),
        (
            StreamApi::OpenAiResponses,
            b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_X\"}}\n\n",
            "resp_X",
        ),
        (
            StreamApi::AnthropicMessages,
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_X\"}}\n\n",
            "msg_X",
        ),
        (StreamApi::Gemini, b"data: {\"responseId\":\"rX\",\"candidates\":[]}\n\n", "rX"),
    ];
    for (api, bytes, handle) in cases {
        let events = decode_chunks(api, [bytes], Ending::Live);
        assert_eq!(
            events.first().map(|event| &event.event),
            Some(&StreamEvent::Handle {
                handle: handle.into()
            }),
            "{api:?}"
        );
    }
}

#[test]
fn responses_events_carry_the_provider_sequence_number_and_others_the_receive_ordinal() {
    let (_, _, bytes, _) = own_fixtures()
        .into_iter()
        .find(|(_, name, _, _)| name.ends_with("reasoning-text-two-calls.sse"))
        .unwrap();
    let events = decode_chunks(StreamApi::OpenAiResponses, [bytes.as_slice()], Ending::Live);
    assert!(events.iter().all(|event| event.seq.source == SeqSource::Provider));
    let (_, _, bytes, _) = own_fixtures()
        .into_iter()
        .find(|(_, name, _, _)| name.ends_with("parallel-keys.sse"))
        .unwrap();
    let events = decode_chunks(StreamApi::OpenAiChat, [bytes.as_slice()], Ending::Live);
    assert!(events.iter().all(|event| event.seq.source == SeqSource::Receive));
}

#[test]
fn tool_arguments_are_never_previewed() {
    use turnstile_core::assemble::Output;
    for (api, name, bytes, _) in own_fixtures() {
        let mut assembler = super::support::assembler(Some(toolset()));
        super::support::feed(
            &mut assembler,
            decode_chunks(api, [bytes.as_slice()], Ending::Live),
        );
        assembler.handle_end_of_input();
        while let Some(output) = assembler.poll_output() {
            if let Output::Preview { delta, .. } = output {
                for fragment in ["{\"city\"", "\"Paris\"}", "Tokyo\"", "Berlin", "town"] {
                    assert!(
                        !delta.contains(fragment),
                        "{name}: preview leaked tool arguments: {delta:?}"
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random splits of every fixture's bytes give exactly the events of the unsplit bytes.
    #[test]
    fn random_splits_of_the_byte_stream_give_identical_events(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        for (api, name, bytes, _) in own_fixtures() {
            let whole = decode_chunks(api, [bytes.as_slice()], Ending::Live);
            let chunks = random_chunks(&bytes, &mut rng);
            let split = decode_chunks(api, chunks.iter().map(Vec::as_slice), Ending::Live);
            prop_assert_eq!(&split, &whole, "seed {} fixture {}", seed, name);
        }
    }
}

#[test]
fn responses_and_anthropic_events_decode_the_same_with_or_without_event_lines() {
    // The typed fast paths key on the SSE event name; without `event:` lines (vercel/ai strips
    // them) the general path must give the same events.
    for (api, name, bytes, _) in own_fixtures() {
        if api != StreamApi::OpenAiResponses && api != StreamApi::AnthropicMessages {
            continue;
        }
        let text = String::from_utf8(bytes.clone()).unwrap();
        let stripped: String = text
            .lines()
            .filter(|line| !line.starts_with("event:"))
            .map(|line| format!("{line}\n"))
            .collect();
        assert_eq!(
            decode_chunks(api, [stripped.as_bytes()], Ending::Live),
            decode_chunks(api, [bytes.as_slice()], Ending::Live),
            "{name}"
        );
    }
}
