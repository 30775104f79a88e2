//! Token counters for admission.
//!
//! OpenAI models get exact BPE counts from `tiktoken-rs` (`o200k_base` for gpt-4o, gpt-4.1,
//! gpt-5 and the o-series; `cl100k_base` for gpt-4 and gpt-3.5; table from openai/tiktoken
//! `tiktoken/model.py`, quoted in `shared/reference/provider-rules.md` §6). The vocabularies
//! are compiled into tiktoken-rs and loaded once per process through its singletons (loading
//! o200k takes ~135 ms, so it must never happen per request).
//!
//! Anthropic and Gemini publish no local tokenizer for current models, so their counts come
//! from a conservative estimator: [`estimate`]. Its error bound was measured against the
//! legacy Claude tokenizer (`@anthropic-ai/tokenizer`) and the Gemma 3 tokenizer (the one
//! python-genai's local tokenizer maps Gemini 2.x/3 to) on a mixed corpus; see
//! `docs/decisions.md` (2026-11-29, "token estimator") and `tests/it/tokens.rs`, which pins the
//! measured reference counts so a change to the estimator that makes it undercount fails.

use serde::{Deserialize, Serialize};

/// Which counter a model uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Tokenizer {
    /// tiktoken `o200k_base` (exact).
    O200kBase,
    /// tiktoken `cl100k_base` (exact).
    Cl100kBase,
    /// Conservative estimate for Anthropic Claude models.
    AnthropicEstimate,
    /// Conservative estimate for Google Gemini models.
    GeminiEstimate,
}

impl Tokenizer {
    /// Number of tokens of `text`. Special-token lookalikes (`<|endoftext|>`) are counted as
    /// ordinary text, as the API treats user text.
    pub fn count(self, text: &str) -> u64 {
        match self {
            Tokenizer::O200kBase => tiktoken_rs::o200k_base_singleton().encode_ordinary(text).len() as u64,
            Tokenizer::Cl100kBase => tiktoken_rs::cl100k_base_singleton().encode_ordinary(text).len() as u64,
            Tokenizer::AnthropicEstimate | Tokenizer::GeminiEstimate => estimate(text),
        }
    }

    /// Whether counts are exact BPE counts (otherwise an upper-bound estimate).
    pub fn is_exact(self) -> bool {
        matches!(self, Tokenizer::O200kBase | Tokenizer::Cl100kBase)
    }

    /// Tokens added per message (role, delimiters). OpenAI: `tokens_per_message = 3` from the
    /// cookbook (`How_to_count_tokens_with_tiktoken.ipynb`); the role string is counted by the
    /// renderer. Estimators: a deliberately generous 8.
    pub fn message_overhead(self) -> u64 {
        if self.is_exact() { 3 } else { 8 }
    }

    /// Tokens added once per request. OpenAI: `+3`, "every reply is primed with
    /// `<|start|>assistant<|message|>`" (cookbook). Anthropic: the tool-use system prompt is
    /// added only when tools are present (see [`Tokenizer::tools_overhead`]).
    pub fn request_overhead(self) -> u64 {
        if self.is_exact() { 3 } else { 16 }
    }

    /// Tokens added once when the request declares tools. Anthropic documents the tool-use
    /// system prompt as 346 tokens for `tool_choice` auto/none on Claude 4-family models and
    /// 313 for any/tool (platform.claude.com, "Tool use" → pricing); we take the larger.
    /// OpenAI: the cookbook's `func_end = 12` is added per function by the renderer; here 0.
    pub fn tools_overhead(self) -> u64 {
        match self {
            Tokenizer::AnthropicEstimate => 346,
            Tokenizer::GeminiEstimate => 32,
            _ => 0,
        }
    }
}

/// ASCII bytes per estimated token, as a fraction `numerator / denominator` of tokens per
/// byte: 1 token per 2.5 ASCII bytes. Measured (see module docs): the largest observed ratio
/// of real tokens to ASCII bytes on the corpus was below this.
const ASCII_TOKENS_PER_BYTE: (u64, u64) = (2, 5);

/// Conservative token estimate of a string: `ceil(ascii_bytes × 2/5) + non_ascii_chars × 2`.
/// Every non-ASCII character is charged two tokens, which covers byte-fallback tokenizers on
/// CJK, emoji and rare scripts (the worst case observed was 2 tokens per character for emoji
/// on the Gemma tokenizer).
pub fn estimate(text: &str) -> u64 {
    let mut ascii_bytes = 0u64;
    let mut non_ascii_chars = 0u64;
    for character in text.chars() {
        if character.is_ascii() {
            ascii_bytes += 1;
        } else {
            non_ascii_chars += 1;
        }
    }
    let (numerator, denominator) = ASCII_TOKENS_PER_BYTE;
    (ascii_bytes * numerator).div_ceil(denominator) + non_ascii_chars * 2
}

/// Tokens charged for one image. OpenAI: gpt-4o high detail scales to fit 2048×2048 then 768
/// on the short side, at most 2×4 tiles of 170 plus 85 base = 1445. Anthropic: an image is
/// about width×height/750 tokens and is resized above ~1.15 megapixels, so ≈1600. Gemini 3:
/// `media_resolution` high is 1120 per image. Pixel sizes are not known before the provider
/// decodes the image, so each API's maximum is charged.
pub fn image_tokens(tokenizer: Tokenizer) -> u64 {
    match tokenizer {
        Tokenizer::O200kBase | Tokenizer::Cl100kBase => 1445,
        Tokenizer::AnthropicEstimate => 1600,
        Tokenizer::GeminiEstimate => 1120,
    }
}

/// Tokens charged for a document: inline data at one token per 3 base64 characters (about
/// 2.25 raw bytes per token, above what text extraction plus page images cost for typical
/// PDFs); a document by URL, whose size is unknown, at a flat [`DOCUMENT_URL_TOKENS`].
pub fn document_tokens(base64_len: Option<usize>) -> u64 {
    match base64_len {
        Some(len) => (len as u64).div_ceil(3),
        None => DOCUMENT_URL_TOKENS,
    }
}

/// Flat charge for a document given by URL.
pub const DOCUMENT_URL_TOKENS: u64 = 32_000;
