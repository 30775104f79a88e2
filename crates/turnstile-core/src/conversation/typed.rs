//! The typed decode of a v1 file: the file's bytes read straight into turns and blocks, with
//! each block's content digest written from its fields, no `serde_json::Value` tree in between
//! (building and dropping that tree was most of a cold prepare, `docs/benchmarks-log.md`).
//!
//! It takes the v1 block kinds (`tool_result` with text parts only), and only where
//! [`Conversation::from_value`] would find nothing to report: members that the v1 format
//! names, with the types it gives them. On anything else (another kind, an unknown or repeated
//! member at any level, a `null` where the digest would have to cover it, a field the decoder
//! would report, a limit) it gives `None`, and the caller decodes the file through
//! `from_value`, which stays the definition. So the two agree wherever this one answers (`tests/it/typed_decode.rs` compares them on every data file,
//! on generated conversations and on mutations of them).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - the typed decode, which scans only the free-form members' text, refuses a file exactly where
//!   the whole-file scan puts `JSON_DEPTH_MAX`, also through a repeated key whose first value is
//!   the deep one, and takes no value deeper than its text. Enforced in
//!   `core/src/conversation/typed.rs` (`free_form`: `parse::value_may_nest_deeper` on the member's
//!   raw text before it is parsed), `parse.rs::conversation_from_slice`. Tests:
//!   `core/tests/it/typed_decode.rs::the_depth_limit_falls_where_the_scan_puts_it_for_every_free_form_member`
//!   (arguments, cache, tools, repeated keys, the raw-value token; every depth around the limit;
//!   red with the block members' offset 4, the tools' 0, or the text scan skipped).
//! - the typed decode of a v1 file gives what `Conversation::from_value` gives (every digest, body
//!   and finding), or declines. Enforced in `core/src/conversation/typed.rs` (`Object` refuses
//!   arrays, `present` refuses `null`s the digest would cover, `deny_unknown_fields` at every
//!   level, since a skipped member is not checked as the `Value` parse checks it),
//!   `parse.rs::conversation_from_slice`. Tests: `core/tests/it/typed_decode.rs` (every data file;
//!   256 generated conversations, legal and mutated, compact and pretty, with nulls, unknown and
//!   repeated members, other types, arrays for objects, members of other kinds; every legal one
//!   decodes typed; red with `null` revisions read as absent, with two members' digest order
//!   swapped, and with arrays taken as objects; a lone surrogate, a non-UTF-8 byte or `1e400` in an
//!   unread member is refused as the `Value` parse refuses it, red with unknown top-level and turn
//!   members skipped).

use super::{
    ArgState, Arguments, Block, BlockBody, BlockState, Conversation, Decoder, FORMAT_V1, MediaSource,
    ResultPart, RoleField, Turn, cache_mark, role_named, status_named, trust_named, without_cache_marks,
};
use crate::digest::{CanonicalObject, Digest};
use crate::ids::{CallId, Generation, Revision};
use crate::limits;
use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

