//! OpenAI Responses (`POST /v1/responses`). One version so far; see `v1/render.rs`.

pub mod v1;
