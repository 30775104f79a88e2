//! Integration tests of the `turnstile` binary (one test binary, see STYLE.md).

mod render;
mod assemble;
mod serve;
mod sim;
mod validate;
