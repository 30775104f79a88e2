//! The registry: ids, listing, declared kinds, and pinned adapter digests.

use turnstile_adapters::AdapterId;
use turnstile_core::{Validated, parse};

#[test]
fn every_adapter_id_parses_back_to_itself_and_unknown_ids_are_refused() {
    for adapter in AdapterId::ALL {
        assert_eq!(adapter.as_str().parse::<AdapterId>().unwrap(), adapter);
        assert_eq!(adapter.to_string(), adapter.as_str());
    }
    for bad in [
        "openai-chat@3",
        "openai-chat",
        "gemini@0",
        "",
        "anthropic-messages@1 ",
    ] {
        assert!(bad.parse::<AdapterId>().is_err(), "{bad:?}");
    }
}

#[test]
fn every_adapter_declares_the_core_kinds_and_never_an_unknown_one() {
    const V1_KINDS: [&str; 7] = [
        "text",
        "image",
        "tool_call",
        "tool_result",
        "context",
        "document",
        "reasoning",
    ];
    for adapter in AdapterId::ALL {
        for kind in [
            "text",
            "image",
            "tool_call",
            "tool_result",
            "context",
            "reasoning",
        ] {
            assert!(adapter.represents(kind), "{adapter} {kind}");
        }
        for kind in adapter.rules().representable_kinds {
            assert!(V1_KINDS.contains(kind), "{adapter} declares {kind}");
        }
        assert_eq!(adapter.rules().adapter, adapter.as_str());
    }
}

#[test]
fn the_probe_conversations_are_ready_v1_files() {
    for (name, text) in turnstile_adapters::probe::PROBE_FILES {
        let conversation = parse::conversation_from_slice(text.as_bytes()).unwrap();
        let validated = Validated::new(&conversation).unwrap_or_else(|v| panic!("{name}: {v:?}"));
        assert!(!validated.is_waiting(), "{name}");
    }
}

#[test]
fn adapter_digests_are_pinned() {
    // A change here means an adapter's rules or its rendering of the probes changed: that is
    // a new rules version, so review it as one (and bump `rules_revision` if it was silent).
    let digests: Vec<String> = AdapterId::ALL
        .iter()
        .map(|adapter| format!("{adapter} {}", adapter.adapter_digest()))
        .collect();
    insta::assert_snapshot!(digests.join("\n"));
}

#[test]
fn the_adapter_digest_covers_the_probe_renderings() {
    // Same declared kinds and nearly the same descriptor text, different bytes: the probe
    // outcomes (bodies) must differ, which is what makes the digests differ.
    let v1 = turnstile_adapters::probe::probe_outcomes(AdapterId::AnthropicMessagesV1);
    let v2 = turnstile_adapters::probe::probe_outcomes(AdapterId::AnthropicMessagesV2);
    assert_eq!(
        v1[0].1["body"], v2[0].1["body"],
        "the features probe renders the same bytes"
    );
    assert_ne!(v1[1], v2[1], "the document probe pauses on @1 and renders on @2");
    assert!(v1[1].1.get("paused").is_some());
}
