//! How a proxied request is answered from its dispatch's events, without I/O: the policy of
//! the answer (what text may be forwarded, when the status line is decided, which event ends
//! it) as two machines the gateway's tokio tasks pump (`proxy::follow`) and the deterministic
//! simulation pumps over its own events (`turnstile-testkit`'s world). The wire shapes are
//! [`super::respond`]'s.
//!
//! [`WholeAnswer`]: reads to the commit (the answer is the committed turn) or to the end (the
//! first failure names the cause).
//!
//! [`StreamAnswer`]: the status line waits for the first sign of an answer, so a dispatch that
//! fails before any output (the provider's 429, say) is that HTTP error and the SDK raises its
//! own typed exception and backs off, instead of a 200 with an error inside. After that it
//! forwards preview text of the first block while it is the followed generation's, then
//! everything else from the committed turn. Provider wire formats cannot take text back, so
//! after a retract the next generation's text is forwarded only past what was already sent and
//! only while it agrees with it; if it diverges (or the committed turn does), the stream ends
//! with the provider's error event. The dispatch itself goes on and commits at most once; a
//! client retrying with the same `Idempotency-Key` gets that commit.
//! A route with `answer = "commit"` ([`StreamAnswer::wait_for_commit`]) forwards no preview:
//! the commit opens the stream and goes out whole, so nothing can diverge.
//!
//! Who answered: a whole answer names the target that committed (the commit's `target` fact)
//! in its model field, and [`WholeAnswer::answered_by`] for the headers. A stream names the
//! target whose generation opened it ([`StreamAnswer::opener`], resolved by the caller): its
//! headers go out with the status line, so a later failover in the same stream cannot rename
//! them, and every frame names that target's model.

use super::respond::{Addressee, Answerer, Facts, Part, StreamEncoder, parts_of};
use crate::serve::hub::ClientEvent;
use axum::http::StatusCode;
use serde_json::Value;
use turnstile_core::Generation;
use turnstile_core::dispatch::DispatchState;
use turnstile_drive::DriveEvent;

/// A failed answer: the client's HTTP status and the provider-style error's code and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
}

impl Failure {
    /// A failed dispatch as the client's HTTP error: the provider's own refusal keeps its status
    /// (a 429 stays a 429, so SDKs back off and retry); everything else is a gateway-side 502.
    pub fn of_dispatch(code: &str, message: &str) -> Failure {
        let status = if code == "max_tokens_in_tool_arguments" {
            // The request itself cannot succeed as sent: its output cap is too small.
            StatusCode::BAD_REQUEST
        } else {
            code.strip_prefix("provider_status_")
                .and_then(|status| status.parse::<u16>().ok())
                .and_then(|status| StatusCode::from_u16(status).ok())
                .filter(|status| status.is_client_error() || status.is_server_error())
                .unwrap_or(StatusCode::BAD_GATEWAY)
        };
        Failure {
            status,
            code: code.to_owned(),
            message: message.to_owned(),
        }
    }

    fn no_commit() -> Failure {
        Failure {
            status: StatusCode::BAD_GATEWAY,
            code: "no_commit".into(),
            message: "the dispatch ended without a committed turn".into(),
        }
    }
}

/// How a dispatch ended, from its events.
enum Outcome {
    /// The `Committed` event.
    Committed(ClientEvent),
    Failed {
        code: String,
        message: String,
    },
}

fn outcome_of(event: &ClientEvent) -> Option<Outcome> {
    match &**event {
        DriveEvent::Committed { .. } => Some(Outcome::Committed(event.clone())),
        DriveEvent::Error { code, message } => Some(Outcome::Failed {
            code: code.clone(),
            message: message.to_string(),
        }),
        DriveEvent::State { state, .. }
            if matches!(state, DispatchState::Failed | DispatchState::Abandoned) =>
        {
            Some(Outcome::Failed {
                code: "dispatch_failed".into(),
                message: format!("the dispatch ended {}", state.as_str()),
            })
        }
        _ => None,
    }
}

