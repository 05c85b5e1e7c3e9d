//! `valvectl pool status`: what the daemon's GPU memory pool holds, per GPU and per process,
//! and how its reclaims went (asked on the pool socket; no registration needed); `pool cap`
//! limits what offline may hold on a GPU and `pool reclaim` takes memory back from it now (root;
//! both used to profile a job).

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::args::Globals;
use crate::client::pool_call;
use crate::error::CliError;
use crate::print;
use clap::{Args, Subcommand};
use valve_protocol::pool::{
    CapReply, PoolOk, PoolRequest, PoolStatus, ReservationState, Role, TakeBackReply,
};

/// The arguments of `valvectl pool`.
#[derive(Debug, Args)]
pub struct PoolArgs {
    /// What to do.
    #[command(subcommand)]
    pub cmd: PoolCommand,
    /// The pool's socket.
    #[arg(long, default_value = "/run/valve/pool.sock", global = true)]
    pub pool_socket: PathBuf,
}

/// `valvectl pool ...`.
#[derive(Debug, Subcommand)]
pub enum PoolCommand {
    /// Handles per GPU (free, online, offline), the processes holding them, reclaim counters.
    Status,
    /// Limit what all offline processes on a GPU may hold together (root).
    ///
    /// A lower cap stops offline from growing; it takes nothing back. `valve-scheduler
    /// profile-job` raises it step by step to measure a job's memory-throughput curve.
    Cap(CapArgs),
    /// Take memory back from offline on a GPU now, as an online burst would (root).
    ///
    /// Offline is frozen, gives the handles back (its requests that used them are redone) and
    /// resumes; the memory stays free. `valve-scheduler profile-job --reclaim-every` uses it to
    /// measure what a job loses per GiB reclaimed.
    Reclaim(ReclaimArgs),
}

/// The arguments of `valvectl pool reclaim`.
#[derive(Debug, Args)]
pub struct ReclaimArgs {
    /// The GPU.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// How much to take back, in MiB (rounded up to whole handles).
    #[arg(long)]
    pub mib: u64,
}

/// The arguments of `valvectl pool cap`.
#[derive(Debug, Args)]
pub struct CapArgs {
    /// The GPU.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// The most offline may hold, in MiB (rounded down to whole handles).
    #[arg(long, conflicts_with = "lift", required_unless_present = "lift")]
    pub offline_mib: Option<u64>,
    /// Lift the cap.
    #[arg(long)]
    pub lift: bool,
}

fn ask(socket: &std::path::Path) -> Result<PoolStatus, CliError> {
    pool_call(socket, &PoolRequest::Status)
}

/// Asks the pool and prints its answer.
pub fn exec(args: &PoolArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    match &args.cmd {
        PoolCommand::Cap(c) => cap(&args.pool_socket, c, g, out),
        PoolCommand::Reclaim(c) => take_back(&args.pool_socket, c, g, out),
        PoolCommand::Status => {
            let v = ask(&args.pool_socket)?;
            if g.json {
                writeln!(out, "{}", print::json(&PoolOk { ok: true, body: &v }))?;
                return Ok(());
            }
            status(out, &v)
        }
    }
}

/// `pool cap`.
fn cap(socket: &Path, c: &CapArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    let req = PoolRequest::Cap {
        gpu: c.gpu as usize,
        offline_mib: if c.lift { None } else { c.offline_mib },
    };
    let v: CapReply = pool_call(socket, &req)?;
    if g.json {
        writeln!(out, "{}", print::json(&PoolOk { ok: true, body: v }))?;
    } else if let Some(mib) = v.offline_cap_mib {
        writeln!(out, "GPU {}: offline may hold {mib} MiB", c.gpu)?;
    } else {
        writeln!(out, "GPU {}: offline is not capped", c.gpu)?;
    }
    Ok(())
}

/// `pool reclaim`.
fn take_back(
    socket: &Path,
    c: &ReclaimArgs,
    g: Globals,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let req = PoolRequest::Reclaim {
        gpu: c.gpu as usize,
        mib: c.mib,
    };
    let v: TakeBackReply = pool_call(socket, &req)?;
    if g.json {
        writeln!(out, "{}", print::json(&PoolOk { ok: true, body: v }))?;
    } else {
        writeln!(
            out,
            "GPU {}: took {} MiB back from offline",
            c.gpu, v.reclaimed_mib
        )?;
    }
    Ok(())
}

