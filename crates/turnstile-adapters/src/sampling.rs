//! Generation settings (temperature, nucleus and top-k sampling, stop sequences, seed, penalties)
//! as one provider-neutral value, [`Sampling`], and the one table of where each API takes each
//! setting and which values it documents as legal.
//!
//! What this module owns and why:
//! - [`Sampling`]: what the client asked for, in neutral names. It travels from an importer
//!   ([`crate::import::Imported::sampling`]) or the gateway's `/dispatch` body to the renderer,
//!   and it is recorded in the render policy (so the manifest's `policy_digest` pins it).
//! - [`Sampling::check`]: a setting the target API has no field for is refused with
//!   [`SamplingError::Unsupported`]; a value outside the range the API documents is refused with
//!   [`SamplingError::OutOfRange`] or [`SamplingError::TooMany`]. Nothing is ever left out,
//!   clamped or rescaled: a request asking for `seed` goes to an API with a seed or nowhere, and
//!   a temperature is sent as given (OpenAI's 0–2 and Anthropic's 0–1 are not rescaled onto each
//!   other; a value legal for both passes unchanged, any other is refused).
//! - [`Sampling::write_fields`]: the renderers' one way to write the settings, in the API's own
//!   field names and in the order of its table below. Floats are written in RFC 8785 form (as
//!   every value we do not own), integers as exact decimal text (a seed beyond 2^53 is kept).
//!
//! The per-API tables (field names and documented ranges):
//! - OpenAI Chat (`CreateChatCompletionRequest`, `shared/fixtures/openapi/openai-openapi.yaml`
//!   l.33105, and `ModelResponseProperties` l.44539; <https://platform.openai.com/docs/api-reference/chat/create>):
//!   `temperature` 0–2, `top_p` 0–1, `stop` (`StopConfiguration`: up to 4), `seed` (the spec's
//!   bounds are the i64 range), `presence_penalty` and `frequency_penalty` −2–2. No top-k.
//! - OpenAI Responses (`CreateResponse` l.36274 via `ModelResponseProperties`;
//!   <https://platform.openai.com/docs/api-reference/responses/create>): `temperature` 0–2,
//!   `top_p` 0–1. No stop sequences, seed, penalties or top-k.
//! - Anthropic Messages (<https://platform.claude.com/docs/en/api/messages>): `temperature` 0–1
//!   ("Ranges from `0.0` to `1.0`", minimum 0, maximum 1), `top_p` 0–1, `top_k` minimum 0,
//!   `stop_sequences` (no documented count). No seed, no penalties.
//! - Gemini (`GenerationConfig`, <https://ai.google.dev/api/generate-content#generationconfig>):
//!   `temperature` 0.0–2.0 ("Values can range from [0.0, 2.0]"), `topP` (a cumulative
//!   probability, 0–1), `topK` and `seed` (proto `int32`: Google's REST reference shows them as
//!   `integer`, where 64-bit fields are strings), `stopSequences` ("up to 5"),
//!   `presencePenalty`, `frequencyPenalty` (no documented range). All inside `generationConfig`.
//!
//! Not carried, on purpose (they stay in `Imported::dropped`): `logit_bias` (token ids of one
//! tokenizer), `logprobs` / `top_logprobs` (they shape the response, which v1 turns do not
//! hold), `response_format` / `text.format` / `responseSchema` (structured output, not
//! sampling), reasoning effort and thinking budgets (scales that do not map onto each other).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a generation setting the target API cannot take, or out of its range, is refused by name —
//!   never dropped, clamped or rescaled. Enforced in `adapters/src/sampling.rs`
//!   (`Sampling::check`), `prepare_with_sampling`. Tests: `adapters/tests/it/render_sampling.rs`,
//!   `render_openapi.rs`, `gateway/tests/it/proxy.rs::generation_settings_reach_the_provider…`.