/// Decode `bytes` (already checked against the size limit), or `None` where the file is not
/// one this decode takes, including one that nests deeper than `JSON_DEPTH_MAX`.
///
/// The depth limit is checked member by member rather than by a scan of the whole file first:
/// the members this decode names nest at most 7 deep (top object, `turns`, turn, `blocks`,
/// block, `content`, part), so only the free-form values can go deeper (`tools` at 1, a
/// block's `arguments` and `cache` at 5). Those are read as raw text, scanned and parsed
/// ([`free_form`]); serde_json refuses anything past 128 levels itself. A file deeper than
/// the limit gives `None`, and the caller's scan reports it.
///
/// The bytes are checked as UTF-8 once, then parsed as a `str`: serde_json then skips the
/// check it would otherwise make on every string and member name.
pub(crate) fn decode(bytes: &[u8]) -> Option<Conversation> {
    let text = std::str::from_utf8(bytes).ok()?;
    let Object(top) = serde_json::from_str::<Object<Top>>(text).ok()?;
    if top.format != FORMAT_V1 || top.conversation_id.is_empty() || top.turns.len() > limits::TURNS_MAX {
        return None;
    }
    let tools_value = match &top.tools {
        Some(raw) => free_form(raw, TOOLS_AT)?,
        None => Value::Array(Vec::new()),
    };
    let mut decoder = Decoder {
        violations: Vec::new(),
        turn_id: None,
    };
    let toolset_digest = Digest::of_value(&without_cache_marks(&tools_value));
    let tools = decoder.tools(tools_value).ok()?;
    let revision = Revision(top.revision);
    let mut blocks_total = 0usize;
    let mut turns = Vec::with_capacity(top.turns.len());
    for Object(turn) in top.turns {
        let Blocks(blocks) = turn.blocks;
        if blocks.is_empty() || turn.id.is_empty() {
            return None;
        }
        blocks_total += blocks.len();
        if blocks_total > limits::BLOCKS_MAX {
            return None;
        }
        let role = role_named(&turn.role)?;
        turns.push(Turn {
            id: Some(turn.id),
            revision: turn.revision.map(Revision),
            role: RoleField::Known(role),
            generation: turn.generation.map(Generation),
            blocks,
        });
    }
    if turns
        .iter()
        .rev()
        .find_map(|turn| turn.revision)
        .is_some_and(|last| last > revision)
    {
        return None;
    }
    Some(Conversation {
        conversation_id: top.conversation_id,
        revision,
        tools,
        toolset_digest,
        turns,
        decode_violations: decoder.violations,
    })
}

/// A JSON object read into `T`, refusing the array form serde's derived structs also take.
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Object<T>, D::Error> {
        struct ObjectVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = Object<T>;
            fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
                formatter.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Object<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Object)
            }
        }
        deserializer.deserialize_map(ObjectVisitor(std::marker::PhantomData))
    }
}

/// A member that must have its type when present: `null` is refused (it would be a finding,
/// or a member the digest covers), where serde's `Option` would read it as absent.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(deserializer: D) -> Result<Option<T>, D::Error> {
    T::deserialize(deserializer).map(Some)
}

/// The top level. `from_value` ignores unknown members, but only after serde_json has parsed
/// them whole, refusing a lone surrogate, bytes that are not UTF-8 or a number out of range
/// inside them; serde skipping a member checks none of that. So a file with a member this
/// struct does not name takes the `Value` path.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Top {
    format: String,
    conversation_id: String,
    revision: u64,
    /// `null` is kept (a finding of `tools()`, and part of the toolset digest). Its text, for
    /// [`free_form`].
    #[serde(default, deserialize_with = "present")]
    tools: Option<Box<RawValue>>,
    turns: Vec<Object<RawTurn>>,
}

/// A turn. A turn with a member this struct does not name takes the `Value` path, for the
/// reason given at [`Top`].
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTurn {
    id: String,
    #[serde(default, deserialize_with = "present")]
    revision: Option<u64>,
    role: String,
    /// `null` is no generation, as in `from_value`.
    #[serde(default)]
    generation: Option<u64>,
    blocks: Blocks,
}

/// A turn's blocks, each decoded as soon as it is read (a `Vec` of [`RawBlock`]s first was
/// moved and grown block by block: 2.5 % of a cold prepare's profile). A block this decode does
/// not take, or more than `BLOCKS_PER_TURN_MAX` of them, ends the whole decode with an error,
/// which [`decode`] turns into `None`.
struct Blocks(Vec<Block>);

impl<'de> Deserialize<'de> for Blocks {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Blocks, D::Error> {
        struct BlocksVisitor;
        impl<'de> Visitor<'de> for BlocksVisitor {
            type Value = Blocks;
            fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
                formatter.write_str("an array of blocks")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Blocks, A::Error> {
                let mut blocks = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(16));
                while let Some(Object(raw)) = seq.next_element::<Object<RawBlock>>()? {
                    if blocks.len() == limits::BLOCKS_PER_TURN_MAX {
                        return Err(de::Error::custom("BLOCKS_PER_TURN_MAX"));
                    }
                    let block = raw
                        .decode()
                        .ok_or_else(|| de::Error::custom("a block the typed decode does not take"))?;
                    blocks.push(block);
                }
                Ok(Blocks(blocks))
            }
        }
        deserializer.deserialize_seq(BlocksVisitor)
    }
}

