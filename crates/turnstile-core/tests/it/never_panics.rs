//! "Never panics": arbitrary bytes, arbitrary JSON values and v1-shaped documents with random
//! field values go through the parser, the validator and (when legal) the graph builder. The
//! same entry point is the cargo-fuzz target in `fuzz/` (nightly), so CI exercises it here.

use proptest::prelude::*;
use serde_json::{Map, Value, json};
use turnstile_core::{Conversation, MessageSequence, Validated, parse, repair, validate};

/// The whole pipeline on untrusted bytes; any panic fails the property. The history doctor
/// (`repair.rs`) too: its plan of any readable document applies to it, and the repaired
/// document decodes again.
pub fn pipeline(bytes: &[u8]) {
    if let Ok(conversation) = parse::conversation_from_slice(bytes) {
        let _ = validate(&conversation);
        if let Ok(validated) = Validated::new(&conversation) {
            let _ = MessageSequence::build(validated);
        }
    }
    if let Ok(document) = parse::json_from_slice(bytes) {
        for close_pending in [false, true] {
            if let Ok(plan) = repair::plan(&document, repair::Options { close_pending }) {
                let repaired = repair::apply(&plan, &document).expect("a plan applies to its own document");
                let _ =
                    validate(&Conversation::from_value(repaired).expect("a repaired document is readable"));
            }
        }
    }
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[a-z_]{0,8}".prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(6, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{0,10}", inner, 0..8)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// Values drawn from the v1 vocabulary, so the decoder's field paths are reached.
fn v1_field() -> impl Strategy<Value = (String, Value)> {
    let keys = prop::sample::select(vec![
        "id",
        "kind",
        "text",
        "call_id",
        "tool",
        "arguments",
        "args_digest",
        "generation",
        "status",
        "content",
        "state",
        "trust",
        "source",
        "media_type",
        "data",
        "url",
        "provider",
        "signature",
        "encrypted",
        "title",
    ]);
    let values = prop_oneof![
        prop::sample::select(vec![
            "text",
            "tool_call",
            "tool_result",
            "context",
            "image",
            "document",
            "reasoning",
            "success",
            "error",
            "cancel",
            "trusted",
            "untrusted",
            "preview",
            "committed",
            "call-1",
            "call-2",
            "{\"a\":",
            "{}",
        ])
        .prop_map(Value::from),
        any_json(),
    ];
    (keys.prop_map(str::to_owned), values)
}

fn v1_document() -> impl Strategy<Value = Value> {
    let block = prop::collection::btree_map(v1_field().prop_map(|(k, _)| k), any_json(), 0..6)
        .prop_flat_map(|_| prop::collection::vec(v1_field(), 0..7))
        .prop_map(|fields| Value::Object(fields.into_iter().collect::<Map<_, _>>()));
    let role = prop::sample::select(vec!["system", "user", "assistant", "tool", "narrator"]);
    let turn = (
        role,
        prop::collection::vec(block, 0..5),
        any::<u8>(),
        any::<bool>(),
    )
        .prop_map(|(role, blocks, revision, with_id)| {
            let mut turn = json!({"role": role, "blocks": blocks, "revision": revision, "generation": 1});
            if with_id {
                turn["id"] = json!(format!("t-{revision}"));
            }
            turn
        });
    (prop::collection::vec(turn, 0..8), any_json()).prop_map(|(turns, tools)| {
        json!({"format": "turnstile.conversation.v1", "conversation_id": "c", "revision": 300,
               "tools": tools, "turns": turns})
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        pipeline(&bytes);
    }

    #[test]
    fn arbitrary_json_never_panics(value in any_json()) {
        pipeline(value.to_string().as_bytes());
        let wrapped = json!({"format": "turnstile.conversation.v1", "conversation_id": "c", "revision": 1,
                             "turns": [value.clone()], "tools": value});
        pipeline(wrapped.to_string().as_bytes());
    }

    #[test]
    fn v1_shaped_documents_never_panic(document in v1_document()) {
        pipeline(document.to_string().as_bytes());
    }

    #[test]
    fn generated_conversations_cut_at_any_byte_never_panic(seed in any::<u64>(), cut in any::<usize>()) {
        let (conversation, _) = crate::generate::legal(seed, 3);
        let bytes = conversation.to_string().into_bytes();
        pipeline(&bytes[..cut % (bytes.len() + 1)]);
    }
}

#[test]
fn nesting_past_the_depth_limit_is_unreadable_not_a_stack_overflow() {
    let deep = "[".repeat(100_000);
    assert!(matches!(
        parse::conversation_from_slice(deep.as_bytes()),
        Err(turnstile_core::conversation::Unreadable::Limit {
            what: "JSON_DEPTH_MAX",
            ..
        })
    ));
    let deep_arguments = format!(
        r#"{{"format":"turnstile.conversation.v1","conversation_id":"c","revision":2,"turns":[
        {{"id":"t1","role":"user","blocks":[{{"id":"u","kind":"text","text":"hi"}}]}},
        {{"id":"t2","role":"assistant","blocks":[{{"id":"a","kind":"tool_call","call_id":"c1","tool":"f",
          "arguments":"{}"}}]}}]}}"#,
        "{\\\"a\\\":".repeat(10_000)
    );
    let conversation = parse::conversation_from_slice(deep_arguments.as_bytes()).unwrap();
    let turnstile_core::Verdict::Rejected(violations) = validate(&conversation) else {
        panic!("not rejected")
    };
    assert_eq!(violations[0].code.as_str(), "unclosed_arguments");
}

