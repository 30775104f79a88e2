//! Tests of turnstile-drive (one binary; its sans-IO tidy rule is in turnstile-core's tidy test): the driver against a
//! scripted store and provider bytes.

mod failover;
mod fence;
mod pairs;