/// The committed turn's parts and facts, from its `Committed` event.
fn answer_of(committed: &DriveEvent, prompt_tokens: u64) -> (Vec<Part>, Facts) {
    let (turn, facts) = match committed {
        DriveEvent::Committed { turn, facts, .. } => (turn, facts.as_ref()),
        _ => (&Value::Null, None),
    };
    let parts = parts_of(turn);
    let facts = Facts::from_commit(facts.unwrap_or(&Value::Null), prompt_tokens, &parts);
    (parts, facts)
}

/// The index of the target that committed, from its `Committed` event's facts.
fn committing_target(committed: &DriveEvent) -> Option<usize> {
    match committed {
        DriveEvent::Committed {
            facts: Some(facts), ..
        } => facts["target"]
            .as_u64()
            .and_then(|target| usize::try_from(target).ok()),
        _ => None,
    }
}

/// The non-streaming answer.
pub struct WholeAnswer {
    to: Addressee,
    prompt_tokens: u64,
    failure: Option<Failure>,
    answered_by: Option<Answerer>,
}

impl WholeAnswer {
    pub fn new(to: Addressee, prompt_tokens: u64) -> WholeAnswer {
        WholeAnswer {
            to,
            prompt_tokens,
            failure: None,
            answered_by: None,
        }
    }

    /// Read one event: `Some` with the response body once the commit is read. The body's
    /// model field names the target that committed, when it is known.
    pub fn push(&mut self, event: &ClientEvent) -> Option<Value> {
        match outcome_of(event)? {
            Outcome::Committed(event) => {
                let (parts, facts) = answer_of(&event, self.prompt_tokens);
                self.answered_by = committing_target(&event)
                    .and_then(|target| self.to.served_by.get(target))
                    .cloned();
                if let Some(answerer) = &self.answered_by {
                    self.to.model = answerer.model.clone();
                }
                Some(super::respond::whole(&self.to, &parts, &facts))
            }
            // The first failure names the cause (a later FAILED state only repeats it).
            Outcome::Failed { code, message } => {
                if self.failure.is_none() {
                    self.failure = Some(Failure::of_dispatch(&code, &message));
                }
                None
            }
        }
    }

    /// The target that committed, once [`WholeAnswer::push`] returned the body (None when it
    /// is not known: the commit came without facts).
    pub fn answered_by(&self) -> Option<&Answerer> {
        self.answered_by.as_ref()
    }

    /// The events ended without a commit.
    pub fn end(self) -> Failure {
        self.failure.unwrap_or_else(Failure::no_commit)
    }
}

/// What [`StreamAnswer::before_head`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    /// Not yet: read on.
    Wait,
    /// Answer with this HTTP error instead of a stream.
    Fail(Failure),
    /// Open the stream (status 200), then [`StreamAnswer::open`].
    Open,
}

/// What opened a stream: the preview of a generation (whose target the pump knows), or a
/// commit that came first (its target is in its facts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opener {
    /// A generation's preview.
    Generation(Generation),
    /// The commit, by this target.
    Target(usize),
}

/// Frames for the client, and whether the stream is over.
#[derive(Debug, Default)]
pub struct Frames {
    pub bytes: Vec<u8>,
    pub done: bool,
}

impl Frames {
    fn add(&mut self, bytes: Vec<u8>) {
        self.bytes.extend(bytes);
    }
}

/// The streaming answer.
pub struct StreamAnswer {
    encoder: StreamEncoder,
    prompt_tokens: u64,
    /// Read before the stream opened.
    read: Vec<ClientEvent>,
    /// The opening frame was produced (Anthropic's waits for the provider's start usage).
    opened: bool,
    /// The generation whose preview is followed.
    generation: Option<Generation>,
    /// The text of its first block so far.
    first_block: String,
    /// A later block started: all further text waits for the commit.
    frozen: bool,
    /// The route's `answer = "commit"`: no preview is forwarded; the commit opens the stream.
    commit_first: bool,
    /// Previews were dropped before they were read ([`StreamAnswer::previews_dropped`]): no
    /// more are forwarded; the commit sends the rest.
    lost_previews: bool,
    done: bool,
}

impl StreamAnswer {
    pub fn new(to: Addressee, prompt_tokens: u64) -> StreamAnswer {
        StreamAnswer {
            encoder: StreamEncoder::new(to, prompt_tokens),
            prompt_tokens,
            read: Vec::new(),
            opened: false,
            generation: None,
            first_block: String::new(),
            frozen: false,
            commit_first: false,
            lost_previews: false,
            done: false,
        }
    }

