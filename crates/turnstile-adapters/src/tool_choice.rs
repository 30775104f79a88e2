//! Tool choice and parallel tool calls as one provider-neutral value, [`ToolChoice`], and the
//! one table of how each API spells each choice.
//!
//! What this module owns and why (the shape of `sampling.rs`):
//! - [`ToolChoice`]: what the client asked for, in neutral names. It travels from an importer
//!   ([`crate::import::Imported::tool_choice`], read by [`read`]) or the gateway's `/dispatch`
//!   body (`tool_choice`, `parallel_tool_calls`) to the renderer, and it is recorded in the
//!   render policy (so the manifest's `policy_digest` pins it, as it pins the sampling).
//! - [`ToolChoice::check`]: a choice the target API cannot spell is refused with
//!   [`ToolChoiceError::Unsupported`] naming the field (`tool_choice` or
//!   `parallel_tool_calls`); a choice naming a tool the request does not declare is
//!   [`ToolChoiceError::UnknownTool`]. Nothing is ever left out or approximated: "one of these
//!   two tools" goes to an API that can say it, or nowhere.
//! - [`ToolChoice::write_fields`]: the renderers' one way to write it, in the API's own fields.
//!   Values are written in RFC 8785 form (the order of keys inside the choice object is the
//!   canonical one, not the API documentation's).
//!
//! The table ([`Kind`] × API; `—` is refused):
//!
//! | kind | OpenAI Chat | OpenAI Responses | Anthropic Messages | Gemini `functionCallingConfig` |
//! | --- | --- | --- | --- | --- |
//! | auto | `"auto"` | `"auto"` | `{type: auto}` | `{mode: AUTO}` |
//! | none | `"none"` | `"none"` | `{type: none}` | `{mode: NONE}` |
//! | required | `"required"` | `"required"` | `{type: any}` | `{mode: ANY}` |
//! | tool (one named tool) | `{type: function, function: {name}}` | `{type: function, name}` | `{type: tool, name}` | `{mode: ANY, allowedFunctionNames: [name]}` |
//! | allowed, required | `{type: allowed_tools, allowed_tools: {mode: required, tools}}` | `{type: allowed_tools, mode: required, tools}` | — | `{mode: ANY, allowedFunctionNames}` |
//! | allowed, auto | `{type: allowed_tools, allowed_tools: {mode: auto, tools}}` | `{type: allowed_tools, mode: auto, tools}` | — | — (names only with ANY or VALIDATED) |
//! | validated | — | — | — | `{mode: VALIDATED, allowedFunctionNames?}` |
//! | parallel tool calls | `parallel_tool_calls` | `parallel_tool_calls` | `tool_choice.disable_parallel_tool_use` (negated) | — |
//!
//! Sources: `CreateChatCompletionRequest.tool_choice` (`ChatCompletionToolChoiceOption`,
//! `shared/fixtures/openapi/openai-openapi.yaml` l.31938) and `parallel_tool_calls`;
//! `CreateResponse.tool_choice` (`ToolChoiceParam` l.63644); Anthropic
//! <https://platform.claude.com/docs/en/api/messages> (`tool_choice`: auto, any, tool, none;
//! `disable_parallel_tool_use` on all but none); Gemini `ToolConfig.functionCallingConfig`
//! (<https://ai.google.dev/api/caching#FunctionCallingConfig>: `mode` AUTO, ANY, NONE,
//! VALIDATED; `allowedFunctionNames` "should only be set when the Mode is ANY or VALIDATED").
//! Meanings are identical where the table maps: Anthropic's `any` and Gemini's `ANY` are
//! OpenAI's `required` ("must call one or more tools"); a named tool is Gemini's ANY restricted
//! to that one name. Anthropic has no "one of these tools" and no parallel switch without a
//! choice type other than none; Gemini has no parallel switch at all.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a tool choice or parallel switch is carried with the same meaning or refused by name
//!   (`unsupported_setting` / `unknown_tool`), never dropped; same API renders back to the same
//!   value. Enforced in `adapters/src/tool_choice.rs` (`ToolChoice::check`, `fields`, `read`),
//!   `prepare_with_settings`. Tests: `adapters/tests/it/render_tool_choice.rs` (independent table,
//!   import round trip, OpenAPI),
//!   `gateway/tests/it/proxy.rs::tool_choice_crosses_apis_only_where_the_meaning_is_identical…`,
//!   `…reach_the_provider_of_the_same_api_exactly`.

use crate::import::{ImportError, Obj, type_name};
use crate::registry::Api;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::fmt;

