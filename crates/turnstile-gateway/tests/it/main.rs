//! Integration tests of the `turnstile` binary (one test binary, see STYLE.md).

mod render;
mod assemble;
mod sim;
mod validate;
