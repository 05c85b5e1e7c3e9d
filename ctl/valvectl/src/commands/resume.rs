//! `valvectl resume`: enables channels, named by handle (through a controller), by pid, or all
//! the daemon disabled (through the daemon, or from its state file when it is not running).

use std::io::Write;

use clap::Args;
use serde::Serialize;
use valve::controller::BatchReport;
use valve::controller::{Controller, PreemptMode};
use valve::driver::RmDriver;
use valve::state::{reenable, DisabledRecord, Salvage, StateFile};
use valve_daemon::protocol::{Request, ResumeAllReply, ResumeReply, DEFAULT_STATE_DIR};
use valve_daemon::EXIT_NO_DAEMON;

use crate::args::{Globals, TargetArgs};
use crate::client::daemon_call;
use crate::error::CliError;
use crate::print;

/// The arguments of `valvectl resume`.
#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// Which channels.
    #[command(flatten)]
    pub targets: TargetArgs,
    /// Enable everything the daemon disabled (works from its state file if it is not running).
    #[arg(long, conflicts_with_all = ["pid", "gpu", "client", "channels", "targets"])]
    pub all: bool,
}

/// Enables channels named by handle.
pub fn exec<D: RmDriver>(
    args: &ResumeArgs,
    ctl: &Controller<D>,
    g: Globals,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let targets = &args.targets;
    targets.validate()?;
    let t = targets.resolve(&ctl.gpus())?;
    let plan = ctl.plan(&t, PreemptMode::Preempt)?;
    let rep = ctl.enable(&plan)?;
    if g.json {
        let line = Enabled {
            enabled: &rep,
            channels: plan.channels(),
        };
        writeln!(out, "{}", print::json(&line))?;
    } else {
        writeln!(
            out,
            "enabled {} channel(s) on {} GPU(s)",
            plan.channels(),
            plan.gpus()
        )?;
        print::batch(out, "enable", &rep)?;
    }
    Ok(())
}

/// `resume --json` by handle.
#[derive(Serialize)]
struct Enabled<'a> {
    enabled: &'a BatchReport,
    channels: usize,
}

/// `resume --pid` and `resume --all`, through the daemon.
pub fn exec_daemon(args: &ResumeArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    if !args.all {
        let pid = args.targets.pid.expect("dispatched on pid");
        let data: ResumeReply = daemon_call(g.socket, &Request::Resume { pid })?;
        if g.json {
            writeln!(out, "{}", print::json(&data))?;
        } else {
            writeln!(out, "{}", resumed_sentence(&data))?;
            if let Some(rep) = &data.enable {
                print::batch_timing(out, "enable", rep)?;
            }
        }
        return Ok(());
    }
    match daemon_call::<ResumeAllReply>(g.socket, &Request::ResumeAll) {
        Ok(data) => {
            if g.json {
                writeln!(out, "{}", print::json(&data))?;
            } else if data.resumed.is_empty() {
                writeln!(
                    out,
                    "nothing to resume: the daemon held no process preempted"
                )?;
            } else {
                writeln!(out, "resumed pid(s) {:?}", data.resumed)?;
            }
            Ok(())
        }
        Err(CliError::Daemon(code, _)) if code == EXIT_NO_DAEMON => from_state_file(out),
        Err(e) => Err(e),
    }
}

/// What `resume --pid` says the daemon did, as `preempt` says what it did.
fn resumed_sentence(r: &ResumeReply) -> String {
    let held = r
        .held_ms
        .map(|ms| format!(" after {ms:.1} ms"))
        .unwrap_or_default();
    match (&r.note, r.to_gate, &r.enable) {
        (Some(note), ..) => format!("resumed pid {}: {note}", r.pid),
        (None, true, _) => format!(
            "resumed pid {}{held}: handed back to the gate, which runs it while online is idle",
            r.pid
        ),
        (None, false, Some(rep)) => format!(
            "resumed pid {}{held}: {} channel(s) on {} GPU(s) enabled",
            r.pid,
            rep.gpus.iter().map(|g| g.channels).sum::<usize>(),
            rep.gpus.len()
        ),
        (None, false, None) => format!("resumed pid {}{held}", r.pid),
    }
}

/// No daemon: re-enables what its state file records, directly. A file that does not parse (a
/// crash mid-write, a full disk) is salvaged as the daemon does at start: what can be read is
/// re-enabled and the bad file is moved aside. Refusing would leave offline frozen.
fn from_state_file(out: &mut dyn Write) -> Result<(), CliError> {
    let state = StateFile::in_dir(std::path::Path::new(DEFAULT_STATE_DIR));
    let records = records_to_resume(&state, out)?;
    let ctl = Controller::open()?;
    let (n, failures) = reenable(&ctl, &records);
    if failures.is_empty() {
        state.save(&[])?;
    }
    writeln!(
        out,
        "daemon not running: re-enabled {n} channel(s) from {}{}",
        state.path().display(),
        if failures.is_empty() {
            String::new()
        } else {
            format!("; failures: {}", failures.join("; "))
        }
    )?;
    if failures.is_empty() {
        Ok(())
    } else {
        Err(CliError::Daemon(5, failures.join("; ")))
    }
}

