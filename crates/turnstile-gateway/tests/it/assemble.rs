//! `turnstile assemble`: exit 0 with the v1 turn JSON, exit 6 with the reason and never a
//! partial tool call, exit 2 for usage errors; on the adapters crate's hand-written fixtures
//! (and the shared captures when present), whole and cut.

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../turnstile-adapters/tests/data")
}

fn turnstile(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(bytes) = stdin {
        let _ = child.stdin.take().unwrap().write_all(bytes);
    } else {
        drop(child.stdin.take());
    }
    child.wait_with_output().unwrap()
}

fn adapter_of(dir: &str) -> &'static str {
    match dir {
        "openai-chat" => "openai-chat@1",
        "openai-responses" => "openai-responses@1",
        "anthropic-messages" => "anthropic-messages@2",
        "gemini" => "gemini@1",
        other => panic!("{other}"),
    }
}

#[test]
fn every_fixture_exits_0_with_its_turn_or_6_with_its_reason() {
    let tools = fixtures().join("tools-weather.json");
    let mut checked = 0;
    for dir in ["openai-chat", "openai-responses", "anthropic-messages", "gemini"] {
        for entry in std::fs::read_dir(fixtures().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|ext| ext != "sse") {
                continue;
            }
            let expected: Value =
                serde_json::from_str(&std::fs::read_to_string(path.with_extension("expected.json")).unwrap())
                    .unwrap();
            let output = turnstile(
                &[
                    "assemble",
                    path.to_str().unwrap(),
                    "--adapter",
                    adapter_of(dir),
                    "--tools",
                    tools.to_str().unwrap(),
                    "--json",
                ],
                None,
            );
            let stdout: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|_| {
                panic!("{}: {}", path.display(), String::from_utf8_lossy(&output.stdout))
            });
            let mut turn_expected = expected.get("committed").cloned();
            if let Some(turn) = &mut turn_expected {
                // The CLI names the replayed turn `t-assembled`.
                let text = turn.to_string().replace("\"t-1", "\"t-assembled");
                *turn = serde_json::from_str(&text).unwrap();
            }
            match turn_expected {
                Some(turn) => {
                    assert_eq!(output.status.code(), Some(0), "{}", path.display());
                    assert_eq!(stdout, turn, "{}", path.display());
                }
                None => {
                    assert_eq!(output.status.code(), Some(6), "{}", path.display());
                    assert_eq!(stdout["status"], "retracted");
                    assert_eq!(stdout["code"], expected["retracted"], "{}", path.display());
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 16);
}

#[test]
fn a_cut_stream_exits_6_and_prints_no_part_of_any_tool_call() {
    let bytes = std::fs::read(fixtures().join("openai-chat/parallel-keys.sse")).unwrap();
    // Cut inside the second tool call's arguments, and just before `[DONE]`.
    for cut in [bytes.len() / 2, bytes.len() - 16] {
        for json in [false, true] {
            let mut args = vec!["assemble", "-", "--adapter", "openai-chat@2"];
            if json {
                args.push("--json");
            }
            let output = turnstile(&args, Some(&bytes[..cut]));
            assert_eq!(output.status.code(), Some(6), "cut {cut}");
            let printed = String::from_utf8_lossy(&output.stdout).to_string()
                + &String::from_utf8_lossy(&output.stderr);
            for fragment in [
                "call_paris",
                "call_tokyo",
                "get_weather",
                "Paris",
                "Tokyo",
                "tool_call",
            ] {
                assert!(
                    !printed.contains(fragment),
                    "cut {cut}: printed {fragment}: {printed}"
                );
            }
            assert!(printed.contains("cut_stream"), "{printed}");
        }
    }
}

#[test]
fn human_output_is_a_pretty_turn_or_one_reason_line() {
    let path = fixtures().join("anthropic-messages/thinking-text-tool.sse");
    let output = turnstile(
        &[
            "assemble",
            path.to_str().unwrap(),
            "--adapter",
            "anthropic-messages@1",
        ],
        None,
    );
    assert_eq!(output.status.code(), Some(0));
    let turn: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(turn["role"], "assistant");
    let path = fixtures().join("anthropic-messages/missing-stop.sse");
    let output = turnstile(
        &[
            "assemble",
            path.to_str().unwrap(),
            "--adapter",
            "anthropic-messages@1",
        ],
        None,
    );
    assert_eq!(output.status.code(), Some(6));
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("nothing committed: missing_stop"));
}

