//! Content digests: `sha256:` + lowercase hex of SHA-256 over RFC 8785 (JCS) canonical JSON.
//!
//! The canonical writer here works on `serde_json::Value` and writes into a buffer that is
//! hashed in one call (canonical JSON comes in small pieces, and a `Sha256::update` per quote
//! or colon cost more than the copy).
//! It is ours (not `serde_jcs`) for speed: `serde_jcs` buffers and re-sorts every object through
//! a formatter, which made digesting 6× slower than parsing (see `docs/benchmarks-log.md`). It
//! stays honest through tests: `tests/it/digest.rs` checks the RFC 8785 examples (§3.2.2,
//! §3.2.3, Appendix B numbers) and a property test compares its bytes with both `serde_jcs`
//! and `serde_json_canonicalizer` on arbitrary values.
//!
//! The rules it implements (RFC 8785 §3.2):
//! - no whitespace; literals as `null`/`true`/`false`;
//! - strings escaped exactly as serde_json does (`\"`, `\\`, `\b \t \n \f \r`, other controls
//!   as `\u00xx` lowercase), everything else literal UTF-8 — the same set RFC 8785 §3.2.2.2
//!   requires;
//! - numbers as ECMAScript `Number.prototype.toString` of the IEEE-754 double (`ryu-js`);
//! - object members sorted by the UTF-16 code units of their names. serde_json maps iterate in
//!   UTF-8 byte order, which equals UTF-16 order unless a name holds a character ≥ U+E000, so
//!   the writer re-sorts only then (or if the map is not sorted at all, e.g. with serde_json's
//!   `preserve_order` feature switched on by some other crate).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - strings are written with serde_json's exact escapes (bodies and digests). Enforced in
//!   `core/src/digest.rs::push_json_string` (eight bytes at a time while none needs an escape).
//!   Tests: `core/tests/it/digest.rs::push_json_string_writes_serde_jsons_bytes` (property on
//!   strings dense in controls, quotes, backslashes and multibyte characters),
//!   `…escapes_at_every_position_of_a_word` (red when 0x1F is missed by the word test).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};
use sha2::{Digest as _, Sha256};
use std::fmt;

/// Every integer up to this one prints the same in serde_json and as an IEEE double (RFC
/// 8785); above it, not every one does.
pub(crate) const EXACT_INTEGER_MAX: u64 = 1 << 53;

/// A `sha256:<64 lowercase hex>` digest.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Digest(String);

impl Digest {
    /// Digest of raw bytes (used for exact request bodies).
    pub fn of_bytes(bytes: &[u8]) -> Digest {
        Digest::from_hash(&Sha256::digest(bytes))
    }

    /// Digest of the RFC 8785 canonical form of a JSON value.
    pub fn of_value(value: &Value) -> Digest {
        Digest::of_bytes(&canonical_value_bytes(value))
    }

    /// Digest of the canonical form of a JSON object.
    pub fn of_map(map: &Map<String, Value>) -> Digest {
        Digest::of_bytes(&canonical_object_bytes(map))
    }

    /// Digest of the RFC 8785 canonical form of any serialisable value (through a
    /// `serde_json::Value`).
    pub fn of_canonical<T: Serialize + ?Sized>(value: &T) -> Digest {
        Digest::of_value(&to_value(value))
    }

    /// Digest of a value whose compact serde_json serialisation is already canonical: struct
    /// fields declared in sorted order, only strings, integers up to 2^53, booleans and nulls.
    /// The caller promises that; a test per caller compares with [`Digest::of_canonical`].
    pub fn of_sorted_serialization<T: Serialize + ?Sized>(value: &T) -> Digest {
        let mut hash = HashState::new();
        hash.serialize(value);
        hash.finish()
    }

    fn from_hash(hash: &[u8]) -> Digest {
        // A table walk into an array: `hex::encode` goes through a char iterator (3.7 % of a
        // cold prepare's profile: one digest per block, per call's arguments and per
        // fragment), and a `Vec` pushed a byte at a time was still 3 %.
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut text = [0u8; 7 + 64];
        text[..7].copy_from_slice(b"sha256:");
        for (pair, &byte) in text[7..].chunks_exact_mut(2).zip(hash) {
            pair[0] = HEX[(byte >> 4) as usize];
            pair[1] = HEX[(byte & 0xF) as usize];
        }
        // Invariant: ASCII only.
        Digest(std::str::from_utf8(&text).expect("hex is ASCII").to_owned())
    }

    /// Parse a digest string; `None` unless it is `sha256:` + 64 lowercase hex digits.
    pub fn parse(text: &str) -> Option<Digest> {
        let hex_part = text.strip_prefix("sha256:")?;
        let well_formed = hex_part.len() == 64
            && hex_part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        well_formed.then(|| Digest(text.to_owned()))
    }