/// The state file's records, or what can be read of a file that does not parse (moved aside,
/// and said so on `out`).
fn records_to_resume(
    state: &StateFile,
    out: &mut dyn Write,
) -> Result<Vec<DisabledRecord>, CliError> {
    let loaded = state.load_or_salvage()?;
    if let Some(s) = &loaded.salvage {
        writeln!(out, "{}", salvage_note(s, loaded.records.len()))?;
    }
    Ok(loaded.records)
}

/// What `resume --all` says about a state file it had to salvage.
fn salvage_note(s: &Salvage, kept: usize) -> String {
    let mut note = format!(
        "the state file did not parse ({}); it was moved to {}. Re-enabling the {kept} record(s) \
         that could be read",
        s.reason,
        s.moved_to.display()
    );
    if s.dropped > 0 {
        note.push_str(&format!(
            "; {} record(s) could not be read: if an offline process stays frozen, enable its \
             channels with `valvectl resume --gpu G --client C --channels ...` (`valvectl ps` \
             lists them) or restart it",
            s.dropped
        ));
    }
    note
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_by_pid_says_what_happened_in_a_sentence() {
        use valve_daemon::protocol::{BatchTiming, GpuBatchTiming};
        let enabled = ResumeReply {
            pid: 42,
            enable: Some(BatchTiming {
                gpus: vec![GpuBatchTiming {
                    gpu: 0,
                    channels: 3,
                    ..GpuBatchTiming::default()
                }],
                wall: 40.0,
            }),
            held_ms: Some(1500.25),
            ..ResumeReply::default()
        };
        assert_eq!(
            resumed_sentence(&enabled),
            "resumed pid 42 after 1500.2 ms: 3 channel(s) on 1 GPU(s) enabled"
        );
        let to_gate = ResumeReply {
            enable: None,
            to_gate: true,
            ..enabled.clone()
        };
        assert!(resumed_sentence(&to_gate).contains("handed back to the gate"));
        let gone = ResumeReply {
            pid: 7,
            note: Some("the process's channels are gone (it exited)".into()),
            ..ResumeReply::default()
        };
        assert_eq!(
            resumed_sentence(&gone),
            "resumed pid 7: the process's channels are gone (it exited)"
        );
    }

    #[test]
    fn a_salvaged_state_file_is_reported_with_where_it_went_and_what_to_do() {
        let s = Salvage {
            moved_to: "/run/valve/disabled.json.corrupt-7".into(),
            reason: "EOF while parsing a list at line 9 column 0".into(),
            dropped: 1,
        };
        let note = salvage_note(&s, 2);
        assert!(
            note.contains("moved to /run/valve/disabled.json.corrupt-7"),
            "{note}"
        );
        assert!(note.contains("Re-enabling the 2 record(s)"), "{note}");
        assert!(note.contains("1 record(s) could not be read"), "{note}");
        assert!(
            note.contains("valvectl resume --gpu G --client C"),
            "{note}"
        );
        let whole = Salvage { dropped: 0, ..s };
        assert!(!salvage_note(&whole, 2).contains("could not be read"));
    }

    #[test]
    fn a_corrupt_state_file_is_salvaged_not_refused() {
        let dir = std::env::temp_dir().join(format!("valvectl-resume-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let state = StateFile::in_dir(&dir);
        assert!(
            records_to_resume(&state, &mut Vec::new())
                .unwrap()
                .is_empty(),
            "no file"
        );
        let whole = DisabledRecord {
            pid: 42,
            device_instance: 0,
            client: 0xc1d0_0001,
            channels: vec![0x5c00_0001, 0x5c00_0002],
        };
        let mut second = whole.clone();
        second.pid = 43;
        state.save(&[whole.clone(), second]).unwrap();
        // A crash mid-write: the second record is cut off.
        let text = std::fs::read(state.path()).unwrap();
        std::fs::write(state.path(), &text[..text.len() - 30]).unwrap();
        let mut out = Vec::new();
        let records = records_to_resume(&state, &mut out).unwrap();
        assert_eq!(records, vec![whole], "what is whole is re-enabled");
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("did not parse"), "{text}");
        assert!(!state.path().exists(), "the bad file is moved aside");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
