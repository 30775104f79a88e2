//! Stream decoders: provider stream bytes → normalized [`Sequenced`] events
//! (`turnstile_core::stream`), one module per provider *API*.
//!
//! A stream format belongs to the API, not to an adapter version (`openai-chat@1` and
//! `openai-chat@2` receive the same bytes), so decoders live here and not under the versioned
//! `src/<api>/` trees. Every decoder is sans-IO and incremental: any split of the same bytes
//! gives the same events (proved by `tests/it/decode.rs`), and no input makes one panic.
//!
//! Polling order: after each [`Decoder::handle_bytes`] (or [`Decoder::handle_end_of_input`]),
//! drain [`Decoder::poll_event`] until `None`.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - an event fed to the assembler twice adds nothing twice (dedupe on `Seq`); an event duplicated
//!   on the wire adds nothing on Responses (sequence numbers) and Gemini (cumulative token count),
//!   and never commits on OpenAI Chat for a model the catalog counts exactly when the usage chunk
//!   arrives (BPE count of the output > `completion_tokens − reasoning_tokens` → malformed) nor on
//!   Anthropic when it repeats `message_start`, `content_block_start` or `content_block_stop`.
//!   **Not detected**: an Anthropic text or argument delta duplicated alone; on Chat a stream
//!   without usage, a model we cannot count exactly (compatible endpoints), or a duplicate smaller
//!   than a tool-call reply's hidden tokens. Enforced in `assemble.rs` dedupe keys,
//!   `decode/gemini.rs`, `decode/openai_chat.rs::check_usage`, `decode/anthropic_messages.rs`.
//!   Tests: `adapters/tests/it/stream/faults.rs`, `stream/integrity.rs` (incl.
//!   `anthropic_a_duplicated_text_delta_alone_cannot_be_detected`),
//!   `gateway/tests/it/assemble.rs::an_openai_chat_text_reply_with_duplicated_deltas_exits_6`,
//!   `serve.rs::a_lost_stop_event_or_duplicated_events…`,
//!   `serve.rs::duplicated_events_on_a_text_only_reply…`.

/// Declares one public decoder type: SSE framing plus one API's event rules, forwarding the
/// [`Decoder`] methods to [`SseDecoder`] (the API rules type stays private to its module).
macro_rules! sse_decoder {
    ($(#[$doc:meta])* $name:ident, $rules:ty, $init:expr) => {
        $(#[$doc])*
        #[derive(Clone)]
        pub struct $name(SseDecoder<$rules>);

        impl $name {
            /// A decoder at the start of a connection.
            pub fn new() -> $name {
                $name(SseDecoder::with($init))
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name::new()
            }
        }

        impl Decoder for $name {
            fn handle_bytes(&mut self, bytes: &[u8]) {
                self.0.handle_bytes(bytes)
            }
            fn handle_end_of_input(&mut self) {
                self.0.handle_end_of_input()
            }
            fn handle_end_of_file(&mut self) {
                self.0.handle_end_of_file()
            }
            fn poll_event(&mut self) -> Option<Sequenced> {
                self.0.poll_event()
            }
            fn fork(&self) -> Box<dyn Decoder> {
                Box::new(self.clone())
            }
        }
    };
}
pub mod anthropic_messages;
pub mod gemini;
pub(crate) mod json;
pub mod openai_chat;
pub mod openai_responses;
pub mod whole;

use crate::sse::{SseEvent, SseParser};
use serde_json::Value;
use std::collections::VecDeque;
use turnstile_core::stream::{Seq, SeqSource, Sequenced, StreamEvent};

/// A push-driven stream decoder.
pub trait Decoder: Send {
    /// Feed the next bytes as received.
    fn handle_bytes(&mut self, bytes: &[u8]);
    /// The connection ended (an unterminated last event is discarded).
    fn handle_end_of_input(&mut self);
    /// A stored capture ended: like `handle_end_of_input`, but a last event that lost its
    /// terminating blank line in storage is still decoded (see `SseParser::handle_end_of_file`).
    fn handle_end_of_file(&mut self);
    /// The next normalized event.
    fn poll_event(&mut self) -> Option<Sequenced>;
    /// A copy of this decoder's whole state (a snapshot: the exhaustive cut test ends a copy
    /// at every byte without replaying the prefix).
    fn fork(&self) -> Box<dyn Decoder>;
}

/// The stream APIs with a decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StreamApi {
    /// OpenAI Chat Completions.
    OpenAiChat,
    /// OpenAI Responses.
    OpenAiResponses,
    /// Anthropic Messages.
    AnthropicMessages,
    /// Google Gemini `streamGenerateContent?alt=sse` (and Vertex AI).
    Gemini,
}

impl StreamApi {
    /// The API an adapter id (`openai-chat@1`, `anthropic-messages@2`, …) streams in.
    pub fn for_adapter(adapter_id: &str) -> Option<StreamApi> {
        let api = adapter_id
            .split_once('@')
            .map_or(adapter_id, |(api, _version)| api);
        match api {
            "openai-chat" => Some(StreamApi::OpenAiChat),
            "openai-responses" => Some(StreamApi::OpenAiResponses),
            "anthropic-messages" => Some(StreamApi::AnthropicMessages),
            "gemini" => Some(StreamApi::Gemini),
            _ => None,
        }
    }

    /// A fresh decoder for one connection, holding the upstream to its vendor's habits
    /// ([`DecoderOptions::VENDOR`]: captures, the simulator, the vendor's own API).
    pub fn decoder(self) -> Box<dyn Decoder> {
        self.decoder_with(DecoderOptions::VENDOR)
    }

    /// A fresh decoder for one connection to an upstream described by `options`: the API's
    /// stream decoder, which also reads a whole JSON answer to the stream request
    /// ([`whole::Sniffing`]).
    pub fn decoder_with(self, options: DecoderOptions) -> Box<dyn Decoder> {
        Box::new(whole::Sniffing::new(self, self.stream_decoder(options)))
    }

    fn stream_decoder(self, options: DecoderOptions) -> Box<dyn Decoder> {
        match self {
            StreamApi::OpenAiChat => Box::new(openai_chat::OpenAiChatDecoder::with_options(options)),
            StreamApi::OpenAiResponses => Box::new(openai_responses::OpenAiResponsesDecoder::new()),
            StreamApi::AnthropicMessages => Box::new(anthropic_messages::AnthropicDecoder::new()),
            StreamApi::Gemini => Box::new(gemini::GeminiDecoder::new()),
        }
    }

    /// All of them.
    pub const ALL: [StreamApi; 4] = [
        StreamApi::OpenAiChat,
        StreamApi::OpenAiResponses,
        StreamApi::AnthropicMessages,
        StreamApi::Gemini,
    ];
}

/// What a decoder may assume of the upstream beyond the wire format. Nothing here can make a
/// partial or altered turn commit: it only decides whether a heuristic that holds for the
/// vendor's own API is a protocol violation (the vendor) or a [`StreamEvent::Notice`] (a
/// compatible server, a proxy, another gateway).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecoderOptions {
    /// Usage is counted with the vendor's own tokenizer: OpenAI Chat output that carries more
    /// tokens than `completion_tokens` reports means a delta arrived twice (retracted). Off, the
    /// mismatch is a notice.
    pub vendor_usage: bool,
}

