//! Integration tests of the `turnstile` binary (one test binary, see STYLE.md).

mod assemble;
mod console;
mod render;
mod serve;
mod sim;
mod validate;
