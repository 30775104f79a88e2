//! The Turnstile gateway as a library: the `turnstile` binary (`main.rs`) is a thin command
//! line over it, and tests can drive its real HTTP layer (`serve`), its provider simulator
//! (`sim`) and its console in process.
#![forbid(unsafe_code)]

pub mod cli;
pub mod console;
pub mod serve;
pub mod sim;
