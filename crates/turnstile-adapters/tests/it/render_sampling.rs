//! Generation settings on the render side. Every adapter writes every setting its API takes in
//! the API's own field and place, checked against an expectation table written here from the
//! provider docs (not read from `sampling.rs`); a setting the API has no field for is refused,
//! naming it, and never left out; a value outside the documented range is refused, never
//! clamped; numbers go out exactly. The bodies are snapshotted per adapter: the adapter
//! digest's probes render without settings, so these snapshots are what makes a change in how
//! settings are written a visible, reviewed change. `prepare` pins the settings in the policy
//! digest, and nothing set renders the bytes and policy of a request without settings.

use crate::render_props::Gen;
use crate::render_support::{SCENARIOS, load, reindent, render_for, render_sampled};
use serde_json::{Value, json};
use turnstile_adapters::prepare::prepare_with_sampling;
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::{Graph, RenderCache, RenderOutcome};
use turnstile_adapters::{
    AdapterId, Catalog, PrepareOutcome, PrepareRequest, Sampling, SamplingError, Setting,
};
use turnstile_core::conversation::Conversation;
use turnstile_core::{MessageSequence, Validated};

/// Where each API takes each setting, as a path in the body; None when it has no field for it.
/// OpenAI: `CreateChatCompletionRequest` / `CreateResponse` of the OpenAPI spec
/// (<https://platform.openai.com/docs/api-reference/chat/create>,
/// <https://platform.openai.com/docs/api-reference/responses/create>); Anthropic:
/// <https://platform.claude.com/docs/en/api/messages>; Gemini: `GenerationConfig` of
/// <https://ai.google.dev/api/generate-content#generationconfig>.
pub fn place(api: Api, setting: Setting) -> Option<&'static [&'static str]> {
    use Setting::*;
    let path: &'static [&'static str] = match (api, setting) {
        (Api::OpenaiChat, Temperature) => &["temperature"],
        (Api::OpenaiChat, TopP) => &["top_p"],
        (Api::OpenaiChat, Stop) => &["stop"],
        (Api::OpenaiChat, Seed) => &["seed"],
        (Api::OpenaiChat, PresencePenalty) => &["presence_penalty"],
        (Api::OpenaiChat, FrequencyPenalty) => &["frequency_penalty"],
        (Api::OpenaiResponses, Temperature) => &["temperature"],
        (Api::OpenaiResponses, TopP) => &["top_p"],
        (Api::AnthropicMessages, Temperature) => &["temperature"],
        (Api::AnthropicMessages, TopP) => &["top_p"],
        (Api::AnthropicMessages, TopK) => &["top_k"],
        (Api::AnthropicMessages, Stop) => &["stop_sequences"],
        (Api::Gemini, Temperature) => &["generationConfig", "temperature"],
        (Api::Gemini, TopP) => &["generationConfig", "topP"],
        (Api::Gemini, TopK) => &["generationConfig", "topK"],
        (Api::Gemini, Stop) => &["generationConfig", "stopSequences"],
        (Api::Gemini, Seed) => &["generationConfig", "seed"],
        (Api::Gemini, PresencePenalty) => &["generationConfig", "presencePenalty"],
        (Api::Gemini, FrequencyPenalty) => &["generationConfig", "frequencyPenalty"],
        _ => return None,
    };
    Some(path)
}

fn set(sampling: &mut Sampling, setting: Setting, value: &Value) {
    match setting {
        Setting::Temperature => sampling.temperature = value.as_f64(),
        Setting::TopP => sampling.top_p = value.as_f64(),
        Setting::TopK => sampling.top_k = value.as_u64(),
        Setting::Stop => {
            sampling.stop = value
                .as_array()
                .unwrap()
                .iter()
                .map(|item| item.as_str().unwrap().to_owned())
                .collect()
        }
        Setting::Seed => sampling.seed = value.as_i64(),
        Setting::PresencePenalty => sampling.presence_penalty = value.as_f64(),
        Setting::FrequencyPenalty => sampling.frequency_penalty = value.as_f64(),
        other => panic!("no test value for {other}"),
    }
}

