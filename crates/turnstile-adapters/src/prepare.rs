//! Prepare one dispatch: render → count → admit → manifest, all before any I/O.
//!
//! This is the only way to obtain a [`turnstile_core::manifest::DispatchManifest`] from a
//! graph: the manifest's `request_digest` is computed here over the exact body bytes returned
//! beside it, `prompt_tokens` is the count of those same bytes, and admission has already
//! passed. Credentials never enter: the adapters render no auth header and the manifest has
//! no field for one.
//!
//! Generation settings ([`Sampling`]) go through [`prepare_with_sampling`]; [`prepare`] is the
//! same with none set. They are a separate argument rather than a field of [`PrepareRequest`]
//! only so that the struct literals written before settings existed keep compiling (a field
//! is planned once every caller passes settings;
//! `docs/decisions/0041-generation-settings-travel-with-the-request.md`, 2026-11-30).
//! [`prepare_with_settings`] takes every request setting at once ([`Settings`]: sampling, tool
//! choice and output format), and is what the gateway calls.

use crate::catalog::{Catalog, Match, ModelInfo};
use crate::output_format::{OutputFormat, OutputFormatError};
use crate::passthrough::{Passthrough, PassthroughError};
use crate::registry::AdapterId;
use crate::render::{Graph, Pause, RenderCache, RenderOptions, RenderOutcome, Rendered, TextContent, render};
use crate::sampling::{Sampling, SamplingError};
use crate::tool_choice::{ToolChoice, ToolChoiceError};
use turnstile_core::Digest;
use turnstile_core::admission::{Admission, OverBudget, admit};
use turnstile_core::manifest::{DispatchManifest, MANIFEST_FORMAT_V1, ManifestBody};

/// What to prepare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepareRequest {
    /// Client-chosen operation id.
    pub operation_id: String,
    /// Adapter version.
    pub adapter: AdapterId,
    /// Provider name for the manifest (defaults to the adapter's API provider).
    pub provider: Option<String>,
    /// Model name.
    pub model: String,
    /// Output cap (defaults to the catalog's per-model default).
    pub max_output_tokens: Option<u64>,
    /// Ask the provider for a stream.
    pub stream: bool,
    /// OpenAI Responses background mode (resumable by handle); other APIs ignore it.
    pub background: bool,
    /// OpenAI Chat: how all-text messages carry their text (the provider's `text_content`);
    /// other APIs ignore it. Pinned by the policy when not the default.
    pub text_content: TextContent,
}

/// A prepared dispatch: bytes, manifest and the policy the manifest pins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    /// The rendered request (body, path, non-secret headers, policy).
    pub rendered: Rendered,
    /// The sealed manifest.
    pub manifest: DispatchManifest,
    /// The render policy (`rendered.policy`) as the JSON value the manifest's `policy_digest`
    /// is over, kept beside the dispatch by the store.
    pub policy: serde_json::Value,
    /// The catalog facts used for admission.
    pub model: ModelInfo,
    /// How the model was found in the catalog.
    pub model_match: Match,
    /// Unused window after prompt and output cap.
    pub headroom: u64,
}

/// Outcome of preparing.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum PrepareOutcome {
    /// Ready to dispatch.
    Prepared(Box<Prepared>),
    /// The adapter cannot represent the graph.
    Paused(Vec<Pause>),
    /// Refused by admission (no manifest: nothing will be sent).
    OverBudget(OverBudget),
}

/// Render, count, admit and seal the manifest, with no generation settings (the provider's
/// defaults). Exactly [`prepare_with_sampling`] with [`Sampling::default`].
pub fn prepare(
    graph: Graph<'_>,
    request: &PrepareRequest,
    catalog: &Catalog,
    cache: &mut RenderCache,
) -> PrepareOutcome {
    match prepare_with_sampling(graph, request, &Sampling::default(), catalog, cache) {
        Ok(outcome) => outcome,
        // Invariant: `Sampling::check` only refuses settings that are set, and none is.
        Err(error) => unreachable!("a request without generation settings was refused: {error}"),
    }
}

/// Every request setting that is not part of the conversation: generation settings and tool
/// choice. `Default` is "nothing set".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// Generation settings.
    pub sampling: Sampling,
    /// Tool choice and parallel tool calls.
    pub tool_choice: ToolChoice,
    /// Structured output.
    pub output_format: OutputFormat,
    /// Fields only the client's API takes (proxy requests only).
    pub passthrough: Passthrough,
    /// The history repair applied to the conversation before it was rendered (a proxy route
    /// with `repair_history`: `turnstile_core::repair`'s plan as JSON): written into the render
    /// policy as `repair`, so the manifest's `policy_digest` pins it. None: nothing repaired,
    /// and the policy (and its digest) is what it always was.
    pub repair: Option<serde_json::Value>,
}

/// A request setting the target API cannot take. Tests assert [`SettingError::code`] and
/// [`SettingError::field`], never the message.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SettingError {
    /// A generation setting.
    #[error(transparent)]
    Sampling(SamplingError),
    /// The tool choice or parallel switch.
    #[error(transparent)]
    ToolChoice(ToolChoiceError),
    /// The output format.
    #[error(transparent)]
    OutputFormat(OutputFormatError),
    /// A field only the client's API takes.
    #[error(transparent)]
    Passthrough(PassthroughError),
}

