//! The model catalog: context window, tokenizer and default output cap per model.
//!
//! Built-in defaults cover the models named in the provider docs; a configuration file can
//! override or add entries ([`Catalog::apply_overrides`]). Lookup is by exact name first, then
//! by the longest matching prefix (as tiktoken's `model.py` does), then the provider's default
//! entry, so a new dated snapshot (`gpt-4o-2024-11-20`) inherits its family's window.

use crate::registry::Api;
use crate::tokens::Tokenizer;
use serde::{Deserialize, Serialize};

/// What admission needs to know about a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Context window in tokens (prompt plus output).
    pub context_window: u64,
    /// Token counter.
    pub tokenizer: Tokenizer,
    /// Output cap used when the caller names none.
    pub max_output_tokens_default: u64,
}

/// How a lookup matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Match {
    /// The exact model name.
    Exact,
    /// The longest catalog prefix of the name.
    Prefix,
    /// Unknown model: the API family's default entry.
    ProviderDefault,
}

/// One catalog entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Model name or prefix.
    pub name: String,
    /// Whether `name` also matches as a prefix.
    pub prefix: bool,
    /// The model facts.
    #[serde(flatten)]
    pub info: ModelInfo,
}

/// A catalog override file was not understood.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogError {
    /// The JSON did not have the shape `{"models": [{"name", "context_window", "tokenizer", …}]}`.
    #[error("catalog overrides: {0}")]
    Shape(String),
}

/// The model catalog.
#[derive(Clone, Debug)]
pub struct Catalog {
    entries: Vec<Entry>,
}

impl Default for Catalog {
    fn default() -> Catalog {
        Catalog::builtin()
    }
}

fn entry(name: &str, prefix: bool, context_window: u64, tokenizer: Tokenizer, out: u64) -> Entry {
    Entry {
        name: name.to_owned(),
        prefix,
        info: ModelInfo {
            context_window,
            tokenizer,
            max_output_tokens_default: out,
        },
    }
}

impl Catalog {
    /// The built-in defaults. Windows from the providers' model pages (OpenAI models docs,
    /// Anthropic "Models overview", Google "Gemini models").
    pub fn builtin() -> Catalog {
        use Tokenizer::*;
        Catalog {
            entries: vec![
                entry("gpt-5", true, 400_000, O200kBase, 8_192),
                entry("gpt-4.1", true, 1_047_576, O200kBase, 8_192),
                entry("gpt-4.5", true, 128_000, O200kBase, 4_096),
                entry("gpt-4o", true, 128_000, O200kBase, 4_096),
                entry("chatgpt-4o", true, 128_000, O200kBase, 4_096),
                entry("o1", true, 200_000, O200kBase, 8_192),
                entry("o3", true, 200_000, O200kBase, 8_192),
                entry("o4-mini", true, 200_000, O200kBase, 8_192),
                entry("gpt-4-turbo", true, 128_000, Cl100kBase, 4_096),
                entry("gpt-4-32k", true, 32_768, Cl100kBase, 4_096),
                entry("gpt-4", true, 8_192, Cl100kBase, 1_024),
                entry("gpt-3.5-turbo", true, 16_385, Cl100kBase, 1_024),
                entry("claude-", true, 200_000, AnthropicEstimate, 4_096),
                entry("gemini-", true, 1_048_576, GeminiEstimate, 8_192),
            ],
        }
    }

    /// The default entry of an API family, for model names the catalog does not know: the
    /// smallest window among the family's current models, so an unknown model is never
    /// admitted on a window it may not have.
    pub fn provider_default(api: Api) -> ModelInfo {
        match api {
            Api::OpenaiChat | Api::OpenaiResponses => ModelInfo {
                context_window: 128_000,
                tokenizer: Tokenizer::O200kBase,
                max_output_tokens_default: 4_096,
            },
            Api::AnthropicMessages => ModelInfo {
                context_window: 200_000,
                tokenizer: Tokenizer::AnthropicEstimate,
                max_output_tokens_default: 4_096,
            },
            Api::Gemini => ModelInfo {
                context_window: 1_048_576,
                tokenizer: Tokenizer::GeminiEstimate,
                max_output_tokens_default: 8_192,
            },
        }
    }

    /// Add or replace an entry (configuration overrides win over built-ins).
    pub fn insert(&mut self, entry: Entry) {
        self.entries.retain(|existing| existing.name != entry.name);
        self.entries.push(entry);
    }

    /// Apply a JSON override document `{"models": [Entry…]}`.
    pub fn apply_overrides(&mut self, value: serde_json::Value) -> Result<(), CatalogError> {
        #[derive(Deserialize)]
        struct Overrides {
            models: Vec<Entry>,
        }
        let overrides: Overrides =
            serde_json::from_value(value).map_err(|error| CatalogError::Shape(error.to_string()))?;
        for entry in overrides.models {
            self.insert(entry);
        }
        Ok(())
    }

    /// Look a model up for an API family. A model whose catalog tokenizer belongs to another
    /// provider (a `claude-*` name on an OpenAI adapter, say) still uses its own window.
    pub fn lookup(&self, api: Api, model: &str) -> (ModelInfo, Match) {
        if let Some(found) = self.entries.iter().find(|entry| entry.name == model) {
            return (found.info, Match::Exact);
        }
        let longest = self
            .entries
            .iter()
            .filter(|entry| entry.prefix && model.starts_with(entry.name.as_str()))
            .max_by_key(|entry| entry.name.len());
        match longest {
            Some(found) => (found.info, Match::Prefix),
            None => (Catalog::provider_default(api), Match::ProviderDefault),
        }
    }
}

/// The exact tokenizer of an OpenAI model the built-in catalog knows by name or family prefix
/// (`gpt-4o-2024-08-06` → o200k), or `None`: for a name it does not know (a compatible endpoint
/// serving another vendor's model, whose counts are in that model's own tokens) and for a
/// catalog entry that is an estimate. Used to hold a stream's reported output usage against
/// the text it carried (`decode/openai_chat.rs`), where only an exact count may accuse.
pub fn exact_openai_tokenizer(model: &str) -> Option<Tokenizer> {
    static BUILTIN: std::sync::LazyLock<Catalog> = std::sync::LazyLock::new(Catalog::builtin);
    match BUILTIN.lookup(Api::OpenaiChat, model) {
        (info, Match::Exact | Match::Prefix) if info.tokenizer.is_exact() => Some(info.tokenizer),
        _ => None,
    }
}
