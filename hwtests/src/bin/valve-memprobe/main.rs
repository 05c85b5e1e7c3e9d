//! `valve-memprobe`: is sub-layer KV reclamation feasible and fast on this GPU? A pool process
//! owns shareable GPU memory; an offline child streams over it in long kernels; Valve freezes the
//! child's channels, the child swaps reclaimed slots to a quarantine, an online child maps the
//! freed handles and uses them, and offline resumes. Prints and writes timings and checks.

mod discover;
mod e2e;
mod e2e_child;
mod offline;
mod online;
mod pool;
mod proto;
mod side;

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Sub-layer GPU memory reclamation probe (run as root on a GPU host)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The measurement (the pool side); starts its children itself.
    Run(pool::RunArgs),
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
    /// (internal) The offline child.
    #[command(hide = true)]
    Offline {
        #[arg(long)]
        sock_fd: i32,
        #[arg(long)]
        ptx: PathBuf,
        #[arg(long)]
        slot: usize,
        #[arg(long)]
        slots: usize,
        #[arg(long)]
        quarantine: String,
        #[arg(long)]
        kernel_ms: f64,
    },
    /// (internal) The online child.
    #[command(hide = true)]
    Online {
        #[arg(long)]
        sock_fd: i32,
        #[arg(long)]
        ptx: PathBuf,
        #[arg(long)]
        slot: usize,
        #[arg(long)]
        slots: usize,
    },
}

fn inherited(fd: i32) -> UnixStream {
    // SAFETY: the parent passed this descriptor number to us alone and nothing else owns it.
    UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Run(a) => pool::run(&a),
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
        Cmd::Offline {
            sock_fd,
            ptx,
            slot,
            slots,
            quarantine,
            kernel_ms,
        } => offline::run(
            inherited(sock_fd),
            &ptx,
            slot,
            slots,
            &quarantine,
            kernel_ms,
        ),
        Cmd::Online {
            sock_fd,
            ptx,
            slot,
            slots,
        } => online::run(inherited(sock_fd), &ptx, slot, slots),
    }
}
