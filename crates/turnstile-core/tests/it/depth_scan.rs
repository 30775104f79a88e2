//! `parse::depth_exceeds` (the nesting pre-scan before any parse) skips string contents with
//! `memchr`; it must answer exactly what a byte-by-byte scan answers, on any bytes.

use proptest::prelude::*;
use turnstile_core::parse::depth_exceeds;

/// The definition: one byte at a time, brackets inside strings not counted, an escape skipping
/// the byte after it.
fn bytewise(bytes: &[u8], depth_max: usize) -> bool {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
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

/// Bytes made mostly of the ones the scan looks at, so quotes, escapes and brackets meet in
/// every order (a trailing backslash, an escaped quote, brackets inside and outside strings).
fn structural() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![
            Just(b'"'),
            Just(b'\\'),
            Just(b'['),
            Just(b']'),
            Just(b'{'),
            Just(b'}'),
            Just(b'a'),
            any::<u8>()
        ],
        0..200,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn the_scan_answers_what_a_bytewise_scan_answers(bytes in structural(), depth_max in 0usize..6) {
        prop_assert_eq!(depth_exceeds(&bytes, depth_max), bytewise(&bytes, depth_max));
    }
}

#[test]
fn strings_hide_brackets_and_escapes_hide_quotes() {
    assert!(!depth_exceeds(br#"["[[[[", "\"[[[["]"#, 1));
    assert!(depth_exceeds(br#"["\\", [[]]]"#, 2));
    assert!(!depth_exceeds(br#"["\\", [[]]]"#, 3));
    assert!(
        depth_exceeds(b"[\"\\", 0),
        "a bracket before a string cut after its backslash"
    );
    assert!(!depth_exceeds(b"\"\\", 0), "a string cut after its backslash");
    assert!(depth_exceeds(b"[[", 1));
    assert!(
        !depth_exceeds(b"\"[[", 1),
        "an unterminated string hides the rest"
    );
}
