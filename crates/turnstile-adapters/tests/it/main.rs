//! Integration tests of turnstile-adapters (one binary; modules per area).

mod render_golden;
mod render_openapi;
mod render_prepare;
mod render_props;
mod render_registry;
mod render_rules;
mod render_support;
mod render_upgrade;
mod stream;
