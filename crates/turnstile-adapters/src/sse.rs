//! Server-sent events framing (WHATWG HTML "Server-sent events", §9.2.5/§9.2.6 "Parsing an
//! event stream" and "Interpreting an event stream"), incremental and sans-IO: feed bytes in any
//! split with [`SseParser::handle_bytes`], take events with [`SseParser::poll_event`].
//!
//! Rules implemented (each has a test in `tests/it/sse.rs`):
//! - lines end with CRLF, LF or CR, also when the CR and the LF arrive in different chunks;
//! - one leading U+FEFF BOM is skipped;
//! - a line starting with `:` is a comment;
//! - `field:value` with one leading space of the value removed; a line without `:` is a field
//!   with an empty value; unknown fields are ignored;
//! - `data` lines append the value and a LF; the last LF is removed at dispatch; an event whose
//!   data buffer is empty is not dispatched (its type is reset);
//! - `event` sets the type (default `message`); `id` sets the last event id unless it contains
//!   NUL; `retry` with only ASCII digits sets the reconnection time;
//! - an event without its terminating blank line at the end of input is discarded (it is never
//!   dispatched: [`SseParser::handle_end_of_input`] drops it);
//! - a line that is not UTF-8 poisons the parser ([`SseError::InvalidUtf8`]). The spec's UTF-8
//!   decode would replace the bytes with U+FFFD, but for us the bytes are a provider's answer
//!   that may become committed history: a replaced character is a turn the provider never sent,
//!   so it is a protocol violation of the stream and nothing of it commits (issue 17;
//!   `docs/decisions/0047-a-provider-stream-that-is-not-utf-8-is-a-protocol.md`, 2026-12-01). A
//!   line is only checked once complete, so a code point split across chunks survives.
//!
//! Why hand-written and not `eventsource-stream` 0.2.3 (checked against these rules and
//! benchmarked in `benches/decode.rs`, figures in `docs/benchmarks-log.md`):
//! - it is a `futures::Stream` adapter, not sans-IO: the decoders here are push-driven and must
//!   run inside the core's deterministic tests without an executor;
//! - it copies the remaining buffer after every line (`String::split_off`), so a chunk holding
//!   many lines costs time quadratic in the chunk size;
//! - (not a reason any more: invalid UTF-8 is a hard error there, as it is here since issue 17.)
//!
//! Its framing rules are otherwise right (CR/LF/CRLF, BOM, comments, unterminated last event
//! discarded), and the conformance test runs both on the same inputs.

use memchr::memchr2;
use std::collections::VecDeque;

/// Longest line accepted, in bytes.
pub const SSE_LINE_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Largest `data` buffer of one event, in bytes.
pub const SSE_EVENT_BYTES_MAX: usize = 16 * 1024 * 1024;

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// The event type (`message` when the stream named none).
    pub event: String,
    /// The data, lines joined with LF.
    pub data: String,
    /// The last event id at dispatch time (empty when never set).
    pub id: String,
}

/// The stream broke a named limit; the parser is poisoned from then on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SseError {
    /// A line longer than [`SSE_LINE_BYTES_MAX`].
    #[error("limit exceeded: SSE_LINE_BYTES_MAX is {0}")]
    LineTooLong(usize),
    /// An event's data longer than [`SSE_EVENT_BYTES_MAX`].
    #[error("limit exceeded: SSE_EVENT_BYTES_MAX is {0}")]
    EventTooLarge(usize),
    /// A line that is not valid UTF-8 (its ordinal in the stream, counting from 0).
    #[error("protocol violation: line {0} of the stream is not valid UTF-8")]
    InvalidUtf8(u64),
}

/// Most bytes a new event's buffer is allocated with before its first line (the size of the
/// event before it, up to this).
const SSE_PRESIZE_BYTES_MAX: usize = 64 * 1024;

/// Incremental event-stream parser.
///
/// Polling order: after each [`SseParser::handle_bytes`] call, drain
/// [`SseParser::poll_event`] until `None`.
#[derive(Clone, Debug, Default)]
pub struct SseParser {
    /// A line not yet terminated.
    partial: Vec<u8>,
    /// The previous chunk ended in CR: a LF at the start of the next one belongs to it.
    after_cr: bool,
    /// Whether the start of the stream (and a possible BOM) is behind us.
    started: bool,
    data: String,
    event: String,
    last_event_id: String,
    retry_ms: Option<u64>,
    ready: VecDeque<SseEvent>,
    error: Option<SseError>,
    /// Lines seen so far (for [`SseError::InvalidUtf8`]).
    lines: u64,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> SseParser {
        SseParser::default()
    }

    /// The reconnection time the stream asked for, if any.
    pub fn retry_ms(&self) -> Option<u64> {
        self.retry_ms
    }

    /// The error that poisoned the parser, if any.
    pub fn error(&self) -> Option<&SseError> {
        self.error.as_ref()
    }

