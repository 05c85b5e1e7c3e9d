//! `valve-driver-patch`: Valve's driver-patch tools on their own, for scripts and hosts without
//! `valvectl` (`scripts/patch-driver.sh` wraps it). The commands are those of `valvectl driver`.

use std::io::Write;

use clap::Parser;
use valve_driver_patch::cli::{exec, DriverCommand};

/// Valve's one-line NVIDIA driver patch: apply, check, emit it; read it back out of a built module.
#[derive(Debug, Parser)]
#[command(name = "valve-driver-patch", version)]
struct Cli {
    #[command(subcommand)]
    command: DriverCommand,
}

fn main() {
    let cli = Cli::parse();
    let code = {
        let mut out = std::io::stdout().lock();
        let code = exec(&cli.command, &mut out);
        let _ = out.flush();
        code
    };
    std::process::exit(code);
}
