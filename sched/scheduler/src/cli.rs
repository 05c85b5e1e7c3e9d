//! Argument parsing and dispatch for `valve-scheduler`; exit codes.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::commands;
use crate::error::Fail;

const AFTER_HELP: &str = "\
Exit codes: 0 ok, 1 other failure, 2 bad arguments or input, 3 the engine (Slurm) failed,
4 a checked target was missed, 5 another scheduler holds the --state file.
How the model and the Slurm set-up work: docs/cluster.md.";

/// Places offline jobs on GPUs that online inference leaves idle, where their predicted
/// throughput meets their SLA; evicts jobs that keep missing it (Valve, paper section 6).
#[derive(Parser, Debug)]
#[command(name = "valve-scheduler", version, after_help = AFTER_HELP)]
pub struct Cli {
    /// Print results as JSON.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Place held Valve jobs and evict those that keep missing their SLA, in a loop.
    Run(commands::run::RunArgs),
    /// Show what the scheduler would decide now, and why (changes nothing).
    Explain(commands::explain::ExplainArgs),
    /// Submit an offline job with its SLA and profile (sbatch --hold).
    Submit(commands::submit::SubmitArgs),
    /// Record a job's progress (run inside the job).
    Report(commands::report::ReportArgs),
    /// Slurm TaskProlog: give a Valve job its GPUs and progress directory.
    TaskProlog(commands::task_prolog::TaskPrologArgs),
    /// Serve a recorded harvest document as a node agent.
    Agent(commands::agent::AgentArgs),
    /// Predict a job's throughput on one node's harvest document.
    Predict(commands::predict::PredictArgs),
    /// Measure a job's profile: its throughput at several pool shares and alone (root).
    ProfileJob(commands::profile_job::ProfileJobArgs),
    /// Time one scheduling pass over a synthetic cluster (a benchmark, not a test).
    BenchPass(commands::bench_pass::BenchPassArgs),
    /// Simulate a large cluster for a week, once per scheduling policy (`--preset small`: a quick
    /// one); runs the `valve-sim` program (`simulate --help`: its options).
    Simulate(commands::simulate::SimulateArgs),
}

/// Parses the command line, runs the command, maps errors to exit codes.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VALVE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log file or journal gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match &cli.command {
        Command::Run(a) => commands::run::exec(a, cli.json),
        Command::Explain(a) => commands::explain::exec(a, cli.json),
        Command::Submit(a) => commands::submit::exec(a, cli.json),
        Command::Report(a) => commands::report::exec(a, cli.json),
        Command::TaskProlog(a) => commands::task_prolog::exec(a, cli.json),
        Command::Agent(a) => commands::agent::exec(a, cli.json),
        Command::Predict(a) => commands::predict::exec(a, cli.json),
        Command::ProfileJob(a) => commands::profile_job::exec(a, cli.json),
        Command::BenchPass(a) => commands::bench_pass::exec(a, cli.json),
        Command::Simulate(a) => commands::simulate::exec(a, cli.json),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("valve-scheduler: {e:#}");
            ExitCode::from(e.downcast_ref::<Fail>().map_or(1, |f| f.code))
        }
    }
}