    /// The digest as `sha256:<hex>`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A SHA-256 in progress: fed in pieces, cloned at a point to resume from later (a midstate),
/// finished into a [`Digest`]. Incremental digests (`MessageSequence` kept beside a growing
/// conversation, a request body whose prefix did not change) keep one of these at the end of
/// the part that does not change, so the next digest hashes only what follows it.
#[derive(Clone, Debug, Default)]
pub struct HashState(Sha256);

impl HashState {
    /// An empty hash.
    pub fn new() -> HashState {
        HashState(Sha256::new())
    }

    /// Feed bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// Feed the compact serde_json serialisation of a value (canonical when the value's type
    /// keeps the rules of [`Digest::of_sorted_serialization`]).
    pub fn serialize<T: Serialize + ?Sized>(&mut self, value: &T) {
        // Invariant: as in `to_value`, digested types serialise to JSON, and the writer never
        // fails.
        serde_json::to_writer(&mut *self, value).expect("digested types serialise to JSON");
    }

    /// The digest of everything fed.
    pub fn finish(self) -> Digest {
        Digest::from_hash(&self.0.finalize())
    }
}

impl std::io::Write for HashState {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// RFC 8785 canonical bytes of a serialisable value.
pub fn canonical_bytes<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    write_value(&to_value(value), &mut out);
    out
}

/// RFC 8785 canonical bytes of a JSON value, written from it directly ([`canonical_bytes`]
/// first converts its argument into a new `Value`).
pub fn canonical_value_bytes(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    write_value(value, &mut out);
    out
}

/// RFC 8785 canonical bytes of a JSON object (a tool call's arguments), written from the map
/// directly.
pub fn canonical_object_bytes(map: &Map<String, Value>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    write_object(map, &mut out);
    out
}

fn to_value<T: Serialize + ?Sized>(value: &T) -> Value {
    // Invariant: every type we digest serialises to JSON (string keys, finite numbers); a type
    // that does not is a programming error caught by the tests that pin its digest.
    serde_json::to_value(value).expect("digested types serialise to JSON")
}

/// A canonical JSON object written member by member into a buffer and hashed once, for a caller that
/// holds the members as typed fields rather than as a `Value` (the typed decode of a v1 block,
/// `conversation/typed.rs`). The caller writes the members in RFC 8785 order (keys sorted by
/// UTF-16 code units); its tests compare every digest with [`Digest::of_map`] of the same
/// object.
pub(crate) struct CanonicalObject {
    /// The object's canonical bytes so far: hashed in one call at the end (a `Sha256::update`
    /// per piece, a quote or a colon, cost more than the copy).
    bytes: Vec<u8>,
}

impl CanonicalObject {
    pub(crate) fn new() -> CanonicalObject {
        let mut bytes = Vec::with_capacity(256);
        bytes.push(b'{');
        CanonicalObject { bytes }
    }

    /// Keys are the v1 member names, written in the code: lowercase ASCII letters and `_`,
    /// which need no escape.
    fn key(&mut self, key: &'static str) {
        debug_assert!(key.bytes().all(|byte| byte.is_ascii_lowercase() || byte == b'_'));
        if self.bytes.len() > 1 {
            self.bytes.push(b',');
        }
        self.bytes.push(b'"');
        self.bytes.extend_from_slice(key.as_bytes());
        self.bytes.extend_from_slice(b"\":");
    }

    pub(crate) fn string(&mut self, key: &'static str, text: &str) {
        self.key(key);
        push_json_string(&mut self.bytes, text);
    }

    pub(crate) fn value(&mut self, key: &'static str, value: &Value) {
        self.key(key);
        write_value(value, &mut self.bytes);
    }

    pub(crate) fn unsigned(&mut self, key: &'static str, number: u64) {
        self.key(key);
        write_number(&Number::from(number), &mut self.bytes);
    }

    /// An array of objects of string members, each given in canonical order.
    pub(crate) fn string_objects<'a, Members: IntoIterator<Item = (&'a str, &'a str)>>(
        &mut self,
        key: &'static str,
        items: impl Iterator<Item = Members>,
    ) {
        self.key(key);
        self.bytes.push(b'[');
        for (index, members) in items.enumerate() {
            if index > 0 {
                self.bytes.push(b',');
            }
            self.bytes.push(b'{');
            for (member, (key, text)) in members.into_iter().enumerate() {
                if member > 0 {
                    self.bytes.push(b',');
                }
                push_json_string(&mut self.bytes, key);
                self.bytes.push(b':');
                push_json_string(&mut self.bytes, text);
            }
            self.bytes.push(b'}');
        }
        self.bytes.push(b']');
    }

