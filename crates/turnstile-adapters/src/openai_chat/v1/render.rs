//! `openai-chat@1`: system turns as `system` messages, `max_tokens`, no `document` blocks
//! (they pause). Placement is shared with @2 in `openai_chat/mod.rs`.

use crate::openai_chat::{ChatVersion, HEADERS};
use crate::registry::{AdapterId, RulesDescriptor};
use crate::render::{CONTEXT_WRAPPING, Ctx, Graph, RenderOptions, RenderOutcome};

pub(crate) const VERSION: ChatVersion = ChatVersion {
    adapter: AdapterId::OpenaiChatV1,
    system_role: "system",
    max_tokens_field: "max_tokens",
    documents: false,
};

/// Declared rules of `openai-chat@1`.
pub static RULES: RulesDescriptor = RulesDescriptor {
    adapter: "openai-chat@1",
    rules_revision: 1,
    endpoint: "POST /v1/chat/completions",
    representable_kinds: &[
        "text",
        "image",
        "tool_call",
        "tool_result",
        "context",
        "reasoning",
    ],
    unrepresentable_parts: &["tool_result.image"],
    system_placement: "one system message per system turn, each block a text part",
    max_output_tokens_field: "max_tokens",
    result_placement: "one tool message per call right after the assistant message, in call order; error/cancel as a leading status text part",
    call_id_rule: "length <= 40, else tc_<sha256 hex 32>",
    reasoning: "omitted (chat has no reasoning input); policy records each omission",
    context_wrapping: CONTEXT_WRAPPING,
    headers: HEADERS,
};

pub(crate) fn render(graph: Graph<'_>, options: &RenderOptions, ctx: &mut Ctx<'_>) -> RenderOutcome {
    crate::openai_chat::render(&VERSION, graph, options, ctx)
}
