//! `anthropic_messages/v2`: see `render.rs`.

pub mod render;