#[test]
fn usage_errors_exit_2() {
    let path = fixtures().join("gemini/text-only-cr.sse");
    let path = path.to_str().unwrap();
    for args in [
        vec!["assemble", path],
        vec!["assemble", path, "--adapter", "bedrock-converse@1"],
        vec!["assemble", "/no/such/file", "--adapter", "gemini@1"],
        vec![
            "assemble",
            path,
            "--adapter",
            "gemini@1",
            "--tools",
            "/no/such/tools.json",
        ],
        vec!["assemble", path, "--adapter", "gemini@1", "--tools", path],
    ] {
        let output = turnstile(&args, None);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[test]
fn the_shared_anthropic_capture_commits_its_tool_call() {
    let shared = match std::env::var_os("TURNSTILE_SHARED") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"),
    };
    let path = shared.join("fixtures/provider-streams/anthropic/text-then-tool-use.sse");
    if !path.is_file() {
        println!(
            "shared captures not found at {} (set TURNSTILE_SHARED): skipped this check",
            path.display()
        );
        return;
    }
    let output = turnstile(
        &[
            "assemble",
            path.to_str().unwrap(),
            "--adapter",
            "anthropic-messages@1",
            "--json",
        ],
        None,
    );
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
    let turn: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(turn["blocks"][1]["call_id"], "toolu_01NRLabsLyVHZPKxbKvkfSMn");
    let path = shared.join("fixtures/provider-streams/anthropic/max-tokens-mid-tool-input.sse");
    let output = turnstile(
        &[
            "assemble",
            path.to_str().unwrap(),
            "--adapter",
            "anthropic-messages@1",
        ],
        None,
    );
    assert_eq!(output.status.code(), Some(6));
    assert!(!String::from_utf8_lossy(&output.stdout).contains("make_file"));
}

/// Issue 17: bytes that are not UTF-8 inside a text delta commit nothing (they used to become
/// U+FFFD in the committed turn).
#[test]
fn a_capture_with_bytes_that_are_not_utf8_exits_6_with_a_protocol_violation() {
    let mut checked = 0;
    for (dir, name) in [
        ("anthropic-messages", "thinking-text-tool.sse"),
        ("gemini", "text-then-call.sse"),
        ("openai-responses", "reasoning-text-two-calls.sse"),
    ] {
        let bytes = std::fs::read(fixtures().join(dir).join(name)).unwrap();
        // Just inside the first text value: `"text":"H…` → `"text":"\xFFH…`.
        let key: &[u8] = if dir == "openai-responses" {
            b"\"delta\":\""
        } else {
            b"\"text\":\""
        };
        let at = bytes
            .windows(key.len() + 1)
            .position(|window| window.starts_with(key) && window[key.len()].is_ascii_alphabetic())
            .unwrap_or_else(|| panic!("{dir}/{name}: no text"))
            + key.len();
        let mut corrupted = bytes.clone();
        corrupted.insert(at, 0xFF);
        let intact = turnstile(
            &["assemble", "-", "--adapter", adapter_of(dir), "--json"],
            Some(&bytes),
        );
        assert_eq!(intact.status.code(), Some(0), "{dir}/{name}");
        let output = turnstile(
            &["assemble", "-", "--adapter", adapter_of(dir), "--json"],
            Some(&corrupted),
        );
        assert_eq!(output.status.code(), Some(6), "{dir}/{name}");
        let stdout: Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(stdout["code"], "protocol_violation", "{dir}/{name}");
        assert!(!String::from_utf8_lossy(&output.stdout).contains('\u{fffd}'));
        checked += 1;
    }
    assert_eq!(checked, 3);
}

/// Issue 17: an OpenAI Chat text reply whose deltas arrived twice ("TransferTransfer one one
/// …") is refused, because the provider's `completion_tokens` is fewer than the tokens the
/// stream carried; the same stream without duplicates commits.
#[test]
fn an_openai_chat_text_reply_with_duplicated_deltas_exits_6() {
    let pieces = ["Transfer", " one", " hundred", " dollars", " to", " savings."];
    let text: String = pieces.concat();
    let completion_tokens = turnstile_adapters::tokens::Tokenizer::O200kBase.count(&text);
    let stream = |twice: bool| {
        let chunk = |delta: &str, finish: &str| {
            format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-4o-2024-08-06\",\
                 \"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish}}}]}}\n\n"
            )
        };
        let mut out = chunk(r#"{"role":"assistant","content":""}"#, "null");
        for piece in pieces {
            let event = chunk(
                &format!("{{\"content\":{}}}", serde_json::to_string(piece).unwrap()),
                "null",
            );
            out.push_str(&event);
            if twice {
                out.push_str(&event);
            }
        }
        out.push_str(&chunk("{}", "\"stop\""));
        out.push_str(&format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-4o-2024-08-06\",\"choices\":[],\
             \"usage\":{{\"prompt_tokens\":12,\"completion_tokens\":{completion_tokens},\"total_tokens\":99}}}}\n\ndata: [DONE]\n\n"
        ));
        out
    };
    let honest = turnstile(
        &["assemble", "-", "--adapter", "openai-chat@1", "--json"],
        Some(stream(false).as_bytes()),
    );
    assert_eq!(
        honest.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&honest.stdout)
    );
    let turn: Value = serde_json::from_slice(&honest.stdout).unwrap();
    assert_eq!(turn["blocks"][0]["text"], text);
    let doubled = turnstile(
        &["assemble", "-", "--adapter", "openai-chat@1", "--json"],
        Some(stream(true).as_bytes()),
    );
    assert_eq!(
        doubled.status.code(),
        Some(6),
        "{}",
        String::from_utf8_lossy(&doubled.stdout)
    );
    let reason: Value = serde_json::from_slice(&doubled.stdout).unwrap();
    assert_eq!(reason["code"], "protocol_violation");
    assert!(!String::from_utf8_lossy(&doubled.stdout).contains("TransferTransfer"));
}