    pub(crate) fn finish(mut self) -> Digest {
        self.bytes.push(b'}');
        Digest::of_bytes(&self.bytes)
    }
}

fn write_value(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(number) => write_number(number, out),
        Value::String(text) => push_json_string(out, text),
        Value::Array(items) => {
            out.extend_from_slice(b"[");
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.extend_from_slice(b",");
                }
                write_value(item, out);
            }
            out.extend_from_slice(b"]");
        }
        Value::Object(map) => write_object(map, out),
    }
}

fn write_object(map: &Map<String, Value>, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{");
    let mut previous: Option<&str> = None;
    let mut in_utf16_order = true;
    for key in map.keys() {
        if key.bytes().any(|b| b >= 0xEE) || previous.is_some_and(|p| p >= key.as_str()) {
            in_utf16_order = false;
            break;
        }
        previous = Some(key);
    }
    if in_utf16_order {
        for (index, (key, value)) in map.iter().enumerate() {
            write_member(index, key, value, out);
        }
    } else {
        let mut members: Vec<(&String, &Value)> = map.iter().collect();
        members.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
        for (index, (key, value)) in members.into_iter().enumerate() {
            write_member(index, key, value, out);
        }
    }
    out.extend_from_slice(b"}");
}

fn write_member(index: usize, key: &str, value: &Value, out: &mut Vec<u8>) {
    if index > 0 {
        out.extend_from_slice(b",");
    }
    push_json_string(out, key);
    out.extend_from_slice(b":");
    write_value(value, out);
}

fn write_number(number: &Number, out: &mut Vec<u8>) {
    // RFC 8785 numbers are IEEE-754 doubles printed as ECMAScript does; integers beyond 2^53
    // become the nearest double, like any JSON number read by a JCS implementation.
    let float = if let Some(unsigned) = number.as_u64() {
        unsigned as f64
    } else if let Some(signed) = number.as_i64() {
        signed as f64
    } else {
        number.as_f64().unwrap_or(0.0)
    };
    let mut buffer = ryu_js::Buffer::new();
    out.extend_from_slice(buffer.format_finite(float).as_bytes());
}

/// Append `text` as a JSON string literal, byte for byte as serde_json's compact writer puts
/// it (and so as RFC 8785 §3.2.2.2 does): `\"`, `\\`, `\b \t \n \f \r`, other controls as
/// `\u00xx` lowercase, everything else as it is. `tests/it/digest.rs` compares the two on
/// arbitrary strings. Faster than serde_json's writer (a table lookup per byte) because it skips
/// eight bytes at a time while none of them needs escaping; the renderers write every string
/// of a request body through it.
pub fn push_json_string(out: &mut Vec<u8>, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = text.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    // `bytes[start..index]` needs no escape and is not written yet.
    let mut start = 0;
    let mut index = 0;
    loop {
        while let Some(chunk) = bytes.get(index..index + 8) {
            let word = u64::from_le_bytes(chunk.try_into().expect("eight bytes"));
            if word_needs_escape(word) {
                break;
            }
            index += 8;
        }
        // Byte by byte through the word that needs an escape (or the tail).
        let stop = (index + 8).min(bytes.len());
        while index < stop {
            let byte = bytes[index];
            let control;
            let escape: &[u8] = match byte {
                b'"' => b"\\\"",
                b'\\' => b"\\\\",
                b'\n' => b"\\n",
                b'\r' => b"\\r",
                b'\t' => b"\\t",
                0x08 => b"\\b",
                0x0C => b"\\f",
                0x00..=0x1F => {
                    control = [
                        b'\\',
                        b'u',
                        b'0',
                        b'0',
                        HEX[(byte >> 4) as usize],
                        HEX[(byte & 0xF) as usize],
                    ];
                    &control
                }
                _ => {
                    index += 1;
                    continue;
                }
            };
            out.extend_from_slice(&bytes[start..index]);
            out.extend_from_slice(escape);
            index += 1;
            start = index;
        }
        if index >= bytes.len() {
            break;
        }
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// Whether any of the eight bytes of `word` is a control character, `"` or `\\`. Exact (no
/// false positives): `(x - 0x01…) & !x & 0x80…` is non-zero iff some byte of `x` is zero, and
/// `(x - 0x20…) & !x & 0x80…` iff some byte is below 0x20.
#[inline(always)]
fn word_needs_escape(word: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let control = word.wrapping_sub(ONES * 0x20) & !word;
    let quote = word ^ (ONES * b'"' as u64);
    let quote = quote.wrapping_sub(ONES) & !quote;
    let backslash = word ^ (ONES * b'\\' as u64);
    let backslash = backslash.wrapping_sub(ONES) & !backslash;
    (control | quote | backslash) & HIGH != 0
}
