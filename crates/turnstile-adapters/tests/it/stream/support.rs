//! Helpers shared by the stream tests: fixture paths, decode + assemble in one call, and a
//! seeded SplitMix64 so every randomized test prints the seed it can be replayed from.

use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;
use turnstile_adapters::decode::{Decoder, StreamApi};
use turnstile_core::Generation;
use turnstile_core::assemble::{Assembler, AssemblerConfig, Disposition, Output, Toolset};
use turnstile_core::stream::Sequenced;

pub const GENERATION: Generation = Generation(1);
pub const TURN_ID: &str = "t-1";

/// The crate's own fixtures.
pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

/// The shared captures directory (`$TURNSTILE_SHARED/fixtures/provider-streams`, else
/// `../shared/…` beside the repository), or `None` with a plain message.
pub fn captures_dir() -> Option<PathBuf> {
    let shared = match std::env::var_os("TURNSTILE_SHARED") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"),
    };
    let dir = shared.join("fixtures/provider-streams");
    if dir.is_dir() {
        Some(dir)
    } else {
        println!(
            "shared captures not found at {} (set TURNSTILE_SHARED): the capture conformance suite did not run",
            dir.display()
        );
        None
    }
}

/// The weather toolset every fixture is checked against.
pub fn toolset() -> Arc<Toolset> {
    let text = std::fs::read_to_string(data_dir().join("tools-weather.json")).unwrap();
    Arc::new(Toolset::from_json(&serde_json::from_str(&text).unwrap()).unwrap())
}

pub fn api_of_dir(dir: &str) -> StreamApi {
    match dir {
        "openai-chat" => StreamApi::OpenAiChat,
        "openai-responses" => StreamApi::OpenAiResponses,
        "anthropic-messages" | "anthropic" => StreamApi::AnthropicMessages,
        "gemini" => StreamApi::Gemini,
        other => panic!("no stream API for fixture directory {other}"),
    }
}

/// What a stream comes to.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The v1 turn offered for commit.
    Committed(Value),
    /// Nothing committed, with the retract code.
    Retracted(String),
}

impl Outcome {
    pub fn from_expected(value: &Value) -> Outcome {
        if let Some(turn) = value.get("committed") {
            Outcome::Committed(turn.clone())
        } else {
            Outcome::Retracted(value["retracted"].as_str().unwrap().to_owned())
        }
    }
}

pub fn assembler(toolset: Option<Arc<Toolset>>) -> Assembler {
    let mut config = AssemblerConfig::new(GENERATION, TURN_ID);
    config.toolset = toolset;
    Assembler::new(config)
}

/// Feed events to an assembler; return its preview text and the quarantine count.
pub fn feed(assembler: &mut Assembler, events: impl IntoIterator<Item = Sequenced>) -> usize {
    let mut quarantined = 0;
    for event in events {
        if let Disposition::Quarantined(_) = assembler.handle_event(GENERATION, event) {
            quarantined += 1;
        }
    }
    quarantined
}

/// End the input and read the outcome (previews are skipped).
pub fn finish(assembler: &mut Assembler) -> Outcome {
    assembler.handle_end_of_input();
    outcome_of(assembler)
}

pub fn outcome_of(assembler: &mut Assembler) -> Outcome {
    let mut outcome = None;
    while let Some(output) = assembler.poll_output() {
        match output {
            Output::Preview { .. } => {}
            Output::Commit(offer) => {
                assert!(outcome.is_none(), "two outcomes for one generation");
                outcome = Some(Outcome::Committed(offer.turn));
            }
            Output::Retract { reason, .. } => {
                assert!(outcome.is_none(), "two outcomes for one generation");
                outcome = Some(Outcome::Retracted(reason.code().to_owned()));
            }
        }
    }
    outcome.unwrap_or_else(|| Outcome::Retracted("<none yet>".into()))
}

/// How the byte stream ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// A live connection closed: an unterminated last event is discarded (WHATWG).
    Live,
    /// A stored file ended (`turnstile assemble`): a last event without its blank line counts.
    File,
}

/// Decode `chunks` (in order) with a fresh decoder.
pub fn decode_chunks<'a>(
    api: StreamApi,
    chunks: impl IntoIterator<Item = &'a [u8]>,
    ending: Ending,
) -> Vec<Sequenced> {
    let mut decoder = api.decoder();
    let mut events = Vec::new();
    for chunk in chunks {
        decoder.handle_bytes(chunk);
        events.extend(std::iter::from_fn(|| decoder.poll_event()));
    }
    end(&mut *decoder, ending);
    events.extend(std::iter::from_fn(|| decoder.poll_event()));
    events
}

pub fn end(decoder: &mut dyn Decoder, ending: Ending) {
    match ending {
        Ending::Live => decoder.handle_end_of_input(),
        Ending::File => decoder.handle_end_of_file(),
    }
}

/// Decode and assemble whole bytes.
pub fn outcome(api: StreamApi, bytes: &[u8], ending: Ending, toolset: Option<Arc<Toolset>>) -> Outcome {
    let mut assembler = assembler(toolset);
    feed(&mut assembler, decode_chunks(api, [bytes], ending));
    finish(&mut assembler)
}

/// Wrap vercel/ai `*.chunks.txt` lines as SSE events, as the captures README says: `data:` for
/// every API, plus `event: <type>` for Anthropic and OpenAI Responses.
pub fn wrap_jsonl(text: &str, with_event_names: bool) -> Vec<u8> {
    let mut out = String::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        if with_event_names {
            let value: Value = serde_json::from_str(line).unwrap();
            out.push_str(&format!("event: {}\n", value["type"].as_str().unwrap()));
        }
        out.push_str("data: ");
        out.push_str(line);
        out.push_str("\n\n");
    }
    out.into_bytes()
}

/// SplitMix64: small, seeded, reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// Split bytes at random points (seeded).
pub fn random_chunks(bytes: &[u8], rng: &mut Rng) -> Vec<Vec<u8>> {
    let mut chunks = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let scale = match rng.below(3) {
            0 => 3,
            1 => 40,
            _ => 400,
        };
        let len = 1 + rng.below(scale);
        let end = (at + len).min(bytes.len());
        chunks.push(bytes[at..end].to_vec());
        at = end;
    }
    chunks
}

/// Every own fixture: (api, name, bytes, expected).
pub fn own_fixtures() -> Vec<(StreamApi, String, Vec<u8>, Outcome)> {
    let mut fixtures = Vec::new();
    for dir in ["openai-chat", "openai-responses", "anthropic-messages", "gemini"] {
        let mut names: Vec<_> = std::fs::read_dir(data_dir().join(dir))
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "sse"))
            .collect();
        names.sort();
        for path in names {
            let bytes = std::fs::read(&path).unwrap();
            let expected_path = path.with_extension("expected.json");
            let expected: Value =
                serde_json::from_str(&std::fs::read_to_string(&expected_path).unwrap()).unwrap();
            let name = format!("{dir}/{}", path.file_name().unwrap().to_string_lossy());
            fixtures.push((api_of_dir(dir), name, bytes, Outcome::from_expected(&expected)));
        }
    }
    fixtures
}
