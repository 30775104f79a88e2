//! Integration tests of turnstile-adapters (one binary; modules per area).

mod render_golden;
mod render_rules;
mod render_support;
