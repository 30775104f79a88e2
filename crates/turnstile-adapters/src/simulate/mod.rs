//! Provider-side encoders: scripted replies (text, parallel tool calls, faults) written out as
//! the exact stream bytes each API sends. The inverse of [`crate::decode`], shared by the
//! `turnstile sim` server and by deterministic simulation tests, so both speak the same real
//! wire formats.

pub mod script;
pub mod wire;
