//! Data-driven validator tests: every `tests/data/NAME.json` (a v1 file at the repository root)
//! has a hand-written `NAME.expect.json` with the status, pending calls and violations
//! (code, turn, block, call_id; messages are not asserted). Violations compare as multisets.

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use turnstile_core::{Validated, Verdict, ViolationCode, parse, validate};

pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data")
}

/// Every split of `document` into a decoded prefix and the turns after it (as JSON), with the
/// file's revision; empty for a file whose revision is below one of its turns' (a finding of
/// the file, not of a turn: a history given turns one at a time never holds that file).
/// Prefixes that do not decode are left out.
pub fn splits(document: &Value) -> Vec<(usize, turnstile_core::Conversation, Vec<Value>, u64)> {
    let revision = document["revision"].as_u64().unwrap_or(0);
    let turns = document["turns"].as_array().cloned().unwrap_or_default();
    if turns
        .iter()
        .filter_map(|turn| turn["revision"].as_u64())
        .any(|last| last > revision)
    {
        return Vec::new();
    }
    (0..turns.len())
        .filter_map(|split| {
            let mut prefix = document.clone();
            prefix["turns"] = Value::Array(turns[..split].to_vec());
            let prefix = turnstile_core::Conversation::from_value(prefix).ok()?;
            Some((split, prefix, turns[split..].to_vec(), revision))
        })
        .collect()
}

/// Every conversation file in `tests/data` that is JSON (expect files left out), parsed.
pub fn data_documents() -> Vec<Value> {
    let mut documents = Vec::new();
    for entry in std::fs::read_dir(data_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.ends_with(".json") || name.ends_with(".expect.json") {
            continue;
        }
        if let Ok(document) = serde_json::from_slice::<Value>(&std::fs::read(&path).unwrap()) {
            documents.push(document);
        }
    }
    documents
}

/// The validator's answer in the shape of an expect file.
fn actual(bytes: &[u8]) -> Value {
    let conversation = parse::conversation_from_slice(bytes).expect("test data is readable");
    let verdict = validate(&conversation);
    // The verdict-and-proof door agrees with `validate` and with `Validated::new`.
    let (again, proof) = Validated::with_verdict(&conversation);
    assert_eq!(again.status(), verdict.status());
    assert_eq!(proof.is_some(), !matches!(verdict, Verdict::Rejected(_)));
    assert_eq!(
        proof.map(|proof| proof.is_waiting()),
        Validated::new(&conversation).ok().map(|proof| proof.is_waiting())
    );
    let (pending, violations): (Vec<String>, Vec<Value>) = match &verdict {
        Verdict::Ready => (vec![], vec![]),
        Verdict::Waiting { pending } => (pending.iter().map(|id| id.0.clone()).collect(), vec![]),
        Verdict::Rejected(violations) => (
            vec![],
            violations
                .iter()
                .map(|v| json!({"code": v.code, "turn": v.turn, "block": v.block, "call_id": v.call_id}))
                .collect(),
        ),
    };
    json!({"status": verdict.status(), "pending": pending, "violations": sorted(violations)})
}

fn sorted(mut values: Vec<Value>) -> Vec<Value> {
    values.sort_by_key(|value| value.to_string());
    values
}

fn check(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let expect_path = path.with_extension("expect.json");
    let mut expected: Value = serde_json::from_slice(&std::fs::read(&expect_path).unwrap()).unwrap();
    let violations = expected["violations"].as_array().unwrap().clone();
    expected["violations"] = Value::Array(sorted(violations));
    let actual = actual(&bytes);
    assert_eq!(actual, expected, "{}", path.display());
}

fn cases() -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(data_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            let name = path.file_name().unwrap().to_string_lossy();
            name.ends_with(".json") && !name.ends_with(".expect.json")
        })
        .collect();
    paths.sort();
    paths
}

#[test]
fn every_data_file_gets_its_expected_verdict() {
    let cases = cases();
    assert!(cases.len() >= 20, "found only {} cases", cases.len());
    for path in cases {
        check(&path);
    }
}

#[test]
fn the_data_files_cover_every_code_waiting_and_ready() {
    let mut codes = std::collections::BTreeSet::new();
    let mut statuses = std::collections::BTreeSet::new();
    for path in cases() {
        let expected: Value =
            serde_json::from_slice(&std::fs::read(path.with_extension("expect.json")).unwrap()).unwrap();
        statuses.insert(expected["status"].as_str().unwrap().to_owned());
        for violation in expected["violations"].as_array().unwrap() {
            codes.insert(violation["code"].as_str().unwrap().to_owned());
        }
    }
    for code in ViolationCode::ALL {
        assert!(codes.contains(code.as_str()), "no data file expects {code}");
    }
    for status in ["ready", "waiting", "rejected"] {
        assert!(statuses.contains(status), "no data file expects {status}");
    }
}

#[test]
fn the_shipped_example_is_ready() {
    let bytes =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/weather.json")).unwrap();
    assert_eq!(actual(&bytes)["status"], "ready");
}

/// Spec §1 (issue 17): a `tool_result` must carry `tool`, `args_digest` and `generation`; one
/// that lacks any of them (or all three: it validated `ready` before) is `result_mismatch`,
/// and nothing else.
#[test]
fn a_result_lacking_tool_args_digest_or_generation_is_result_mismatch() {
    let path = data_dir().join("ready_multi_round_tools_then_text.json");
    let original: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(actual(&serde_json::to_vec(&original).unwrap())["status"], "ready");
    let (turn, block) = original["turns"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .find_map(|(t, turn)| {
            let b = turn["blocks"]
                .as_array()?
                .iter()
                .position(|b| b["kind"] == "tool_result")?;
            Some((t, b))
        })
        .expect("the case has results");
    let omissions: [&[&str]; 4] = [
        &["tool"],
        &["args_digest"],
        &["generation"],
        &["tool", "args_digest", "generation"],
    ];
    for omitted in omissions {
        let mut conversation = original.clone();
        let result = conversation["turns"][turn]["blocks"][block]
            .as_object_mut()
            .unwrap();
        for field in omitted {
            assert!(result.remove(*field).is_some(), "{field}");
        }
        let block_id = result["id"].clone();
        let call_id = result["call_id"].clone();
        let verdict = actual(&serde_json::to_vec(&conversation).unwrap());
        assert_eq!(verdict["status"], "rejected", "{omitted:?}");
        assert_eq!(
            verdict["violations"],
            json!([{"code": "result_mismatch", "turn": conversation["turns"][turn]["id"], "block": block_id, "call_id": call_id}]),
            "{omitted:?}"
        );
    }
}
