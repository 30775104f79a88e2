//! Stream decoding and assembly (issue 4): SSE framing, the four decoders, and the decoders
//! feeding the core assembler, checked on hand-written fixtures (`tests/data/`) and, when
//! present, on the recorded captures in shared `fixtures/provider-streams/`.

mod captures;
mod cuts;
mod decode;
mod faults;
mod integrity;
mod never_panics;
mod sse;
pub mod support;
mod whole;
