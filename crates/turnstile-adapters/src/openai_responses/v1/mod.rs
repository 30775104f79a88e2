//! `openai_responses/v1`: see `render.rs`.

pub mod render;
