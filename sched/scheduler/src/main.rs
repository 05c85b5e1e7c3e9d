//! `valve-scheduler`: Valve's cluster scheduler for offline jobs on harvested GPUs. `cli.rs`
//! only parses and dispatches; each subcommand lives in `commands/<name>.rs`.

mod cli;
mod commands;

fn main() -> std::process::ExitCode {
    cli::main()
}
