//! Integration tests of the `turnstile` binary (one test binary, see STYLE.md).

mod api_errors;
mod assemble;
mod compatible;
mod console;
mod console_api;
mod drain;
mod executor;
mod failover;
mod fencing;
mod foreign;
mod health;
mod listener;
mod observability;
mod open_world;
mod proxy;
mod proxy_sdk;
mod recovery;
mod render;
mod resume;
mod serve;
mod sim;
mod slow_clients;
mod stored_history;
mod traces;
mod validate;
