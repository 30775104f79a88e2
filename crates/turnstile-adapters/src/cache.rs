//! Prompt-cache breakpoints: where each API takes them, and what the render policy pins.
//!
//! A breakpoint lives on the v1 block or tool it marks (`"cache": {"ttl"?}`,
//! `turnstile_core::conversation::CacheMark`), outside every content digest, so the renderers
//! keep it in place and a breakpoint that moves between requests changes no block digest. This
//! module owns, per target API:
//! - Anthropic Messages: every mark is written in place as `cache_control: {"type":
//!   "ephemeral", "ttl"?}` on the system block, content block, tool result or tool it marks.
//!   Anthropic takes at most [`ANTHROPIC_BREAKPOINTS_MAX`] breakpoints per request (the
//!   request-level automatic `cache_control` counts as one) and none on thinking blocks; a
//!   request beyond that pauses, naming the mark, instead of sending something Anthropic answers
//!   400 to.
//! - OpenAI Chat and Responses: OpenAI caches prefixes by itself and has no breakpoints; its
//!   nearest field is `prompt_cache_key`, which routes requests that share a prefix to the same
//!   cache. A marked conversation is sent with a key derived from the conversation id and the
//!   prefix up to its first breakpoint ([`prompt_cache_key`]): stable while that prefix is, and
//!   the same for every request of the conversation when the first mark sits on the tools or
//!   the system prompt. The client's own `prompt_cache_key` (same API) wins. A one-hour TTL has
//!   no OpenAI meaning (its retention settings are other values) and pauses (`cache.ttl`).
//! - Gemini: caching is implicit (automatic prefix caching, billed by itself) or explicit via
//!   `cachedContent`, which needs server state we do not hold; there is no per-request field a
//!   breakpoint could become, so a mark cannot change what Gemini does or bills. It is left out
//!   and reported as `cache_control` in `x-turnstile-dropped` ([`dropped_towards`]).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a cache breakpoint stays on the block or tool it marks, outside every content digest, and is
//!   pinned by `policy_digest`; the provider gets exactly the request's breakpoints (in place for
//!   Anthropic, a stable `prompt_cache_key` for OpenAI). Enforced in `core/src/conversation.rs`
//!   (`CacheMark`, removed before the digest), `adapters/src/cache.rs`,
//!   `proxy/continuation.rs::with_request_marks`. Tests: `adapters/tests/it/render_cache.rs`
//!   (digest test red with the mark left in the digest; fragment test red with one tag for marked
//!   and unmarked), `gateway/tests/it/proxy.rs::cache_breakpoints_reach_anthropic_in_place…` (red
//!   without `with_request_marks`), `…the_native_api_takes_cache_breakpoints…`.

use crate::passthrough::Passthrough;
use crate::registry::Api;
use crate::render::{Ctx, Pause, PauseReason};
use serde::Serialize;
use turnstile_core::Digest;
use turnstile_core::conversation::{BlockBody, CacheMark, CacheTtl, Conversation};

/// Most breakpoints Anthropic takes in one request ("A maximum of 4 blocks with cache_control
/// may be provided"; the request-level `cache_control` uses one of them).
pub const ANTHROPIC_BREAKPOINTS_MAX: usize = 4;

/// One breakpoint as the render policy records it: the block (by id) or the tool (by name).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Breakpoint {
    /// The marked block's id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block: Option<String>,
    /// The marked tool's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The mark.
    #[serde(flatten)]
    pub mark: CacheMark,
}

/// What the render policy records about caching (left out of the policy when empty, so a
/// conversation without marks keeps the policy digest it always had).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CachePolicy {
    /// Every breakpoint of the conversation, tools first, then blocks in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub breakpoints: Vec<Breakpoint>,
    /// The `prompt_cache_key` derived for an OpenAI target.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_cache_key: Option<String>,
}

impl CachePolicy {
    /// Whether there is nothing to record.
    pub fn is_unset(&self) -> bool {
        self.breakpoints.is_empty() && self.prompt_cache_key.is_none()
    }
}

