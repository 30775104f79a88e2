//! `turnstile render`: exit statuses of the spec (0 rendered, 3 waiting, 1 rejected with the
//! violations as JSON on stderr, 4 paused, 5 over budget, 2 usage), nothing on stdout except
//! on 0, the exact body bytes, and a manifest that pins them.

use serde_json::{Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use turnstile_core::Digest;

const ADAPTERS: [&str; 6] = [
    "openai-chat@1",
    "openai-chat@2",
    "openai-responses@1",
    "anthropic-messages@1",
    "anthropic-messages@2",
    "gemini@1",
];

fn repo(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(relative)
}

fn render_data(name: &str) -> String {
    repo(&format!(
        "crates/turnstile-adapters/tests/data/render/{name}.json"
    ))
    .to_string_lossy()
    .into_owned()
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

fn model_for(adapter: &str) -> &'static str {
    if adapter.starts_with("openai") {
        "gpt-4o"
    } else if adapter.starts_with("anthropic") {
        "claude-sonnet-4-5"
    } else {
        "gemini-2.5-pro"
    }
}

fn stderr_json(output: &Output) -> Value {
    serde_json::from_slice(&output.stderr).unwrap_or_else(|error| {
        panic!(
            "stderr is not JSON ({error}): {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

#[test]
fn every_adapter_renders_the_example_and_exits_zero_with_the_body_on_stdout() {
    let example = repo("examples/weather.json");
    for adapter in ADAPTERS {
        let output = turnstile(
            &[
                "render",
                example.to_str().unwrap(),
                "--adapter",
                adapter,
                "--model",
                model_for(adapter),
            ],
            None,
        );
        assert_eq!(
            output.status.code(),
            Some(0),
            "{adapter}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let body: Value = serde_json::from_slice(&output.stdout).unwrap();
        assert!(body.is_object(), "{adapter}");
        assert!(
            !output.stdout.ends_with(b"\n"),
            "{adapter}: exactly the body bytes, no newline"
        );
    }
}

#[test]
fn the_manifest_names_the_exact_bytes_printed_without_it() {
    let example = repo("examples/weather.json");
    for adapter in ADAPTERS {
        let args = [
            "render",
            example.to_str().unwrap(),
            "--adapter",
            adapter,
            "--model",
            model_for(adapter),
            "--max-output-tokens",
            "777",
        ];
        let body = turnstile(&args, None);
        let mut with_manifest = args.to_vec();
        with_manifest.push("--manifest");
        let manifest_output = turnstile(&with_manifest, None);
        assert_eq!(manifest_output.status.code(), Some(0));
        let manifest: Value = serde_json::from_slice(&manifest_output.stdout).unwrap();
        assert_eq!(
            manifest["request_digest"],
            json!(Digest::of_bytes(&body.stdout).as_str()),
            "{adapter}"
        );
        assert_eq!(manifest["format"], "turnstile.manifest.v1");
        assert_eq!(manifest["adapter"], adapter);
        assert_eq!(manifest["model"], model_for(adapter));
        assert_eq!(manifest["max_output_tokens"], 777);
        assert_eq!(manifest["conversation_id"], "c-42");
        assert_eq!(manifest["conversation_revision"], 4);
        assert!(manifest["prompt_tokens"].as_u64().unwrap() > 20);
        assert!(manifest["operation_id"].as_str().unwrap().starts_with("render-"));
        for field in [
            "sequence_digest",
            "adapter_digest",
            "toolset_digest",
            "policy_digest",
            "request_digest",
            "manifest_digest",
        ] {
            assert!(
                Digest::parse(manifest[field].as_str().unwrap()).is_some(),
                "{adapter} {field}"
            );
        }
        assert_eq!(
            manifest.as_object().unwrap().len(),
            15,
            "{adapter}: the spec's fields, no more"
        );
        // Deterministic: the same input gives the same manifest.
        assert_eq!(turnstile(&with_manifest, None).stdout, manifest_output.stdout);
    }
}

#[test]
fn standard_input_renders_like_a_file() {
    let example = repo("examples/weather.json");
    let bytes = std::fs::read(&example).unwrap();
    let from_file = turnstile(
        &[
            "render",
            example.to_str().unwrap(),
            "--adapter",
            "gemini@1",
            "--model",
            "gemini-2.5-pro",
        ],
        None,
    );
    let from_stdin = turnstile(
        &[
            "render",
            "-",
            "--adapter",
            "gemini@1",
            "--model",
            "gemini-2.5-pro",
        ],
        Some(&bytes),
    );
    assert_eq!(from_stdin.status.code(), Some(0));
    assert_eq!(from_stdin.stdout, from_file.stdout);
}

#[test]
fn a_document_pauses_with_exit_four_on_version_one_and_renders_on_version_two() {
    let file = render_data("documents");
    for (adapter, code) in [
        ("openai-chat@1", 4),
        ("anthropic-messages@1", 4),
        ("openai-chat@2", 0),
        ("anthropic-messages@2", 0),
        ("openai-responses@1", 0),
        ("gemini@1", 0),
    ] {
        let output = turnstile(
            &[
                "render",
                &file,
                "--adapter",
                adapter,
                "--model",
                model_for(adapter),
            ],
            None,
        );
        assert_eq!(output.status.code(), Some(code), "{adapter}");
        if code == 4 {
            assert!(
                output.stdout.is_empty(),
                "{adapter}: nothing on stdout when paused"
            );
            let explanation = stderr_json(&output);
            assert_eq!(explanation["status"], "paused");
            assert_eq!(explanation["pauses"][0]["kind"], "document");
            assert_eq!(explanation["pauses"][0]["reason"], "unrepresentable_kind");
        }
    }
}

#[test]
fn over_budget_exits_five_with_nothing_on_stdout() {
    let example = repo("examples/weather.json");
    let output = turnstile(
        &[
            "render",
            example.to_str().unwrap(),
            "--adapter",
            "openai-chat@2",
            "--model",
            "gpt-4",
            "--max-output-tokens",
            "8192",
        ],
        None,
    );
    assert_eq!(output.status.code(), Some(5));
    assert!(output.stdout.is_empty());
    let explanation = stderr_json(&output);
    assert_eq!(explanation["status"], "over_budget");
    assert_eq!(explanation["context_window"], 8192);
    assert!(explanation["excess"].as_u64().unwrap() > 0);
    // The same request with room to spare renders.
    let fits = turnstile(
        &[
            "render",
            example.to_str().unwrap(),
            "--adapter",
            "openai-chat@2",
            "--model",
            "gpt-4",
            "--max-output-tokens",
            "1000",
        ],
        None,
    );
    assert_eq!(fits.status.code(), Some(0));
}

#[test]
fn a_catalog_override_changes_the_window_used_for_admission() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("catalog.json");
    std::fs::write(
        &catalog,
        br#"{"models": [{"name": "tiny-model", "prefix": false, "context_window": 50, "tokenizer": "o200k_base", "max_output_tokens_default": 10}]}"#,
    )
    .unwrap();
    let example = repo("examples/weather.json");
    let output = turnstile(
        &[
            "render",
            example.to_str().unwrap(),
            "--adapter",
            "openai-responses@1",
            "--model",
            "tiny-model",
            "--catalog",
            catalog.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(
        output.status.code(),
        Some(5),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.stdout.is_empty());
}

fn write_conversation(dir: &Path, value: &Value) -> String {
    let path = dir.join("conversation.json");
    std::fs::write(&path, serde_json::to_vec(value).unwrap()).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn waiting_exits_three_and_rejected_exits_one_with_violations_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let mut example: Value =
        serde_json::from_slice(&std::fs::read(repo("examples/weather.json")).unwrap()).unwrap();
    // Drop the tool turn: the calls are pending.
    example["turns"].as_array_mut().unwrap().pop();
    example["revision"] = json!(3);
    let waiting = write_conversation(dir.path(), &example);
    let output = turnstile(
        &[
            "render",
            &waiting,
            "--adapter",
            "openai-chat@1",
            "--model",
            "gpt-4o",
        ],
        None,
    );
    assert_eq!(output.status.code(), Some(3));
    assert!(output.stdout.is_empty());
    let explanation = stderr_json(&output);
    assert_eq!(explanation["status"], "waiting");
    assert_eq!(explanation["pending"], json!(["call-7", "call-8"]));

    // A user turn after unanswered calls: missing_result.
    example["turns"]
        .as_array_mut()
        .unwrap()
        .push(json!({"id": "t-9", "revision": 4, "role": "user", "blocks": [{"id": "u-9", "kind": "text", "text": "hi"}]}));
    example["revision"] = json!(4);
    let rejected = write_conversation(dir.path(), &example);
    for adapter in ADAPTERS {
        let output = turnstile(
            &[
                "render",
                &rejected,
                "--adapter",
                adapter,
                "--model",
                model_for(adapter),
            ],
            None,
        );
        assert_eq!(output.status.code(), Some(1), "{adapter}");
        assert!(output.stdout.is_empty());
        let explanation = stderr_json(&output);
        let codes: Vec<&str> = explanation["violations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|violation| violation["code"].as_str().unwrap())
            .collect();
        assert_eq!(codes, vec!["missing_result", "missing_result"], "{adapter}");
    }
}

#[test]
fn usage_errors_exit_two_with_nothing_on_stdout() {
    let example = repo("examples/weather.json");
    let example = example.to_str().unwrap();
    for args in [
        vec![
            "render",
            example,
            "--adapter",
            "openai-chat@9",
            "--model",
            "gpt-4o",
        ],
        vec!["render", example, "--model", "gpt-4o"],
        vec!["render", example, "--adapter", "gemini@1"],
        vec![
            "render",
            "/nonexistent/file.json",
            "--adapter",
            "gemini@1",
            "--model",
            "m",
        ],
        vec![
            "render",
            example,
            "--adapter",
            "gemini@1",
            "--model",
            "m",
            "--max-output-tokens",
            "lots",
        ],
    ] {
        let output = turnstile(&args, None);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(output.stdout.is_empty(), "{args:?}");
    }
    let output = turnstile(
        &["render", "-", "--adapter", "gemini@1", "--model", "m"],
        Some(b"not json"),
    );
    assert_eq!(output.status.code(), Some(2));
    assert!(output.stdout.is_empty());
}

/// Issue 17: a tool whose schema keeps its bulk in `$defs` (tens of thousands of tokens) is
/// over budget in an 8,000-token window on every adapter, OpenAI's included (the cookbook
/// formula counted only first-level `properties` and admitted it).
#[test]
fn a_tool_with_a_large_defs_block_is_refused_over_an_8000_token_window_on_every_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("catalog.json");
    std::fs::write(
        &catalog,
        serde_json::to_vec(&json!({"models": [
            {"name": "gpt-8k", "prefix": false, "context_window": 8000, "tokenizer": "o200k_base", "max_output_tokens_default": 1000},
            {"name": "claude-8k", "prefix": false, "context_window": 8000, "tokenizer": "anthropic_estimate", "max_output_tokens_default": 1000},
            {"name": "gemini-8k", "prefix": false, "context_window": 8000, "tokenizer": "gemini_estimate", "max_output_tokens_default": 1000}
        ]}))
        .unwrap(),
    )
    .unwrap();
    let mut defs = serde_json::Map::new();
    for index in 0..400 {
        defs.insert(
            format!("Leg{index}"),
            json!({"type": "object", "description": format!("Leg {index} of the itinerary: departure airport, arrival airport, carrier, fare class and baggage allowance"),
                   "properties": {"from": {"type": "string", "description": "IATA code of the departure airport"},
                                  "to": {"type": "string", "description": "IATA code of the arrival airport"}}}),
        );
    }
    let conversation = json!({
        "format": "turnstile.conversation.v1", "conversation_id": "c-defs", "revision": 1,
        "tools": [{"name": "book_trip", "description": "Book a trip.",
                   "input_schema": {"type": "object", "properties": {"legs": {"type": "array", "items": {"$ref": "#/$defs/Leg0"}}},
                                    "$defs": defs}}],
        "turns": [{"id": "t-1", "revision": 1, "role": "user",
                   "blocks": [{"id": "u-1", "kind": "text", "text": "Book it."}]}]
    });
    let path = write_conversation(dir.path(), &conversation);
    for adapter in ADAPTERS {
        let model = if adapter.starts_with("openai") {
            "gpt-8k"
        } else if adapter.starts_with("anthropic") {
            "claude-8k"
        } else {
            "gemini-8k"
        };
        let output = turnstile(
            &[
                "render",
                &path,
                "--adapter",
                adapter,
                "--model",
                model,
                "--catalog",
                catalog.to_str().unwrap(),
            ],
            None,
        );
        assert_eq!(
            output.status.code(),
            Some(5),
            "{adapter}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(output.stdout.is_empty(), "{adapter}");
        let explanation = stderr_json(&output);
        assert_eq!(explanation["status"], "over_budget", "{adapter}");
        assert!(
            explanation["prompt_tokens"].as_u64().unwrap() > 8000,
            "{adapter}: {explanation}"
        );
    }
}
