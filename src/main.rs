//! The `pretrain` binary.

use std::io::IsTerminal;

use clap::Parser;

use tracing_subscriber::EnvFilter;

#[global_allocator]
static GLOBAL: pretrain::Allocator = pretrain::Allocator {};

fn main() -> std::process::ExitCode {
    // Ordinary errors are reported by their messages; RUST_BACKTRACE still gives panics theirs.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
    // Every kernel of a module is loaded with its module (which happens when a device opens), not
    // at its first launch: with lazy loading (the driver's default since CUDA 12.2) the first
    // launch can wait on a context-wide lock while NCCL kernels spin waiting for peers. Set before
    // the driver initialises; a user's own setting wins.
    if cfg!(feature = "cuda") && std::env::var_os("CUDA_MODULE_LOADING").is_none() {
        std::env::set_var("CUDA_MODULE_LOADING", "EAGER");
    }
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
            if let Some(stop) = pretrain::train::signals::interrupted(&e) {
                eprintln!("{stop}");
                return std::process::ExitCode::from(stop.exit_code());
            }
            eprintln!("error: {e:#}");
            if pretrain::launch::is_peer_failure(&e) {
                std::process::ExitCode::from(pretrain::launch::PEER_FAILED_EXIT)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}
