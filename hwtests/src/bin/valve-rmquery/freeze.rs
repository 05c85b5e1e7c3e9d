//! The freeze-check probe: what RM tells a third process about a channel before, during and
//! after a disable (per-channel state through a diag object, the resident compute channel, the
//! allocated channel IDs), to find the signal the daemon's freeze check can rely on.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use valve::controller::{ChannelTarget, PreemptMode};
use valve::driver::{ControlParams, RmDriver};
use valve::Controller;
use valve_ioctl_bindings::{ChannelHandle, ClientHandle, ObjectHandle};

use crate::{hex, Resident};

/// `NV2080_CTRL_FIFO_GET_ALLOCATED_CHANNELS_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Allocated {
    runlist_id: u32,
    bit_mask: [u32; 128],
}
impl ControlParams for Allocated {
    const CMD: u32 = 0x2080_1119;
}

/// `NV2080_CTRL_FIFO_GET_INFO_PARAMS` with one entry asked for.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FifoInfo {
    size: u32,
    table: [[u32; 2]; 256],
    engine_type: u32,
}
impl ControlParams for FifoInfo {
    const CMD: u32 = 0x2080_1109;
}

/// A target channel, `CLIENT:HANDLE` in hex.
pub fn parse_target(gpu: usize, s: &str) -> Result<ChannelTarget> {
    let (c, h) = s
        .split_once(':')
        .context("name a channel as CLIENT:HANDLE")?;
    Ok(ChannelTarget {
        gpu,
        client: ClientHandle(hex(c)?),
        channel: ChannelHandle(hex(h)?),
    })
}

fn states(ctl: &Controller, targets: &[ChannelTarget]) -> Value {
    let report = ctl.channel_states(targets, false);
    let rows: Vec<Value> = report
        .readings
        .iter()
        .map(|r| {
            let name = format!("{:x}:{:x}", r.target.client.0, r.target.channel.0);
            match &r.state {
                Ok(s) => {
                    json!({"channel": name, "result": "Ok(())", "enabled": u8::from(s.enabled),
                    "scheduled": u8::from(s.scheduled)})
                }
                Err(e) => json!({"channel": name, "result": e}),
            }
        })
        .collect();
    json!(rows)
}

fn sample_resident(ctl: &Controller, sub: ObjectHandle, n: usize, every: Duration) -> Value {
    let mut seen = BTreeMap::<String, usize>::new();
    let t0 = Instant::now();
    let mut cost = Duration::ZERO;
    for i in 0..n {
        let mut p = Resident::default();
        let t = Instant::now();
        let key = match ctl.driver().control(ctl.client(), sub, &mut p) {
            Ok(()) => format!("{:#x}", p.ch_id),
            Err(e) => format!("error {e:?}"),
        };
        cost += t.elapsed();
        *seen.entry(key).or_default() += 1;
        if let Some(wait) = (every * (i as u32 + 1)).checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    json!({"samples": seen, "mean_call_us": cost.as_secs_f64() * 1e6 / n.max(1) as f64})
}

fn allocated(ctl: &Controller, sub: ObjectHandle) -> Value {
    let mut p = Allocated {
        runlist_id: 0,
        bit_mask: [0; 128],
    };
    let r = ctl.driver().control(ctl.client(), sub, &mut p);
    let ids: Vec<u32> = (0..128 * 32)
        .filter(|i| p.bit_mask[(i / 32) as usize] & (1 << (i % 32)) != 0)
        .collect();
    json!({"result": format!("{r:?}"), "chids": ids})
}

fn per_runlist_chram(ctl: &Controller, sub: ObjectHandle) -> Value {
    let mut p = FifoInfo {
        size: 1,
        table: [[0; 2]; 256],
        engine_type: 0,
    };
    p.table[0][0] = 7; // IS_PER_RUNLIST_CHANNEL_RAM_SUPPORTED
    let r = ctl.driver().control(ctl.client(), sub, &mut p);
    json!({"result": format!("{r:?}"), "value": p.table[0][1]})
}

/// Before, during a `hold` with `disable` disabled (a subset of `targets` or all), and after.
pub fn probe(
    ctl: &Controller,
    sub: ObjectHandle,
    targets: &[ChannelTarget],
    disable: &[ChannelTarget],
    hold: Duration,
) -> Result<Value> {
    let every = Duration::from_micros(500);
    let mut out = json!({"per_runlist_chram": per_runlist_chram(ctl, sub),
        "allocated": allocated(ctl, sub)});
    out["before"] =
        json!({"state": states(ctl, targets), "resident": sample_resident(ctl, sub, 400, every)});
    let plan = ctl.plan(disable, PreemptMode::Preempt)?;
    let t = Instant::now();
    let disabled_ns = valve::stats::monotonic_ns();
    let guard = ctl.disable(&plan)?;
    let disable_us = t.elapsed().as_secs_f64() * 1e6;
    // The daemon's own check, as it runs after a disable, over every channel of the target.
    let never = std::sync::atomic::AtomicBool::new(false);
    let daemon_check = valve_daemon::freeze_check::check(ctl, targets, Instant::now(), &never);
    let first = sample_resident(ctl, sub, 20, Duration::from_micros(250));
    let during_state = states(ctl, targets);
    let n = (hold.as_micros() / every.as_micros()).max(1) as usize;
    let during = sample_resident(ctl, sub, n, every);
    let enable_ns = valve::stats::monotonic_ns();
    guard.enable()?;
    out["during"] = json!({"disable_us": disable_us, "daemon_check": daemon_check, "disabled_ns": disabled_ns, "enable_ns": enable_ns, "first_5ms": first, "state": during_state, "resident": during});
    out["after"] =
        json!({"state": states(ctl, targets), "resident": sample_resident(ctl, sub, 400, every)});
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes of the 580 headers' parameter structs (RM checks `paramsSize`).
    #[test]
    fn parameter_structs_have_the_driver_s_sizes() {
        assert_eq!(std::mem::size_of::<Allocated>(), 516);
        assert_eq!(std::mem::size_of::<FifoInfo>(), 2056);
    }

    #[test]
    fn targets_are_client_colon_handle() {
        let t = parse_target(0, "c1d00002:5c000010").unwrap();
        assert_eq!((t.client.0, t.channel.0), (0xc1d0_0002, 0x5c00_0010));
        assert!(parse_target(0, "5c000010").is_err());
    }
}