impl DecoderOptions {
    /// The vendor's own API (and the simulator, which counts as it does).
    pub const VENDOR: DecoderOptions = DecoderOptions { vendor_usage: true };
    /// A compatible upstream that need not count as the vendor does.
    pub const COMPATIBLE: DecoderOptions = DecoderOptions { vendor_usage: false };
}

/// Decode a whole live byte stream at once (tests, benchmarks): every event, in order. The
/// WHATWG end-of-input rule applies: an unterminated last event is discarded.
pub fn decode_all(api: StreamApi, bytes: &[u8]) -> Vec<Sequenced> {
    let mut decoder = api.decoder();
    decoder.handle_bytes(bytes);
    decoder.handle_end_of_input();
    std::iter::from_fn(|| decoder.poll_event()).collect()
}

/// What an API module implements: one SSE event in, normalized events out through `Emitter`.
pub(crate) trait EventDecoder {
    /// A typed, borrowing fast path for the API's hot events (deltas): `true` if it handled
    /// the event. Anything it does not recognise falls through to [`EventDecoder::event`].
    fn fast(&mut self, event: &SseEvent, out: &mut Emitter) -> bool {
        let _ = (event, out);
        false
    }
    fn event(&mut self, event: &SseEvent, payload: Value, out: &mut Emitter);
    /// A live body ended cleanly (the transport saw its whole length). An API whose stream can
    /// be known complete without its own end marker says so here; most say nothing. Not called
    /// at the end of a stored file: there a last line cut in storage is still decoded, and a
    /// cut inside what follows the stop (usage, the marker) would read as malformed.
    fn end_of_input(&mut self, out: &mut Emitter) {
        let _ = out;
    }
    /// Called when the SSE data is not JSON. Most APIs: a malformed event.
    fn non_json(&mut self, event: &SseEvent, out: &mut Emitter) {
        let _ = event;
        out.push(StreamEvent::Malformed {
            detail: "an event whose data is not JSON".into(),
        });
    }
}

/// Collects normalized events and numbers them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Emitter {
    out: VecDeque<Sequenced>,
    seq: Option<Seq>,
    receive_ordinal: u64,
}