/// Which tools the model may or must call, in neutral names (the native API's `tool_choice`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
#[non_exhaustive]
pub enum Choice {
    /// The model decides whether to call tools.
    Auto,
    /// The model calls no tool.
    None,
    /// The model must call one or more tools.
    Required,
    /// The model must call this one tool.
    Tool {
        /// The tool's name (declared in the request).
        name: String,
    },
    /// The model may (`auto`) or must (`required`) call tools from this subset only.
    Allowed {
        /// Whether calling is optional or required.
        mode: AllowedMode,
        /// The tools allowed, by name (declared in the request), in the client's order.
        tools: Vec<String>,
    },
    /// Gemini's VALIDATED mode: a function call or text, with calls checked against the
    /// declarations; optionally restricted to `tools`.
    Validated {
        /// The tools allowed (empty: every declared tool).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tools: Vec<String>,
    },
}

/// The mode of [`Choice::Allowed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllowedMode {
    /// The model may call one of the tools, or answer.
    Auto,
    /// The model must call one or more of the tools.
    Required,
}

/// One row of the table: the kind of a [`Choice`], or the parallel switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Kind {
    /// [`Choice::Auto`].
    Auto,
    /// [`Choice::None`].
    None,
    /// [`Choice::Required`].
    Required,
    /// [`Choice::Tool`].
    Tool,
    /// [`Choice::Allowed`] with [`AllowedMode::Required`].
    AllowedRequired,
    /// [`Choice::Allowed`] with [`AllowedMode::Auto`].
    AllowedAuto,
    /// [`Choice::Validated`].
    Validated,
    /// [`ToolChoice::parallel_tool_calls`].
    Parallel,
}

impl Kind {
    /// Every row, in table order.
    pub const ALL: [Kind; 8] = [
        Kind::Auto,
        Kind::None,
        Kind::Required,
        Kind::Tool,
        Kind::AllowedRequired,
        Kind::AllowedAuto,
        Kind::Validated,
        Kind::Parallel,
    ];
}

/// Which APIs take which kinds: the table of the module doc, as data.
const TAKES: &[(Api, &[Kind])] = &[
    (
        Api::OpenaiChat,
        &[
            Kind::Auto,
            Kind::None,
            Kind::Required,
            Kind::Tool,
            Kind::AllowedRequired,
            Kind::AllowedAuto,
            Kind::Parallel,
        ],
    ),
    (
        Api::OpenaiResponses,
        &[
            Kind::Auto,
            Kind::None,
            Kind::Required,
            Kind::Tool,
            Kind::AllowedRequired,
            Kind::AllowedAuto,
            Kind::Parallel,
        ],
    ),
    (
        Api::AnthropicMessages,
        &[Kind::Auto, Kind::None, Kind::Required, Kind::Tool, Kind::Parallel],
    ),
    (
        Api::Gemini,
        &[
            Kind::Auto,
            Kind::None,
            Kind::Required,
            Kind::Tool,
            Kind::AllowedRequired,
            Kind::Validated,
        ],
    ),
];

/// Whether `api` has a spelling for `kind`.
pub fn takes(api: Api, kind: Kind) -> bool {
    TAKES
        .iter()
        .any(|(table_api, kinds)| *table_api == api && kinds.contains(&kind))
}

/// The tool choice and parallel switch of one request. `Default` is "nothing set", which
/// renders exactly the bytes of a request without them (the provider's defaults).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolChoice {
    /// Which tools the model may or must call (None: the API's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Choice>,
    /// Whether the model may call several tools in one turn (None: the API's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
}

/// The neutral field a refusal names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Field {
    /// [`ToolChoice::tool_choice`].
    ToolChoice,
    /// [`ToolChoice::parallel_tool_calls`].
    ParallelToolCalls,
}

impl Field {
    /// The neutral name: `tool_choice` or `parallel_tool_calls`.
    pub fn as_str(self) -> &'static str {
        match self {
            Field::ToolChoice => "tool_choice",
            Field::ParallelToolCalls => "parallel_tool_calls",
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a target API cannot take a request's tool choice. Tests assert [`ToolChoiceError::code`]
/// and [`ToolChoiceError::field`], never the message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ToolChoiceError {
    /// The API has no spelling for this choice. Refused rather than approximated. Code
    /// `unsupported_setting`.
    #[error("{api} cannot express the {field} {kind:?}", api = api.as_str())]
    Unsupported {
        /// The field concerned.
        field: Field,
        /// The kind of choice asked for.
        kind: Kind,
        /// The API that cannot take it.
        api: Api,
    },
    /// The choice names a tool the request does not declare. Code `unknown_tool`.
    #[error("tool_choice names {name:?}, which the request does not declare")]
    UnknownTool {
        /// The name.
        name: String,
    },
}

impl ToolChoiceError {
    /// The machine-readable code: `unsupported_setting` or `unknown_tool`.
    pub fn code(&self) -> &'static str {
        match self {
            ToolChoiceError::Unsupported { .. } => "unsupported_setting",
            ToolChoiceError::UnknownTool { .. } => "unknown_tool",
        }
    }