    /// Answer only from the commit (a route's `answer = "commit"`): previews neither open the
    /// stream nor reach it, so nothing is sent before the commit, which then goes out whole in
    /// the stream format; a failover's different text can never diverge from what was sent.
    /// No keep-alive goes out while waiting: the status line waits with the rest, so a
    /// dispatch that fails is still the HTTP error.
    pub fn wait_for_commit(&mut self) {
        self.commit_first = true;
    }

    /// Previews of the dispatch were dropped before this answer read them (its client read
    /// too slowly for the backlog, or the output budget needed the room): the text forwarded
    /// so far is still a prefix of the answer, so nothing more is forwarded from previews and
    /// the commit sends the rest of the first block and everything after it, as
    /// [`StreamAnswer::wait_for_commit`] does from the start.
    pub fn previews_dropped(&mut self) {
        self.lost_previews = true;
    }

    /// Before the status line: read one event. A failure before any preview or commit is the
    /// answer; output (or a commit) opens the stream. Events that ended before either open it
    /// too (it then ends with `no_commit`).
    pub fn before_head(&mut self, event: ClientEvent) -> Head {
        if (self.commit_first || self.lost_previews) && matches!(*event, DriveEvent::Preview { .. }) {
            // Never forwarded: not kept either.
            return Head::Wait;
        }
        let decided = if matches!(*event, DriveEvent::Preview { .. }) {
            Head::Open
        } else {
            match outcome_of(&event) {
                Some(Outcome::Committed(_)) => Head::Open,
                Some(Outcome::Failed { code, message }) => Head::Fail(Failure::of_dispatch(&code, &message)),
                None => Head::Wait,
            }
        };
        self.read.push(event);
        decided
    }

    /// After [`StreamAnswer::before_head`] said [`Head::Open`]: what opened the stream (None
    /// when the events ended before any sign of an answer, or a commit without facts).
    pub fn opener(&self) -> Option<Opener> {
        match &**self.read.last()? {
            DriveEvent::Preview { generation, .. } => Some(Opener::Generation(*generation)),
            committed @ DriveEvent::Committed { .. } => committing_target(committed).map(Opener::Target),
            _ => None,
        }
    }

    /// Before [`StreamAnswer::open`]: target `target` answers, so every frame names its model.
    /// Its provider and model for the headers, None when the target is unknown.
    pub fn answered_by(&mut self, target: usize) -> Option<Answerer> {
        self.encoder.answered_by(target)
    }

    /// The stream opened: `ready` is what the hub already has besides what was read (a commit
    /// among it is known up front and gives the provider's own usage for the opening frame).
    pub fn open(&mut self, ready: Vec<ClientEvent>) -> Frames {
        self.read.extend(ready);
        let read = std::mem::take(&mut self.read);
        if let Some(committed) = read
            .iter()
            .find(|event| matches!(***event, DriveEvent::Committed { .. }))
        {
            self.encoder
                .known_usage(answer_of(committed, self.prompt_tokens).1);
        }
        let mut frames = Frames::default();
        // Anthropic's opening frame carries the provider's own start usage: it waits for the
        // hub's first report of it (or for anything else that is not a state change, then it
        // opens with the admission count).
        self.opened = !self.encoder.opens_with_usage();
        if self.opened {
            frames.add(self.encoder.start());
        }
        for event in read {
            if frames.done {
                break;
            }
            let more = self.push(&event);
            frames.add(more.bytes);
            frames.done = more.done;
        }
        frames
    }

