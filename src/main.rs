//! The `pretrain` binary.

use std::io::IsTerminal;

use clap::Parser;

use tracing_subscriber::EnvFilter;

#[global_allocator]
static GLOBAL: pretrain::Allocator = pretrain::Allocator {};

fn main() -> std::process::ExitCode {
    pretrain::process_defaults();
    pretrain::faults::Faults::load();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let colour = pretrain::cli::log_colours(
        std::io::stdout().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(colour)
        .init();
    match pretrain::cli::run(pretrain::cli::Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            if let Some(stop) = pretrain::job::signals::interrupted(&e) {
                eprintln!("{stop}");
                return std::process::ExitCode::from(stop.exit_code());
            }
            eprintln!("error: {e:#}");
            if pretrain::launch::is_peer_failure(&e) {
                std::process::ExitCode::from(pretrain::launch::PEER_FAILED_EXIT)
            } else if pretrain::job::flight::timed_out(&e) {
                std::process::ExitCode::from(pretrain::launch::TIMED_OUT_EXIT)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}
