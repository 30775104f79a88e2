//! Bytes → [`Conversation`], within the limits of [`crate::limits`]: size first, before
//! anything is parsed. Then the typed decode (`conversation/typed.rs`), which checks the
//! nesting depth on each free-form member's text before it builds a value from it; where it
//! declines, nesting depth by a linear scan of the whole file (so the recursive `Value` parser
//! never goes deeper than `JSON_DEPTH_MAX`), then serde_json into a `Value`. The typed
//! decode's structs are at most 7 levels deep, and serde_json refuses more than 128 levels by
//! itself, so neither parser recurses without a bound.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - the nesting scan (`JSON_DEPTH_MAX`) answers what a byte-by-byte scan answers, string contents
//!   skipped with `memchr`. Enforced in `core/src/parse.rs::depth_exceeds`. Tests:
//!   `core/tests/it/depth_scan.rs` (property test against the byte-wise scan; red with a one-byte
//!   escape skip).

use crate::conversation::{Conversation, Unreadable};
use crate::limits;
use serde_json::Value;

/// Parse and decode a conversation file.
pub fn conversation_from_slice(bytes: &[u8]) -> Result<Conversation, Unreadable> {
    check_size(bytes)?;
    // The typed decode checks the depth limit on its free-form members' text
    // (`conversation/typed.rs`) and gives `None` beyond it, so the scan of the whole file runs
    // only on the way to `from_value`.
    if let Some(conversation) = crate::conversation::typed::decode(bytes) {
        return Ok(conversation);
    }
    check_limits(bytes)?;
    Conversation::from_value(json_within_limits(bytes)?)
}

/// The typed decode alone (`conversation/typed.rs`): the conversation where the file is one
/// it takes (nothing `from_value` would report, no member it does not name), else `None`. For
/// tests and benchmarks; [`conversation_from_slice`] is the decode to use.
#[doc(hidden)]
pub fn conversation_typed(bytes: &[u8]) -> Option<Conversation> {
    // As `conversation_from_slice` calls it: the depth limit is the typed decode's own check.
    check_size(bytes).ok()?;
    crate::conversation::typed::decode(bytes)
}

fn check_size(bytes: &[u8]) -> Result<(), Unreadable> {
    if bytes.len() > limits::FILE_BYTES_MAX {
        return Err(Unreadable::Limit {
            what: "FILE_BYTES_MAX",
            actual: bytes.len(),
            max: limits::FILE_BYTES_MAX,
        });
    }
    Ok(())
}

fn check_limits(bytes: &[u8]) -> Result<(), Unreadable> {
    check_size(bytes)?;
    if value_may_nest_deeper(bytes, limits::JSON_DEPTH_MAX) {
        return Err(Unreadable::Limit {
            what: "JSON_DEPTH_MAX",
            actual: limits::JSON_DEPTH_MAX + 1,
            max: limits::JSON_DEPTH_MAX,
        });
    }
    Ok(())
}

/// Parse bounded JSON: at most `FILE_BYTES_MAX` bytes and `JSON_DEPTH_MAX` levels.
pub fn json_from_slice(bytes: &[u8]) -> Result<Value, Unreadable> {
    check_limits(bytes)?;
    json_within_limits(bytes)
}

/// Parse JSON already checked against the limits.
fn json_within_limits(bytes: &[u8]) -> Result<Value, Unreadable> {
    serde_json::from_slice(bytes).map_err(|error| Unreadable::NotJson(error.to_string()))
}

/// Whether JSON text nests arrays/objects deeper than `depth_max`. Brackets inside strings do
/// not count. Malformed text is scanned as far as it goes; the parser reports it afterwards.
pub fn depth_exceeds(bytes: &[u8], depth_max: usize) -> bool {
    scan(bytes, depth_max, false)
}

/// Whether the `serde_json::Value` parsed from JSON text could nest deeper than `depth_max`:
/// the text does ([`depth_exceeds`]), or a member in it is named serde_json's private raw-value
/// token. With the `raw_value` feature (on in this workspace, for the stream decoders), an
/// object whose first member has that name is replaced by its value's string parsed as JSON,
/// with a fresh recursion budget, so strings nested in such strings build a value as deep as
/// the bytes allow from text that is not deep at all: a 69 KB file overflowed a 2 MiB thread
/// stack (`tests/it/never_panics.rs`). No conversation, request or tool schema needs a member
/// of that name; every bounded parse of untrusted JSON into a `Value` refuses it.
pub fn value_may_nest_deeper(bytes: &[u8], depth_max: usize) -> bool {
    scan(bytes, depth_max, true)
}

/// JSON text from outside (a provider's event, a body) as a `Value`, or `None` where it is not
/// JSON or where the value could nest deeper than `JSON_DEPTH_MAX` ([`value_may_nest_deeper`]:
/// serde_json would recurse without a bound).
pub fn bounded_value(text: &[u8]) -> Option<Value> {
    if value_may_nest_deeper(text, limits::JSON_DEPTH_MAX) {
        return None;
    }
    serde_json::from_slice(text).ok()
}

/// serde_json's `raw::TOKEN` (private; `tests/it/never_panics.rs` checks that serde_json still
/// treats it as described at [`value_may_nest_deeper`]).
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

fn scan(bytes: &[u8], depth_max: usize, tokens: bool) -> bool {
    let mut depth = 0usize;
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        match byte {
            b'"' => {
                let open = at;
                // Past the string in one jump per escape: most of a conversation's bytes are
                // text inside strings, and only a quote or a backslash can end one.
                at += 1;
                loop {
                    let Some(offset) = bytes
                        .get(at..)
                        .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
                    else {
                        // Unterminated: nothing after it counts.
                        return false;
                    };
                    at += offset;
                    if bytes[at] == b'"' {
                        break;
                    }
                    at += 2;
                }
                if tokens && is_member_name(bytes, at + 1) && is_raw_value_token(&bytes[open..=at]) {
                    return true;
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > depth_max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        at += 1;
    }
    false
}

/// Whether the string that ended just before `after` names a member: a colon follows it.
fn is_member_name(bytes: &[u8], after: usize) -> bool {
    bytes.get(after..).and_then(|rest| {
        rest.iter()
            .find(|byte| !matches!(byte, b' ' | b'\t' | b'\n' | b'\r'))
    }) == Some(&b':')
}

/// Whether a JSON string literal (quotes included) says [`RAW_VALUE_TOKEN`], in any spelling:
/// its first character is `$`, written as it is or as `\u0024` (hex in either case), and only
/// such a string of a length the token can have is decoded.
fn is_raw_value_token(literal: &[u8]) -> bool {
    let content = &literal[1..literal.len() - 1];
    let dollar = content.first() == Some(&b'$')
        || content
            .get(..6)
            .is_some_and(|escape| escape.eq_ignore_ascii_case(b"\\u0024"));
    let length = RAW_VALUE_TOKEN.len()..=6 * RAW_VALUE_TOKEN.len();
    dollar
        && length.contains(&content.len())
        && serde_json::from_slice::<String>(literal).is_ok_and(|text| text == RAW_VALUE_TOKEN)
}
