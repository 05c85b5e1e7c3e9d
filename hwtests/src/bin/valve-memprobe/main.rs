//! `valve-memprobe e2e`: the memory pool's reclaim microbenchmark and fault checks on a GPU host,
//! through `valvectl daemon --pool` and offline and online children linked with `valve-client`.

mod child;
mod e2e;
mod e2e_child;
mod proto;
mod side;
mod soak;

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    about = "The memory pool end to end: reclaim timings and faults (run as root on a GPU host)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The whole path: `valvectl daemon --pool`, offline and online children on valve-client.
    E2e(e2e::E2eArgs),
    /// (internal) The end-to-end run's offline child.
    #[command(hide = true)]
    E2eOffline {
        #[arg(long)]
        sock_fd: i32,
        #[arg(long)]
        ptx: PathBuf,
        #[arg(long)]
        pool: PathBuf,
        #[arg(long)]
        gib: u64,
        #[arg(long)]
        kernel_ms: f64,
    },
    /// (internal) The end-to-end run's online child.
    #[command(hide = true)]
    E2eOnline {
        #[arg(long)]
        sock_fd: i32,
        #[arg(long)]
        ptx: PathBuf,
        #[arg(long)]
        pool: PathBuf,
    },
}

fn inherited(fd: i32) -> UnixStream {
    // SAFETY: the parent passed this descriptor number to us alone and nothing else owns it.
    UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::E2e(a) => e2e::run(&a),
        Cmd::E2eOffline {
            sock_fd,
            ptx,
            pool,
            gib,
            kernel_ms,
        } => e2e_child::run_offline(inherited(sock_fd), &ptx, &pool, gib, kernel_ms),
        Cmd::E2eOnline { sock_fd, ptx, pool } => {
            e2e_child::run_online(inherited(sock_fd), &ptx, &pool)
        }
    }
}
