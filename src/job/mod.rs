//! What a job's processes share, whichever of them runs training or supervises: graceful stops
//! on SIGTERM and SIGINT (`signals.rs`) and the flight recorder's files, reports and SIGUSR1
//! (`flight.rs`). The launcher and the trainer both use them; neither owns them.

pub mod flight;
pub mod signals;
