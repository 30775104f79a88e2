//! Integration tests of turnstile-adapters (one binary; modules per area).

mod import_golden;
mod import_props;
mod import_refusals;
mod import_repair;
mod import_validator;
mod render_admission;
mod render_cache;
mod render_element_fields;
mod render_golden;
mod render_openapi;
mod render_output_format;
mod render_passthrough;
mod render_prepare;
mod render_props;
mod render_registry;
mod render_resume;
mod render_rules;
mod render_sampling;
mod render_step;
mod render_support;
mod render_text_content;
mod render_tool_choice;
mod render_upgrade;
mod stream;
