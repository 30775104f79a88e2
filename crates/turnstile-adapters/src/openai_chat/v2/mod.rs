//! `openai_chat/v2`: see `render.rs`.

pub mod render;
