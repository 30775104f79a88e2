//! Bytes → [`Conversation`], with the limits of [`crate::limits`] checked before any value is
//! built: size first, then nesting depth (a linear scan, so a hostile document never reaches
//! the recursive parser deeper than `JSON_DEPTH_MAX`), then serde_json.

use crate::conversation::{Conversation, Unreadable};
use crate::limits;
use serde_json::Value;

/// Parse and decode a conversation file.
pub fn conversation_from_slice(bytes: &[u8]) -> Result<Conversation, Unreadable> {
    Conversation::from_value(json_from_slice(bytes)?)
}

/// Parse bounded JSON: at most `FILE_BYTES_MAX` bytes and `JSON_DEPTH_MAX` levels.
pub fn json_from_slice(bytes: &[u8]) -> Result<Value, Unreadable> {
    if bytes.len() > limits::FILE_BYTES_MAX {
        return Err(Unreadable::Limit {
            what: "FILE_BYTES_MAX",
            actual: bytes.len(),
            max: limits::FILE_BYTES_MAX,
        });
    }
    if depth_exceeds(bytes, limits::JSON_DEPTH_MAX) {
        return Err(Unreadable::Limit {
            what: "JSON_DEPTH_MAX",
            actual: limits::JSON_DEPTH_MAX + 1,
            max: limits::JSON_DEPTH_MAX,
        });
    }
    serde_json::from_slice(bytes).map_err(|error| Unreadable::NotJson(error.to_string()))
}

/// Whether JSON text nests arrays/objects deeper than `depth_max`. Brackets inside strings do
/// not count. Malformed text is scanned as far as it goes; the parser reports it afterwards.
pub fn depth_exceeds(bytes: &[u8], depth_max: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &byte in bytes {
        if in_string {
            if escaped {
                escaped = false;
            } else if byte == b'\\' {
                escaped = true;
            } else if byte == b'"' {
                in_string = false;
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > depth_max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}
