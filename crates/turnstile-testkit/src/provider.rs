//! The scripted provider: the only part of the world that is not production code. Each reply
//! (text, parallel tool calls) is drawn from the seed and written out as the exact SSE frames
//! of the API by `turnstile_adapters::simulate::wire`; transport faults are applied the way the
//! `turnstile sim` server applies them (drop stop, duplicate, disconnect after N events, cut at
//! a byte), then the body is split into chunks of random sizes.

use crate::plan::{FaultKind, FaultPlan};
use crate::report::SeedReport;
use crate::rng::Rng;
use serde_json::json;
use std::collections::{HashMap, VecDeque};
use turnstile_adapters::decode::StreamApi;
use turnstile_adapters::simulate::script::{Reply, ScriptedCall};
use turnstile_adapters::simulate::wire::{self, Api, Frame};

/// Most tool calls in one reply.
pub const CALLS_PER_REPLY_MAX: u64 = 3;
/// Largest chunk the transport delivers at once.
const CHUNK_BYTES_MAX: u64 = 256;

/// What a connection will deliver.
#[derive(Clone, Debug)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// Body chunks, in order.
    pub chunks: VecDeque<Vec<u8>>,
    /// The body ends cleanly (true) or the connection breaks after the last chunk (false).
    pub clean_end: bool,
    /// The head never arrives (the provider holds the connection).
    pub hang: bool,
    /// After its chunks, the body sends pings for ever.
    pub endless: bool,
}

/// A reply already produced, for resume and idempotent replay.
#[derive(Clone, Debug)]
struct Produced {
    frames: Vec<Frame>,
    resumable: bool,
}

/// The provider's memory (it outlives gateway crashes: it is another process).
#[derive(Debug)]
pub struct Provider {
    api: Api,
    stream_api: StreamApi,
    produced: HashMap<String, Produced>,
    idempotent: HashMap<String, String>,
    handles_issued: u64,
    /// Handles issued, oldest first (the foreign-handle fault reuses one).
    handles: Vec<String>,
}

/// The wire encoder for a decoder's API.
pub fn wire_api(api: StreamApi) -> Api {
    match api {
        StreamApi::OpenAiChat => Api::OpenAiChat,
        StreamApi::OpenAiResponses => Api::OpenAiResponses,
        StreamApi::AnthropicMessages => Api::Anthropic,
        _ => Api::Gemini,
    }
}

impl Provider {
    /// A provider speaking `api`.
    pub fn new(api: StreamApi) -> Provider {
        Provider {
            api: wire_api(api),
            stream_api: api,
            produced: HashMap::new(),
            idempotent: HashMap::new(),
            handles_issued: 0,
            handles: Vec::new(),
        }
    }

    fn reply(rng: &mut Rng, cities: &[&str]) -> Reply {
        let calls = rng.below(CALLS_PER_REPLY_MAX + 1) as usize;
        let text = match rng.below(3) {
            0 if calls > 0 => String::new(),
            1 => "Let me check the weather for you.".to_owned(),
            _ => format!("Sure thing, seed word {}.", rng.below(1000)),
        };
        let tool_calls = (0..calls)
            .map(|_| ScriptedCall {
                id: None,
                name: "get_weather".into(),
                arguments: json!({"city": cities[rng.index(cities.len())]}),
            })
            .collect();
        Reply {
            text,
            tool_calls,
            ..Reply::default()
        }
    }

    /// A request with these bytes and idempotency key.
    pub fn request(
        &mut self,
        rng: &mut Rng,
        plan: &FaultPlan,
        report: &mut SeedReport,
        body: &[u8],
        idempotency_key: &str,
    ) -> Answer {
        if plan.honours_idempotency_key
            && let Some(handle) = self.idempotent.get(idempotency_key)
            && let Some(produced) = self.produced.get(handle)
        {
            report.fault(FaultKind::IdempotentReplay);
            let frames = produced.frames.clone();
            return self.deliver(rng, plan, report, frames, false);
        }
        if rng.chance(plan.status) {
            let status = if rng.chance(0.5) { 429 } else { 500 };
            report.fault(if status == 429 {
                FaultKind::Provider429
            } else {
                FaultKind::Provider500
            });
            let body = wire::error_body(self.api, status).to_string().into_bytes();
            return Answer {
                status,
                chunks: VecDeque::from([body]),
                clean_end: true,
                hang: false,
                endless: false,
            };
        }
        if rng.chance(plan.hang) {
            report.fault(FaultKind::HungHead);
            return Answer {
                status: 200,
                chunks: VecDeque::new(),
                clean_end: false,
                hang: true,
                endless: false,
            };
        }
        let mut reply = Provider::reply(rng, &["Paris", "Lagos", "Lima", "Osaka", "Zürich"]);
        self.handles_issued += 1;
        let number = self.handles_issued;
        let mut handle = match self.api {
            Api::OpenAiChat => format!("chatcmpl-dst{number}"),
            Api::OpenAiResponses => format!("resp_dst{number}"),
            Api::Anthropic => format!("msg_dst{number}"),
            Api::Gemini => format!("dst-{number}"),
        };
        if !self.handles.is_empty() && rng.chance(plan.foreign_handle) {
            report.fault(FaultKind::ForeignHandle);
            handle = self.handles[rng.index(self.handles.len())].clone();
        }
        self.handles.push(handle.clone());
        let ids = wire::call_ids(self.api, &reply, number);
        let resumable = plan.resume_by_handle && self.stream_api == StreamApi::OpenAiResponses;
        // The world's dialects: what compatible servers do that the vendor does not.
        if self.api == Api::OpenAiChat && rng.chance(plan.dialect) {
            report.fault(FaultKind::NoDone);
            reply.faults.omit_done = true;
        }
        let frames = if !resumable && rng.chance(plan.dialect) {
            report.fault(FaultKind::JsonAnswer);
            let whole = wire::whole_body(self.api, &reply, &handle, "dst-model", &ids, body.len());
            vec![wire::Frame {
                bytes: whole.to_string().into_bytes(),
                stop: true,
                sequence: None,
            }]
        } else {
            wire::frames(self.api, &reply, &handle, "dst-model", &ids, body.len())
        };
        self.produced.insert(
            handle.clone(),
            Produced {
                frames: frames.clone(),
                resumable,
            },
        );
        if plan.honours_idempotency_key {
            self.idempotent
                .entry(idempotency_key.to_owned())
                .or_insert(handle);
        }
        self.deliver(rng, plan, report, frames, true)
    }

