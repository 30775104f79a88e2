//! `anthropic-messages@2`: what changes from @1 (`shared/spec/conversation-v1.md` §3) is
//! `document` blocks and nothing else: PDFs as `base64` or `url` sources, `text/plain` as a
//! `text` source, with the optional `title` (Anthropic "PDF support" and "Citations" pages).
//! Other document media types pause.

use crate::anthropic_messages::{AnthropicVersion, HEADERS};
use crate::registry::RulesDescriptor;
use crate::render::{CONTEXT_WRAPPING, Ctx, Graph, RenderOptions, RenderOutcome};

const VERSION: AnthropicVersion = AnthropicVersion { documents: true };

/// Declared rules of `anthropic-messages@2`.
pub static RULES: RulesDescriptor = RulesDescriptor {
    adapter: "anthropic-messages@2",
    rules_revision: 1,
    endpoint: "POST /v1/messages",
    representable_kinds: &[
        "text",
        "image",
        "tool_call",
        "tool_result",
        "context",
        "reasoning",
        "document",
    ],
    unrepresentable_parts: &["document.media_type (other than application/pdf, text/plain)"],
    system_placement: "top-level system array, each block a text block",
    max_output_tokens_field: "max_tokens",
    result_placement: "all results of one assistant turn in ONE user message, tool_result blocks first in call order, is_error for error and cancel; consecutive same-role turns merged",
    call_id_rule: "^[a-zA-Z0-9_-]+$, else tc_<sha256 hex 32>",
    reasoning: "anthropic thinking (signature) / redacted_thinking (encrypted) replayed; foreign omitted with policy",
    context_wrapping: CONTEXT_WRAPPING,
    headers: HEADERS,
};

pub(crate) fn render(graph: Graph<'_>, options: &RenderOptions, ctx: &mut Ctx<'_>) -> RenderOutcome {
    crate::anthropic_messages::render(&VERSION, graph, options, ctx)
}
