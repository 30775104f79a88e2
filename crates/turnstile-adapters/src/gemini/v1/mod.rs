//! `gemini/v1`: see `render.rs`.

pub mod render;