/// A block: every member the v1 block kinds name, and no other (an unknown member is part of
/// the digest, so such a block takes the `Value` path).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBlock {
    id: String,
    #[serde(default, deserialize_with = "present")]
    state: Option<String>,
    /// Not part of the digest; `null` is no mark, as in `from_value`. Its text, for
    /// [`free_form`].
    #[serde(default)]
    cache: Option<Box<RawValue>>,
    kind: String,
    #[serde(default, deserialize_with = "present")]
    text: Option<String>,
    #[serde(default, deserialize_with = "present")]
    call_id: Option<String>,
    #[serde(default, deserialize_with = "present")]
    tool: Option<String>,
    /// Any JSON (the digest covers it as given; `null` included). Its text, for
    /// [`free_form`].
    #[serde(default, deserialize_with = "present")]
    arguments: Option<Box<RawValue>>,
    #[serde(default, deserialize_with = "present")]
    args_digest: Option<String>,
    #[serde(default, deserialize_with = "present")]
    generation: Option<u64>,
    #[serde(default, deserialize_with = "present")]
    status: Option<String>,
    #[serde(default, deserialize_with = "present")]
    content: Option<Vec<Object<RawPart>>>,
    #[serde(default, deserialize_with = "present")]
    source: Option<String>,
    #[serde(default, deserialize_with = "present")]
    trust: Option<String>,
    #[serde(default, deserialize_with = "present")]
    media_type: Option<String>,
    #[serde(default, deserialize_with = "present")]
    data: Option<String>,
    #[serde(default, deserialize_with = "present")]
    url: Option<String>,
    #[serde(default, deserialize_with = "present")]
    title: Option<String>,
    #[serde(default, deserialize_with = "present")]
    provider: Option<String>,
    #[serde(default, deserialize_with = "present")]
    signature: Option<String>,
    #[serde(default, deserialize_with = "present")]
    encrypted: Option<String>,
}

/// A text part of a tool result.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPart {
    kind: String,
    text: String,
}

impl RawBlock {
    /// The block `from_value` would decode from the same object, or `None` where it would
    /// report something or where this decode does not take the kind.
    fn decode(mut self) -> Option<Block> {
        if self.id.is_empty() {
            return None;
        }
        let arguments = match &self.arguments {
            Some(raw) => Some(free_form(raw, BLOCK_MEMBERS_AT)?),
            None => None,
        };
        let cache = match &self.cache {
            Some(raw) => Some(free_form(raw, BLOCK_MEMBERS_AT)?),
            None => None,
        };
        let state = match self.state.take() {
            None => BlockState::Committed,
            Some(state) if state == "committed" => BlockState::Committed,
            Some(state) => BlockState::Other(state),
        };
        let cache = cache_mark(cache).ok()?;
        if self
            .content
            .as_ref()
            .is_some_and(|parts| parts.iter().any(|Object(part)| part.kind != "text"))
        {
            return None;
        }
        let digest = self.digest(arguments.as_ref());
        let body = match self.kind.as_str() {
            "text" => BlockBody::Text { text: self.text? },
            "tool_call" => {
                let call_id = non_empty(self.call_id?)?;
                let tool = self.tool?;
                let arguments = match arguments? {
                    Value::Object(value) => Arguments::from_object(value),
                    Value::String(text) => Arguments::from_text(text),
                    other => Arguments::Unclosed {
                        state: ArgState::Invalid,
                        raw: other.to_string(),
                    },
                };
                BlockBody::ToolCall {
                    call_id,
                    tool,
                    arguments,
                }
            }
            "tool_result" => {
                let call_id = non_empty(self.call_id?)?;
                let args_digest = match self.args_digest {
                    None => None,
                    Some(text) => Some(Digest::parse(&text)?),
                };
                let status = status_named(&self.status?)?;
                BlockBody::ToolResult {
                    call_id,
                    tool: self.tool.unwrap_or_default(),
                    args_digest,
                    generation: self.generation.map(Generation),
                    status,
                    content: self
                        .content
                        .unwrap_or_default()
                        .into_iter()
                        .map(|Object(part)| ResultPart::Text(part.text))
                        .collect(),
                }
            }
            "context" => BlockBody::Context {
                source: self.source,
                trust: trust_named(self.trust.as_deref())?,
                text: self.text?,
            },
            "image" => BlockBody::Image {
                source: self.media_source()?,
            },
            "document" => BlockBody::Document {
                source: self.media_source()?,
                title: self.title,
            },
            "reasoning" => {
                if self.signature.is_none() && self.encrypted.is_none() {
                    return None;
                }
                BlockBody::Reasoning {
                    provider: self.provider?,
                    signature: self.signature,
                    encrypted: self.encrypted,
                    text: self.text,
                }
            }
            _ => return None,
        };
        Some(Block {
            id: Some(self.id),
            state,
            digest,
            body,
            cache,
        })
    }

