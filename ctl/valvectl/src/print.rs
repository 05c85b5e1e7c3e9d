//! Printing helpers: the human-readable tables and lines of `gpus`, `ps`, `status`, `gate` and
//! the disable/enable reports; `--json` output is written by the commands themselves.

use std::io::Write;

use valve::controller::BatchReport;
use valve::driver::DriverInfo;
use valve::gpu::GpuInfo;
use valve_daemon::protocol::{BatchTiming, GateReply, MpsRole, ProcessEntry, PsReply, StatusReply};
use valve_protocol::gate::{GateStatus, TraceEntry, TraceEvent};

/// `x` as one line of JSON (`--json` output).
pub fn json(x: &impl serde::Serialize) -> String {
    serde_json::to_string(x).expect("replies serialise")
}

/// A disable or enable report: per GPU, then the total.
pub fn batch(out: &mut dyn Write, what: &str, rep: &BatchReport) -> std::io::Result<()> {
    for g in &rep.gpus {
        writeln!(
            out,
            "  {what} GPU {}: {} channel(s), ioctl {:.0} us (started +{:.0} us)",
            g.gpu,
            g.channels,
            g.ioctl.as_secs_f64() * 1e6,
            g.start_offset.as_secs_f64() * 1e6
        )?;
    }
    writeln!(
        out,
        "  {what} total: {:.0} us",
        rep.wall.as_secs_f64() * 1e6
    )
}

/// A disable or enable as the daemon reports it: per GPU, then the total.
pub fn batch_timing(out: &mut dyn Write, what: &str, rep: &BatchTiming) -> std::io::Result<()> {
    for g in &rep.gpus {
        writeln!(
            out,
            "  {what} GPU {}: {} channel(s), ioctl {:.0} us (started +{:.0} us)",
            g.gpu, g.channels, g.ioctl, g.start_offset
        )?;
    }
    writeln!(out, "  {what} total: {:.0} us", rep.wall)
}

/// The STATE of a CUDA MPS client or server in `ps`: it runs, and cannot be frozen.
fn mps_mark(p: &ProcessEntry) -> Option<&'static str> {
    match p.mps? {
        MpsRole::Server => Some("running, MPS server (cannot be frozen)"),
        MpsRole::Client => Some("running, MPS client (cannot be frozen)"),
    }
}

/// The `valvectl ps` table of the daemon's `ps` reply.
pub fn processes(out: &mut dyn Write, data: &PsReply) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<8} {:<16} {:<4} {:<11} {:<5} {:<9} STATE",
        "PID", "COMM", "GPU", "CLIENT", "TSGS", "CHANNELS"
    )?;
    for p in &data.processes {
        if !p.discoverable {
            writeln!(
                out,
                "{:<8} {:<16} {:<4} {:<11} {:<5} {:<9} {}",
                p.pid,
                p.comm,
                "-",
                "-",
                "-",
                "-",
                match mps_mark(p) {
                    Some(mark) => mark,
                    None => p.note.as_deref().unwrap_or(""),
                }
            )?;
            continue;
        }
        let state = match (p.preempted == Some(true), mps_mark(p)) {
            (true, _) => "PREEMPTED",
            (false, Some(mark)) => mark,
            (false, None) => "running",
        };
        for g in &p.gpus {
            let gpu = g.gpu.map_or("?".into(), |i| i.to_string());
            writeln!(
                out,
                "{:<8} {:<16} {:<4} {:<11} {:<5} {:<9} {state}",
                p.pid,
                p.comm,
                gpu,
                g.client,
                g.tsgs.len(),
                g.channels
            )?;
        }
    }
    Ok(())
}

/// The daemon's `status` reply as two lines.
pub fn daemon_status(out: &mut dyn Write, data: &StatusReply) -> std::io::Result<()> {
    writeln!(
        out,
        "daemon up {:.0} s, {} RM events seen, {} GPU process(es) known, preempted pids: {:?}, \
         max hold: {}",
        data.uptime_s,
        data.events,
        data.processes,
        data.preempted,
        data.max_hold_ms
            .map(|m| format!("{m} ms"))
            .unwrap_or("none".into())
    )?;
    writeln!(out, "state file: {}", data.state_file.display())?;
    let f = &data.freeze_checks;
    writeln!(
        out,
        "freeze checks: {} confirmed, {} NOT frozen (a channel still enabled), {} unconfirmed, \
         {} resumed before their check",
        f.confirmed, f.running, f.unconfirmed, f.resumed_first
    )
}

