//! Arbitrary bytes through parse → validate → graph; the stable twin is
//! `crates/turnstile-core/tests/it/never_panics.rs`. Run: `cd fuzz && cargo +nightly fuzz run validate`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use turnstile_core::{MessageSequence, Validated, parse, validate};

fuzz_target!(|bytes: &[u8]| {
    if let Ok(conversation) = parse::conversation_from_slice(bytes) {
        let _ = validate(&conversation);
        if let Ok(validated) = Validated::new(&conversation) {
            let _ = MessageSequence::build(validated);
        }
    }
});
