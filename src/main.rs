//! The `kvxfer` command.

mod cli;
mod config_file;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use cli::args::Cli;

fn main() -> ExitCode {
    let args = match config_file::expand(std::env::args_os().collect(), &Cli::command()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let cli = Cli::parse_from(args);
    // Logs go to stderr, filtered by RUST_LOG (warnings by default).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    #[cfg(feature = "nixl")]
    // SAFETY: no thread has started yet (the log subscriber starts none).
    unsafe {
        cli::nixl_runtime::select(cli.nixl_library.as_deref())
    };
    #[cfg(not(feature = "nixl"))]
    if cli.nixl_library.is_some() {
        eprintln!("error: --nixl-library: this kvxfer was built without the `nixl` feature");
        return ExitCode::from(2);
    }
    cli::commands::run(cli.command)
}