    /// Resume `handle` after sequence number `after`.
    pub fn resume(
        &mut self,
        rng: &mut Rng,
        plan: &FaultPlan,
        report: &mut SeedReport,
        handle: &str,
        after: Option<u64>,
    ) -> Answer {
        let refused = rng.chance(plan.resume_refused);
        match self.produced.get(handle) {
            Some(produced) if produced.resumable && !refused => {
                let frames: Vec<Frame> = produced
                    .frames
                    .iter()
                    .filter(|frame| match (frame.sequence, after) {
                        (Some(sequence), Some(after)) => sequence > after,
                        _ => true,
                    })
                    .cloned()
                    .collect();
                self.deliver(rng, plan, report, frames, false)
            }
            _ => {
                if refused {
                    report.fault(FaultKind::ResumeRefused);
                }
                self.refusal()
            }
        }
    }

    /// `GET /v1/responses/{id}`: a produced reply is whole at once here (generation takes no
    /// time in this world), so a resumable one is `completed`; anything else is refused as
    /// the real API refuses a response it cannot retrieve.
    pub fn status(&self, handle: &str) -> Answer {
        match self.produced.get(handle) {
            Some(produced) if produced.resumable => Provider::response_object(handle, "completed"),
            _ => self.refusal(),
        }
    }

    /// Whether `handle` names a response this provider can be asked about (a resumable one).
    pub fn knows(&self, handle: &str) -> bool {
        self.produced
            .get(handle)
            .is_some_and(|produced| produced.resumable)
    }

    /// The response object of `handle` with `status`, as status and cancel answer it.
    pub fn response_object(handle: &str, status: &str) -> Answer {
        Answer {
            status: 200,
            chunks: VecDeque::from([
                serde_json::json!({"id": handle, "object": "response", "status": status})
                    .to_string()
                    .into_bytes(),
            ]),
            clean_end: true,
            hang: false,
            endless: false,
        }
    }

    /// `POST /v1/responses/{id}/cancel`: nothing here is still running, so it is refused
    /// (a completed response cannot be cancelled).
    pub fn cancel(&self, _handle: &str) -> Answer {
        self.refusal()
    }

    fn refusal(&self) -> Answer {
        Answer {
            status: 400,
            chunks: VecDeque::from([wire::error_body(self.api, 400).to_string().into_bytes()]),
            clean_end: true,
            hang: false,
            endless: false,
        }
    }

    fn deliver(
        &mut self,
        rng: &mut Rng,
        plan: &FaultPlan,
        report: &mut SeedReport,
        frames: Vec<Frame>,
        transport_faults: bool,
    ) -> Answer {
        let mut events = frames;
        let mut clean_end = true;
        let mut endless = false;
        if transport_faults && rng.chance(plan.endless) && !events.is_empty() {
            report.fault(FaultKind::EndlessStream);
            let keep = rng.index(events.len());
            events.truncate(keep);
            endless = true;
            clean_end = false;
        }
        if transport_faults {
            if rng.chance(plan.lost_stop) {
                report.fault(FaultKind::LostStop);
                events.retain(|frame| !frame.stop);
            }
            if rng.chance(plan.duplicate) {
                report.fault(FaultKind::DuplicateDeltas);
                events = events
                    .into_iter()
                    .flat_map(|frame| [frame.clone(), frame])
                    .collect();
            }
            if rng.chance(plan.disconnect) && !events.is_empty() {
                report.fault(FaultKind::Disconnect);
                let keep = rng.index(events.len());
                events.truncate(keep);
                clean_end = false;
            }
        }
        let mut bytes: Vec<u8> = events.into_iter().flat_map(|frame| frame.bytes).collect();
        if transport_faults && rng.chance(plan.cut) && !bytes.is_empty() {
            report.fault(FaultKind::CutAtByte);
            let cut = rng.index(bytes.len());
            bytes.truncate(cut);
            clean_end = false;
        }
        let mut chunks = VecDeque::new();
        let mut rest = bytes.as_slice();
        while !rest.is_empty() {
            let take = (1 + rng.below(CHUNK_BYTES_MAX) as usize).min(rest.len());
            chunks.push_back(rest[..take].to_vec());
            rest = &rest[take..];
        }
        Answer {
            status: 200,
            chunks,
            clean_end,
            hang: false,
            endless,
        }
    }
}