    /// One event after the stream opened.
    pub fn push(&mut self, event: &ClientEvent) -> Frames {
        let mut frames = Frames::default();
        if self.done {
            frames.done = true;
            return frames;
        }
        if (self.commit_first || self.lost_previews) && matches!(**event, DriveEvent::Preview { .. }) {
            return frames;
        }
        if !self.opened {
            if let DriveEvent::Usage { usage, .. } = &**event {
                self.encoder.start_usage(usage);
            }
            if matches!(**event, DriveEvent::State { .. }) && outcome_of(event).is_none() {
                return frames;
            }
            self.opened = true;
            frames.add(self.encoder.start());
        }
        match &**event {
            DriveEvent::Preview {
                generation: this,
                block_index,
                delta,
            } => {
                if self.generation.is_none() {
                    self.generation = Some(*this);
                    self.first_block.clear();
                    self.frozen = false;
                }
                if self.frozen || Some(*this) != self.generation {
                    return frames;
                }
                if *block_index != 0 {
                    self.frozen = true;
                    return frames;
                }
                self.first_block.push_str(delta);
                // Text already forwarded (by an earlier, retracted generation) is sent once: a
                // new generation continues the stream only while it agrees with it.
                let forwarded = self.encoder.forwarded();
                let agrees = if self.first_block.len() <= forwarded.len() {
                    forwarded.starts_with(self.first_block.as_str())
                } else {
                    self.first_block.starts_with(forwarded)
                };
                if !agrees {
                    frames.add(self.encoder.error(
                        "preview_diverged",
                        "a new attempt produced different text than was already sent; the dispatch continues",
                    ));
                    return self.finished(frames);
                }
                if self.first_block.len() > forwarded.len() {
                    let rest = self.first_block[forwarded.len()..].to_owned();
                    frames.add(self.encoder.text(&rest));
                }
            }
            DriveEvent::Retract {
                generation: retracted,
                ..
            } => {
                if Some(*retracted) == self.generation {
                    self.generation = None;
                }
            }
            _ => match outcome_of(event) {
                Some(Outcome::Committed(event)) => {
                    let (parts, facts) = answer_of(&event, self.prompt_tokens);
                    match self.encoder.finish(&parts, &facts) {
                        Ok(bytes) => frames.add(bytes),
                        Err(_) => frames.add(self.encoder.error(
                            "preview_mismatch",
                            "the committed turn differs from the text already sent",
                        )),
                    }
                    return self.finished(frames);
                }
                Some(Outcome::Failed { code, message }) => {
                    frames.add(self.encoder.error(&code, &message));
                    return self.finished(frames);
                }
                None => {}
            },
        }
        frames
    }

    /// The events ended before a commit.
    pub fn end(&mut self) -> Frames {
        let mut frames = Frames::default();
        if self.done {
            frames.done = true;
            return frames;
        }
        if !self.opened {
            self.opened = true;
            frames.add(self.encoder.start());
        }
        let failure = Failure::no_commit();
        frames.add(self.encoder.error(&failure.code, &failure.message));
        self.finished(frames)
    }

