//! `openai-chat@2`: what changes from @1 (`shared/spec/conversation-v1.md` §3) and nothing
//! else: system turns as `developer` messages ("With o1 models and newer, `developer` messages
//! replace the previous `system` messages", spec `ChatCompletionRequestDeveloperMessage`),
//! `max_completion_tokens` in place of the deprecated `max_tokens`, and `document` blocks as
//! `file` content parts (inline data only: Chat file parts have no URL form, so a document by
//! URL pauses).

use crate::openai_chat::{ChatVersion, HEADERS};
use crate::registry::{AdapterId, RulesDescriptor};
use crate::render::{CONTEXT_WRAPPING, Ctx, Graph, RenderOptions, RenderOutcome};

pub(crate) const VERSION: ChatVersion = ChatVersion {
    adapter: AdapterId::OpenaiChatV2,
    system_role: "developer",
    max_tokens_field: "max_completion_tokens",
    documents: true,
};

/// Declared rules of `openai-chat@2`.
pub static RULES: RulesDescriptor = RulesDescriptor {
    adapter: "openai-chat@2",
    rules_revision: 1,
    endpoint: "POST /v1/chat/completions",
    representable_kinds: &[
        "text",
        "image",
        "tool_call",
        "tool_result",
        "context",
        "reasoning",
        "document",
    ],
    unrepresentable_parts: &["tool_result.image", "document.url"],
    system_placement: "one developer message per system turn, each block a text part",
    max_output_tokens_field: "max_completion_tokens",
    result_placement: "one tool message per call right after the assistant message, in call order; error/cancel as a leading status text part",
    call_id_rule: "length <= 40, else tc_<sha256 hex 32>",
    reasoning: "omitted (chat has no reasoning input); policy records each omission",
    context_wrapping: CONTEXT_WRAPPING,
    headers: HEADERS,
};

pub(crate) fn render(graph: Graph<'_>, options: &RenderOptions, ctx: &mut Ctx<'_>) -> RenderOutcome {
    crate::openai_chat::render(&VERSION, graph, options, ctx)
}
