//! RFC 8785 canonical JSON: the RFC's own examples, a cross-check against a second
//! implementation, and the args-digest definition of the v1 spec.

use proptest::prelude::*;
use serde_json::{Value, json};
use turnstile_core::Digest;
use turnstile_core::digest::canonical_bytes;

fn canonical(value: &Value) -> String {
    String::from_utf8(canonical_bytes(value)).unwrap()
}

#[test]
fn rfc8785_section_3_2_2_example_canonicalises_exactly() {
    let input = r#"{
      "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
      "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
      "literals": [null, true, false]
    }"#;
    let value: Value = serde_json::from_str(input).unwrap();
    assert_eq!(
        canonical(&value),
        r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
    );
}

#[test]
fn rfc8785_section_3_2_3_sorts_keys_by_utf16_code_units() {
    let input = r#"{"\u20ac":"Euro Sign","\r":"Carriage Return","\ufb33":"Hebrew Letter Dalet With Dagesh",
      "1":"One","\ud83d\ude00":"Emoji: Grinning Face","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis"}"#;
    let value: Value = serde_json::from_str(input).unwrap();
    let text = canonical(&value);
    let order: Vec<usize> = ["\\r", "\"1\"", "\u{80}", "ö", "€", "😀", "\u{fb33}"]
        .iter()
        .map(|key| {
            text.find(key)
                .unwrap_or_else(|| panic!("{key} missing in {text}"))
        })
        .collect();
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(order, sorted, "{text}");
}

