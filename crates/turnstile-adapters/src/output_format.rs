//! Structured output as one provider-neutral value, [`OutputFormat`], and the one table of how
//! each API spells it (the shape of `sampling.rs` and `tool_choice.rs`).
//!
//! What this module owns and why:
//! - [`OutputFormat`]: what the client asked the answer to look like. It travels from an
//!   importer ([`crate::import::Imported::output_format`], read by [`read`]) or the gateway's
//!   `/dispatch` body (`output_format`) to the renderer, and the render policy records it (so
//!   `policy_digest` pins it).
//! - [`OutputFormat::check`]: a format the target API cannot spell is refused with
//!   [`OutputFormatError`] naming the field `output_format`; never dropped, never turned into
//!   an instruction in the prompt.
//! - [`OutputFormat::write`]: the renderers' one way to write it. Schemas are values we do not
//!   own, written in RFC 8785 form.
//!
//! The table (`—` is refused):
//!
//! | neutral | OpenAI Chat `response_format` | OpenAI Responses `text.format` | Anthropic Messages | Gemini `generationConfig` |
//! | --- | --- | --- | --- | --- |
//! | text | `{type: text}` | `{type: text}` | — | `responseMimeType: text/plain` |
//! | json_object | `{type: json_object}` | `{type: json_object}` | — | `responseMimeType: application/json` |
//! | json_schema | `{type: json_schema, json_schema: {name, description?, schema, strict?}}` | `{type: json_schema, name, description?, schema, strict?}` | — | `responseMimeType: application/json`, `responseJsonSchema` (no name, description or strict) |
//! | gemini | — | — | — | `responseMimeType`, `responseSchema` / `responseJsonSchema` as given |
//!
//! Sources: `ResponseFormatJsonSchema` (`shared/fixtures/openapi/openai-openapi.yaml`),
//! `TextResponseFormatConfiguration` (Responses `text.format`); Gemini `GenerationConfig`
//! (<https://ai.google.dev/api/generate-content#generationconfig>: `responseMimeType`
//! `text/plain` (default), `application/json`, `text/x.enum`; `responseSchema` is Google's
//! OpenAPI subset, `responseJsonSchema` JSON Schema). Anthropic Messages at the version the
//! adapters target (`anthropic-version: 2023-06-01`, no beta header) has no structured-output
//! field, so every format is refused towards it (and an Anthropic request carrying the beta
//! `output_format` is `unrepresentable` on import).
//!
//! Crossing to Gemini, a JSON schema keeps its schema; `name` (an identifier OpenAI requires) is
//! not written, and a `description` (which the model reads) or `strict: false` (Gemini always
//! constrains decoding to the schema) is refused. Crossing from Gemini, a JSON schema gets the
//! name `response` (OpenAI requires one; it names the format, it does not constrain it).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - structured output is carried with the same meaning or refused by name, never dropped or turned
//!   into a prompt. Enforced in `adapters/src/output_format.rs` (`OutputFormat::check`, `fields`,
//!   `read`). Tests: `adapters/tests/it/render_output_format.rs` (independent table, import round
//!   trip, OpenAPI), `gateway/tests/it/proxy.rs::structured_output_reaches_the_provider…`.

use crate::import::{ImportError, Obj, type_name};
use crate::registry::Api;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The name written for a JSON schema that arrived without one (from Gemini).
pub const DEFAULT_SCHEMA_NAME: &str = "response";

/// Most bytes of a schema (its JSON text); the body limits already bound it, this names it.
pub const SCHEMA_BYTES_MAX: usize = 256 * 1024;

/// What the answer must look like, in neutral names. `None` in [`OutputFormat::format`] is the
/// API's default (free text).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OutputFormat {
    /// The format asked for.
    pub format: Option<Format>,
}

/// One structured-output request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
#[non_exhaustive]
pub enum Format {
    /// Plain text, asked for explicitly.
    Text,
    /// Any JSON object ("JSON mode").
    JsonObject,
    /// JSON valid against a JSON Schema.
    JsonSchema {
        /// OpenAI's name of the format (required there; None when the client's API has none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// OpenAI's description of the format (the model reads it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        /// The JSON Schema.
        schema: Value,
        /// OpenAI's strict mode.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
    /// Gemini's own spelling, kept as given (Google's schema dialect, `text/x.enum`): Gemini only.
    Gemini {
        /// `responseMimeType`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mime_type: Option<String>,
        /// `responseSchema` (Google's OpenAPI subset).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        response_schema: Option<Value>,
        /// `responseJsonSchema`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        response_json_schema: Option<Value>,
    },
}

/// Why a target API cannot take a request's output format. Tests assert
/// [`OutputFormatError::code`], never the message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OutputFormatError {
    /// The API cannot spell this format (or this part of it: `what`). Code
    /// `unsupported_setting`.
    #[error("{api} cannot take the output_format {kind} ({what})", api = api.as_str())]
    Unsupported {
        /// The kind asked for (`json_schema`, …).
        kind: &'static str,
        /// The API.
        api: Api,
        /// What cannot be spelt.
        what: &'static str,
    },
}