impl SettingError {
    /// The machine-readable code of the inner error.
    pub fn code(&self) -> &'static str {
        match self {
            SettingError::Sampling(error) => error.code(),
            SettingError::ToolChoice(error) => error.code(),
            SettingError::OutputFormat(error) => error.code(),
            SettingError::Passthrough(error) => error.code(),
        }
    }

    /// The name of the setting concerned: neutral (`temperature`, `tool_choice`, …), or the
    /// client's own field for a client-only field (`reasoning_effort`).
    pub fn field(&self) -> &str {
        match self {
            SettingError::Sampling(error) => error.setting().as_str(),
            SettingError::ToolChoice(error) => error.field().as_str(),
            SettingError::OutputFormat(error) => error.field(),
            SettingError::Passthrough(error) => error.field(),
        }
    }
}

/// Render, count, admit and seal the manifest, with generation settings written in the
/// adapter's API fields and recorded in the render policy (so `policy_digest` pins them).
///
/// `Err` when the API cannot take a setting (no field for it, or a value outside its documented
/// range): checked before anything renders, because the request is wrong whatever the graph;
/// nothing is ever sent without the setting or with a clamped value.
pub fn prepare_with_sampling(
    graph: Graph<'_>,
    request: &PrepareRequest,
    sampling: &Sampling,
    catalog: &Catalog,
    cache: &mut RenderCache,
) -> Result<PrepareOutcome, SamplingError> {
    let settings = Settings {
        sampling: sampling.clone(),
        tool_choice: ToolChoice::default(),
        output_format: OutputFormat::default(),
        passthrough: Passthrough::default(),
        repair: None,
    };
    match prepare_with_settings(graph, request, &settings, catalog, cache) {
        Ok(outcome) => Ok(outcome),
        Err(SettingError::Sampling(error)) => Err(error),
        // Invariant: an unset tool choice passes every check.
        Err(SettingError::ToolChoice(error)) => unreachable!("an unset tool choice was refused: {error}"),
        // Invariant: an unset output format passes every check.
        Err(SettingError::OutputFormat(error)) => unreachable!("an unset output format was refused: {error}"),
        // Invariant: no client-only field passes every check.
        Err(SettingError::Passthrough(error)) => unreachable!("no client-only field was refused: {error}"),
    }
}

/// Render, count, admit and seal the manifest with every request setting written in the
/// adapter's API fields and recorded in the render policy (so `policy_digest` pins them).
/// `Err` when the API cannot take one: nothing is sent without it.
pub fn prepare_with_settings(
    graph: Graph<'_>,
    request: &PrepareRequest,
    settings: &Settings,
    catalog: &Catalog,
    cache: &mut RenderCache,
) -> Result<PrepareOutcome, SettingError> {
    settings
        .sampling
        .check(request.adapter.api())
        .map_err(SettingError::Sampling)?;
    let (model, model_match) = catalog.lookup(request.adapter.api(), &request.model);
    let max_output_tokens = request
        .max_output_tokens
        .unwrap_or(model.max_output_tokens_default);
    let options = RenderOptions {
        model: request.model.clone(),
        max_output_tokens,
        stream: request.stream,
        background: request.background,
        sampling: settings.sampling.clone(),
        tool_choice: settings.tool_choice.clone(),
        output_format: settings.output_format.clone(),
        passthrough: settings.passthrough.clone(),
        text_content: request.text_content,
    };
    let rendered = match render(request.adapter, graph, &options, model.tokenizer, cache) {
        RenderOutcome::Rendered(rendered) => rendered,
        RenderOutcome::Paused(pauses) => return Ok(PrepareOutcome::Paused(pauses)),
        RenderOutcome::Refused(error) => return Err(SettingError::Sampling(error)),
        RenderOutcome::RefusedToolChoice(error) => return Err(SettingError::ToolChoice(error)),
        RenderOutcome::RefusedOutputFormat(error) => return Err(SettingError::OutputFormat(error)),
        RenderOutcome::RefusedPassthrough(error) => return Err(SettingError::Passthrough(error)),
    };
    let headroom = match admit(rendered.prompt_tokens, max_output_tokens, model.context_window) {
        Admission::Admitted { headroom } => headroom,
        Admission::Refused(over) => return Ok(PrepareOutcome::OverBudget(over)),
    };
    let conversation = graph.conversation();
    // The policy as the JSON value `policy_digest` is over, built once: the digest here and the
    // copy the store keeps (and checks against the digest) are both of it.
    let mut policy = serde_json::to_value(&rendered.policy).expect("a render policy serialises to JSON");
    if let (Some(repair), Some(map)) = (&settings.repair, policy.as_object_mut()) {
        map.insert("repair".to_owned(), repair.clone());
    }
    let manifest = ManifestBody {
        format: MANIFEST_FORMAT_V1.to_owned(),
        operation_id: request.operation_id.clone(),
        conversation_id: conversation.conversation_id.clone(),
        conversation_revision: conversation.revision,
        sequence_digest: graph.sequence().sequence_digest.clone(),
        adapter: request.adapter.as_str().to_owned(),
        adapter_digest: request.adapter.adapter_digest().clone(),
        provider: request
            .provider
            .clone()
            .unwrap_or_else(|| request.adapter.provider().to_owned()),
        model: request.model.clone(),
        toolset_digest: conversation.toolset_digest.clone(),
        policy_digest: Digest::of_value(&policy),
        max_output_tokens,
        prompt_tokens: rendered.prompt_tokens,
        request_digest: cache.body_digest(
            request.adapter,
            &request.model,
            &conversation.conversation_id,
            &rendered.body,
        ),
    }
    .seal();
    Ok(PrepareOutcome::Prepared(Box::new(Prepared {
        rendered,
        manifest,
        policy,
        model,
        model_match,
        headroom,
    })))
}