    /// The neutral field concerned.
    pub fn field(&self) -> Field {
        match self {
            ToolChoiceError::Unsupported { field, .. } => *field,
            ToolChoiceError::UnknownTool { .. } => Field::ToolChoice,
        }
    }
}

impl Choice {
    /// The table row of this choice.
    pub fn kind(&self) -> Kind {
        match self {
            Choice::Auto => Kind::Auto,
            Choice::None => Kind::None,
            Choice::Required => Kind::Required,
            Choice::Tool { .. } => Kind::Tool,
            Choice::Allowed {
                mode: AllowedMode::Required,
                ..
            } => Kind::AllowedRequired,
            Choice::Allowed {
                mode: AllowedMode::Auto,
                ..
            } => Kind::AllowedAuto,
            Choice::Validated { .. } => Kind::Validated,
        }
    }

    /// The tool names the choice refers to.
    fn names(&self) -> &[String] {
        match self {
            Choice::Tool { name } => std::slice::from_ref(name),
            Choice::Allowed { tools, .. } | Choice::Validated { tools } => tools,
            Choice::Auto | Choice::None | Choice::Required => &[],
        }
    }
}

impl ToolChoice {
    /// Whether nothing is set (the default).
    pub fn is_unset(&self) -> bool {
        *self == ToolChoice::default()
    }

    /// Check against `api` and the names of the tools the request declares: the first field
    /// (`tool_choice`, then `parallel_tool_calls`) the API cannot spell is the error, and so is
    /// a name that is not declared.
    pub fn check(&self, api: Api, declared: &[&str]) -> Result<(), ToolChoiceError> {
        if let Some(choice) = &self.tool_choice {
            if !takes(api, choice.kind()) {
                return Err(ToolChoiceError::Unsupported {
                    field: Field::ToolChoice,
                    kind: choice.kind(),
                    api,
                });
            }
            if let Some(name) = choice
                .names()
                .iter()
                .find(|name| !declared.contains(&name.as_str()))
            {
                return Err(ToolChoiceError::UnknownTool { name: name.clone() });
            }
        }
        if self.parallel_tool_calls.is_some() {
            let parallel_unsupported = !takes(api, Kind::Parallel)
                // Anthropic's switch lives inside a choice object that `none` does not have.
                || (api == Api::AnthropicMessages && self.tool_choice == Some(Choice::None));
            if parallel_unsupported {
                return Err(ToolChoiceError::Unsupported {
                    field: Field::ParallelToolCalls,
                    kind: Kind::Parallel,
                    api,
                });
            }
        }
        Ok(())
    }

    /// The top-level fields `api` takes for this value, in writing order. Callers check first
    /// ([`ToolChoice::check`]); what the API cannot spell is not among them.
    pub fn fields(&self, api: Api) -> Vec<(&'static str, Value)> {
        let mut fields = Vec::new();
        match api {
            Api::OpenaiChat | Api::OpenaiResponses => {
                if let Some(choice) = &self.tool_choice
                    && let Some(value) = openai_value(api, choice)
                {
                    fields.push(("tool_choice", value));
                }
                if let Some(parallel) = self.parallel_tool_calls {
                    fields.push(("parallel_tool_calls", Value::Bool(parallel)));
                }
            }
            Api::AnthropicMessages => {
                let mut value = match &self.tool_choice {
                    None if self.parallel_tool_calls.is_some() => json!({"type": "auto"}),
                    None => return fields,
                    Some(Choice::Auto) => json!({"type": "auto"}),
                    Some(Choice::None) => json!({"type": "none"}),
                    Some(Choice::Required) => json!({"type": "any"}),
                    Some(Choice::Tool { name }) => json!({"type": "tool", "name": name}),
                    Some(_) => return fields,
                };
                if let Some(parallel) = self.parallel_tool_calls {
                    value["disable_parallel_tool_use"] = Value::Bool(!parallel);
                }
                fields.push(("tool_choice", value));
            }
            Api::Gemini => {
                let config = match &self.tool_choice {
                    None => return fields,
                    Some(Choice::Auto) => json!({"mode": "AUTO"}),
                    Some(Choice::None) => json!({"mode": "NONE"}),
                    Some(Choice::Required) => json!({"mode": "ANY"}),
                    Some(Choice::Tool { name }) => json!({"mode": "ANY", "allowedFunctionNames": [name]}),
                    Some(Choice::Allowed {
                        mode: AllowedMode::Required,
                        tools,
                    }) => json!({"mode": "ANY", "allowedFunctionNames": tools}),
                    Some(Choice::Validated { tools }) if tools.is_empty() => json!({"mode": "VALIDATED"}),
                    Some(Choice::Validated { tools }) => {
                        json!({"mode": "VALIDATED", "allowedFunctionNames": tools})
                    }
                    Some(_) => return fields,
                };
                fields.push(("toolConfig", json!({"functionCallingConfig": config})));
            }
        }
        fields
    }