/// A value for every setting, legal for every API that takes it.
fn full_values() -> Vec<(Setting, Value)> {
    vec![
        (Setting::Temperature, json!(0.7)),
        (Setting::TopP, json!(0.95)),
        (Setting::TopK, json!(40)),
        (Setting::Stop, json!(["\n\nEND", "STOP"])),
        (Setting::Seed, json!(1234567)),
        (Setting::PresencePenalty, json!(0.5)),
        (Setting::FrequencyPenalty, json!(-0.25)),
    ]
}

/// Every setting `api` takes, with a value legal there.
pub fn full_sampling(api: Api) -> Sampling {
    let mut sampling = Sampling::default();
    for (setting, value) in full_values() {
        if place(api, setting).is_some() {
            set(&mut sampling, setting, &value);
        }
    }
    sampling
}

fn unit(g: &mut Gen) -> f64 {
    // Full-precision doubles as well as short decimals, so the shortest-form writing and the
    // importer's parsing are both exercised.
    if g.chance(50) {
        g.below(1001) as f64 / 1000.0
    } else {
        (g.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A random non-empty subset of the settings `api` takes, each with a legal value.
pub fn random_sampling(api: Api, g: &mut Gen) -> Sampling {
    const STOPS: &[&str] = &["\n\n", "END", "Human:", "</answer>", "日本", "   ", "\"quoted\""];
    let mut sampling = Sampling::default();
    while sampling.is_unset() {
        for setting in Setting::ALL {
            if place(api, setting).is_none() || g.chance(50) {
                continue;
            }
            match setting {
                // 0–1 is legal for every API that takes a temperature.
                Setting::Temperature => sampling.temperature = Some(unit(g)),
                Setting::TopP => sampling.top_p = Some(unit(g)),
                Setting::TopK => sampling.top_k = Some(g.below(1000)),
                Setting::Stop => {
                    sampling.stop = (0..1 + g.below(4)).map(|_| g.pick(STOPS).to_owned()).collect()
                }
                Setting::Seed if api == Api::Gemini => {
                    sampling.seed = Some(g.next() as i32 as i64);
                }
                Setting::Seed => sampling.seed = Some(g.next() as i64),
                Setting::PresencePenalty => sampling.presence_penalty = Some(unit(g) * 4.0 - 2.0),
                Setting::FrequencyPenalty => sampling.frequency_penalty = Some(unit(g) * 4.0 - 2.0),
                _ => {}
            }
        }
    }
    sampling
}

fn at<'a>(body: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(body, |value, key| value.get(*key))
}

fn body_of(outcome: RenderOutcome, what: &str) -> (Vec<u8>, Value) {
    match outcome {
        RenderOutcome::Rendered(rendered) => {
            let value = serde_json::from_slice(&rendered.body).unwrap();
            (rendered.body, value)
        }
        other => panic!("{what}: {other:?}"),
    }
}

#[test]
fn every_adapter_writes_every_setting_its_api_takes_in_the_apis_own_field() {
    let conversation = load("multi_round");
    for adapter in AdapterId::ALL {
        let api = adapter.api();
        let sampling = full_sampling(api);
        let (_, body) = body_of(
            render_sampled(&conversation, adapter, &sampling),
            adapter.as_str(),
        );
        let (_, plain) = body_of(render_for(&conversation, adapter), adapter.as_str());
        let mut written = 0;
        for (setting, value) in full_values() {
            let Some(path) = place(api, setting) else {
                continue;
            };
            assert_eq!(at(&body, path), Some(&value), "{adapter} {setting} at {path:?}");
            assert_eq!(at(&plain, path), None, "{adapter} {setting} without settings");
            written += 1;
        }
        // Nothing else changed: taking the settings out gives the body without settings.
        let mut stripped = body.clone();
        for setting in Setting::ALL {
            if let Some((last, parent)) = place(api, setting).and_then(|path| path.split_last()) {
                let parent = parent
                    .iter()
                    .fold(&mut stripped, |value, key| value.get_mut(*key).unwrap());
                parent.as_object_mut().unwrap().remove(*last);
            }
        }
        assert_eq!(stripped, plain, "{adapter}");
        let expected_count = match api {
            Api::OpenaiChat => 6,
            Api::OpenaiResponses => 2,
            Api::AnthropicMessages => 4,
            Api::Gemini => 7,
        };
        assert_eq!(written, expected_count, "{adapter}");
    }
}

#[test]
fn the_bodies_with_every_setting_are_pinned_per_adapter() {
    let conversation = load("consecutive_user");
    for adapter in AdapterId::ALL {
        let RenderOutcome::Rendered(rendered) =
            render_sampled(&conversation, adapter, &full_sampling(adapter.api()))
        else {
            panic!("{adapter} renders");
        };
        let slug = adapter.as_str().replace('@', "_v").replace('-', "_");
        insta::assert_snapshot!(
            format!("sampling__{slug}"),
            format!(
                "policy: {}\nbody:\n{}\n",
                serde_json::to_string(&rendered.policy).unwrap(),
                reindent(&rendered.body)
            )
        );
    }
}

#[test]
fn a_setting_the_target_api_has_no_field_for_is_refused_by_name_and_never_left_out() {
    let conversation = load("multi_round");
    let mut refusals = 0;
    for adapter in AdapterId::ALL {
        let api = adapter.api();
        for (setting, value) in full_values() {
            let mut sampling = Sampling::default();
            set(&mut sampling, setting, &value);
            let outcome = render_sampled(&conversation, adapter, &sampling);
            if place(api, setting).is_some() {
                assert!(
                    matches!(outcome, RenderOutcome::Rendered(_)),
                    "{adapter} {setting}: {outcome:?}"
                );
                continue;
            }
            refusals += 1;
            let RenderOutcome::Refused(error) = outcome else {
                panic!("{adapter} {setting}: {outcome:?}");
            };
            assert_eq!(
                (error.code(), error.setting()),
                ("unsupported_setting", setting),
                "{adapter}"
            );
            assert_eq!(error, SamplingError::Unsupported { setting, api });
            // prepare refuses it too, before anything renders.
            match prepared(&conversation, adapter, &sampling) {
                Err(error) => assert_eq!(error.code(), "unsupported_setting"),
                Ok(outcome) => panic!("{adapter} {setting}: prepared {outcome:?}"),
            }
        }
    }
    // Chat: top_k (×2 versions); Responses: top_k, stop, seed, both penalties; Anthropic: seed,
    // both penalties (×2 versions).
    assert_eq!(refusals, 2 + 5 + 6);
}

#[test]
fn values_outside_the_documented_ranges_are_refused_and_never_clamped() {
    let conversation = load("consecutive_user");
    let over_budget_stops = |count: usize| json!((0..count).map(|i| format!("s{i}")).collect::<Vec<_>>());
    let refused: Vec<(AdapterId, Setting, Value, &str)> = vec![
        (
            AdapterId::AnthropicMessagesV1,
            Setting::Temperature,
            json!(1.5),
            "setting_out_of_range",
        ),
        (
            AdapterId::AnthropicMessagesV2,
            Setting::Temperature,
            json!(-0.1),
            "setting_out_of_range",
        ),
        (
            AdapterId::OpenaiChatV1,
            Setting::Temperature,
            json!(2.01),
            "setting_out_of_range",
        ),
        (
            AdapterId::OpenaiResponsesV1,
            Setting::Temperature,
            json!(3),
            "setting_out_of_range",
        ),
        (
            AdapterId::GeminiV1,
            Setting::Temperature,
            json!(2.5),
            "setting_out_of_range",
        ),
        (
            AdapterId::OpenaiChatV2,
            Setting::TopP,
            json!(1.5),
            "setting_out_of_range",
        ),
        (
            AdapterId::AnthropicMessagesV1,
            Setting::TopP,
            json!(-0.5),
            "setting_out_of_range",
        ),
        (
            AdapterId::OpenaiChatV1,
            Setting::PresencePenalty,
            json!(-2.5),
            "setting_out_of_range",
        ),
        (
            AdapterId::OpenaiChatV1,
            Setting::FrequencyPenalty,
            json!(2.5),
            "setting_out_of_range",
        ),
        (
            AdapterId::OpenaiChatV1,
            Setting::Stop,
            over_budget_stops(5),
            "setting_out_of_range",
        ),
        (
            AdapterId::GeminiV1,
            Setting::Stop,
            over_budget_stops(6),
            "setting_out_of_range",
        ),
        (
            AdapterId::GeminiV1,
            Setting::Seed,
            json!(2_147_483_648i64),
            "setting_out_of_range",
        ),
        (
            AdapterId::GeminiV1,
            Setting::Seed,
            json!(-2_147_483_649i64),
            "setting_out_of_range",
        ),
        (
            AdapterId::GeminiV1,
            Setting::TopK,
            json!(2_147_483_648u64),
            "setting_out_of_range",
        ),
    ];
    for (adapter, setting, value, code) in refused {
        let mut sampling = Sampling::default();
        set(&mut sampling, setting, &value);
        match render_sampled(&conversation, adapter, &sampling) {
            RenderOutcome::Refused(error) => {
                assert_eq!(
                    (error.code(), error.setting()),
                    (code, setting),
                    "{adapter} {value}"
                )
            }
            other => panic!("{adapter} {setting} {value}: {other:?}"),
        }
    }
    // The bounds themselves are legal and go out as given.
    let accepted: Vec<(AdapterId, Setting, Value)> = vec![
        (AdapterId::AnthropicMessagesV1, Setting::Temperature, json!(1)),
        (AdapterId::AnthropicMessagesV1, Setting::Temperature, json!(0)),
        (AdapterId::OpenaiChatV1, Setting::Temperature, json!(2)),
        (AdapterId::OpenaiResponsesV1, Setting::TopP, json!(1)),
        (AdapterId::OpenaiChatV1, Setting::PresencePenalty, json!(-2)),
        (AdapterId::OpenaiChatV1, Setting::Stop, over_budget_stops(4)),
        (AdapterId::GeminiV1, Setting::Stop, over_budget_stops(5)),
        (AdapterId::GeminiV1, Setting::Seed, json!(i32::MIN)),
        (AdapterId::GeminiV1, Setting::Seed, json!(i32::MAX)),
        (AdapterId::GeminiV1, Setting::PresencePenalty, json!(-7.5)),
        (AdapterId::AnthropicMessagesV2, Setting::TopK, json!(0)),
        (AdapterId::OpenaiChatV2, Setting::Seed, json!(i64::MIN)),
        (AdapterId::OpenaiChatV2, Setting::Seed, json!(i64::MAX)),
    ];
    for (adapter, setting, value) in accepted {
        let mut sampling = Sampling::default();
        set(&mut sampling, setting, &value);
        let (_, body) = body_of(
            render_sampled(&conversation, adapter, &sampling),
            &format!("{adapter} {setting} {value}"),
        );
        let path = place(adapter.api(), setting).unwrap();
        assert_eq!(at(&body, path), Some(&value), "{adapter} {setting}");
    }
}

#[test]
fn a_float_that_is_not_finite_is_refused_for_every_api() {
    let conversation = load("consecutive_user");
    for adapter in AdapterId::ALL {
        for number in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let sampling = Sampling {
                temperature: Some(number),
                ..Sampling::default()
            };
            match render_sampled(&conversation, adapter, &sampling) {
                RenderOutcome::Refused(error) => assert_eq!(
                    (error.code(), error.setting()),
                    ("setting_out_of_range", Setting::Temperature)
                ),
                other => panic!("{adapter} {number}: {other:?}"),
            }
        }
    }
}

#[test]
fn numbers_go_out_exactly_in_their_shortest_form() {
    let conversation = load("consecutive_user");
    let text = |adapter: AdapterId, sampling: Sampling| {
        let (bytes, _) = body_of(
            render_sampled(&conversation, adapter, &sampling),
            adapter.as_str(),
        );
        String::from_utf8(bytes).unwrap()
    };
    let chat = text(
        AdapterId::OpenaiChatV2,
        Sampling {
            temperature: Some(1.0),
            top_p: Some(0.1),
            seed: Some(9_007_199_254_740_993),
            presence_penalty: Some(-0.0),
            frequency_penalty: Some(1e-7),
            stop: vec!["\"quoted\"\n".into()],
            ..Sampling::default()
        },
    );
    assert!(
        chat.contains(r#","temperature":1,"top_p":0.1,"stop":["\"quoted\"\n"],"seed":9007199254740993,"presence_penalty":0,"frequency_penalty":1e-7,"stream":true"#),
        "{chat}"
    );
    let gemini = text(
        AdapterId::GeminiV1,
        Sampling {
            temperature: Some(0.0),
            top_k: Some(40),
            ..Sampling::default()
        },
    );
    assert!(
        gemini.ends_with(r#""generationConfig":{"maxOutputTokens":1024,"temperature":0,"topK":40}}"#),
        "{gemini}"
    );
}

#[test]
fn nothing_set_renders_the_bytes_and_policy_of_a_request_without_settings() {
    for name in SCENARIOS {
        let conversation = load(name);
        for adapter in AdapterId::ALL {
            let plain = render_for(&conversation, adapter);
            assert_eq!(
                render_sampled(&conversation, adapter, &Sampling::default()),
                plain,
                "{name} × {adapter}"
            );
            let RenderOutcome::Rendered(plain) = plain else {
                continue;
            };
            let policy = serde_json::to_value(&plain.policy).unwrap();
            assert!(policy.get("sampling").is_none(), "{name} × {adapter}: {policy}");
            let RenderOutcome::Rendered(sampled) =
                render_sampled(&conversation, adapter, &full_sampling(adapter.api()))
            else {
                panic!("{name} × {adapter} renders with settings");
            };
            let policy = serde_json::to_value(&sampled.policy).unwrap();
            assert_eq!(
                policy["sampling"],
                serde_json::to_value(full_sampling(adapter.api())).unwrap(),
                "{name} × {adapter}"
            );
            assert_ne!(sampled.policy.digest(), plain.policy.digest());
            // Settings are not prompt tokens.
            assert_eq!(sampled.prompt_tokens, plain.prompt_tokens, "{name} × {adapter}");
        }
    }
}

fn prepared(
    conversation: &Conversation,
    adapter: AdapterId,
    sampling: &Sampling,
) -> Result<PrepareOutcome, SamplingError> {
    let validated = Validated::new(conversation).unwrap();
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).unwrap();
    let request = PrepareRequest {
        operation_id: "op-sampling".into(),
        adapter,
        provider: None,
        model: crate::render_support::model_for(adapter).into(),
        max_output_tokens: Some(512),
        stream: true,
        background: false,
        text_content: Default::default(),
    };
    prepare_with_sampling(
        graph,
        &request,
        sampling,
        &Catalog::builtin(),
        &mut RenderCache::new(),
    )
}

#[test]
fn prepare_pins_the_settings_in_the_policy_digest_of_the_manifest() {
    let conversation = load("multi_round");
    for adapter in AdapterId::ALL {
        let manifest = |sampling: &Sampling| match prepared(&conversation, adapter, sampling) {
            Ok(PrepareOutcome::Prepared(prepared)) => {
                assert_eq!(prepared.rendered.policy.sampling, *sampling);
                assert_eq!(
                    prepared.manifest.body.policy_digest,
                    prepared.rendered.policy.digest()
                );
                prepared.manifest
            }
            other => panic!("{adapter}: {other:?}"),
        };
        let plain = manifest(&Sampling::default());
        let zero = manifest(&Sampling {
            temperature: Some(0.0),
            ..Sampling::default()
        });
        let half = manifest(&Sampling {
            temperature: Some(0.5),
            ..Sampling::default()
        });
        assert_ne!(plain.body.policy_digest, zero.body.policy_digest, "{adapter}");
        assert_ne!(zero.body.policy_digest, half.body.policy_digest, "{adapter}");
        assert_ne!(zero.body.request_digest, half.body.request_digest, "{adapter}");
        // Without settings, prepare_with_sampling is prepare.
        let validated = Validated::new(&conversation).unwrap();
        let sequence = MessageSequence::build(validated);
        let graph = Graph::new(validated, &sequence).unwrap();
        let request = PrepareRequest {
            operation_id: "op-sampling".into(),
            adapter,
            provider: None,
            model: crate::render_support::model_for(adapter).into(),
            max_output_tokens: Some(512),
            stream: true,
            background: false,
            text_content: Default::default(),
        };
        let PrepareOutcome::Prepared(same) =
            turnstile_adapters::prepare(graph, &request, &Catalog::builtin(), &mut RenderCache::new())
        else {
            panic!("{adapter} prepares");
        };
        assert_eq!(same.manifest, plain, "{adapter}");
    }
}

#[test]
fn a_refused_setting_is_refused_even_for_a_graph_that_would_pause() {
    // The request is wrong whatever the graph: `document` pauses on anthropic-messages@1, yet
    // a seed is refused first.
    let conversation = load("documents");
    let sampling = Sampling {
        seed: Some(7),
        ..Sampling::default()
    };
    assert!(matches!(
        render_for(&conversation, AdapterId::AnthropicMessagesV1),
        RenderOutcome::Paused(_)
    ));
    match prepared(&conversation, AdapterId::AnthropicMessagesV1, &sampling) {
        Err(error) => assert_eq!(
            (error.code(), error.setting()),
            ("unsupported_setting", Setting::Seed)
        ),
        Ok(outcome) => panic!("{outcome:?}"),
    }
}

#[test]
fn sampling_equality_is_an_equivalence_even_for_nan() {
    let nan = Sampling {
        temperature: Some(f64::NAN),
        ..Sampling::default()
    };
    assert_eq!(nan, nan.clone());
    let negative_zero = Sampling {
        temperature: Some(-0.0),
        ..Sampling::default()
    };
    let zero = Sampling {
        temperature: Some(0.0),
        ..Sampling::default()
    };
    assert_eq!(negative_zero, zero);
    assert_ne!(zero, nan);
    assert!(Sampling::default().is_unset());
    assert!(!zero.is_unset());
}

#[test]
fn the_dispatch_body_form_reads_every_setting_and_refuses_unknown_ones() {
    let sampling: Sampling = serde_json::from_value(json!({
        "temperature": 0, "top_p": 0.9, "top_k": 5, "stop": ["x"], "seed": -3,
        "presence_penalty": 1.5, "frequency_penalty": -1
    }))
    .unwrap();
    assert_eq!(
        sampling,
        Sampling {
            temperature: Some(0.0),
            top_p: Some(0.9),
            top_k: Some(5),
            stop: vec!["x".into()],
            seed: Some(-3),
            presence_penalty: Some(1.5),
            frequency_penalty: Some(-1.0),
        }
    );
    assert_eq!(
        serde_json::from_value::<Sampling>(json!({})).unwrap(),
        Sampling::default()
    );
    assert!(serde_json::from_value::<Sampling>(json!({"temprature": 0})).is_err());
    assert!(serde_json::from_value::<Sampling>(json!({"top_k": -1})).is_err());
}
