//! Google Gemini `generateContent` (Gemini API, `v1beta`). One version so far; see
//! `v1/render.rs`.

pub(crate) mod import;
pub mod v1;
