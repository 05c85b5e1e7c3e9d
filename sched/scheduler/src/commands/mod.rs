//! One module per `valve-scheduler` subcommand, each with its clap arguments (`<Name>Args`) and
//! its `exec`; `cli.rs` only parses and dispatches.

pub mod bench_pass;
