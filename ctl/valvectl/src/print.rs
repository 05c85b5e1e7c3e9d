//! Printing helpers: the human-readable tables and lines of `gpus`, `ps`, `status`, `gate` and
//! the disable/enable reports; `--json` output is written by the commands themselves.

use std::io::Write;

use valve::controller::BatchReport;
use valve::driver::DriverInfo;
use valve::gpu::GpuInfo;

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

/// The STATE of a CUDA MPS client or server in `ps`: it runs, and cannot be frozen.
fn mps_mark(p: &serde_json::Value) -> Option<&'static str> {
    match p["mps"].as_str()? {
        "server" => Some("running, MPS server (cannot be frozen)"),
        "client" => Some("running, MPS client (cannot be frozen)"),
        _ => None,
    }
}

/// The `valvectl ps` table of the daemon's `ps` reply.
pub fn processes(out: &mut dyn Write, data: &serde_json::Value) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<8} {:<16} {:<4} {:<11} {:<5} {:<9} STATE",
        "PID", "COMM", "GPU", "CLIENT", "TSGS", "CHANNELS"
    )?;
    for p in data["processes"].as_array().into_iter().flatten() {
        // serde_json values ignore width specifiers: format them as strings first.
        let pid = p["pid"].to_string();
        if p["discoverable"] == false {
            writeln!(
                out,
                "{:<8} {:<16} {:<4} {:<11} {:<5} {:<9} {}",
                pid,
                p["comm"].as_str().unwrap_or(""),
                "-",
                "-",
                "-",
                "-",
                match mps_mark(p) {
                    Some(mark) => mark,
                    None => p["note"].as_str().unwrap_or(""),
                }
            )?;
            continue;
        }
        let state = match (p["preempted"] == true, mps_mark(p)) {
            (true, _) => "PREEMPTED",
            (false, Some(mark)) => mark,
            (false, None) => "running",
        };
        for g in p["gpus"].as_array().into_iter().flatten() {
            let gpu = g["gpu"]
                .as_u64()
                .map(|i| i.to_string())
                .unwrap_or("?".into());
            writeln!(
                out,
                "{:<8} {:<16} {:<4} {:<11} {:<5} {:<9} {state}",
                pid,
                p["comm"].as_str().unwrap_or(""),
                gpu,
                g["client"].as_str().unwrap_or(""),
                g["tsgs"].as_array().map(|t| t.len()).unwrap_or(0),
                g["channels"].to_string()
            )?;
        }
    }
    Ok(())
}