    /// Feed the next bytes of the stream.
    pub fn handle_bytes(&mut self, mut bytes: &[u8]) -> Result<(), SseError> {
        if let Some(error) = &self.error {
            return Err(error.clone());
        }
        if !self.started {
            // The BOM may itself arrive split; wait until three bytes (or a mismatch) are seen.
            const BOM: &[u8] = b"\xEF\xBB\xBF";
            let have = self.partial.len();
            let take = (BOM.len() - have).min(bytes.len());
            self.partial.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.partial.len() < BOM.len() && BOM.starts_with(&self.partial) {
                return Ok(());
            }
            self.started = true;
            let head = std::mem::take(&mut self.partial);
            let head = if head == BOM { &[][..] } else { &head[..] };
            self.scan(head)?;
        }
        self.scan(bytes)
    }

    /// The stream ended. An event without its terminating blank line is discarded.
    pub fn handle_end_of_input(&mut self) {
        self.partial.clear();
        self.data.clear();
        self.event.clear();
        self.after_cr = false;
    }

    /// A stored capture ended. Unlike [`SseParser::handle_end_of_input`], the last event is
    /// dispatched even without its terminating blank line: files commonly lose their final line
    /// terminator in storage (two of the recorded captures in shared `provider-streams/` do).
    /// Only `turnstile assemble` uses this; it is safe for the APIs here because each event's
    /// data is one JSON object (or `[DONE]`), and no strict prefix of one decodes.
    pub fn handle_end_of_file(&mut self) {
        if self.error.is_none() {
            let line = std::mem::take(&mut self.partial);
            if line.is_empty() || self.line(&line).is_ok() {
                self.dispatch();
            }
        }
        self.handle_end_of_input();
    }

    /// The next dispatched event.
    pub fn poll_event(&mut self) -> Option<SseEvent> {
        self.ready.pop_front()
    }

    fn scan(&mut self, mut bytes: &[u8]) -> Result<(), SseError> {
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            if bytes[0] == b'\n' {
                bytes = &bytes[1..];
            }
        }
        while let Some(at) = memchr2(b'\n', b'\r', bytes) {
            let ending_cr = bytes[at] == b'\r';
            if self.partial.is_empty() {
                self.line(&bytes[..at])?;
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.extend_from_slice(&bytes[..at]);
                let result = self.line(&line);
                line.clear();
                self.partial = line;
                result?;
            }
            bytes = &bytes[at + 1..];
            if ending_cr {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        if self.partial.len() + bytes.len() > SSE_LINE_BYTES_MAX {
            return Err(self.poison(SseError::LineTooLong(SSE_LINE_BYTES_MAX)));
        }
        self.partial.extend_from_slice(bytes);
        Ok(())
    }

    fn poison(&mut self, error: SseError) -> SseError {
        self.error = Some(error.clone());
        error
    }

    fn line(&mut self, line: &[u8]) -> Result<(), SseError> {
        if line.len() > SSE_LINE_BYTES_MAX {
            return Err(self.poison(SseError::LineTooLong(SSE_LINE_BYTES_MAX)));
        }
        let ordinal = self.lines;
        self.lines += 1;
        let Ok(line) = std::str::from_utf8(line) else {
            return Err(self.poison(SseError::InvalidUtf8(ordinal)));
        };
        if line.is_empty() {
            self.dispatch();
            return Ok(());
        }
        if line.starts_with(':') {
            return Ok(());
        }
        let (name, value) = match line.split_once(':') {
            Some((name, value)) => (name, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match name {
            "data" => {
                if self.data.len() + value.len() + 1 > SSE_EVENT_BYTES_MAX {
                    return Err(self.poison(SseError::EventTooLarge(SSE_EVENT_BYTES_MAX)));
                }
                self.data.push_str(value);
                self.data.push('\n');
            }
            "event" => {
                self.event.clear();
                self.event.push_str(value);
            }
            "id" if !value.contains('\0') => {
                self.last_event_id.clear();
                self.last_event_id.push_str(value);
            }
            "retry" if !value.is_empty() && value.bytes().all(|byte| byte.is_ascii_digit()) => {
                // More digits than a u64 holds: keep the old value (spec: "interpret as
                // an integer"; an overflowing one is not one we can honour).
                if let Ok(ms) = value.parse() {
                    self.retry_ms = Some(ms);
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn dispatch(&mut self) {
        if self.data.is_empty() {
            self.event.clear();
            return;
        }
        self.data.pop(); // the LF after the last data line
        // The next event's buffers start at this one's size (up to `SSE_PRESIZE_BYTES_MAX`): a
        // stream's events are much alike, so one allocation each instead of a string grown from
        // empty by doubling, and one large event leaves no large buffer behind.
        let event = if self.event.is_empty() {
            "message".to_owned()
        } else {
            let capacity = self.event.len().min(SSE_PRESIZE_BYTES_MAX);
            std::mem::replace(&mut self.event, String::with_capacity(capacity))
        };
        let capacity = (self.data.len() + 1).min(SSE_PRESIZE_BYTES_MAX);
        self.ready.push_back(SseEvent {
            event,
            data: std::mem::replace(&mut self.data, String::with_capacity(capacity)),
            id: self.last_event_id.clone(),
        });
    }
}