/// `pool status` as a table, the processes and their reservations, and the reclaim counters.
fn status(out: &mut dyn Write, v: &PoolStatus) -> Result<(), CliError> {
    writeln!(
        out,
        "{:<4} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "GPU", "HANDLE", "POOL MiB", "FREE MiB", "ONLINE", "OFFLINE"
    )?;
    for gpu in &v.gpus {
        let mib = |n: usize| (n as u64 * gpu.handle_bytes as u64) >> 20;
        writeln!(
            out,
            "{:<4} {:>6}Mi {:>10} {:>10} {:>10} {:>10}",
            gpu.gpu,
            gpu.handle_bytes >> 20,
            mib(gpu.handles),
            mib(gpu.free),
            mib(gpu.online),
            mib(gpu.offline)
        )?;
    }
    for c in &v.clients {
        let role = match c.role {
            Role::Online => "online",
            Role::Offline => "offline",
        };
        writeln!(
            out,
            "  pid {:<8} {:<8} GPU {} holds {} handle(s)",
            c.pid, role, c.gpu, c.handles
        )?;
        if let Some(m) = &c.reservation {
            writeln!(
                out,
                "    MIAD: holds {} handle(s) by target, headroom {}, T {} ms, {:.1} events/min against {:.1}/min (balance {:+.1})",
                m.target_handles,
                m.headroom_handles,
                m.interval_ms,
                m.event_rate_per_min,
                m.target_rate_per_min,
                m.balance_events
            )?;
            write_start(out, m)?;
        }
    }
    let r = &v.reclaims;
    writeln!(
        out,
        "reclaims {}, handles taken from offline {}, offline killed for missing the deadline {}, last reclaim {} us",
        r.reclaims, r.handles, r.killed, r.last_us
    )?;
    if let Some(kill) = &r.last_kill {
        let answered = if kill.answered {
            "answered too late or wrongly"
        } else {
            "did not answer"
        };
        writeln!(
            out,
            "last kill: pid {} ({answered}) at unix time {}; its threads then: {}",
            kill.pid, kill.unix_s, kill.threads
        )?;
    }
    Ok(())
}

/// How a reservation started: warm (from which file, how old, what was adjusted) or cold (why).
fn write_start(out: &mut dyn Write, m: &ReservationState) -> Result<(), CliError> {
    let st = &m.start;
    let online = &m.online;
    if st.warm {
        write!(
            out,
            "    started warm: {online}'s reservation saved {} s before in {}",
            st.saved_s_ago.unwrap_or(0),
            st.from.as_deref().unwrap_or("?")
        )?;
        let adjusted = st.adjusted.as_deref().unwrap_or_default();
        if !adjusted.is_empty() {
            write!(out, " (adjusted: {})", adjusted.join("; "))?;
        }
        writeln!(out)?;
    } else {
        let why = st.why.as_deref().unwrap_or("?");
        writeln!(out, "    started cold ({online}): {why}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use valve_vmm::wire;

    use super::*;

    #[test]
    fn no_pool_is_exit_7_with_the_command_that_starts_one() {
        let e = ask(std::path::Path::new("/nonexistent/valve-pool.sock")).unwrap_err();
        assert_eq!(e.exit_code(), 7);
        assert!(e.to_string().contains("valvectl daemon --pool"), "{e}");
    }

    #[test]
    fn status_is_read_from_a_live_pool_socket() {
        let dir = std::env::temp_dir().join(format!("valvectl-pool-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pool.sock");
        let _ = std::fs::remove_file(&path);
        let listener = wire::listen(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            let (req, _) = wire::recv(&s).unwrap().unwrap();
            assert_eq!(req["op"], "status");
            let reply = json!({"ok": true, "gpus": [{"gpu": 0, "handle_bytes": 64u64 << 20, "handles": 4, "free": 1, "online": 2, "offline": 1}],
                               "clients": [{"client": 1, "pid": 42, "role": "online", "gpu": 0, "handles": 2,
                                            "reservation": {"target_handles": 2, "headroom_handles": 1, "interval_ms": 600,
                                                            "event_rate_per_min": 3.0, "target_rate_per_min": 6.0,
                                                            "balance_events": -1.5, "events": 3, "online": "label:chat",
                                                            "start": {"warm": true, "from": "/var/lib/valve/reservations.json",
                                                                      "saved_s_ago": 35, "adjusted": ["target 300 clamped to 192"]}}},
                                            {"client": 2, "pid": 43, "role": "online", "gpu": 0, "handles": 0,
                                             "reservation": {"target_handles": 1, "headroom_handles": 1, "interval_ms": 1000,
                                                             "event_rate_per_min": 0.0, "target_rate_per_min": 6.0,
                                                             "balance_events": 0.0, "events": 0, "online": "exe:/usr/bin/python3",
                                                             "start": {"warm": false, "why": "nothing saved for exe:/usr/bin/python3"}}}],
                               "reclaims": {"reclaims": 1, "handles": 2, "killed": 1, "last_us": 1800,
                                            "last_kill": {"pid": 44, "unix_s": 1795687000u64, "answered": false,
                                                          "threads": "44 python3 S futex_wait_queue [202 0x7f10 0x80]"}}});
            wire::send(&s, &reply, &[]).unwrap();
        });
        let args = PoolArgs {
            cmd: PoolCommand::Status,
            pool_socket: path,
        };
        let mut out = Vec::new();
        let g = Globals {
            json: false,
            socket: std::path::Path::new("/unused"),
        };
        exec(&args, g, &mut out).unwrap();
        server.join().unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("256"), "pool MiB: {text}");
        assert!(text.contains("last reclaim 1800 us"), "{text}");
        assert!(
            text.contains("T 600 ms, 3.0 events/min against 6.0/min (balance -1.5)"),
            "{text}"
        );
        assert!(
            text.contains(
                "started warm: label:chat's reservation saved 35 s before in \
                 /var/lib/valve/reservations.json (adjusted: target 300 clamped to 192)"
            ),
            "{text}"
        );
        assert!(
            text.contains("started cold (exe:/usr/bin/python3): nothing saved for"),
            "{text}"
        );
        assert!(
            text.contains("last kill: pid 44 (did not answer) at unix time 1795687000; its threads then: 44 python3 S futex_wait_queue"),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