/// The GPUs as `valvectl gpus` prints them, after the driver's version if it can be read.
pub fn gpus(
    out: &mut dyn Write,
    driver: Option<&DriverInfo>,
    gpus: &[GpuInfo],
) -> std::io::Result<()> {
    if let Some(d) = driver {
        writeln!(
            out,
            "driver {} ({})",
            d.version,
            if d.open_module {
                "open kernel module"
            } else {
                "proprietary"
            }
        )?;
    }
    writeln!(
        out,
        "{:<4} {:<28} {:<13} {:<6} {:<12} UUID",
        "IDX", "NAME", "PCI BUS ID", "MINOR", "RM-INSTANCE"
    )?;
    for g in gpus {
        writeln!(
            out,
            "{:<4} {:<28} {:<13} {:<6} {:<12} {}",
            g.index, g.name, g.pci_bus_id, g.minor, g.device_instance, g.uuid
        )?;
    }
    Ok(())
}

/// The gate's status as a few human lines.
pub fn gate_status(out: &mut dyn Write, v: &GateReply) -> std::io::Result<()> {
    let s = match v {
        GateReply::Idle { starting: true, .. } => {
            return writeln!(out, "gate: starting (attaching its programs)");
        }
        GateReply::Idle { .. } => return writeln!(out, "gate: not running"),
        GateReply::Active(s) => s,
    };
    if s.running {
        gate_who(out, s)?;
    } else {
        writeln!(out, "gate: not running")?;
    }
    writeln!(
        out,
        "preemptions {}, resumes {}, online edges {} ({} while offline was held), offline preempted {:.2} s in all; cooldown now {:.2} ms",
        s.preemptions,
        s.resumes,
        s.edges,
        s.quiet_edges,
        s.preempted_s,
        s.cooldown_us / 1e3
    )?;
    if let Some(budget) = s.hold_budget_pct {
        writeln!(
            out,
            "hold for likely arrivals {:.1} ms of it (budget {budget}% of idle time, over {} gaps between requests{}); {} of {} arrivals after an idle online found offline held",
            s.hold_us / 1e3,
            s.hold_gaps,
            if s.hold_gaps < valve_daemon::gate::policy::HOLD_MIN_GAPS {
                "; none before 8"
            } else {
                ""
            },
            s.arrivals_held,
            s.arrivals_idle
        )?;
    }
    gate_latencies(out, s)
}

/// Who the gate runs for and whether offline is frozen now.
fn gate_who(out: &mut dyn Write, s: &GateStatus) -> std::io::Result<()> {
    let who = |pids: &[u32], label: &Option<String>| {
        let mut w = format!("{pids:?}").replace(' ', "");
        if let Some(l) = label {
            w.push_str(&format!(" (label {l})"));
        }
        w
    };
    writeln!(
        out,
        "gate: running; offline {}{}",
        if s.preempted { "PREEMPTED" } else { "running" },
        if s.pinned {
            " (held by a busy signal)"
        } else {
            ""
        }
    )?;
    writeln!(
        out,
        "online pids {}; offline pids {}: {} channel(s) on {} GPU(s)",
        who(&s.online_pids, &s.online_label),
        who(&s.offline_pids, &s.offline_label),
        s.offline_channels,
        s.offline_gpus
    )
}

/// The gate's latencies, arrivals, probes, threads and errors.
fn gate_latencies(out: &mut dyn Write, s: &GateStatus) -> std::io::Result<()> {
    writeln!(
        out,
        "disable p50/p99 {:.0}/{:.0} us, enable {:.0}/{:.0} us, online launch -> offline stopped {:.0}/{:.0} us",
        s.disable_us.p50_us,
        s.disable_us.p99_us,
        s.enable_us.p50_us,
        s.enable_us.p99_us,
        s.edge_to_disable_us.p50_us,
        s.edge_to_disable_us.p99_us
    )?;
    if !s.online_ports.is_empty() {
        writeln!(
            out,
            "online ports {:?}, arrivals {} (hold {:.2} ms), request arrival -> offline stopped {:.0}/{:.0} us; issue {}",
            s.online_ports,
            s.arrivals,
            s.arrival_hold_us / 1e3,
            s.arrival_to_disable_us.p50_us,
            s.arrival_to_disable_us.p99_us,
            s.issue
        )?;
    }
    let h = &s.online_probe_hits;
    writeln!(
        out,
        "online calls probed: {} kernel launches, {} graph launches, {} synchronising calls",
        h.kernel_launches, h.graph_launches, h.syncs
    )?;
    if !s.scheduling.is_empty() {
        writeln!(out, "threads: {}", s.scheduling)?;
    }
    if let Some(e) = &s.last_error {
        writeln!(out, "errors {}, latest: {e}", s.errors)?;
    }
    if let Some(n) = &s.note {
        writeln!(out, "note: {n}")?;
    }
    Ok(())
}