/// Every breakpoint of a conversation: tools first (they precede the messages in every API's
/// prefix), then blocks in order.
pub fn breakpoints(conversation: &Conversation) -> Vec<Breakpoint> {
    let mut breakpoints = tool_breakpoints(conversation);
    breakpoints.extend(block_breakpoints(&conversation.turns));
    breakpoints
}

fn tool_breakpoints(conversation: &Conversation) -> Vec<Breakpoint> {
    conversation
        .tools
        .iter()
        .filter_map(|tool| {
            tool.cache.map(|mark| Breakpoint {
                block: None,
                tool: Some(tool.name.clone()),
                mark,
            })
        })
        .collect()
}

/// The breakpoints of the blocks of `turns`, in order.
pub(crate) fn block_breakpoints(turns: &[turnstile_core::conversation::Turn]) -> Vec<Breakpoint> {
    turns
        .iter()
        .flat_map(|turn| &turn.blocks)
        .filter_map(|block| {
            block.cache.map(|mark| Breakpoint {
                block: Some(block.id.clone().unwrap_or_default()),
                tool: None,
                mark,
            })
        })
        .collect()
}

/// The `prompt_cache_key` for a marked conversation: `turnstile-` + 32 hex digits of SHA-256
/// over the canonical `{conversation, prefix}`, where the prefix is the toolset digest and
/// the content digests of the blocks up to and including the first marked one (only the
/// toolset digest when a tool carries the first mark). None when nothing is marked.
pub fn prompt_cache_key(conversation: &Conversation) -> Option<String> {
    let mut prefix = vec![conversation.toolset_digest.as_str().to_owned()];
    if !conversation.tools.iter().any(|tool| tool.cache.is_some()) {
        let mut marked = false;
        for block in conversation.turns.iter().flat_map(|turn| &turn.blocks) {
            prefix.push(block.digest.as_str().to_owned());
            if block.cache.is_some() {
                marked = true;
                break;
            }
        }
        if !marked {
            return None;
        }
    }
    let key = serde_json::json!({"conversation": conversation.conversation_id, "prefix": prefix});
    let digest = Digest::of_canonical(&key);
    let hex = digest.as_str().trim_start_matches("sha256:");
    Some(format!("turnstile-{}", &hex[..32.min(hex.len())]))
}

/// The policy record for `api`, pausing `ctx` on a mark the API cannot take. A resumed render
/// (`render.rs`, "resume") looks at the turns from its resume point only: the breakpoints
/// before it are kept, and so is the `prompt_cache_key` once a block before it is marked (the
/// key covers the blocks up to the first mark).
pub(crate) fn plan(
    api: Api,
    conversation: &Conversation,
    passthrough: &Passthrough,
    ctx: &mut Ctx<'_>,
) -> CachePolicy {
    let (from, kept_key) = match ctx.resume_cache() {
        Some((from, kept, marked, key)) => {
            let mut breakpoints = tool_breakpoints(conversation);
            breakpoints.extend_from_slice(kept);
            (from, Some((breakpoints, marked, key.cloned())))
        }
        None => (0, None),
    };
    let new_turns = &conversation.turns[from.min(conversation.turns.len())..];
    let (breakpoints, kept_key) = match kept_key {
        Some((mut breakpoints, marked, key)) => {
            breakpoints.extend(block_breakpoints(new_turns));
            (breakpoints, marked.then_some(key))
        }
        None => (breakpoints(conversation), None),
    };
    if breakpoints.is_empty() {
        return CachePolicy::default();
    }
    let mut prompt_cache_key = None;
    match api {
        Api::AnthropicMessages => {
            let automatic = passthrough.api == Some(Api::AnthropicMessages)
                && passthrough.fields.iter().any(|(name, _)| name == "cache_control");
            let count = breakpoints.len() + usize::from(automatic);
            if count > ANTHROPIC_BREAKPOINTS_MAX {
                ctx.pauses.push(Pause {
                    block: None,
                    kind: "cache".into(),
                    reason: PauseReason::UnrepresentablePart,
                });
            }
            // Before a resume point no marked reasoning block was found (the render that
            // kept the state paused on nothing).
            for block in new_turns.iter().flat_map(|turn| &turn.blocks) {
                if block.cache.is_some() && matches!(block.body, BlockBody::Reasoning { .. }) {
                    ctx.pause(Some(block), "reasoning.cache", PauseReason::UnrepresentablePart);
                }
            }
        }
        Api::OpenaiChat | Api::OpenaiResponses => {
            for breakpoint in &breakpoints {
                if breakpoint.mark.ttl == Some(CacheTtl::OneHour) {
                    ctx.pauses.push(Pause {
                        block: breakpoint.block.clone(),
                        kind: "cache.ttl".into(),
                        reason: PauseReason::UnrepresentablePart,
                    });
                }
            }
            let own_key = passthrough.api == Some(api)
                && passthrough
                    .fields
                    .iter()
                    .any(|(name, _)| name == "prompt_cache_key");
            if !own_key {
                let tools_marked = conversation.tools.iter().any(|tool| tool.cache.is_some());
                prompt_cache_key = match kept_key {
                    Some(key) if !tools_marked => key,
                    _ => self::prompt_cache_key(conversation),
                };
            }
        }
        Api::Gemini => {}
    }
    CachePolicy {
        breakpoints,
        prompt_cache_key,
    }
}