impl OutputFormatError {
    /// The machine-readable code: `unsupported_setting`.
    pub fn code(&self) -> &'static str {
        "unsupported_setting"
    }

    /// The neutral field concerned: always `output_format`.
    pub fn field(&self) -> &'static str {
        "output_format"
    }
}

impl Format {
    /// The neutral kind name.
    pub fn kind(&self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::JsonObject => "json_object",
            Format::JsonSchema { .. } => "json_schema",
            Format::Gemini { .. } => "gemini",
        }
    }
}

impl OutputFormat {
    /// Whether nothing is set.
    pub fn is_unset(&self) -> bool {
        self.format.is_none()
    }

    /// Check against `api` (the table of the module doc).
    pub fn check(&self, api: Api) -> Result<(), OutputFormatError> {
        let Some(format) = &self.format else {
            return Ok(());
        };
        let refuse = |what: &'static str| {
            Err(OutputFormatError::Unsupported {
                kind: format.kind(),
                api,
                what,
            })
        };
        match (api, format) {
            (Api::AnthropicMessages, _) => refuse("Anthropic Messages has no structured-output field"),
            (Api::OpenaiChat | Api::OpenaiResponses, Format::Gemini { .. }) => {
                refuse("Google's own schema spelling")
            }
            (
                Api::Gemini,
                Format::JsonSchema {
                    description: Some(_), ..
                },
            ) => refuse("Gemini has no description of the format"),
            (
                Api::Gemini,
                Format::JsonSchema {
                    strict: Some(false), ..
                },
            ) => refuse("Gemini always constrains the answer to the schema"),
            _ => Ok(()),
        }
    }

    /// The fields written for `api`: top-level `(name, value)` pairs for OpenAI, fields of
    /// `generationConfig` for Gemini. Callers check first.
    pub fn fields(&self, api: Api) -> Vec<(&'static str, Value)> {
        let Some(format) = &self.format else {
            return Vec::new();
        };
        match (api, format) {
            (Api::OpenaiChat | Api::OpenaiResponses, Format::Text) => openai(api, json!({"type": "text"})),
            (Api::OpenaiChat | Api::OpenaiResponses, Format::JsonObject) => {
                openai(api, json!({"type": "json_object"}))
            }
            (
                Api::OpenaiChat | Api::OpenaiResponses,
                Format::JsonSchema {
                    name,
                    description,
                    schema,
                    strict,
                },
            ) => {
                let mut inner =
                    json!({"name": name.as_deref().unwrap_or(DEFAULT_SCHEMA_NAME), "schema": schema});
                if let Some(description) = description {
                    inner["description"] = json!(description);
                }
                if let Some(strict) = strict {
                    inner["strict"] = json!(strict);
                }
                match api {
                    Api::OpenaiChat => openai(api, json!({"type": "json_schema", "json_schema": inner})),
                    _ => {
                        inner["type"] = json!("json_schema");
                        openai(api, inner)
                    }
                }
            }
            (Api::Gemini, Format::Text) => vec![("responseMimeType", json!("text/plain"))],
            (Api::Gemini, Format::JsonObject) => vec![("responseMimeType", json!("application/json"))],
            (Api::Gemini, Format::JsonSchema { schema, .. }) => vec![
                ("responseMimeType", json!("application/json")),
                ("responseJsonSchema", schema.clone()),
            ],
            (
                Api::Gemini,
                Format::Gemini {
                    mime_type,
                    response_schema,
                    response_json_schema,
                },
            ) => {
                let mut fields = Vec::new();
                if let Some(mime_type) = mime_type {
                    fields.push(("responseMimeType", json!(mime_type)));
                }
                if let Some(schema) = response_schema {
                    fields.push(("responseSchema", schema.clone()));
                }
                if let Some(schema) = response_json_schema {
                    fields.push(("responseJsonSchema", schema.clone()));
                }
                fields
            }
            _ => Vec::new(),
        }
    }

    /// Append `,"<field>":<value>` for every field, in RFC 8785 form; the text written (for
    /// the caller's token count).
    pub(crate) fn write(&self, api: Api, out: &mut Vec<u8>) -> String {
        let start = out.len();
        for (name, value) in self.fields(api) {
            out.push(b',');
            crate::render::push_json_string(out, name);
            out.push(b':');
            out.extend_from_slice(&turnstile_core::digest::canonical_bytes(&value));
        }
        String::from_utf8_lossy(&out[start..]).into_owned()
    }
}

