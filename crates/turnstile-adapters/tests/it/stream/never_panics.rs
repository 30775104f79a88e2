//! "Never panics": arbitrary bytes, and fixtures with random bytes flipped, inserted or
//! deleted, through every decoder and on into the assembler. The same property is the
//! cargo-fuzz target's (`fuzz/fuzz_targets/decode_stream.rs`, when `fuzz/` exists).

use super::support::{
    Ending, Rng, assembler, decode_chunks, feed, finish, own_fixtures, random_chunks, toolset,
};
use proptest::prelude::*;
use turnstile_adapters::decode::StreamApi;

fn run_everything(api: StreamApi, bytes: &[u8], seed: u64) {
    let mut rng = Rng::new(seed);
    let chunks = random_chunks(bytes, &mut rng);
    for ending in [Ending::Live, Ending::File] {
        let events = decode_chunks(api, chunks.iter().map(Vec::as_slice), ending);
        let mut assembler = assembler(Some(toolset()));
        feed(&mut assembler, events);
        let _ = finish(&mut assembler);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic_any_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..4096), seed in any::<u64>()) {
        for api in StreamApi::ALL {
            run_everything(api, &bytes, seed);
        }
    }

    #[test]
    fn sse_framed_arbitrary_json_never_panics_any_decoder(
        payloads in proptest::collection::vec("[ -~]{0,80}", 0..24),
        seed in any::<u64>(),
    ) {
        let mut bytes = Vec::new();
        for payload in &payloads {
            bytes.extend_from_slice(b"data: ");
            bytes.extend_from_slice(payload.as_bytes());
            bytes.extend_from_slice(b"\n\n");
        }
        for api in StreamApi::ALL {
            run_everything(api, &bytes, seed);
        }
    }

    #[test]
    fn mutated_fixtures_never_panic_their_decoder(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        for (api, _, bytes, _) in own_fixtures() {
            let mut mutated = bytes.clone();
            for _ in 0..1 + rng.below(8) {
                let at = rng.below(mutated.len() + 1);
                match rng.below(3) {
                    0 if at < mutated.len() => mutated[at] = rng.next() as u8,
                    1 => {
                        const NOISE: &[u8] = b"{}[]\":,\n\r\\0-9aZ";
                        mutated.insert(at, NOISE[rng.below(NOISE.len())]);
                    }
                    _ if at < mutated.len() => {
                        mutated.remove(at);
                    }
                    _ => {}
                }
            }
            // Any API's decoder on any fixture, too.
            run_everything(api, &mutated, seed);
            run_everything(StreamApi::ALL[rng.below(4)], &mutated, seed);
        }
    }
}

/// A provider event nesting serde_json's raw-value token (an object named by it is replaced by
/// its string parsed as JSON, with a fresh recursion budget) reaches no `Value` parse without
/// a bound: every decoder, and the assembler after it, gets through it on a 2 MiB stack (a
/// tokio worker's). With the decoders' `Value` path on plain `serde_json::from_str` (before
/// `parse::bounded_value`) this test aborts with a stack overflow.
#[test]
fn an_event_nesting_the_raw_value_token_gets_through_every_decoder() {
    let mut inner = "1".to_owned();
    for level in 0..14 {
        let arrays = if level == 13 { 10 } else { 120 };
        inner = format!(
            "{}{{\"$serde_json::private::RawValue\":{}}}{}",
            "[".repeat(arrays),
            serde_json::to_string(&inner).unwrap(),
            "]".repeat(arrays)
        );
    }
    let stream = format!(
        "event: message_start\ndata: {{\"type\":\"message_start\",\"x\":{inner}}}\n\ndata: {{\"choices\":[],\"x\":{inner}}}\n\n"
    );
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            for api in StreamApi::ALL {
                for ending in [Ending::Live, Ending::File] {
                    let events = decode_chunks(api, [stream.as_bytes()].into_iter(), ending);
                    let mut assembler = assembler(Some(toolset()));
                    feed(&mut assembler, events);
                    let _ = finish(&mut assembler);
                }
            }
        })
        .unwrap()
        .join()
        .expect("every decoder read the event without overflowing its stack");
}
