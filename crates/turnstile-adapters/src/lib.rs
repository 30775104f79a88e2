//! Provider adapters: one module per provider API and version (`openai_chat/v1`, …), each with
//! `render` (graph → exact request bytes), `import` (provider request → graph, for proxy and
//! shadow modes), `decode` (stream bytes → normalized events) and its token counter.
//!
//! Placement and role rules of a provider live in its adapter and nowhere else. A block kind an
//! adapter version cannot represent pauses the conversation; it is never degraded into text.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod decode;
pub mod sse;

pub mod anthropic_messages;
pub mod cache;
pub mod call_ids;
pub mod catalog;
pub mod gemini;
pub mod import;
pub mod openai_chat;
pub mod openai_responses;
pub mod output_format;
pub mod passthrough;
pub mod prepare;
#[doc(hidden)]
pub mod probe;
pub mod registry;
pub mod render;
pub mod sampling;
pub mod simulate;
pub mod tokens;
pub mod tool_choice;

pub use catalog::Catalog;
pub use prepare::{
    PrepareOutcome, PrepareRequest, Prepared, SettingError, Settings, prepare, prepare_with_sampling,
    prepare_with_settings,
};
pub use registry::{AdapterId, Api};
pub use render::{Graph, RenderCache, RenderOptions, RenderOutcome, Rendered, TextContent};
pub use sampling::{Sampling, SamplingError, Setting};
pub use tool_choice::{Choice, ToolChoice, ToolChoiceError};
