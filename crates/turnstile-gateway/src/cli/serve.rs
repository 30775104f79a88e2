//! `turnstile serve [--listen ADDR] [--store URL] [--sim-url URL] [--config FILE]`.

use super::Exit;

/// Arguments of `turnstile serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// Listen address (default 127.0.0.1:8080).
    #[arg(long)]
    listen: Option<String>,
    /// `sqlite:PATH` (default sqlite:./turnstile.db) or `postgres://…`.
    #[arg(long)]
    store: Option<String>,
    /// Use an external `turnstile sim` instead of the built-in one.
    #[arg(long)]
    sim_url: Option<String>,
    /// TOML configuration (tenants, providers, models, limits; see docs/operating.md).
    #[arg(long)]
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
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("turnstile serve: cannot start the runtime: {error}");
            return Exit::Usage;
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
        Err(message) => {
            eprintln!("turnstile serve: {message}");
            Exit::Usage
        }
    }
}
