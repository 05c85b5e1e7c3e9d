//! One module per `valve-scheduler` subcommand, each with its clap arguments (`<Name>Args`) and
//! its `exec`; `cli.rs` only parses and dispatches. `common`, `print` and `metrics` are shared.

pub mod agent;
pub mod bench_pass;
pub mod common;
pub mod explain;
pub mod metrics;
pub mod predict;
pub mod print;
pub mod profile_job;
pub mod report;
pub mod run;
pub mod simulate;
pub mod stop;
pub mod submit;
pub mod task_prolog;
