//! `valve-scheduler`: Valve's cluster scheduler for offline jobs on harvested GPUs. `cli.rs`
//! only parses and dispatches (`error.rs`: errors and exit codes); each subcommand lives in `commands/<name>.rs`.

mod cli;
mod commands;
mod error;

fn main() -> std::process::ExitCode {
    cli::main()
}
