//! `valvectl driver`: the one-line lock patch for NVIDIA's open kernel module (apply, check,
//! emit, read a built module's flags); the logic is the `valve-driver-patch` crate.

use std::io::Write;

use clap::Args;
use valve_driver_patch::cli::{DriverCommand, EXIT_CODES_HELP};

use crate::error::CliError;

/// The arguments of `valvectl driver`.
#[derive(Debug, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub struct DriverArgs {
    /// What to do.
    #[command(subcommand)]
    pub cmd: DriverCommand,
}

/// Runs the applier; its own output says what happened, so a failure only carries the code.
pub fn exec(args: &DriverArgs, out: &mut dyn Write) -> Result<(), CliError> {
    match valve_driver_patch::cli::exec(&args.cmd, out) {
        0 => Ok(()),
        code => Err(CliError::Reported(code)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        a: DriverArgs,
    }

    #[test]
    fn the_applier_exit_code_comes_through_unchanged() {
        let w = Wrap::try_parse_from(["x", "check", "--src", "/nonexistent-tree"]).unwrap();
        let e = exec(&w.a, &mut Vec::new()).unwrap_err();
        assert_eq!(
            e.exit_code(),
            2,
            "a missing tree is a usage error, as in the applier"
        );
    }
}
