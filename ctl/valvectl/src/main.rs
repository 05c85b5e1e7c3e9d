//! `valvectl`, Valve's command line: list GPUs, preempt and resume channels or processes, bench,
//! run the daemon and the gate, check the node. [`cli::run`] parses and dispatches.

mod args;
mod cli;
mod client;
mod commands;
mod doctor;
mod error;
mod print;

fn main() {
    std::process::exit(cli::run());
}