/// One `gate trace` record as a line: sequence, time in ms, event and its fields.
pub fn trace_line(r: &TraceEntry) -> String {
    let ms = |ns: u64| ns as f64 / 1e6;
    let us_after = |ns: u64| ns.saturating_sub(r.t_ns) as f64 / 1e3;
    let what = match r.event {
        TraceEvent::Arrival {
            port,
            recv_ns,
            idle_ns,
            read_ns,
        } => format!(
            "arrival   port {port} ({}seen by the gate +{:.0} us, idle {:.2} ms before)",
            if read_ns > 0 {
                format!("read by its watcher +{:.0} us, ", us_after(read_ns))
            } else {
                String::new()
            },
            us_after(recv_ns),
            ms(idle_ns)
        ),
        TraceEvent::Launch {
            pid,
            recv_ns,
            idle_ns,
            after_resume,
        } => format!(
            "launch    pid {pid} (seen by the gate +{:.0} us, idle {:.2} ms before){}",
            us_after(recv_ns),
            ms(idle_ns),
            if after_resume {
                ": first since the resume (too soon after a wait, or during one, to be an idle edge)"
            } else {
                ""
            }
        ),
        TraceEvent::Disable { pid, end_ns, ok } => {
            switch_line("disable", pid, us_after(end_ns), ok)
        }
        TraceEvent::Enable { pid, end_ns, ok } => switch_line("enable", pid, us_after(end_ns), ok),
        TraceEvent::Cooldown {
            cooldown_ns,
            waits_ignored,
            ..
        } => format!(
            "cooldown  {:.2} ms after the last online activity: resume{}",
            ms(cooldown_ns),
            if waits_ignored {
                " (an online thread still waited on its GPU work: its launches were not seen)"
            } else {
                ""
            }
        ),
        TraceEvent::Busy => "busy".into(),
        TraceEvent::Idle => "idle".into(),
    };
    format!("{:>7} {:>14.3} ms  {what}", r.seq, ms(r.t_ns))
}

/// A disable or enable in the trace.
fn switch_line(what: &str, pid: u32, took_us: f64, ok: bool) -> String {
    format!(
        "{what:<9} {} took {took_us:.0} us{}",
        match pid {
            0 => "all offline".to_string(),
            p => format!("pid {p}"),
        },
        if ok { "" } else { " FAILED" }
    )
}

#[cfg(test)]
mod tests {

