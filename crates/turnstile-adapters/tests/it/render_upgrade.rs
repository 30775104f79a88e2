//! Upgrade and rollback: the same graph through @1 and @2. The graph is unchanged, the
//! adapter digests differ, and the bytes differ only as the spec declares (Chat: `developer`
//! for `system`, `max_completion_tokens` for `max_tokens`; Messages: nothing without
//! documents). A `document` block renders through @2 and pauses through @1 (rollback).

use crate::render_support::{SCENARIOS, load, options_for, tokenizer_for};
use turnstile_adapters::AdapterId;
use turnstile_adapters::render::{Graph, PauseReason, RenderCache, RenderOutcome, render};
use turnstile_core::conversation::Conversation;
use turnstile_core::{MessageSequence, Validated};

fn has_document(conversation: &Conversation) -> bool {
    conversation
        .turns
        .iter()
        .flat_map(|turn| &turn.blocks)
        .any(|block| block.body.kind() == "document")
}

/// Render one graph with two adapters; also prove the graph (sequence digest) is unchanged.
fn both(conversation: &Conversation, old: AdapterId, new: AdapterId) -> (RenderOutcome, RenderOutcome) {
    let validated = Validated::new(conversation).unwrap();
    let sequence = MessageSequence::build(validated);
    let digest_before = sequence.sequence_digest.clone();
    let graph = Graph::new(validated, &sequence).unwrap();
    let mut cache = RenderCache::new();
    let first = render(old, graph, &options_for(old), tokenizer_for(old), &mut cache);
    let second = render(new, graph, &options_for(new), tokenizer_for(new), &mut cache);
    let rebuilt = MessageSequence::build(Validated::new(conversation).unwrap());
    assert_eq!(
        rebuilt.sequence_digest, digest_before,
        "rendering must not change the graph"
    );
    (first, second)
}

#[test]
fn openai_chat_v2_differs_from_v1_only_in_the_system_role_and_the_output_cap_field() {
    let mut compared = 0;
    for name in SCENARIOS {
        let conversation = load(name);
        if has_document(&conversation) {
            continue;
        }
        let (RenderOutcome::Rendered(v1), RenderOutcome::Rendered(v2)) =
            both(&conversation, AdapterId::OpenaiChatV1, AdapterId::OpenaiChatV2)
        else {
            continue;
        };
        let upgraded = String::from_utf8(v1.body.clone())
            .unwrap()
            .replace("{\"role\":\"system\",", "{\"role\":\"developer\",")
            .replace(",\"max_tokens\":", ",\"max_completion_tokens\":");
        assert_eq!(upgraded.as_bytes(), v2.body.as_slice(), "{name}");
        if conversation.turns.iter().any(|turn| {
            turn.role
                == turnstile_core::conversation::RoleField::Known(turnstile_core::conversation::Role::System)
        }) {
            assert_ne!(v1.body, v2.body, "{name}: a system turn must render differently");
        }
        assert!(
            v1.prompt_tokens.abs_diff(v2.prompt_tokens) <= 1,
            "{name}: role token count differs by at most one"
        );
        compared += 1;
    }
    assert!(compared >= 5, "compared {compared} scenarios");
}

#[test]
fn anthropic_messages_v2_renders_the_same_bytes_as_v1_without_documents() {
    let mut compared = 0;
    for name in SCENARIOS {
        let conversation = load(name);
        if has_document(&conversation) {
            continue;
        }
        let (RenderOutcome::Rendered(v1), RenderOutcome::Rendered(v2)) = both(
            &conversation,
            AdapterId::AnthropicMessagesV1,
            AdapterId::AnthropicMessagesV2,
        ) else {
            panic!("{name}: both versions render");
        };
        assert_eq!(v1.body, v2.body, "{name}");
        assert_eq!(v1.prompt_tokens, v2.prompt_tokens, "{name}");
        compared += 1;
    }
    assert!(compared >= 5);
}

#[test]
fn every_version_has_its_own_adapter_digest() {
    let digests: std::collections::HashSet<_> = AdapterId::ALL.iter().map(|id| id.adapter_digest()).collect();
    assert_eq!(digests.len(), AdapterId::ALL.len());
    assert_ne!(
        AdapterId::AnthropicMessagesV1.adapter_digest(),
        AdapterId::AnthropicMessagesV2.adapter_digest()
    );
    assert_ne!(
        AdapterId::OpenaiChatV1.adapter_digest(),
        AdapterId::OpenaiChatV2.adapter_digest()
    );
}

#[test]
fn a_document_renders_through_v2_and_pauses_when_rolled_back_to_v1() {
    let conversation = load("documents");
    for (old, new) in [
        (AdapterId::OpenaiChatV1, AdapterId::OpenaiChatV2),
        (AdapterId::AnthropicMessagesV1, AdapterId::AnthropicMessagesV2),
    ] {
        let (rolled_back, upgraded) = both(&conversation, old, new);
        let RenderOutcome::Rendered(rendered) = upgraded else {
            panic!("{new} renders documents");
        };
        assert!(
            String::from_utf8_lossy(&rendered.body).contains("JVBERi0xLjQK"),
            "{new}"
        );
        let RenderOutcome::Paused(pauses) = rolled_back else {
            panic!("{old} must pause on a document");
        };
        let blocks: Vec<_> = pauses
            .iter()
            .map(|pause| (pause.block.as_deref(), pause.kind.as_str(), pause.reason))
            .collect();
        assert_eq!(
            blocks,
            vec![
                (Some("u-2"), "document", PauseReason::UnrepresentableKind),
                (Some("u-3"), "document", PauseReason::UnrepresentableKind),
            ],
            "{old}"
        );
    }
}

#[test]
fn document_support_matches_the_spec_list() {
    let representing: Vec<_> = AdapterId::ALL
        .iter()
        .filter(|id| id.represents("document"))
        .map(|id| id.as_str())
        .collect();
    assert_eq!(
        representing,
        vec![
            "openai-chat@2",
            "openai-responses@1",
            "anthropic-messages@2",
            "gemini@1"
        ]
    );
}
