//! Integration tests of the `turnstile` binary (one test binary, see STYLE.md).

mod render;
mod assemble;
mod console;
mod serve;
mod sim;
mod validate;