    #[test]
    fn status_names_freezes_that_did_not_take() {
        let mut data = valve_daemon::protocol::StatusReply::default();
        data.freeze_checks.confirmed = 9;
        data.freeze_checks.running = 1;
        let mut out = Vec::new();
        daemon_status(&mut out, &data).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("freeze checks: 9 confirmed, 1 NOT frozen"),
            "{text}"
        );
    }

    use super::*;
    use valve_protocol::gate::{LatencySummary, ProbeHits};

    fn entry(seq: u64, t_ns: u64, event: TraceEvent) -> TraceEntry {
        TraceEntry { seq, t_ns, event }
    }

    #[test]
    fn ps_marks_mps_clients_and_servers_as_not_freezable() {
        let gpu =
            serde_json::json!([{"gpu": 0, "client": "0xc1d00010", "tsgs": [], "channels": 13}]);
        // The wire form, as the daemon sends it, read as the typed reply.
        let v: PsReply = serde_json::from_value(serde_json::json!({"processes": [
            {"pid": 10, "comm": "train", "discoverable": true, "preempted": false,
             "gpus": gpu, "mps": "client"},
            {"pid": 11, "comm": "plain", "discoverable": true, "preempted": false,
             "gpus": gpu, "mps": null},
            {"pid": 12, "comm": "nvidia-cuda-mps", "discoverable": false,
             "note": "not discoverable: started before the daemon", "mps": "server"},
        ]}))
        .unwrap();
        let mut out = Vec::new();
        processes(&mut out, &v).unwrap();
        let text = String::from_utf8(out).unwrap();
        let line = |pid: &str| {
            text.lines()
                .find(|l| l.starts_with(pid))
                .unwrap()
                .to_string()
        };
        assert!(
            line("10").ends_with("running, MPS client (cannot be frozen)"),
            "{text}"
        );
        assert!(line("11").ends_with(" running"), "{text}");
        assert!(
            line("12").ends_with("running, MPS server (cannot be frozen)"),
            "{text}"
        );
    }

    #[test]
    fn trace_lines_name_each_event() {
        let arrival = |read_ns| {
            entry(
                3,
                2_000_000,
                TraceEvent::Arrival {
                    port: 8000,
                    recv_ns: 2_050_000,
                    idle_ns: 5_000_000,
                    read_ns,
                },
            )
        };
        let line = trace_line(&arrival(0));
        assert!(
            line.contains("arrival   port 8000 (seen by the gate +50 us, idle 5.00 ms before)"),
            "{line}"
        );
        let line = trace_line(&arrival(2_020_000));
        assert!(
            line.contains("(read by its watcher +20 us, seen by the gate +50 us,"),
            "{line}"
        );
        let l = entry(
            3,
            2_000_000,
            TraceEvent::Launch {
                pid: 7,
                recv_ns: 2_010_000,
                idle_ns: 50_000,
                after_resume: true,
            },
        );
        let line = trace_line(&l);
        assert!(
            line.contains("idle 0.05 ms before): first since the resume"),
            "{line}"
        );
        let d = entry(
            4,
            2_060_000,
            TraceEvent::Disable {
                pid: 0,
                end_ns: 3_160_000,
                ok: true,
            },
        );
        let line = trace_line(&d);
        assert!(
            line.contains("disable   all offline took 1100 us"),
            "{line}"
        );
        let cooldown = |waits_ignored| {
            entry(
                5,
                1,
                TraceEvent::Cooldown {
                    last_activity_ns: 0,
                    cooldown_ns: 3_000_000,
                    waits_ignored,
                },
            )
        };
        let line = trace_line(&cooldown(true));
        assert!(
            line.contains("3.00 ms after the last online activity: resume (an online thread"),
            "{line}"
        );
        assert!(trace_line(&cooldown(false)).ends_with("resume"));
        let e = entry(
            5,
            1,
            TraceEvent::Enable {
                pid: 42,
                end_ns: 2,
                ok: false,
            },
        );
        let line = trace_line(&e);
        assert!(line.ends_with("pid 42 took 0 us FAILED"), "{line}");
    }

    fn p(p50_us: f64, p99_us: f64) -> LatencySummary {
        LatencySummary {
            p50_us,
            p99_us,
            ..LatencySummary::default()
        }
    }

    fn render(v: &GateReply) -> String {
        let mut out = Vec::new();
        gate_status(&mut out, v).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn gate_status_prints_what_an_operator_needs() {
        let v = GateStatus {
            running: true,
            preempted: true,
            online_pids: vec![10],
            offline_pids: vec![20, 21],
            offline_label: Some("batch".into()),
            offline_channels: 40,
            offline_gpus: 2,
            preemptions: 7,
            resumes: 6,
            edges: 90,
            quiet_edges: 80,
            preempted_s: 1.5,
            cooldown_us: 4200.0,
            disable_us: p(650.0, 700.0),
            enable_us: p(400.0, 450.0),
            edge_to_disable_us: p(700.0, 800.0),
            ..GateStatus::default()
        };
        let text = render(&v.clone().into());
        assert!(text.contains("offline PREEMPTED"), "{text}");
        assert!(
            text.contains("[20,21] (label batch): 40 channel(s) on 2 GPU(s)"),
            "{text}"
        );
        assert!(
            text.contains("preemptions 7, resumes 6, online edges 90 (80 while offline was held)"),
            "{text}"
        );
        assert!(text.contains("cooldown now 4.20 ms"), "{text}");
        assert!(text.contains("stopped 700/800 us"), "{text}");
        assert!(
            !text.contains("arrivals"),
            "no ports, no arrival line: {text}"
        );
        let mut held = GateStatus {
            hold_budget_pct: Some(10.0),
            hold_us: 2500.0,
            hold_gaps: 40,
            arrivals_held: 31,
            arrivals_idle: 40,
            ..v.clone()
        };
        let text = render(&held.clone().into());
        assert!(
            text.contains("hold for likely arrivals 2.5 ms of it (budget 10% of idle time, over 40 gaps between requests); 31 of 40 arrivals after an idle online found offline held"),
            "{text}"
        );
        held.hold_gaps = 3;
        assert!(render(&held.into()).contains("; none before 8)"));
        let with_arrivals = GateStatus {
            arrivals: 12,
            online_ports: vec![8000],
            arrival_hold_us: 6000.0,
            arrival_to_disable_us: p(1100.0, 1300.0),
            issue: "serial (forced)".into(),
            scheduling: "gate SCHED_FIFO 10, launch-watch SCHED_FIFO 10".into(),
            online_probe_hits: ProbeHits {
                kernel_launches: 900,
                graph_launches: 30,
                syncs: 31,
            },
            ..v
        };
        let text = render(&with_arrivals.into());
        assert!(
            text.contains("online ports [8000], arrivals 12 (hold 6.00 ms), request arrival -> offline stopped 1100/1300 us; issue serial (forced)"),
            "{text}"
        );
        assert!(
            text.contains("threads: gate SCHED_FIFO 10, launch-watch SCHED_FIFO 10"),
            "{text}"
        );
        assert!(
            text.contains("probed: 900 kernel launches, 30 graph launches, 31 synchronising"),
            "{text}"
        );
        assert_eq!(render(&GateReply::idle(false)), "gate: not running\n");
        assert_eq!(
            render(&GateReply::idle(true)),
            "gate: starting (attaching its programs)\n"
        );
    }
}