/// The daemon's `status` reply as two lines.
pub fn daemon_status(out: &mut dyn Write, data: &serde_json::Value) -> std::io::Result<()> {
    writeln!(out, "daemon up {:.0} s, {} RM events seen, {} GPU process(es) known, preempted pids: {}, max hold: {}",
        data["uptime_s"].as_f64().unwrap_or(0.0), data["events"], data["processes"], data["preempted"],
        data["max_hold_ms"].as_u64().map(|m| format!("{m} ms")).unwrap_or("none".into()))?;
    writeln!(
        out,
        "state file: {}",
        data["state_file"].as_str().unwrap_or("")
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
pub fn gate_status(out: &mut dyn Write, v: &serde_json::Value) -> std::io::Result<()> {
    if v["starting"] == true {
        writeln!(out, "gate: starting (attaching its programs)")?;
        return Ok(());
    }
    if v["running"] != true {
        writeln!(out, "gate: not running")?;
        if v.get("preemptions").is_none() {
            return Ok(());
        }
    } else {
        let who = |pids: &serde_json::Value, label: &serde_json::Value| {
            let mut s = pids.to_string();
            if let Some(l) = label.as_str() {
                s.push_str(&format!(" (label {l})"));
            }
            s
        };
        writeln!(
            out,
            "gate: running; offline {}{}",
            if v["preempted"] == true {
                "PREEMPTED"
            } else {
                "running"
            },
            if v["pinned"] == true {
                " (held by a busy signal)"
            } else {
                ""
            }
        )?;
        writeln!(
            out,
            "online pids {}; offline pids {}: {} channel(s) on {} GPU(s)",
            who(&v["online_pids"], &v["online_label"]),
            who(&v["offline_pids"], &v["offline_label"]),
            v["offline_channels"],
            v["offline_gpus"]
        )?;
    }
    let f = |k: &str, p: &str| v[k][p].as_f64().unwrap_or(0.0);
    writeln!(
        out,
        "preemptions {}, resumes {}, online edges {}, offline preempted {:.2} s in all; cooldown now {:.2} ms",
        v["preemptions"],
        v["resumes"],
        v["edges"],
        v["preempted_s"].as_f64().unwrap_or(0.0),
        v["cooldown_us"].as_f64().unwrap_or(0.0) / 1e3
    )?;
    if let Some(budget) = v["hold_budget_pct"].as_f64() {
        writeln!(
            out,
            "hold for likely arrivals {:.1} ms of it (budget {budget}% of idle time, over {} gaps between requests{}); {} arrivals found offline held",
            v["hold_us"].as_f64().unwrap_or(0.0) / 1e3,
            v["hold_gaps"],
            if v["hold_gaps"].as_u64().unwrap_or(0) < valve_daemon::gate::policy::HOLD_MIN_GAPS as u64 {
                "; none before 8"
            } else {
                ""
            },
            v["arrivals_held"].as_u64().unwrap_or(0)
        )?;
    }
    writeln!(
        out,
        "disable p50/p99 {:.0}/{:.0} us, enable {:.0}/{:.0} us, online launch -> offline stopped {:.0}/{:.0} us",
        f("disable_us", "p50_us"),
        f("disable_us", "p99_us"),
        f("enable_us", "p50_us"),
        f("enable_us", "p99_us"),
        f("edge_to_disable_us", "p50_us"),
        f("edge_to_disable_us", "p99_us")
    )?;
    if v.get("arrivals").is_some() {
        writeln!(
            out,
            "online ports {}, arrivals {} (hold {:.2} ms), request arrival -> offline stopped {:.0}/{:.0} us; issue {}",
            v["online_ports"],
            v["arrivals"],
            v["arrival_hold_us"].as_f64().unwrap_or(0.0) / 1e3,
            f("arrival_to_disable_us", "p50_us"),
            f("arrival_to_disable_us", "p99_us"),
            v["issue"].as_str().unwrap_or("?")
        )?;
    }
    if let Some(h) = v.get("online_probe_hits").filter(|h| h.is_object()) {
        writeln!(
            out,
            "online calls probed: {} kernel launches, {} graph launches, {} synchronising calls",
            h["kernel_launches"], h["graph_launches"], h["syncs"]
        )?;
    }
    if let Some(sched) = v["scheduling"].as_str() {
        writeln!(out, "threads: {sched}")?;
    }
    if let Some(e) = v["last_error"].as_str() {
        writeln!(out, "errors {}, latest: {e}", v["errors"])?;
    }
    if let Some(n) = v["note"].as_str() {
        writeln!(out, "note: {n}")?;
    }
    Ok(())
}

/// One `gate trace` record as a line: sequence, time in ms, event and its fields.
pub fn trace_line(r: &serde_json::Value) -> String {
    let ms = |k: &str| r[k].as_u64().unwrap_or(0) as f64 / 1e6;
    let us_after = |k: &str| {
        r[k].as_u64()
            .unwrap_or(0)
            .saturating_sub(r["t_ns"].as_u64().unwrap_or(0)) as f64
            / 1e3
    };
    let what = match r["event"].as_str().unwrap_or("?") {
        "arrival" => format!(
            "arrival   port {} ({}seen by the gate +{:.0} us, idle {:.2} ms before)",
            r["port"],
            match r["read_ns"].as_u64() {
                Some(n) if n > 0 => format!("read by its watcher +{:.0} us, ", us_after("read_ns")),
                _ => String::new(),
            },
            us_after("recv_ns"),
            ms("idle_ns")
        ),
        "launch" => format!(
            "launch    pid {} (seen by the gate +{:.0} us, idle {:.2} ms before){}",
            r["pid"],
            us_after("recv_ns"),
            ms("idle_ns"),
            if r["after_resume"] == true {
                ": first since the resume (too soon after a wait, or during one, to be an idle edge)"
            } else {
                ""
            }
        ),
        e @ ("disable" | "enable") => format!(
            "{e:<9} {} took {:.0} us{}",
            match r["pid"].as_u64() {
                Some(0) | None => "all offline".to_string(),
                Some(p) => format!("pid {p}"),
            },
            us_after("end_ns"),
            if r["ok"] == false { " FAILED" } else { "" }
        ),
        "cooldown" => format!(
            "cooldown  {:.2} ms after the last online activity: resume{}",
            ms("cooldown_ns"),
            if r["waits_ignored"] == true {
                " (an online thread still waited on its GPU work: its launches were not seen)"
            } else {
                ""
            }
        ),
        e => e.to_string(),
    };
    format!("{:>7} {:>14.3} ms  {what}", r["seq"], ms("t_ns"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ps_marks_mps_clients_and_servers_as_not_freezable() {
        let gpu =
            serde_json::json!([{"gpu": 0, "client": "0xc1d00010", "tsgs": [], "channels": 13}]);
        let v = serde_json::json!({"processes": [
            {"pid": 10, "comm": "train", "discoverable": true, "preempted": false,
             "gpus": gpu, "mps": "client"},
            {"pid": 11, "comm": "plain", "discoverable": true, "preempted": false,
             "gpus": gpu, "mps": null},
            {"pid": 12, "comm": "nvidia-cuda-mps", "discoverable": false,
             "note": "not discoverable: started before the daemon", "mps": "server"},
        ]});
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
        let a = serde_json::json!({"seq": 3, "event": "arrival", "t_ns": 2_000_000u64,
            "port": 8000, "recv_ns": 2_050_000u64, "idle_ns": 5_000_000u64});
        let line = trace_line(&a);
        assert!(
            line.contains("arrival   port 8000 (seen by the gate +50 us, idle 5.00 ms before)"),
            "{line}"
        );
        let mut read = a.clone();
        read["read_ns"] = serde_json::json!(2_020_000u64);
        let line = trace_line(&read);
        assert!(
            line.contains("(read by its watcher +20 us, seen by the gate +50 us,"),
            "{line}"
        );
        let l = serde_json::json!({"seq": 3, "event": "launch", "t_ns": 2_000_000u64,
            "pid": 7, "recv_ns": 2_010_000u64, "idle_ns": 50_000u64, "after_resume": true});
        assert!(
            trace_line(&l).contains("idle 0.05 ms before): first since the resume"),
            "{}",
            trace_line(&l)
        );
        let d = serde_json::json!({"seq": 4, "event": "disable", "t_ns": 2_060_000u64,
            "pid": 0, "end_ns": 3_160_000u64, "ok": true});
        assert!(
            trace_line(&d).contains("disable   all offline took 1100 us"),
            "{}",
            trace_line(&d)
        );
        let c = serde_json::json!({"seq": 5, "event": "cooldown", "t_ns": 1,
            "last_activity_ns": 0, "cooldown_ns": 3_000_000u64, "waits_ignored": true});
        assert!(
            trace_line(&c)
                .contains("3.00 ms after the last online activity: resume (an online thread"),
            "{}",
            trace_line(&c)
        );
        let c = serde_json::json!({"seq": 5, "event": "cooldown", "t_ns": 1,
            "last_activity_ns": 0, "cooldown_ns": 3_000_000u64, "waits_ignored": false});
        assert!(trace_line(&c).ends_with("resume"), "{}", trace_line(&c));
        let e = serde_json::json!({"seq": 5, "event": "enable", "t_ns": 1, "pid": 42,
            "end_ns": 2, "ok": false});
        assert!(
            trace_line(&e).ends_with("pid 42 took 0 us FAILED"),
            "{}",
            trace_line(&e)
        );
    }

    #[test]
    fn gate_status_prints_what_an_operator_needs() {
        let v = serde_json::json!({"running": true, "preempted": true, "pinned": false,
            "online_pids": [10], "online_label": null, "offline_pids": [20, 21],
            "offline_label": "batch", "offline_channels": 40, "offline_gpus": 2,
            "preemptions": 7, "resumes": 6, "edges": 90, "preempted_s": 1.5, "cooldown_us": 4200.0,
            "disable_us": {"p50_us": 650.0, "p99_us": 700.0},
            "enable_us": {"p50_us": 400.0, "p99_us": 450.0},
            "edge_to_disable_us": {"p50_us": 700.0, "p99_us": 800.0}, "errors": 0,
            "last_error": null});
        let render = |v: &serde_json::Value| {
            let mut out = Vec::new();
            gate_status(&mut out, v).unwrap();
            String::from_utf8(out).unwrap()
        };
        let text = render(&v);
        assert!(text.contains("offline PREEMPTED"), "{text}");
        assert!(
            text.contains("[20,21] (label batch): 40 channel(s) on 2 GPU(s)"),
            "{text}"
        );
        assert!(text.contains("preemptions 7, resumes 6"), "{text}");
        assert!(text.contains("cooldown now 4.20 ms"), "{text}");
        assert!(text.contains("stopped 700/800 us"), "{text}");
        assert!(
            !text.contains("arrivals"),
            "no arrival line from an older daemon: {text}"
        );
        let mut held = v.clone();
        held["hold_budget_pct"] = serde_json::json!(10.0);
        held["hold_us"] = serde_json::json!(2500.0);
        held["hold_gaps"] = serde_json::json!(40);
        held["arrivals_held"] = serde_json::json!(31);
        let text = render(&held);
        assert!(
            text.contains("hold for likely arrivals 2.5 ms of it (budget 10% of idle time, over 40 gaps between requests); 31 arrivals found offline held"),
            "{text}"
        );
        held["hold_gaps"] = serde_json::json!(3);
        assert!(render(&held).contains("; none before 8)"));
        let mut with_arrivals = v.clone();
        with_arrivals["arrivals"] = serde_json::json!(12);
        with_arrivals["online_ports"] = serde_json::json!([8000]);
        with_arrivals["arrival_hold_us"] = serde_json::json!(6000.0);
        with_arrivals["arrival_to_disable_us"] =
            serde_json::json!({"p50_us": 1100.0, "p99_us": 1300.0});
        with_arrivals["issue"] = serde_json::json!("serial (forced)");
        with_arrivals["scheduling"] =
            serde_json::json!("gate SCHED_FIFO 10, launch-watch SCHED_FIFO 10");
        with_arrivals["online_probe_hits"] =
            serde_json::json!({"kernel_launches": 900, "graph_launches": 30, "syncs": 31});
        let text = render(&with_arrivals);
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
        let mut out = Vec::new();
        gate_status(&mut out, &serde_json::json!({"running": false})).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "gate: not running\n");
        let mut out = Vec::new();
        let starting = serde_json::json!({"running": false, "starting": true});
        gate_status(&mut out, &starting).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "gate: starting (attaching its programs)\n"
        );
    }
}