    fn finished(&mut self, mut frames: Frames) -> Frames {
        self.done = true;
        frames.done = true;
        frames
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;
    use turnstile_adapters::Api;
    use turnstile_core::Revision;

    fn to(api: Api) -> Addressee {
        Addressee {
            api,
            id: "chatcmpl-t".into(),
            model: "m".into(),
            created: 0,
            include_usage: false,
            served_by: vec![
                Answerer {
                    provider: "p0".into(),
                    model: "m0".into(),
                },
                Answerer {
                    provider: "p1".into(),
                    model: "m1".into(),
                },
            ],
        }
    }

    fn preview(generation: u64, text: &str) -> ClientEvent {
        Arc::new(DriveEvent::Preview {
            generation: Generation(generation),
            block_index: 0,
            delta: text.into(),
        })
    }

    fn committed(text: &str) -> ClientEvent {
        Arc::new(DriveEvent::Committed {
            revision: Revision(3),
            turn: json!({"id": "op.g1", "role": "assistant", "revision": 3,
                         "blocks": [{"id": "b", "kind": "text", "text": text}]}),
            facts: None,
        })
    }

    fn state(state: DispatchState) -> ClientEvent {
        Arc::new(DriveEvent::State {
            state,
            generation: Some(Generation(1)),
        })
    }

    fn text_of(frames: &[u8]) -> String {
        String::from_utf8_lossy(frames).into_owned()
    }

    #[test]
    fn a_failure_before_any_output_is_the_http_error_with_the_providers_status() {
        let mut answer = StreamAnswer::new(to(Api::OpenaiChat), 5);
        assert_eq!(answer.before_head(state(DispatchState::Dispatching)), Head::Wait);
        let error = Arc::new(DriveEvent::Error {
            code: "provider_status_429".into(),
            message: "slow down".into(),
        });
        match answer.before_head(error) {
            Head::Fail(failure) => {
                assert_eq!(failure.status, StatusCode::TOO_MANY_REQUESTS);
                assert_eq!(failure.code, "provider_status_429");
            }
            other => panic!("expected the 429 itself, got {other:?}"),
        }
    }

    #[test]
    fn preview_then_commit_streams_the_text_once_and_ends_with_the_commit() {
        let mut answer = StreamAnswer::new(to(Api::OpenaiChat), 5);
        assert_eq!(answer.before_head(preview(1, "Hel")), Head::Open);
        let opened = answer.open(vec![preview(1, "lo")]);
        assert!(!opened.done);
        let sent = text_of(&opened.bytes);
        assert!(sent.contains("\"Hel\"") && sent.contains("\"lo\""), "{sent}");
        let end = answer.push(&committed("Hello"));
        assert!(end.done);
        let tail = text_of(&end.bytes);
        assert!(tail.contains("\"finish_reason\":\"stop\""), "{tail}");
        assert!(
            !tail.contains("Hello"),
            "text already sent is not sent again: {tail}"
        );
        // Nothing after the end.
        assert!(answer.push(&preview(1, "x")).bytes.is_empty());
    }

    #[test]
    fn after_dropped_previews_nothing_more_is_forwarded_and_the_commit_sends_exactly_the_rest() {
        let mut answer = StreamAnswer::new(to(Api::OpenaiChat), 5);
        assert_eq!(answer.before_head(preview(1, "one ")), Head::Open);
        let opened = answer.open(vec![]);
        assert!(text_of(&opened.bytes).contains("\"one \""));
        // "two " and "three " were dropped before this answer read them.
        answer.previews_dropped();
        let after = answer.push(&preview(1, "four"));
        assert!(after.bytes.is_empty(), "{}", text_of(&after.bytes));
        let end = answer.push(&committed("one two three four"));
        assert!(end.done);
        let tail = text_of(&end.bytes);
        assert!(tail.contains("\"two three four\""), "{tail}");
        assert!(tail.contains("\"finish_reason\":\"stop\""), "{tail}");
        assert!(!tail.contains("preview_mismatch"), "{tail}");
    }

    #[test]
    fn waiting_for_the_commit_forwards_no_preview_and_streams_the_committed_turn_whole() {
        let mut answer = StreamAnswer::new(to(Api::OpenaiChat), 5);
        answer.wait_for_commit();
        // Generation 1's text, then its retract, then generation 2's different text: none of
        // it opens the stream.
        assert_eq!(answer.before_head(preview(1, "Sunny")), Head::Wait);
        let retract = Arc::new(DriveEvent::Retract {
            generation: Generation(1),
            reason: "cut_stream".into(),
        });
        assert_eq!(answer.before_head(retract), Head::Wait);
        assert_eq!(answer.before_head(preview(2, "Rain")), Head::Wait);
        assert_eq!(answer.before_head(committed("Rain")), Head::Open);
        let frames = answer.open(vec![preview(2, "late")]);
        assert!(frames.done);
        let sent = text_of(&frames.bytes);
        assert!(sent.contains("\"Rain\""), "{sent}");
        assert!(
            !sent.contains("Sunny") && !sent.contains("late") && !sent.contains("error"),
            "{sent}"
        );
        assert!(sent.contains("\"finish_reason\":\"stop\""), "{sent}");
    }

    #[test]
    fn a_new_generation_that_disagrees_with_forwarded_text_ends_the_stream_with_an_error() {
        let mut answer = StreamAnswer::new(to(Api::OpenaiChat), 5);
        assert_eq!(answer.before_head(preview(1, "Sunny")), Head::Open);
        answer.open(Vec::new());
        let retract = Arc::new(DriveEvent::Retract {
            generation: Generation(1),
            reason: "cut_stream".into(),
        });
        assert!(!answer.push(&retract).done);
        // Agreeing text of generation 2 is not repeated.
        let same = answer.push(&preview(2, "Sun"));
        assert!(same.bytes.is_empty() && !same.done);
        let diverged = answer.push(&preview(2, "Rain"));
        assert!(diverged.done);
        assert!(text_of(&diverged.bytes).contains("preview_diverged"));
    }

    #[test]
    fn a_commit_that_contradicts_forwarded_text_is_a_preview_mismatch_not_a_wrong_answer() {
        let mut answer = StreamAnswer::new(to(Api::OpenaiChat), 5);
        assert_eq!(answer.before_head(preview(1, "Sunny")), Head::Open);
        answer.open(Vec::new());
        let end = answer.push(&committed("Rainy"));
        assert!(end.done);
        assert!(text_of(&end.bytes).contains("preview_mismatch"));
    }

    #[test]
    fn events_that_end_before_any_sign_of_an_answer_open_and_end_with_no_commit() {
        let mut answer = StreamAnswer::new(to(Api::AnthropicMessages), 5);
        assert_eq!(answer.before_head(state(DispatchState::Dispatching)), Head::Wait);
        let opened = answer.open(Vec::new());
        assert!(!opened.done);
        let end = answer.end();
        assert!(end.done);
        let all = text_of(&[opened.bytes, end.bytes].concat());
        assert!(
            all.contains("message_start"),
            "Anthropic opens before its error: {all}"
        );
        assert!(all.contains("no_commit"), "{all}");
    }

    fn committed_by(target: u64, text: &str) -> ClientEvent {
        Arc::new(DriveEvent::Committed {
            revision: Revision(3),
            turn: json!({"id": "op.g2", "role": "assistant", "revision": 3,
                         "blocks": [{"id": "b", "kind": "text", "text": text}]}),
            facts: Some(json!({"stop_reason": "end_turn", "usage": {}, "target": target})),
        })
    }

    #[test]
    fn a_whole_answer_names_the_target_that_committed_in_its_model_field() {
        let mut answer = WholeAnswer::new(to(Api::OpenaiChat), 5);
        let body = answer
            .push(&committed_by(1, "Hello"))
            .expect("the commit answers");
        assert_eq!(body["model"], "m1");
        let answerer = answer.answered_by().expect("the commit names its target");
        assert_eq!(
            (answerer.provider.as_str(), answerer.model.as_str()),
            ("p1", "m1")
        );
        // A commit without facts (another replica's dispatch): the model asked for, no name.
        let mut answer = WholeAnswer::new(to(Api::OpenaiChat), 5);
        let body = answer.push(&committed("Hello")).expect("the commit answers");
        assert_eq!(body["model"], "m");
        assert!(answer.answered_by().is_none());
    }

    #[test]
    fn a_stream_is_opened_by_a_generations_preview_or_a_commits_target_and_names_it() {
        let mut answer = StreamAnswer::new(to(Api::OpenaiChat), 5);
        assert_eq!(answer.before_head(preview(2, "Hel")), Head::Open);
        assert_eq!(answer.opener(), Some(Opener::Generation(Generation(2))));
        let answerer = answer.answered_by(1).expect("target 1 is known");
        assert_eq!(answerer.model, "m1");
        let opened = text_of(&answer.open(Vec::new()).bytes);
        assert!(opened.contains("\"model\":\"m1\""), "{opened}");
        let mut answer = StreamAnswer::new(to(Api::OpenaiChat), 5);
        assert_eq!(answer.before_head(committed_by(0, "Hi")), Head::Open);
        assert_eq!(answer.opener(), Some(Opener::Target(0)));
        assert!(answer.answered_by(7).is_none(), "no such target");
    }

    #[test]
    fn a_whole_answer_is_the_commit_even_after_a_failed_attempt_and_else_the_first_failure() {
        let mut answer = WholeAnswer::new(to(Api::OpenaiChat), 5);
        let failed = Arc::new(DriveEvent::Error {
            code: "provider_status_503".into(),
            message: "down".into(),
        });
        assert!(answer.push(&failed).is_none());
        let body = answer.push(&committed("Hello")).expect("the commit answers");
        assert_eq!(body["choices"][0]["message"]["content"], "Hello");

        let mut answer = WholeAnswer::new(to(Api::OpenaiChat), 5);
        assert!(answer.push(&failed).is_none());
        assert!(answer.push(&state(DispatchState::Failed)).is_none());
        let failure = answer.end();
        assert_eq!(failure.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            failure.code, "provider_status_503",
            "the first failure names the cause"
        );
    }
}
