//! Typed, borrowing reads of provider JSON that accept exactly what `serde_json::Value` accepts
//! and mean what the decoders' `Value` paths mean, for the hot events' fast paths.
//!
//! Why not `#[derive(Deserialize)]`: a derived struct also accepts a JSON *array* (fields by
//! position), skips unknown members with `IgnoredAny` (which lets through a lone UTF-16
//! surrogate escape or a number out of range that `Value` refuses) and fails on a repeated key
//! (where a `Value` map keeps the last). The objects declared with [`json_object!`] read only
//! objects, check every skipped member as strictly as `Value` does ([`Strict`]) and let the last
//! of repeated keys win, so whenever a fast path succeeds, the `Value` path would have read the
//! same fields; whenever it fails, the event goes to the `Value` path, unchanged.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a stream event read through a decode template means what the `Value` path reads from it (Chat
//!   hot chunks, Anthropic text and tool-input deltas); the assembler's dedupe keys are a set.
//!   Enforced in `adapters/src/decode/json.rs` (`Templates`, `Pieces`: the hole is the raw token of
//!   the member read, each new token checked by serde_json), `decode/openai_chat.rs` (`Template`,
//!   rebuilt chunk through `Chat::chunk`), `decode/anthropic_messages.rs` (objects only, unknown
//!   members checked); `core/src/assemble.rs` (`SeenKeys`). Tests: `openai_chat.rs` and
//!   `anthropic_messages.rs` unit properties (streams sharing templates, holes of every kind,
//!   against the `Value`-only decoder; red without the token check, with the last piece compared as
//!   a prefix, without the remembered id), `…read_through_templates…` hit counts with varying
//!   `obfuscation`; `assemble.rs::the_dedupe_keys_are_a_set` (red with a strict comparison).

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::borrow::Cow;
use std::fmt;

/// A JSON string, borrowed from the event data when it has no escapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Str<'a>(pub(crate) Cow<'a, str>);

impl Str<'_> {
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> Visitor<'de> for Text {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(text)))
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(text.to_owned())))
            }
            fn visit_string<E: de::Error>(self, text: String) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(text)))
            }
        }
        deserializer.deserialize_str(Text)
    }
}

/// A JSON string with the raw text of its token (quotes and escapes as received), so a reader
/// can tell where in the event data it sat. The raw text is only known when read from JSON
/// text; a string taken from a `Value` has none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RawStr<'a> {
    pub(crate) raw: Option<&'a str>,
    pub(crate) value: Str<'a>,
}

impl<'a> RawStr<'a> {
    /// A string read from a `Value` (no token).
    pub(crate) fn from_value(text: &'a str) -> RawStr<'a> {
        RawStr {
            raw: None,
            value: Str(Cow::Borrowed(text)),
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        self.value.as_str()
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for RawStr<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // The token first (any value), then the string read from it exactly as `Str` reads
        // one: anything else than a string is refused, as `Str` refuses it.
        let raw: &'a serde_json::value::RawValue =
            <&'de serde_json::value::RawValue>::deserialize(deserializer)?;
        let value = serde_json::from_str::<Str<'a>>(raw.get()).map_err(de::Error::custom)?;
        Ok(RawStr {
            raw: Some(raw.get()),
            value,
        })
    }
}

/// An event's text around some of its string tokens (the holes), for a decoder that reads the
/// next events of the same shape without parsing them: an event made of the same pieces with a
/// valid JSON string token in each hole is the same JSON text but for those strings, and a
/// string token in a string's place leaves every other token where it was, so a parser reads
/// the same members from it, with the new strings in the holes.
#[derive(Clone, Debug)]
struct Pieces {
    /// The text before, between and after the holes: one piece more than holes.
    pieces: Vec<Box<str>>,
    /// Which hole holds the string the decoder uses (the others are read and dropped).
    fragment: usize,
}

impl Pieces {
    /// The pieces of `data` around `holes`, the string tokens of members read from `data`
    /// itself; `holes[0]` is the fragment. `None` for a string not read from `data`'s text.
    fn of(data: &str, holes: &[&RawStr<'_>]) -> Option<Pieces> {
        let mut spans = holes
            .iter()
            .map(|token| {
                let raw = token.raw?;
                let start = (raw.as_ptr() as usize).checked_sub(data.as_ptr() as usize)?;
                let end = start.checked_add(raw.len())?;
                (data.get(start..end) == Some(raw)).then_some((start, end))
            })
            .collect::<Option<Vec<_>>>()?;
        let fragment = *spans.first()?;
        spans.sort_unstable();
        let mut pieces = Vec::with_capacity(spans.len() + 1);
        let mut from = 0;
        for &(start, end) in &spans {
            pieces.push(data.get(from..start)?.into());
            from = end;
        }
        pieces.push(data.get(from..)?.into());
        Some(Pieces {
            pieces,
            fragment: spans.iter().position(|span| *span == fragment)?,
        })
    }

    /// The fragment of `data` if `data` is these pieces with a valid string token in every
    /// hole (each checked by serde_json, so it is refused exactly where a parse would refuse it).
    fn read<'d>(&self, data: &'d str) -> Option<Str<'d>> {
        let (last, pieces) = self.pieces.split_last()?;
        // Both ends first: an event of another shape is turned away before any token is read.
        if !data.ends_with(&**last) || !data.starts_with(&**pieces.first()?) {
            return None;
        }
        let mut rest = data;
        let mut fragment = None;
        for (hole, piece) in pieces.iter().enumerate() {
            rest = rest.strip_prefix(&**piece)?;
            let token = &rest[..string_token_len(rest)?];
            let value = serde_json::from_str::<Str<'d>>(token).ok()?;
            if hole == self.fragment {
                fragment = Some(value);
            }
            rest = &rest[token.len()..];
        }
        (rest == &**last).then_some(())?;
        fragment
    }
}

/// Most templates a decoder keeps.
const TEMPLATES_MAX: usize = 8;
/// Largest event kept as a template (hot events are a few hundred bytes).
const TEMPLATE_BYTES_MAX: usize = 4096;

/// A decoder's templates: the last few hot events' [`Pieces`], each with what the rest of its
/// event meant (`T`, the decoder's own), most recently used first.
#[derive(Clone, Debug)]
pub(crate) struct Templates<T> {
    kept: Vec<(Pieces, T)>,
    /// Events read through a template (tests and benchmarks look at it).
    pub(crate) reads: u64,
}

impl<T> Default for Templates<T> {
    fn default() -> Self {
        Templates {
            kept: Vec::new(),
            reads: 0,
        }
    }
}

impl<T> Templates<T> {
    /// The kept template `data` fits, with the fragment it holds; that template becomes the
    /// most recently used.
    pub(crate) fn read<'d>(&mut self, data: &'d str) -> Option<(&T, Str<'d>)> {
        let (at, fragment) = self
            .kept
            .iter()
            .enumerate()
            .find_map(|(at, (pieces, _))| Some((at, pieces.read(data)?)))?;
        self.kept[..=at].rotate_right(1);
        self.reads += 1;
        Some((&self.kept[0].1, fragment))
    }

