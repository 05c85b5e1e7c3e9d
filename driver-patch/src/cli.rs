//! The command line: clap subcommands and their `exec`, shared by the `valve-driver-patch` binary
//! (which `scripts/patch-driver.sh` wraps) and `valvectl driver`. Normal output goes to `out`;
//! refusals and warnings go to stderr, as the Python applier printed them.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use crate::{Flag, PatchError, PatchOptions, EXIT_FAILED, EXIT_OK};

/// The exit codes of `patch` and `check` (also in docs/driver-patch.md).
pub const EXIT_CODES_HELP: &str = "\
exit codes (the same with and without --check):
   0  patched: the flag is set now, was set already (\"already patched\"), or (--check) is set
  10  --check only: not patched (the entry lacks the flag); nothing changed
   2  usage error, or --src is not a directory
   3  refused: a prebuilt or proprietary driver (*.o_binary, no src/nvidia), not the source
   4  unsupported: a tree this applier does not understand or will not patch (files missing,
      no entry or several entries for the method id, flags not parseable, flag not defined,
      or a 525-branch entry where the per-GPU lock would not help); nothing changed
   1  a file could not be read or written
";

const PATCH_ABOUT: &str = "Apply Valve's one-line patch to an open-gpu-kernel-modules source tree";
const PATCH_LONG_ABOUT: &str = "Apply Valve's one-line patch to an open-gpu-kernel-modules source tree: the \
FIFO_DISABLE_CHANNELS control (0x2080110b) gets a flag that makes RM lock only the target GPU, so preempting N \
GPUs costs about one GPU's time instead of N.";

/// The tree and the flag, common to `patch`, `check` and `emit-patch`.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct TreeArgs {
    /// Root of the open-gpu-kernel-modules tree (with src/nvidia and kernel-open).
    #[arg(long, value_name = "DIR")]
    pub src: PathBuf,
    /// The flag to add (route-to-physical is for experiments only, see docs/driver-patch.md).
    #[arg(long, value_enum, value_name = "FLAG", default_value_t = Flag::GpuLockDeviceOnly)]
    pub flag: Flag,
}

