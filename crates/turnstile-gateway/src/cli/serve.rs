//! `turnstile serve [--listen ADDR] [--store URL] [--sim-url URL] [--config FILE]`.

use super::Exit;

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
}

/// Run the gateway until SIGINT/SIGTERM.
pub fn run(args: ServeArgs) -> Exit {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal: never escapes in a file or the journal.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none(),
        )
        .init();
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