fn openai(api: Api, format: Value) -> Vec<(&'static str, Value)> {
    match api {
        Api::OpenaiChat => vec![("response_format", format)],
        _ => vec![("text", json!({"format": format}))],
    }
}

// ---------------------------------------------------------------------------------------------
// Reading a request.

fn schema_value(object: &mut Obj, key: &str, required: bool) -> Result<Option<Value>, ImportError> {
    let value = match object.take(key) {
        None if required => {
            return Err(ImportError::malformed(
                object.path_of(key),
                "required field is missing",
            ));
        }
        None => return Ok(None),
        Some(value @ Value::Object(_)) => value,
        Some(other) => {
            return Err(ImportError::malformed(
                object.path_of(key),
                format!("expected an object, found {}", type_name(&other)),
            ));
        }
    };
    let bytes = value.to_string().len();
    if bytes > SCHEMA_BYTES_MAX {
        return Err(ImportError::Limit {
            path: object.path_of(key),
            what: "SCHEMA_BYTES_MAX",
            actual: bytes,
            max: SCHEMA_BYTES_MAX,
        });
    }
    Ok(Some(value))
}

fn no_more(object: Obj) -> Result<(), ImportError> {
    match object.keys().first() {
        None => Ok(()),
        Some(key) => Err(ImportError::malformed(object.path_of(key), "unknown field")),
    }
}

/// An OpenAI format object: Chat nests the schema under `json_schema`, Responses does not.
fn read_openai(api: Api, mut object: Obj) -> Result<Format, ImportError> {
    let kind = object.required_string("type")?;
    let format = match kind.as_str() {
        "text" => Format::Text,
        "json_object" => Format::JsonObject,
        "json_schema" => {
            let mut nested = match api {
                Api::OpenaiChat => Some(object.required_object("json_schema")?),
                _ => None,
            };
            let inner = nested.as_mut().unwrap_or(&mut object);
            let name = inner.required_string("name")?;
            let description = inner.string("description")?;
            let strict = inner.bool("strict")?;
            // Chat documents `schema` as optional; without one v1 has no schema to carry.
            let Some(schema) = schema_value(inner, "schema", false)? else {
                return Err(ImportError::unrepresentable(
                    inner.path_of("schema"),
                    "a json_schema format without a schema",
                ));
            };
            if let Some(nested) = nested {
                no_more(nested)?;
            }
            Format::JsonSchema {
                name: Some(name),
                description,
                schema,
                strict,
            }
        }
        other => {
            return Err(ImportError::unrepresentable(
                object.path_of("type"),
                format!("an output format of type {other:?}"),
            ));
        }
    };
    no_more(object)?;
    Ok(format)
}

/// Read the output format of `api` from a request being imported. For Gemini, `config` is
/// `generationConfig` (already camel-cased); for the others, `top` is the body.
pub(crate) fn read(api: Api, top: &mut Obj) -> Result<OutputFormat, ImportError> {
    let format = match api {
        Api::OpenaiChat => match top.object("response_format")? {
            None => None,
            Some(object) => Some(read_openai(api, object)?),
        },
        Api::OpenaiResponses => match top.object("text")? {
            None => None,
            Some(mut text) => {
                let format = match text.object("format")? {
                    None => None,
                    Some(object) => Some(read_openai(api, object)?),
                };
                if text.has("verbosity") {
                    return Err(ImportError::unrepresentable(
                        text.path_of("verbosity"),
                        "text.verbosity is not carried yet",
                    ));
                }
                no_more(text)?;
                format
            }
        },
        Api::AnthropicMessages => {
            top.refuse(
                "output_format",
                "structured output (a beta of Anthropic Messages the adapters do not target)",
            )?;
            None
        }
        Api::Gemini => read_gemini(top)?,
    };
    Ok(OutputFormat { format })
}

fn read_gemini(config: &mut Obj) -> Result<Option<Format>, ImportError> {
    let mime_type = config.string("responseMimeType")?;
    let response_schema = schema_value(config, "responseSchema", false)?;
    let response_json_schema = schema_value(config, "responseJsonSchema", false)?;
    Ok(
        match (mime_type.as_deref(), &response_schema, &response_json_schema) {
            (None, None, None) => None,
            (Some("text/plain"), None, None) => Some(Format::Text),
            (Some("application/json"), None, None) => Some(Format::JsonObject),
            (Some("application/json"), None, Some(_)) => Some(Format::JsonSchema {
                name: None,
                description: None,
                schema: response_json_schema.unwrap_or(Value::Null),
                strict: None,
            }),
            _ => Some(Format::Gemini {
                mime_type,
                response_schema,
                response_json_schema,
            }),
        },
    )
}