use crate::registry::Api;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Generation settings of one request, in provider-neutral names. `Default` is "nothing set",
/// which renders exactly the bytes of a request without settings.
///
/// Equality compares floats by value, and by bit pattern when either is NaN, so it is an
/// equivalence (what `Eq` promises) for every value, including the NaN [`Sampling::check`]
/// refuses.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Sampling {
    /// Sampling temperature.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus sampling: the cumulative probability mass considered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Top-k sampling: how many of the most likely tokens are considered (Anthropic, Gemini).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u64>,
    /// Stop sequences, in order (empty: none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// Seed for best-effort deterministic sampling (OpenAI Chat, Gemini).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Presence penalty (OpenAI Chat, Gemini).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    /// Frequency penalty (OpenAI Chat, Gemini).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
}

/// One generation setting, by its neutral name (the field of [`Sampling`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Setting {
    /// [`Sampling::temperature`].
    Temperature,
    /// [`Sampling::top_p`].
    TopP,
    /// [`Sampling::top_k`].
    TopK,
    /// [`Sampling::stop`].
    Stop,
    /// [`Sampling::seed`].
    Seed,
    /// [`Sampling::presence_penalty`].
    PresencePenalty,
    /// [`Sampling::frequency_penalty`].
    FrequencyPenalty,
}

impl Setting {
    /// Every setting, in the order [`Sampling::check`] looks at them.
    pub const ALL: [Setting; 7] = [
        Setting::Temperature,
        Setting::TopP,
        Setting::TopK,
        Setting::Stop,
        Setting::Seed,
        Setting::PresencePenalty,
        Setting::FrequencyPenalty,
    ];

    /// The neutral name, e.g. `top_p`.
    pub fn as_str(self) -> &'static str {
        match self {
            Setting::Temperature => "temperature",
            Setting::TopP => "top_p",
            Setting::TopK => "top_k",
            Setting::Stop => "stop",
            Setting::Seed => "seed",
            Setting::PresencePenalty => "presence_penalty",
            Setting::FrequencyPenalty => "frequency_penalty",
        }
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a target API cannot take a request's generation settings. Tests assert
/// [`SamplingError::code`] and [`SamplingError::setting`], never the message.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SamplingError {
    /// The API has no field for the setting. Refused rather than left out. Code
    /// `unsupported_setting`.
    #[error("{api} has no field for the generation setting {setting}", api = api.as_str())]
    Unsupported {
        /// The setting asked for.
        setting: Setting,
        /// The API that cannot take it.
        api: Api,
    },
    /// The value is outside the range the API documents (bounds inclusive). Refused rather than
    /// clamped. Code `setting_out_of_range`.
    #[error("{setting} is {value}; {api} takes {min} to {max}", api = api.as_str())]
    OutOfRange {
        /// The setting.
        setting: Setting,
        /// The API whose range it breaks.
        api: Api,
        /// The value asked for.
        value: f64,
        /// The smallest legal value.
        min: f64,
        /// The largest legal value.
        max: f64,
    },
    /// More stop sequences than the API takes. Code `setting_out_of_range`.
    #[error("{count} {setting} sequences; {api} takes at most {max}", api = api.as_str())]
    TooMany {
        /// The setting ([`Setting::Stop`]).
        setting: Setting,
        /// The API.
        api: Api,
        /// How many were asked for.
        count: usize,
        /// The most the API takes.
        max: usize,
    },
    /// A float that is NaN or infinite: no API takes one (and JSON cannot carry one). Code
    /// `setting_out_of_range`.
    #[error("{setting} is not a finite number")]
    NotFinite {
        /// The setting.
        setting: Setting,
    },
}

impl SamplingError {
    /// The machine-readable code: `unsupported_setting` or `setting_out_of_range`.
    pub fn code(&self) -> &'static str {
        match self {
            SamplingError::Unsupported { .. } => "unsupported_setting",
            SamplingError::OutOfRange { .. }
            | SamplingError::TooMany { .. }
            | SamplingError::NotFinite { .. } => "setting_out_of_range",
        }
    }

    /// The setting concerned.
    pub fn setting(&self) -> Setting {
        match self {
            SamplingError::Unsupported { setting, .. }
            | SamplingError::OutOfRange { setting, .. }
            | SamplingError::TooMany { setting, .. }
            | SamplingError::NotFinite { setting } => *setting,
        }
    }
}

/// What values an API documents for one setting.
#[derive(Clone, Copy, Debug)]
enum Range {
    /// A float in `[min, max]`.
    Float { min: f64, max: f64 },
    /// A float with no documented bounds (finite all the same).
    AnyFloat,
    /// An integer in `[min, max]`.
    Integer { min: i128, max: i128 },
    /// A list of at most `max` strings (`None`: no documented count).
    Items { max: Option<usize> },
}