    /// Keep `data`'s text around `holes` (the string tokens of members read from `data`
    /// itself, the fragment first) as a template meaning `shape`, unless `data` is over
    /// `TEMPLATE_BYTES_MAX` or a hole was not read from its text.
    pub(crate) fn keep(&mut self, data: &str, holes: &[&RawStr<'_>], shape: T) {
        if data.len() > TEMPLATE_BYTES_MAX {
            return;
        }
        if let Some(pieces) = Pieces::of(data, holes) {
            self.kept.truncate(TEMPLATES_MAX - 1);
            self.kept.insert(0, (pieces, shape));
        }
    }
}

/// What goes in a template's hole (tests): valid strings, and tokens that are not one string.
#[cfg(test)]
pub(crate) const HOLES: &[&str] = &[
    "\"\"",
    "\"Hi\"",
    "\"a\\nb\\u00e9\"",
    "\"\\ud800\"",
    "\"\\ud83d\\ude00\"",
    "\"{\\\"city\\\":\"",
    "\"a\\\\\"",
    "\"\\\"\"",
    "\"\\x\"",
    "\"\u{1}\"",
    "\"é\"",
    "null",
    "5",
    "{}",
    "\"a\",\"content\":\"b\"",
    "\"a\",\"arguments\":\"b\"",
    "\"x\" ",
    " \"x\"",
    "\"unterminated",
    "\"a\"}",
];

/// The length of the JSON string token at the start of `text` (from its opening quote to its
/// closing one, both included), or `None` when `text` does not start with one that ends. Only
/// finds the end: whether the token is a valid string is for a parser to say.
fn string_token_len(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    if bytes.first() != Some(&b'"') {
        return None;
    }
    let mut at = 1;
    loop {
        let next = at + memchr::memchr2(b'"', b'\\', bytes.get(at..)?)?;
        if bytes[next] == b'"' {
            return Some(next + 1);
        }
        at = next + 2;
    }
}

/// Any JSON value, read and dropped, refused exactly where building a `serde_json::Value` of
/// it would fail (strings are unescaped and checked, numbers are parsed).
pub(crate) struct Strict;

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Anything;
        impl<'de> Visitor<'de> for Anything {
            type Value = Strict;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_none<E: de::Error>(self) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Strict, D::Error> {
                Strict::deserialize(deserializer)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
                while seq.next_element::<Strict>()?.is_some() {}
                Ok(Strict)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
                while map.next_entry::<Strict, Strict>()?.is_some() {}
                Ok(Strict)
            }
        }
        deserializer.deserialize_any(Anything)
    }
}

/// An object member's name.
pub(crate) struct Key<'a>(Cow<'a, str>);

impl Key<'_> {
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Str::deserialize(deserializer).map(|name| Key(name.0))
    }
}

/// `Deserialize` for a struct of `Option` fields read from a JSON object only: listed members
/// are read into their field (the last of repeated keys wins, as in a `Value` map), every other
/// member is checked by [`Strict`] and dropped. A missing member, or `null`, leaves `None`.
macro_rules! json_object {
    ($name:ident<$lt:lifetime> { $($key:literal => $field:ident),* $(,)? }) => {
        json_object!(@impl [$name<'de>] $name { $($key => $field),* });
    };
    ($name:ident { $($key:literal => $field:ident),* $(,)? }) => {
        json_object!(@impl [$name] $name { $($key => $field),* });
    };
    (@impl [$($ty:tt)*] $name:ident { $($key:literal => $field:ident),* }) => {
        impl<'de> serde::Deserialize<'de> for $($ty)* {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Members;
                impl<'de> serde::de::Visitor<'de> for Members {
                    type Value = $($ty)*;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str(concat!("a JSON object (", stringify!($name), ")"))
                    }
                    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                        let mut value = <$($ty)*>::default();
                        while let Some(key) = map.next_key::<$crate::decode::json::Key<'de>>()? {
                            match key.as_str() {
                                $($key => value.$field = map.next_value()?,)*
                                _ => {
                                    map.next_value::<$crate::decode::json::Strict>()?;
                                }
                            }
                        }
                        Ok(value)
                    }
                }
                deserializer.deserialize_map(Members)
            }
        }
    };
}
pub(crate) use json_object;
