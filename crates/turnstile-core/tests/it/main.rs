//! Integration tests of turnstile-core (one binary, see STYLE.md).

mod assemble;
mod depth_scan;
mod digest;
mod dispatch;
mod generate;
mod history;
mod kept;
mod never_panics;
mod properties;
mod push_turn;
mod repair;
mod sequence;
mod tidy;
mod typed_decode;
mod validator_data;