    /// The source of an image or document, as `media_source` reads it.
    fn media_source(&mut self) -> Option<MediaSource> {
        let media_type = self.media_type.take();
        if let Some(url) = self.url.take() {
            return Some(MediaSource::Url { url, media_type });
        }
        Some(MediaSource::Base64 {
            data: self.data.take()?,
            media_type: media_type?,
        })
    }

    /// `Digest::of_map` of the block's object without `id`, `state` and `cache`: its members
    /// written in RFC 8785 order (the keys are ASCII, so byte order is UTF-16 order).
    fn digest(&self, arguments: Option<&Value>) -> Digest {
        let mut object = CanonicalObject::new();
        if let Some(text) = &self.args_digest {
            object.string("args_digest", text);
        }
        if let Some(value) = arguments {
            object.value("arguments", value);
        }
        if let Some(text) = &self.call_id {
            object.string("call_id", text);
        }
        if let Some(parts) = &self.content {
            object.string_objects(
                "content",
                parts
                    .iter()
                    .map(|Object(part)| [("kind", part.kind.as_str()), ("text", part.text.as_str())]),
            );
        }
        for (key, text) in [("data", &self.data), ("encrypted", &self.encrypted)] {
            if let Some(text) = text {
                object.string(key, text);
            }
        }
        if let Some(number) = self.generation {
            object.unsigned("generation", number);
        }
        object.string("kind", &self.kind);
        for (key, text) in [
            ("media_type", &self.media_type),
            ("provider", &self.provider),
            ("signature", &self.signature),
            ("source", &self.source),
            ("status", &self.status),
            ("text", &self.text),
            ("title", &self.title),
            ("tool", &self.tool),
            ("trust", &self.trust),
            ("url", &self.url),
        ] {
            if let Some(text) = text {
                object.string(key, text);
            }
        }
        object.finish()
    }
}

/// Levels above the `tools` value (the top object).
const TOOLS_AT: usize = 1;
/// Levels above a block's free-form members (top object, `turns`, turn, `blocks`, block).
const BLOCK_MEMBERS_AT: usize = 5;

/// A free-form member `above` levels below the top of the file, parsed from its text, or
/// `None` where the file would break `JSON_DEPTH_MAX` through it: its text nests deeper than
/// the levels left, as `parse::depth_exceeds` counts them (every value written counts, also one
/// a repeated key then replaces), or it holds serde_json's raw-value token, through which a
/// value nests deeper than its text (`parse::value_may_nest_deeper`). The check comes before
/// the parse, which would recurse through the token.
fn free_form(raw: &RawValue, above: usize) -> Option<Value> {
    let levels = limits::JSON_DEPTH_MAX - above;
    if crate::parse::value_may_nest_deeper(raw.get().as_bytes(), levels) {
        return None;
    }
    serde_json::from_str(raw.get()).ok()
}

fn non_empty(id: String) -> Option<CallId> {
    (!id.is_empty()).then_some(CallId(id))
}