/// serde_json's `raw_value` feature (on in this workspace) parses the string of an object whose
/// member is named `$serde_json::private::RawValue` as JSON, with a fresh recursion budget:
/// such objects nested in each other's strings make a value as deep as the bytes allow from text
/// only 41 levels deep. Before the bounded parses refused the token, this 69 KB file aborted
/// the process (stack overflow on a 2 MiB thread stack, the size of a tokio worker's).
#[test]
fn the_raw_value_token_is_refused_not_a_stack_overflow() {
    // The hazard is serde_json's behaviour: if this stops holding, the guard can go.
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(r#"{"$serde_json::private::RawValue":"[[1]]"}"#).unwrap(),
        serde_json::json!([[1]])
    );
    let mut inner = "1".to_owned();
    for level in 0..14 {
        let arrays = if level == 13 { 40 } else { 120 };
        inner = format!(
            "{}{{\"$serde_json::private::RawValue\":{}}}{}",
            "[".repeat(arrays),
            serde_json::to_string(&inner).unwrap(),
            "]".repeat(arrays)
        );
    }
    let file = |arguments: &str| {
        format!(
            r#"{{"format":"turnstile.conversation.v1","conversation_id":"c","revision":2,"turns":[
        {{"id":"t1","role":"user","blocks":[{{"id":"u","kind":"text","text":"hi"}}]}},
        {{"id":"t2","role":"assistant","blocks":[{{"id":"a","kind":"tool_call","call_id":"c1","tool":"f","arguments":{arguments}}}]}}]}}"#
        )
    };
    let spellings = [
        file(&format!(r#"{{"a":{inner}}}"#)),
        // As a string of arguments (parsed by `Arguments::from_text`).
        file(&serde_json::to_string(&format!(r#"{{"a":{inner}}}"#)).unwrap()),
        // The token's `$` escaped, and the whole name escaped.
        file(r#"{"a":{"\u0024serde_json::private::RawValue":"[1]"}}"#),
        file(&format!(
            r#"{{"a":{{"{}":"[1]"}}}}"#,
            "$serde_json::private::RawValue"
                .chars()
                .map(|c| format!("\\u{:04X}", c as u32))
                .collect::<String>()
        )),
    ];
    for (index, bytes) in spellings.into_iter().enumerate() {
        let outcome = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let typed = parse::conversation_from_slice(bytes.as_bytes());
                let value = parse::json_from_slice(bytes.as_bytes()).map(|_| ());
                (typed.map(|conversation| conversation.turns.len()), value)
            })
            .unwrap()
            .join()
            .unwrap();
        match (index, outcome) {
            // In a string of arguments the token is text to the file; `Arguments::from_text`
            // refuses to parse it (below), which the validator then reports.
            (1, (Ok(2), Ok(()))) => {}
            (
                _,
                (
                    Err(turnstile_core::conversation::Unreadable::Limit {
                        what: "JSON_DEPTH_MAX",
                        ..
                    }),
                    Err(turnstile_core::conversation::Unreadable::Limit {
                        what: "JSON_DEPTH_MAX",
                        ..
                    }),
                ),
            ) => {}
            (index, other) => panic!("spelling {index}: {other:?}"),
        }
    }
    // A string argument with the token stays text: never parsed into a value.
    let arguments = turnstile_core::conversation::Arguments::from_text(format!(r#"{{"a":{inner}}}"#));
    assert!(matches!(
        arguments,
        turnstile_core::conversation::Arguments::Unclosed { .. }
    ));
    // Other members named with a `$` (JSON Schema's) are untouched, and so is a string value
    // that says the token (only a member name is replaced).
    let schema = r##"{"format":"turnstile.conversation.v1","conversation_id":"c","revision":1,
        "tools":[{"name":"f","input_schema":{"$defs":{"x":{"type":"string"}},"$ref":"#/$defs/x","$serde":"json"}}],
        "turns":[{"id":"t1","role":"user","blocks":[{"id":"u","kind":"text","text":"$serde_json::private::RawValue"}]}]}"##;
    assert!(parse::conversation_from_slice(schema.as_bytes()).is_ok());
}
