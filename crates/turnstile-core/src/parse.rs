//! Bytes → [`Conversation`], with the limits of [`crate::limits`] checked before any value is
//! built: size first, then nesting depth (a linear scan, so a hostile document never reaches
//! the recursive parser deeper than `JSON_DEPTH_MAX`), then serde_json.

use crate::conversation::{Conversation, Unreadable};
use crate::limits;
use serde_json::Value;

/// Parse and decode a conversation file.
pub fn conversation_from_slice(bytes: &[u8]) -> Result<Conversation, Unreadable> {
    check_size(bytes)?;
    // The typed decode checks the depth limit on what it decoded (`conversation/typed.rs`) and
    // gives `None` beyond it, so the depth scan runs only on the way to `from_value`.
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
    check_limits(bytes).ok()?;
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
    if depth_exceeds(bytes, limits::JSON_DEPTH_MAX) {
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
    let mut depth = 0usize;
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        match byte {
            b'"' => {
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
