//! Tests of turnstile-drive (one binary; its sans-IO tidy rule is in turnstile-core's tidy test): the driver against a
//! scripted store and provider bytes.

mod fence;
mod pairs;
