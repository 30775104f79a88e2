//! `turnstile validate`: the spec's JSON shape and exit statuses, on real files and standard
//! input, and exit 2 (never a panic) for unreadable input and broken limits.

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn repo(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(relative)
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
        // A refused oversize input may close the pipe early; that is fine.
        let _ = child.stdin.take().unwrap().write_all(bytes);
    } else {
        drop(child.stdin.take());
    }
    child.wait_with_output().unwrap()
}

fn json_of(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "stdout is not JSON ({error}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

#[test]
fn every_data_file_exits_with_its_status_and_prints_the_spec_shape() {
    let mut checked = 0;
    for entry in std::fs::read_dir(repo("tests/data")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.ends_with(".json") || name.ends_with(".expect.json") {
            continue;
        }
        let expected: Value =
            serde_json::from_slice(&std::fs::read(path.with_extension("expect.json")).unwrap()).unwrap();
        let output = turnstile(&["validate", path.to_str().unwrap(), "--json"], None);
        let status = expected["status"].as_str().unwrap();
        let code = match status {
            "ready" => 0,
            "rejected" => 1,
            "waiting" => 3,
            other => panic!("unknown status {other}"),
        };
        assert_eq!(output.status.code(), Some(code), "{name}");
        let body = json_of(&output);
        let keys: Vec<&String> = body.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["pending", "status", "violations"], "{name}");
        assert_eq!(body["status"], status, "{name}");
        assert_eq!(body["pending"], expected["pending"], "{name}");
        let violations = body["violations"].as_array().unwrap();
        assert_eq!(
            violations.len(),
            expected["violations"].as_array().unwrap().len(),
            "{name}"
        );
        for violation in violations {
            let keys: Vec<&String> = violation.as_object().unwrap().keys().collect();
            assert_eq!(keys, ["block", "call_id", "code", "message", "turn"], "{name}");
            assert!(
                violation["message"].as_str().is_some_and(|m| !m.is_empty()),
                "{name}"
            );
        }
        checked += 1;
    }
    assert!(checked >= 20);
}

#[test]
fn standard_input_is_read_with_a_dash() {
    let bytes = std::fs::read(repo("tests/data/waiting_no_results_yet.json")).unwrap();
    let output = turnstile(&["validate", "-", "--json"], Some(&bytes));
    assert_eq!(output.status.code(), Some(3));
    assert_eq!(
        json_of(&output)["pending"],
        serde_json::json!(["call-1", "call-2", "call-3"])
    );
}

#[test]
fn the_human_summary_names_every_violation_code() {
    let output = turnstile(
        &[
            "validate",
            repo("tests/data/many_rules_broken_at_once.json")
                .to_str()
                .unwrap(),
        ],
        None,
    );
    assert_eq!(output.status.code(), Some(1));
    let text = String::from_utf8(output.stdout).unwrap();
    for code in [
        "unclosed_arguments",
        "unknown_kind",
        "duplicate_result",
        "orphan_result",
        "missing_result",
    ] {
        assert!(text.contains(code), "{code} missing from: {text}");
    }
}

#[test]
fn unreadable_input_exits_2_with_a_message_and_no_stdout() {
    let deep = format!(
        "{{\"format\":\"turnstile.conversation.v1\",\"conversation_id\":\"c\",\"revision\":0,\"turns\":{}{}}}",
        "[".repeat(200),
        "]".repeat(200)
    );
    let many_blocks = format!(
        "{{\"format\":\"turnstile.conversation.v1\",\"conversation_id\":\"c\",\"revision\":1,\"turns\":[{{\"id\":\"t\",\"role\":\"user\",\"blocks\":[{}]}}]}}",
        vec![r#"{"id":"b","kind":"text","text":"x"}"#; turnstile_core::limits::BLOCKS_PER_TURN_MAX + 1]
            .join(",")
    );
    let many_turns = format!(
        "{{\"format\":\"turnstile.conversation.v1\",\"conversation_id\":\"c\",\"revision\":1,\"turns\":[{}]}}",
        vec!["{}"; turnstile_core::limits::TURNS_MAX + 1].join(",")
    );
    let too_big = vec![b' '; turnstile_core::limits::FILE_BYTES_MAX + 1];
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("not json", b"{\"format\": ".to_vec()),
        ("binary", vec![0xff, 0x00, 0x13]),
        ("empty", Vec::new()),
        ("not an object", b"[1,2,3]".to_vec()),
        (
            "wrong format",
            br#"{"format":"turnstile.conversation.v2","turns":[]}"#.to_vec(),
        ),
        ("missing format", br#"{"turns":[]}"#.to_vec()),
        ("too deep", deep.into_bytes()),
        ("too many blocks in a turn", many_blocks.into_bytes()),
        ("too many turns", many_turns.into_bytes()),
        ("too big", too_big),
    ];
    for (name, bytes) in cases {
        let output = turnstile(&["validate", "-", "--json"], Some(&bytes));
        assert_eq!(output.status.code(), Some(2), "{name}");
        assert!(output.stdout.is_empty(), "{name}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("turnstile validate:"), "{name}: {stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    }
}

#[test]
fn a_missing_file_and_bad_usage_exit_2() {
    assert_eq!(
        turnstile(&["validate", "/nonexistent/conversation.json"], None)
            .status
            .code(),
        Some(2)
    );
    assert_eq!(turnstile(&["validate"], None).status.code(), Some(2));
    assert_eq!(
        turnstile(&["validate", "a.json", "--frobnicate"], None)
            .status
            .code(),
        Some(2)
    );
    assert_eq!(turnstile(&["no-such-command"], None).status.code(), Some(2));
}
