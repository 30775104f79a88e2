//! Arbitrary bytes, split at a fuzzer-chosen point, through every stream decoder and on into
//! the assembler, ending both as a live connection and as a stored file. The stable twin is
//! `crates/turnstile-adapters/tests/it/stream/never_panics.rs`.
//! Run: `cd fuzz && cargo +nightly fuzz run decode_stream`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::Generation;
use turnstile_core::assemble::{Assembler, AssemblerConfig};

fuzz_target!(|input: &[u8]| {
    let Some((&split, bytes)) = input.split_first() else { return };
    let split = usize::from(split).min(bytes.len());
    for api in StreamApi::ALL {
        for file_ending in [false, true] {
            let mut decoder = api.decoder();
            let mut assembler = Assembler::new(AssemblerConfig::new(Generation(1), "t"));
            for chunk in [&bytes[..split], &bytes[split..]] {
                decoder.handle_bytes(chunk);
                while let Some(event) = decoder.poll_event() {
                    let _ = assembler.handle_event(Generation(1), event);
                }
            }
            if file_ending {
                decoder.handle_end_of_file();
            } else {
                decoder.handle_end_of_input();
            }
            while let Some(event) = decoder.poll_event() {
                let _ = assembler.handle_event(Generation(1), event);
            }
            assembler.handle_end_of_input();
            while assembler.poll_output().is_some() {}
        }
    }
});
