//! Named limits on every input the core accepts. Exceeding one is an `Unreadable` input (CLI
//! exit 2, HTTP 413/400), never a panic and never a partial result.

/// Largest conversation file, in bytes.
pub const FILE_BYTES_MAX: usize = 32 * 1024 * 1024;
/// Most turns in one conversation.
pub const TURNS_MAX: usize = 10_000;
/// Most blocks in one turn.
pub const BLOCKS_PER_TURN_MAX: usize = 1_024;
/// Most blocks in one conversation, all turns together.
pub const BLOCKS_MAX: usize = 100_000;
/// Deepest nesting of JSON arrays and objects in a conversation file (and in a tool call's
/// arguments string). serde_json's own recursion guard (128) sits above this one.
pub const JSON_DEPTH_MAX: usize = 64;
/// Most tools declared by one conversation.
pub const TOOLS_MAX: usize = 512;