#[test]
fn rfc8785_appendix_b_numbers_serialise_like_ecmascript() {
    let cases: &[(u64, &str)] = &[
        (0x0000000000000000, "0"),
        (0x8000000000000000, "0"),
        (0x0000000000000001, "5e-324"),
        (0x8000000000000001, "-5e-324"),
        (0x7fefffffffffffff, "1.7976931348623157e+308"),
        (0xffefffffffffffff, "-1.7976931348623157e+308"),
        (0x4340000000000000, "9007199254740992"),
        (0xc340000000000000, "-9007199254740992"),
        (0x4430000000000000, "295147905179352830000"),
        (0x44b52d02c7e14af5, "9.999999999999997e+22"),
        (0x44b52d02c7e14af6, "1e+23"),
        (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
        (0x444b1ae4d6e2ef4e, "999999999999999700000"),
        (0x444b1ae4d6e2ef4f, "999999999999999900000"),
        (0x444b1ae4d6e2ef50, "1e+21"),
        (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
        (0x3eb0c6f7a0b5ed8d, "0.000001"),
        (0x41b3de4355555553, "333333333.3333332"),
        (0x41b3de4355555554, "333333333.33333325"),
        (0x41b3de4355555555, "333333333.3333333"),
        (0x41b3de4355555556, "333333333.3333334"),
        (0x41b3de4355555557, "333333333.33333343"),
        (0xbecbf647612f3696, "-0.0000033333333333333333"),
        (0x43143ff3c1cb0959, "1424953923781206.2"),
    ];
    for &(bits, expected) in cases {
        let value = json!(f64::from_bits(bits));
        assert_eq!(canonical(&value), expected, "bits {bits:#018x}");
    }
}

#[test]
fn args_digest_is_sha256_of_the_canonical_arguments_whatever_their_spelling() {
    let spaced: Value = serde_json::from_str(r#"{ "days" : 2, "city" : "Paris" }"#).unwrap();
    let compact = json!({"city": "Paris", "days": 2});
    assert_eq!(Digest::of_canonical(&spaced), Digest::of_canonical(&compact));
    // sha256 of the UTF-8 bytes `{"city":"Paris","days":2}`, computed independently.
    assert_eq!(
        Digest::of_canonical(&compact).as_str(),
        format!("sha256:{}", sha256_hex(br#"{"city":"Paris","days":2}"#))
    );
    assert!(Digest::parse(Digest::of_canonical(&compact).as_str()).is_some());
    assert!(Digest::parse("sha256:ABC").is_none());
}

/// SHA-256 written out from FIPS 180-4, so the digest test does not only trust `sha2`.
fn sha256_hex(message: &[u8]) -> String {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
    ];
    let mut data = message.to_vec();
    data.push(0x80);
    while data.len() % 64 != 56 {
        data.push(0);
    }
    data.extend_from_slice(&((message.len() as u64) * 8).to_be_bytes());
    for chunk in data.chunks(64) {
        let mut w = [0u32; 64];
        for i in 0..16 {
            w[i] = u32::from_be_bytes(chunk[i * 4..i * 4 + 4].try_into().unwrap());
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
        }
        let mut v = h;
        for i in 0..64 {
            let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
            let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
            let t1 = v[7]
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
            let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
            let t2 = s0.wrapping_add(maj);
            v = [
                t1.wrapping_add(t2),
                v[0],
                v[1],
                v[2],
                v[3].wrapping_add(t1),
                v[4],
                v[5],
                v[6],
            ];
        }
        for i in 0..8 {
            h[i] = h[i].wrapping_add(v[i]);
        }
    }
    h.iter().map(|word| format!("{word:08x}")).collect()
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        any::<String>().prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(any::<String>(), inner, 0..6)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn our_canonical_writer_agrees_with_serde_jcs_and_serde_json_canonicalizer(value in json_value()) {
        let ours = String::from_utf8(canonical_bytes(&value)).unwrap();
        let serde_jcs = String::from_utf8(serde_jcs::to_vec(&value).unwrap()).unwrap();
        let canonicalizer = String::from_utf8(serde_json_canonicalizer::to_vec(&value).unwrap()).unwrap();
        prop_assert_eq!(&ours, &serde_jcs);
        prop_assert_eq!(&ours, &canonicalizer);
        prop_assert_eq!(Digest::of_value(&value), Digest::of_bytes(ours.as_bytes()));
        prop_assert_eq!(turnstile_core::digest::canonical_value_bytes(&value), ours.as_bytes());
        if let Value::Object(map) = &value {
            prop_assert_eq!(turnstile_core::digest::canonical_object_bytes(map), ours.as_bytes());
        }
    }

    #[test]
    fn keys_beyond_u_e000_sort_by_utf16_code_units(keys in prop::collection::vec("[a\\u{e000}-\\u{e010}\\u{1f600}-\\u{1f610}]{1,3}", 1..8)) {
        let value = Value::Object(keys.iter().map(|k| (k.clone(), json!(1))).collect());
        let ours = String::from_utf8(canonical_bytes(&value)).unwrap();
        prop_assert_eq!(ours, String::from_utf8(serde_jcs::to_vec(&value).unwrap()).unwrap());
    }
}

/// Strings rich in what JSON escapes (controls, `"`, `\`), around runs long enough for the
/// eight-bytes-at-a-time skip, with multibyte characters on both sides of the word boundaries.
fn escapable_string() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("\"".to_owned()),
        Just("\\".to_owned()),
        (0u8..0x20).prop_map(|byte| char::from(byte).to_string()),
        Just("\u{7f}".to_owned()),
        Just("\u{2028}\u{2029}".to_owned()),
        Just("é€😀".to_owned()),
        "[a-z ]{0,17}",
        any::<String>(),
    ];
    prop::collection::vec(piece, 0..12).prop_map(|pieces| pieces.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    /// The renderers write every body string with `push_json_string`, and the block digests
    /// hash through the same escaper: it must be serde_json's own bytes (and so RFC 8785's).
    #[test]
    fn push_json_string_writes_serde_jsons_bytes(text in escapable_string()) {
        let mut ours = b"prefix".to_vec();
        turnstile_core::digest::push_json_string(&mut ours, &text);
        let mut expected = b"prefix".to_vec();
        serde_json::to_writer(&mut expected, &text).unwrap();
        prop_assert_eq!(&ours, &expected);
        prop_assert_eq!(canonical_bytes(&Value::String(text.clone())), expected[6..].to_vec());
    }
}

#[test]
fn push_json_string_escapes_at_every_position_of_a_word() {
    for special in ["\"", "\\", "\n", "\u{1}", "\u{1f}", "\u{8}", "\u{c}"] {
        for at in 0..20 {
            let text = format!("{}{special}{}", "x".repeat(at), "y".repeat(19 - at));
            let mut ours = Vec::new();
            turnstile_core::digest::push_json_string(&mut ours, &text);
            assert_eq!(ours, serde_json::to_vec(&text).unwrap(), "{text:?}");
        }
    }
}

/// `Digest::of_value` and `of_map` hash the bytes of our canonical writer: at every size
/// around SHA-256's 64-byte blocks and beyond, they equal the digest of an independent RFC 8785
/// implementation's bytes (`serde_json_canonicalizer`).
#[test]
fn value_digests_equal_the_digest_of_independent_canonical_bytes_at_every_size() {
    for size in [
        0, 1, 255, 256, 257, 500, 511, 512, 513, 1023, 1024, 1025, 4096, 100_000,
    ] {
        let value = json!({"a": "x".repeat(size), "b": ["y".repeat(size / 3), size, {"c": "\"".repeat(size % 700)}],
                           "d": (0..size % 97).map(|index| index.to_string()).collect::<Vec<_>>()});
        let bytes = serde_json_canonicalizer::to_vec(&value).unwrap();
        assert_eq!(Digest::of_value(&value), Digest::of_bytes(&bytes), "size {size}");
        let Value::Object(map) = &value else {
            unreachable!()
        };
        assert_eq!(Digest::of_map(map), Digest::of_bytes(&bytes), "size {size}");
    }
}

/// A JSON integer either side of 2^53, where serde_json and RFC 8785 stop agreeing.
fn manifest_integer() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..100_000, (1u64 << 53) - 2..(1u64 << 53) + 3, any::<u64>(),]
}

fn digest_field() -> impl Strategy<Value = Digest> {
    // A stored manifest's digest fields are whatever strings it holds, not only well-formed
    // digests: `is_intact` must agree with the definition on those too.
    prop_oneof![
        "[0-9a-f]{64}".prop_map(|hex| format!("sha256:{hex}")),
        escapable_string(),
    ]
    .prop_map(|text| serde_json::from_value(Value::String(text)).unwrap())
}

prop_compose! {
    fn manifest_body()(
        strings in prop::collection::vec(escapable_string(), 6),
        digests in prop::collection::vec(digest_field(), 5),
        integers in prop::collection::vec(manifest_integer(), 3),
    ) -> turnstile_core::manifest::ManifestBody {
        turnstile_core::manifest::ManifestBody {
            format: strings[0].clone(),
            operation_id: strings[1].clone(),
            conversation_id: strings[2].clone(),
            conversation_revision: turnstile_core::ids::Revision(integers[0]),
            sequence_digest: digests[0].clone(),
            adapter: strings[3].clone(),
            adapter_digest: digests[1].clone(),
            provider: strings[4].clone(),
            model: strings[5].clone(),
            toolset_digest: digests[2].clone(),
            policy_digest: digests[3].clone(),
            max_output_tokens: integers[1],
            prompt_tokens: integers[2],
            request_digest: digests[4].clone(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// `manifest_digest` is defined over the RFC 8785 form of the body; `ManifestBody::digest`
    /// hashes serde_json's bytes of its fields in sorted order instead (and the generic form
    /// for an integer above 2^53). Both must give the definition's digest, on bodies with
    /// strings that need escaping and integers either side of 2^53; `is_intact` must accept
    /// what `seal` wrote and refuse a body changed after sealing.
    #[test]
    fn a_manifest_digest_is_the_digest_of_the_canonical_body(body in manifest_body(), other in 0u64..(1 << 53)) {
        let definition = Digest::of_bytes(&serde_json_canonicalizer::to_vec(&serde_json::to_value(&body).unwrap()).unwrap());
        prop_assert_eq!(body.digest(), definition.clone());
        // The generic path, which wrote every digest stored before the fast path, agrees.
        prop_assert_eq!(Digest::of_canonical(&body), definition.clone());
        let mut sealed = body.seal();
        prop_assert_eq!(&sealed.manifest_digest, &definition);
        prop_assert!(sealed.is_intact());
        // (Two integers above 2^53 can be the same IEEE double, and so the same canonical
        // body: the changed value is below it.)
        if other != sealed.body.prompt_tokens {
            sealed.body.prompt_tokens = other;
            prop_assert!(!sealed.is_intact());
        }
    }
}

/// The stored-history check (issue 49 item 7): a turn's digest is the canonical digest of its
/// id, revision, role, generation and per-block id, state, cache mark and content digest, and
/// a change to any one of them (a byte of a text, a digit of a revision) changes it.
#[test]
fn a_turn_digest_is_canonical_and_covers_every_field_a_reader_takes() {
    use turnstile_core::conversation::Conversation;
    let turn = json!({"id": "t-1", "revision": 1, "role": "assistant", "generation": 2, "blocks": [
        {"id": "a-1", "kind": "text", "text": "revenue was 4057", "cache": {"ttl": "1h"}},
        {"id": "a-2", "kind": "tool_call", "call_id": "c-1", "tool": "f", "arguments": {"x": 1}}]});
    let digest_of = |turn: &Value| Conversation::decode_turn(turn.clone()).unwrap().0.digest();
    let decoded = Conversation::decode_turn(turn.clone()).unwrap().0;
    let expected = Digest::of_value(&json!({
        "blocks": decoded.blocks.iter().map(|block| json!({
            "cache": block.cache.map(|mark| mark.ttl.map_or("default", |ttl| ttl.as_str())),
            "digest": block.digest.as_str(), "id": block.id, "state": "committed"})).collect::<Vec<_>>(),
        "generation": 2, "id": "t-1", "revision": 1, "role": "assistant"}));
    assert_eq!(decoded.digest(), expected);

    let changes: [(&str, Value); 8] = [
        ("/blocks/0/text", json!("revenue was 9057")),
        ("/blocks/0/id", json!("a-9")),
        ("/blocks/0/cache", json!({"ttl": "5m"})),
        ("/blocks/1/arguments", json!({"x": 2})),
        ("/id", json!("t-2")),
        ("/revision", json!(2)),
        ("/role", json!("user")),
        ("/generation", json!(3)),
    ];
    for (path, value) in changes {
        let mut changed = turn.clone();
        *changed.pointer_mut(path).unwrap() = value;
        assert_ne!(digest_of(&changed), expected, "a change at {path} goes unnoticed");
    }
    let mut uncached = turn.clone();
    uncached["blocks"][0].as_object_mut().unwrap().remove("cache");
    assert_ne!(
        digest_of(&uncached),
        expected,
        "a removed cache mark goes unnoticed"
    );
}
