//! `turnstile serve [--listen ADDR] [--store URL] [--sim-url URL] [--config FILE]`.

use super::Exit;
use crate::serve::config::{Config, LogFormat};
use std::io::IsTerminal;

/// Install the process's log subscriber: `RUST_LOG` filters (default `info`); `json` writes one
/// object per line (the event's fields flattened beside `timestamp`, `level`, `target` and
/// `message`); `text` is coloured only when standard error is a terminal.
fn install_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    match format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            // Colour only for a person at a terminal: never escapes in a file or the journal.
            .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
            .with_writer(std::io::stderr)
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init(),
    }
}

/// Arguments of `turnstile serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// Listen address (default 127.0.0.1:8080).
    #[arg(long, env = "TURNSTILE_LISTEN")]
    listen: Option<String>,
    /// `sqlite:PATH` (default sqlite:./turnstile.db) or `postgres://…`.
    #[arg(long, env = "TURNSTILE_STORE", hide_env_values = true)]
    store: Option<String>,
    /// Use an external `turnstile sim` instead of the built-in one.
    #[arg(long, env = "TURNSTILE_SIM_URL")]
    sim_url: Option<String>,
    /// TOML configuration (tenants, providers, models, limits; see docs/operating.md).
    #[arg(long, env = "TURNSTILE_CONFIG")]
    config: Option<String>,
    /// Log lines as `text` (default) or `json`; overrides the config key `log_format`.
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
}

/// Run the gateway until SIGINT/SIGTERM.
pub fn run(args: ServeArgs) -> Exit {
    // The flag, else the config file's key (a file that does not load is reported by `run`).
    let format = args.log_format.unwrap_or_else(|| {
        args.config
            .as_deref()
            .and_then(|path| Config::load(path).ok())
            .map_or(LogFormat::Text, |config| config.log_format)
    });
    install_logs(format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("turnstile serve: cannot start the runtime: {error}");
            return Exit::Listen;
        }
    };
    let flags = crate::serve::Flags {
        listen: args.listen,
        store: args.store,
        sim_url: args.sim_url,
        config: args.config,
    };
    match runtime.block_on(crate::serve::run(flags)) {
        Ok(()) => Exit::Ok,
        Err(failure) => {
            eprintln!("turnstile serve: {}", failure.message);
            match failure.stage {
                crate::serve::start::Stage::Config => Exit::Config,
                crate::serve::start::Stage::Store => Exit::Store,
                crate::serve::start::Stage::Listen => Exit::Listen,
            }
        }
    }
}
