//! OpenAI Responses (`POST /v1/responses`). One version so far; see `v1/render.rs`.

pub(crate) mod import;
pub mod v1;