impl Emitter {
    /// Begin one provider event: the receive ordinal advances; `provider_seq` overrides it.
    pub(crate) fn begin(&mut self, provider_seq: Option<u64>) {
        let (source, number) = match provider_seq {
            Some(number) => (SeqSource::Provider, number),
            None => (SeqSource::Receive, self.receive_ordinal),
        };
        self.receive_ordinal += 1;
        self.seq = Some(Seq {
            source,
            number,
            part: 0,
        });
    }

    /// The current provider event carries the provider's own sequence number.
    pub(crate) fn provider_seq(&mut self, number: u64) {
        if let Some(seq) = &mut self.seq {
            seq.source = SeqSource::Provider;
            seq.number = number;
        }
    }

    pub(crate) fn push(&mut self, event: StreamEvent) {
        let seq = self.seq.get_or_insert(Seq {
            source: SeqSource::Receive,
            number: self.receive_ordinal,
            part: 0,
        });
        let current = *seq;
        seq.part = seq.part.saturating_add(1);
        self.out.push_back(Sequenced { seq: current, event });
    }
}

/// An SSE parser plus one API's event decoder: the shape of every decoder here.
#[derive(Clone)]
pub(crate) struct SseDecoder<D> {
    sse: SseParser,
    api: D,
    out: Emitter,
    poisoned: bool,
}

impl<D: EventDecoder> SseDecoder<D> {
    pub(crate) fn with(api: D) -> SseDecoder<D> {
        SseDecoder {
            sse: SseParser::new(),
            api,
            out: Emitter::default(),
            poisoned: false,
        }
    }

    fn drain_sse(&mut self) {
        while let Some(event) = self.sse.poll_event() {
            self.out.begin(None);
            if self.api.fast(&event, &mut self.out) {
                continue;
            }
            // Bounded: a hostile event could otherwise nest a value past any stack.
            match turnstile_core::parse::bounded_value(event.data.as_bytes()) {
                Some(payload) => self.api.event(&event, payload, &mut self.out),
                None => self.api.non_json(&event, &mut self.out),
            }
        }
    }
}

impl<D: EventDecoder> SseDecoder<D> {
    pub(crate) fn handle_bytes(&mut self, bytes: &[u8]) {
        if self.poisoned {
            return;
        }
        if let Err(error) = self.sse.handle_bytes(bytes) {
            self.poisoned = true;
            self.drain_sse();
            self.out.begin(None);
            self.out.push(StreamEvent::Malformed {
                detail: error.to_string(),
            });
            return;
        }
        self.drain_sse();
    }

    pub(crate) fn handle_end_of_input(&mut self) {
        self.sse.handle_end_of_input();
        if !self.poisoned {
            self.out.begin(None);
            self.api.end_of_input(&mut self.out);
        }
    }

    pub(crate) fn handle_end_of_file(&mut self) {
        if self.poisoned {
            return;
        }
        self.sse.handle_end_of_file();
        self.drain_sse();
        // The last line, decoded only now, may itself break a rule (not UTF-8).
        if let Some(error) = self.sse.error() {
            self.poisoned = true;
            self.out.begin(None);
            self.out.push(StreamEvent::Malformed {
                detail: error.to_string(),
            });
        }
    }

    pub(crate) fn poll_event(&mut self) -> Option<Sequenced> {
        self.out.out.pop_front()
    }
}

/// Feed `datas` as SSE events named `event` to `api`, in `SseDecoder::drain_sse`'s order, or
/// without the fast path (`fast_first` false): the property tests hold the two to one output.
#[cfg(test)]
pub(crate) fn decode_events<D: EventDecoder>(
    api: &mut D,
    event: &str,
    datas: &[String],
    fast_first: bool,
) -> Vec<Sequenced> {
    let mut out = Emitter::default();
    for data in datas {
        let event = SseEvent {
            event: event.into(),
            data: data.clone(),
            id: String::new(),
        };
        out.begin(None);
        if fast_first && api.fast(&event, &mut out) {
            continue;
        }
        match turnstile_core::parse::bounded_value(event.data.as_bytes()) {
            Some(payload) => api.event(&event, payload, &mut out),
            None => api.non_json(&event, &mut out),
        }
    }
    out.out.into_iter().collect()
}

/// Helpers for reading loosely typed provider JSON without panicking.
pub(crate) fn str_at<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

pub(crate) fn u64_at(value: &Value, key: &str) -> Option<u64> {
    value.get(key).and_then(Value::as_u64)
}

/// A provider error object (`{"type","code","message"}`, flat or under `"error"`), normalized.
pub(crate) fn provider_error(error: &Value) -> StreamEvent {
    let code = str_at(error, "code")
        .or_else(|| str_at(error, "type"))
        .or_else(|| str_at(error, "status"))
        .map(str::to_owned)
        .or_else(|| u64_at(error, "code").map(|code| code.to_string()))
        .unwrap_or_else(|| "unknown".to_owned());
    let message = str_at(error, "message").unwrap_or_default().to_owned();
    StreamEvent::ProviderError { code, message }
}