/// Where one API takes one setting.
#[derive(Clone, Copy, Debug)]
struct Field {
    setting: Setting,
    /// The API's own field name (inside `generationConfig` for Gemini).
    name: &'static str,
    range: Range,
}

const INT32: Range = Range::Integer {
    min: i32::MIN as i128,
    max: i32::MAX as i128,
};

/// OpenAI Chat, in the order written (after the output cap).
const OPENAI_CHAT: &[Field] = &[
    Field {
        setting: Setting::Temperature,
        name: "temperature",
        range: Range::Float { min: 0.0, max: 2.0 },
    },
    Field {
        setting: Setting::TopP,
        name: "top_p",
        range: Range::Float { min: 0.0, max: 1.0 },
    },
    Field {
        setting: Setting::Stop,
        name: "stop",
        range: Range::Items { max: Some(4) },
    },
    Field {
        setting: Setting::Seed,
        name: "seed",
        range: Range::Integer {
            min: i64::MIN as i128,
            max: i64::MAX as i128,
        },
    },
    Field {
        setting: Setting::PresencePenalty,
        name: "presence_penalty",
        range: Range::Float { min: -2.0, max: 2.0 },
    },
    Field {
        setting: Setting::FrequencyPenalty,
        name: "frequency_penalty",
        range: Range::Float { min: -2.0, max: 2.0 },
    },
];

/// OpenAI Responses (after `max_output_tokens`).
const OPENAI_RESPONSES: &[Field] = &[
    Field {
        setting: Setting::Temperature,
        name: "temperature",
        range: Range::Float { min: 0.0, max: 2.0 },
    },
    Field {
        setting: Setting::TopP,
        name: "top_p",
        range: Range::Float { min: 0.0, max: 1.0 },
    },
];

/// Anthropic Messages (after `max_tokens`).
const ANTHROPIC_MESSAGES: &[Field] = &[
    Field {
        setting: Setting::Temperature,
        name: "temperature",
        range: Range::Float { min: 0.0, max: 1.0 },
    },
    Field {
        setting: Setting::TopP,
        name: "top_p",
        range: Range::Float { min: 0.0, max: 1.0 },
    },
    Field {
        setting: Setting::TopK,
        name: "top_k",
        range: Range::Integer {
            min: 0,
            max: u64::MAX as i128,
        },
    },
    Field {
        setting: Setting::Stop,
        name: "stop_sequences",
        range: Range::Items { max: None },
    },
];

/// Gemini, inside `generationConfig` (after `maxOutputTokens`).
const GEMINI: &[Field] = &[
    Field {
        setting: Setting::Temperature,
        name: "temperature",
        range: Range::Float { min: 0.0, max: 2.0 },
    },
    Field {
        setting: Setting::TopP,
        name: "topP",
        range: Range::Float { min: 0.0, max: 1.0 },
    },
    Field {
        setting: Setting::TopK,
        name: "topK",
        range: Range::Integer {
            min: 0,
            max: i32::MAX as i128,
        },
    },
    Field {
        setting: Setting::Stop,
        name: "stopSequences",
        range: Range::Items { max: Some(5) },
    },
    Field {
        setting: Setting::Seed,
        name: "seed",
        range: INT32,
    },
    Field {
        setting: Setting::PresencePenalty,
        name: "presencePenalty",
        range: Range::AnyFloat,
    },
    Field {
        setting: Setting::FrequencyPenalty,
        name: "frequencyPenalty",
        range: Range::AnyFloat,
    },
];

fn fields(api: Api) -> &'static [Field] {
    match api {
        Api::OpenaiChat => OPENAI_CHAT,
        Api::OpenaiResponses => OPENAI_RESPONSES,
        Api::AnthropicMessages => ANTHROPIC_MESSAGES,
        Api::Gemini => GEMINI,
    }
}

/// The API's own name of a setting (inside `generationConfig` for Gemini), or None when the API
/// has no field for it.
pub fn field_name(api: Api, setting: Setting) -> Option<&'static str> {
    fields(api)
        .iter()
        .find(|field| field.setting == setting)
        .map(|field| field.name)
}