/// `valve-driver-patch <command>` / `valvectl driver <command>`.
#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
pub enum DriverCommand {
    #[command(about = PATCH_ABOUT, long_about = PATCH_LONG_ABOUT, after_help = EXIT_CODES_HELP)]
    #[command(infer_long_args = true, args_override_self = true)]
    Patch {
        #[command(flatten)]
        tree: TreeArgs,
        /// Report patched / not patched / unsupported; change nothing.
        #[arg(long)]
        check: bool,
        /// Also write the change as a unified diff to FILE.
        #[arg(long, value_name = "FILE")]
        emit_patch: Option<PathBuf>,
    },
    /// Report patched (0) / not patched (10) / unsupported; change nothing (= patch --check).
    #[command(after_help = EXIT_CODES_HELP)]
    #[command(infer_long_args = true, args_override_self = true)]
    Check {
        #[command(flatten)]
        tree: TreeArgs,
    },
    /// Print the change as a unified diff (the same whether the tree is patched yet or not); change
    /// nothing.
    #[command(after_help = EXIT_CODES_HELP)]
    #[command(infer_long_args = true, args_override_self = true)]
    EmitPatch {
        #[command(flatten)]
        tree: TreeArgs,
    },
    /// Print the FIFO_DISABLE_CHANNELS flags a compiled object or module (g_subdevice_nvoc.o,
    /// nv-kernel.o, nvidia.ko) carries; exit 0 when there is exactly one such entry, else 1.
    EntryFlags {
        /// The object or (uncompressed) module.
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Print a one-line apt sources list: this machine's Debian archives with contrib and non-free
    /// added, for a private `apt-get update` (exit 1 if there is none).
    AptSources {
        /// The apt configuration to read (sources.list, sources.list.d/*.list|*.sources).
        #[arg(long, value_name = "DIR", default_value = "/etc/apt")]
        etc_apt: PathBuf,
    },
}

/// Prints a refusal or failure the way the Python applier did, and returns its exit code.
fn fail(e: &PatchError) -> i32 {
    eprintln!("patch-driver: {}: {e}", e.word());
    e.exit_code()
}

fn warn_route_to_physical(flag: Flag) {
    if flag == Flag::RouteToPhysical {
        eprintln!(
            "patch-driver: warning: ROUTE_TO_PHYSICAL sends the control to GSP before the kernel-side check of \
             pRunlistPreemptEvent, and (550+) makes it fail on vGPU guests; use only for experiments"
        );
    }
}

fn run_patch(src: &Path, opts: &PatchOptions, out: &mut dyn Write) -> io::Result<i32> {
    let plan = match crate::plan(src, opts.flag) {
        Ok(plan) => plan,
        Err(e) => return Ok(fail(&e)),
    };
    warn_route_to_physical(opts.flag);
    write!(out, "{}", plan.report)?;
    match plan.apply(opts) {
        Ok(status) => {
            out.write_all(status.line(&plan.report).as_bytes())?;
            Ok(status.exit_code())
        }
        Err(e) => {
            out.flush()?;
            Ok(fail(&e))
        }
    }
}

fn run_emit_patch(tree: &TreeArgs, out: &mut dyn Write) -> io::Result<i32> {
    match crate::emit_patch(&tree.src, tree.flag) {
        Ok(diff) => {
            warn_route_to_physical(tree.flag);
            out.write_all(&diff)?;
            Ok(EXIT_OK)
        }
        Err(e) => Ok(fail(&e)),
    }
}

fn run_entry_flags(file: &Path, out: &mut dyn Write) -> io::Result<i32> {
    match crate::entry_flags(file) {
        Ok(flags) if flags.is_empty() => {
            writeln!(out, "none")?;
            Ok(EXIT_FAILED)
        }
        Ok(flags) => {
            let words: Vec<String> = flags.iter().map(|f| format!("{f:#x}")).collect();
            writeln!(out, "{}", words.join(" "))?;
            Ok(if flags.len() == 1 {
                EXIT_OK
            } else {
                EXIT_FAILED
            })
        }
        Err(e) => {
            eprintln!("entry-flags: {e}");
            Ok(e.exit_code())
        }
    }
}

fn run_apt_sources(etc_apt: &Path, out: &mut dyn Write) -> io::Result<i32> {
    match crate::apt_sources(etc_apt) {
        Ok(lines) => {
            writeln!(out, "{}", lines.join("\n"))?;
            Ok(EXIT_OK)
        }
        Err(e) => {
            eprintln!("apt-sources: {e}");
            Ok(e.exit_code())
        }
    }
}

/// Runs `cmd`, printing its normal output to `out` (flushed before returning) and refusals,
/// warnings and failures to stderr; returns the process exit code (see [`EXIT_CODES_HELP`]).
pub fn exec(cmd: &DriverCommand, out: &mut dyn Write) -> i32 {
    let result = match cmd {
        DriverCommand::Patch {
            tree,
            check,
            emit_patch,
        } => {
            let opts = PatchOptions {
                flag: tree.flag,
                check: *check,
                emit_patch: emit_patch.clone(),
            };
            run_patch(&tree.src, &opts, out)
        }
        DriverCommand::Check { tree } => {
            let opts = PatchOptions {
                flag: tree.flag,
                check: true,
                emit_patch: None,
            };
            run_patch(&tree.src, &opts, out)
        }
        DriverCommand::EmitPatch { tree } => run_emit_patch(tree, out),
        DriverCommand::EntryFlags { file } => run_entry_flags(file, out),
        DriverCommand::AptSources { etc_apt } => run_apt_sources(etc_apt, out),
    };
    match result.and_then(|code| out.flush().map(|()| code)) {
        Ok(code) => code,
        // stdout closed or full: the output is lost, which is a failure of the command.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => EXIT_FAILED,
        Err(e) => {
            eprintln!("patch-driver: error: writing the output: {e}");
            EXIT_FAILED
        }
    }
}
