//! `turnstile sim [--listen ADDR]`: run the provider simulator.

use super::Exit;

/// Arguments of `turnstile sim`.
#[derive(clap::Args)]
pub struct SimArgs {
    /// Address to listen on (port 0 picks a free one; the chosen address is printed).
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: String,
}

/// Run until killed. Prints `turnstile sim listening on http://ADDR` once bound.
pub fn run(args: &SimArgs) -> Exit {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("turnstile sim: cannot start the runtime: {error}");
            return Exit::Usage;
        }
    };
    runtime.block_on(async {
        let listener = match tokio::net::TcpListener::bind(&args.listen).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("turnstile sim: cannot listen on {}: {error}", args.listen);
                return Exit::Usage;
            }
        };
        // The OpenAI encoders count output with the BPE tokenizers, which load lazily (seconds
        // in a debug build): load them before announcing, so the first reply's response head
        // is as fast as every other's (a gateway's head timeout must not see the load).
        for tokenizer in [
            turnstile_adapters::tokens::Tokenizer::O200kBase,
            turnstile_adapters::tokens::Tokenizer::Cl100kBase,
        ] {
            tokenizer.count("warm");
        }
        match listener.local_addr() {
            Ok(address) => println!("turnstile sim listening on http://{address}"),
            Err(error) => eprintln!("turnstile sim: {error}"),
        }
        match crate::sim::serve(listener, crate::sim::Sim::default()).await {
            Ok(()) => Exit::Ok,
            Err(error) => {
                eprintln!("turnstile sim: {error}");
                Exit::Usage
            }
        }
    })
}