/// The value of one setting, borrowed.
enum Value<'a> {
    Float(f64),
    Integer(i128),
    Items(&'a [String]),
}

/// Floats equal by value, or by bits when either is NaN (see [`Sampling`]).
fn same_float(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b || a.to_bits() == b.to_bits(),
        (None, None) => true,
        _ => false,
    }
}

impl PartialEq for Sampling {
    fn eq(&self, other: &Sampling) -> bool {
        same_float(self.temperature, other.temperature)
            && same_float(self.top_p, other.top_p)
            && self.top_k == other.top_k
            && self.stop == other.stop
            && self.seed == other.seed
            && same_float(self.presence_penalty, other.presence_penalty)
            && same_float(self.frequency_penalty, other.frequency_penalty)
    }
}

// An equivalence: reflexive even for NaN (same bits), symmetric, and transitive because two
// non-NaN floats compare by value and a NaN equals only its own bit pattern.
impl Eq for Sampling {}

impl Sampling {
    /// Whether nothing is set (the default): such a request renders without any setting.
    pub fn is_unset(&self) -> bool {
        *self == Sampling::default()
    }

    fn value(&self, setting: Setting) -> Option<Value<'_>> {
        match setting {
            Setting::Temperature => self.temperature.map(Value::Float),
            Setting::TopP => self.top_p.map(Value::Float),
            Setting::TopK => self.top_k.map(|k| Value::Integer(i128::from(k))),
            Setting::Stop => (!self.stop.is_empty()).then_some(Value::Items(&self.stop)),
            Setting::Seed => self.seed.map(|seed| Value::Integer(i128::from(seed))),
            Setting::PresencePenalty => self.presence_penalty.map(Value::Float),
            Setting::FrequencyPenalty => self.frequency_penalty.map(Value::Float),
        }
    }

    /// Check every set setting against `api`: the first one (in [`Setting::ALL`] order) the
    /// API has no field for, or whose value it does not document as legal, is the error.
    pub fn check(&self, api: Api) -> Result<(), SamplingError> {
        for setting in Setting::ALL {
            let Some(value) = self.value(setting) else {
                continue;
            };
            if let Value::Float(number) = value
                && !number.is_finite()
            {
                return Err(SamplingError::NotFinite { setting });
            }
            let Some(field) = fields(api).iter().find(|field| field.setting == setting) else {
                return Err(SamplingError::Unsupported { setting, api });
            };
            match (value, field.range) {
                (Value::Float(number), Range::Float { min, max }) if !(min..=max).contains(&number) => {
                    return Err(SamplingError::OutOfRange {
                        setting,
                        api,
                        value: number,
                        min,
                        max,
                    });
                }
                (Value::Integer(number), Range::Integer { min, max }) if !(min..=max).contains(&number) => {
                    return Err(SamplingError::OutOfRange {
                        setting,
                        api,
                        value: number as f64,
                        min: min as f64,
                        max: max as f64,
                    });
                }
                (Value::Items(items), Range::Items { max: Some(max) }) if items.len() > max => {
                    return Err(SamplingError::TooMany {
                        setting,
                        api,
                        count: items.len(),
                        max,
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Append `,"<field>":<value>` for every set setting, in `api`'s names and table order.
    /// Callers check first ([`Sampling::check`]); a setting the API has no field for is not
    /// written (unreachable after a passing check).
    pub(crate) fn write_fields(&self, api: Api, out: &mut Vec<u8>) {
        for field in fields(api) {
            let Some(value) = self.value(field.setting) else {
                continue;
            };
            out.push(b',');
            crate::render::push_json_string(out, field.name);
            out.push(b':');
            match value {
                Value::Float(number) => {
                    out.extend_from_slice(&turnstile_core::digest::canonical_bytes(&number))
                }
                Value::Integer(number) => out.extend_from_slice(number.to_string().as_bytes()),
                Value::Items(items) => {
                    out.push(b'[');
                    for (index, item) in items.iter().enumerate() {
                        if index > 0 {
                            out.push(b',');
                        }
                        crate::render::push_json_string(out, item);
                    }
                    out.push(b']');
                }
            }
        }
    }
}