    /// Append `,"<field>":<value>` for every field of [`ToolChoice::fields`], values in RFC 8785
    /// form. Returns the text written, for the caller's token count.
    pub(crate) fn write_fields(&self, api: Api, out: &mut Vec<u8>) -> String {
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

fn openai_value(api: Api, choice: &Choice) -> Option<Value> {
    let function = |name: &str| match api {
        Api::OpenaiChat => json!({"type": "function", "function": {"name": name}}),
        _ => json!({"type": "function", "name": name}),
    };
    Some(match choice {
        Choice::Auto => json!("auto"),
        Choice::None => json!("none"),
        Choice::Required => json!("required"),
        Choice::Tool { name } => function(name),
        Choice::Allowed { mode, tools } => {
            let mode = match mode {
                AllowedMode::Auto => "auto",
                AllowedMode::Required => "required",
            };
            let tools: Vec<Value> = tools.iter().map(|name| function(name)).collect();
            match api {
                Api::OpenaiChat => {
                    json!({"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}})
                }
                _ => json!({"type": "allowed_tools", "mode": mode, "tools": tools}),
            }
        }
        Choice::Validated { .. } => return None,
    })
}

// ---------------------------------------------------------------------------------------------
// Reading a request: the inverse of `fields`, one reader per API.

/// Read the tool choice fields of `api` from a request body being imported (`top` is the body;
/// Gemini's `toolConfig` is read from it too). A spelling the API does not document is
/// `invalid_request`; a choice of a tool kind v1 does not declare (custom, MCP, hosted tools)
/// is `unrepresentable`.
pub(crate) fn read(api: Api, top: &mut Obj) -> Result<ToolChoice, ImportError> {
    match api {
        Api::OpenaiChat | Api::OpenaiResponses => Ok(ToolChoice {
            tool_choice: match top.take("tool_choice") {
                None => None,
                Some(value) => Some(read_openai(api, top.path_of("tool_choice"), value)?),
            },
            parallel_tool_calls: top.bool("parallel_tool_calls")?,
        }),
        Api::AnthropicMessages => match top.object("tool_choice")? {
            None => Ok(ToolChoice::default()),
            Some(object) => read_anthropic(object),
        },
        Api::Gemini => read_gemini(top),
    }
}

fn wrong(path: &str, expected: &str, found: &Value) -> ImportError {
    ImportError::malformed(path, format!("expected {expected}, found {}", type_name(found)))
}

/// Fields left in a choice object: the provider would refuse them, so do we (by path).
fn no_more(object: Obj) -> Result<(), ImportError> {
    match object.keys().first() {
        None => Ok(()),
        Some(key) => Err(ImportError::malformed(object.path_of(key), "unknown field")),
    }
}

fn read_openai(api: Api, path: String, value: Value) -> Result<Choice, ImportError> {
    let mut object = match value {
        Value::String(mode) => {
            return match mode.as_str() {
                "auto" => Ok(Choice::Auto),
                "none" => Ok(Choice::None),
                "required" => Ok(Choice::Required),
                _ => Err(ImportError::malformed(
                    path,
                    format!("unknown tool_choice {mode:?}"),
                )),
            };
        }
        value @ Value::Object(_) => Obj::new(value, path.clone(), path)?,
        other => return Err(wrong(&path, "a string or an object", &other)),
    };
    let kind = object.required_string("type")?;
    let choice = match kind.as_str() {
        "function" => Choice::Tool {
            name: openai_function_name(api, &mut object)?,
        },
        "allowed_tools" => {
            let mut holder = match api {
                Api::OpenaiChat => Some(object.required_object("allowed_tools")?),
                _ => None,
            };
            let inner = holder.as_mut().unwrap_or(&mut object);
            let mode = match inner.required_string("mode")?.as_str() {
                "auto" => AllowedMode::Auto,
                "required" => AllowedMode::Required,
                other => {
                    return Err(ImportError::malformed(
                        inner.path_of("mode"),
                        format!("unknown mode {other:?}"),
                    ));
                }
            };
            let items = inner.required_array("tools")?;
            let mut tools = Vec::with_capacity(items.len());
            for (item_path, item_pattern, item) in inner.elements("tools", items) {
                let mut tool = Obj::new(item, item_path, item_pattern)?;
                match tool.required_string("type")?.as_str() {
                    "function" => tools.push(openai_function_name(api, &mut tool)?),
                    other => {
                        return Err(ImportError::unrepresentable(
                            tool.path_of("type"),
                            format!("an allowed {other:?} tool (v1 declares function tools only)"),
                        ));
                    }
                }
                no_more(tool)?;
            }
            if let Some(holder) = holder {
                no_more(holder)?;
            }
            Choice::Allowed { mode, tools }
        }
        other => {
            return Err(ImportError::unrepresentable(
                object.path_of("type"),
                format!("a tool_choice of type {other:?} (v1 declares function tools only)"),
            ));
        }
    };
    no_more(object)?;
    Ok(choice)
}

/// Chat: `{type: function, function: {name}}`; Responses: `{type: function, name}`.
fn openai_function_name(api: Api, object: &mut Obj) -> Result<String, ImportError> {
    match api {
        Api::OpenaiChat => {
            let mut function = object.required_object("function")?;
            let name = function.required_string("name")?;
            no_more(function)?;
            Ok(name)
        }
        _ => object.required_string("name"),
    }
}

fn read_anthropic(mut object: Obj) -> Result<ToolChoice, ImportError> {
    let kind = object.required_string("type")?;
    let disable = object.bool("disable_parallel_tool_use")?;
    let tool_choice = match kind.as_str() {
        "auto" => Choice::Auto,
        "any" => Choice::Required,
        "tool" => Choice::Tool {
            name: object.required_string("name")?,
        },
        "none" if disable.is_some() => {
            return Err(ImportError::malformed(
                object.path_of("disable_parallel_tool_use"),
                "tool_choice of type none takes no disable_parallel_tool_use",
            ));
        }
        "none" => Choice::None,
        other => {
            return Err(ImportError::malformed(
                object.path_of("type"),
                format!("unknown tool_choice type {other:?}"),
            ));
        }
    };
    no_more(object)?;
    Ok(ToolChoice {
        tool_choice: Some(tool_choice),
        parallel_tool_calls: disable.map(|disable| !disable),
    })
}

fn read_gemini(top: &mut Obj) -> Result<ToolChoice, ImportError> {
    let Some(mut config) = top.object("toolConfig")? else {
        return Ok(ToolChoice::default());
    };
    config.camel_case_keys()?;
    config.refuse(
        "retrievalConfig",
        "a retrieval configuration for Google's server-side grounding tools",
    )?;
    let Some(mut calling) = config.object("functionCallingConfig")? else {
        no_more(config)?;
        return Ok(ToolChoice::default());
    };
    no_more(config)?;
    calling.camel_case_keys()?;
    let mode = calling.string("mode")?;
    let names = calling.strings("allowedFunctionNames", false)?;
    let names_path = calling.path_of("allowedFunctionNames");
    let mode_path = calling.path_of("mode");
    no_more(calling)?;
    let names_refused = |mode: &str| {
        ImportError::malformed(
            names_path.clone(),
            format!("allowedFunctionNames is only set with mode ANY or VALIDATED, not {mode}"),
        )
    };
    let tool_choice = match mode.as_deref() {
        // Unspecified is the documented default, AUTO: nothing asked for.
        None | Some("MODE_UNSPECIFIED") if names.is_empty() => None,
        None => return Err(names_refused("unspecified")),
        Some("AUTO") if names.is_empty() => Some(Choice::Auto),
        Some("NONE") if names.is_empty() => Some(Choice::None),
        Some(mode @ ("AUTO" | "NONE" | "MODE_UNSPECIFIED")) => return Err(names_refused(mode)),
        Some("ANY") => Some(match names.len() {
            0 => Choice::Required,
            1 => Choice::Tool {
                name: names.into_iter().next().unwrap_or_default(),
            },
            _ => Choice::Allowed {
                mode: AllowedMode::Required,
                tools: names,
            },
        }),
        Some("VALIDATED") => Some(Choice::Validated { tools: names }),
        Some(other) => {
            return Err(ImportError::malformed(
                mode_path,
                format!("unknown functionCallingConfig mode {other:?}"),
            ));
        }
    };
    Ok(ToolChoice {
        tool_choice,
        parallel_tool_calls: None,
    })
}