/// The fields left out towards `api`, for the client's `x-turnstile-dropped`: `cache_control`
/// when the conversation is marked and the target is Gemini.
pub fn dropped_towards(api: Api, conversation: &Conversation) -> Vec<String> {
    let marked = conversation.tools.iter().any(|tool| tool.cache.is_some())
        || conversation
            .turns
            .iter()
            .flat_map(|turn| &turn.blocks)
            .any(|block| block.cache.is_some());
    if api == Api::Gemini && marked {
        vec!["cache_control".to_owned()]
    } else {
        Vec::new()
    }
}

/// Anthropic's `cache_control` object for a mark.
pub(crate) fn anthropic_cache_control(mark: &CacheMark) -> String {
    match mark.ttl {
        None => "{\"type\":\"ephemeral\"}".to_owned(),
        Some(ttl) => format!("{{\"type\":\"ephemeral\",\"ttl\":\"{}\"}}", ttl.as_str()),
    }
}

/// Insert `,"cache_control":{…}` before the closing brace of a rendered JSON object (a block's
/// fragment always ends with one; anything else is left as it is).
pub(crate) fn mark_object(out: &mut Vec<u8>, mark: Option<&CacheMark>) {
    let Some(mark) = mark else {
        return;
    };
    if out.last() != Some(&b'}') {
        return;
    }
    out.pop();
    out.extend_from_slice(b",\"cache_control\":");
    out.extend_from_slice(anthropic_cache_control(mark).as_bytes());
    out.push(b'}');
}

/// The fragment-cache tag of a block with `mark` (a marked block's fragment differs from the
/// unmarked one of the same digest).
pub(crate) fn tag(base: u8, mark: Option<&CacheMark>) -> u8 {
    match mark.map(|mark| mark.ttl) {
        None => base,
        Some(None) => base | 0x10,
        Some(Some(CacheTtl::FiveMinutes)) => base | 0x20,
        Some(Some(CacheTtl::OneHour)) => base | 0x30,
    }
}

/// The fragment-cache key of the tool list with its marks.
pub(crate) fn tools_key(conversation: &Conversation) -> Digest {
    let marks: Vec<Option<&CacheMark>> = conversation
        .tools
        .iter()
        .map(|tool| tool.cache.as_ref())
        .collect();
    if marks.iter().all(Option::is_none) {
        return conversation.toolset_digest.clone();
    }
    Digest::of_canonical(&serde_json::json!({"tools": conversation.toolset_digest.as_str(), "marks": marks}))
}
