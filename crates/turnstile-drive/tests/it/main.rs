//! Tests of turnstile-drive (one binary): the tidy rule (sans-IO) and the driver against a
//! scripted store and provider bytes.

mod pairs;
mod tidy;
