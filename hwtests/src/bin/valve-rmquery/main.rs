//! `valve-rmquery`: asks RM, as a third process, what it tells about other processes' channels:
//! which channels (and subcontexts) share a channel group, which channel is resident on the
//! compute engine, and which pids hold an MPS server object. Prints one JSON object per query.
//!
//! A research probe for `docs/mps.md` (run by `hwtests/mps/probe.sh` on a GPU host): the answers
//! are recorded as they come, RM errors included.

mod freeze;

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use valve::driver::{ControlParams, RmDriver};
use valve::Controller;
use valve_ioctl_bindings::ObjectHandle;

/// `NV2080_CTRL_CMD_FIFO_MAX_CHANNELS_PER_TSG`.
const MAX_CHANNELS_PER_TSG: usize = 128;
/// `NV2080_CTRL_GPU_GET_PIDS_MAX_COUNT`.
const GET_PIDS_MAX: usize = 950;
/// `MPS_COMPUTE`, the class an MPS server allocates.
const MPS_COMPUTE: u32 = 0x900e;

/// `NV2080_CTRL_FIFO_GET_CHANNEL_GROUP_UNIQUE_ID_INFO_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GroupInfo {
    client: u32,
    channel_or_tsg: u32,
    tsg_id: u32,
    num_channels: u32,
    channel_unique_id: [u32; MAX_CHANNELS_PER_TSG],
    vas_unique_id: [u32; MAX_CHANNELS_PER_TSG],
    veid: [u32; MAX_CHANNELS_PER_TSG],
}
impl ControlParams for GroupInfo {
    const CMD: u32 = 0x2080_1123;
}

/// `NV2080_CTRL_GR_GET_CURRENT_RESIDENT_CHANNEL_PARAMS`: `chID`, then the 8-byte aligned
/// `NV2080_CTRL_GR_ROUTE_INFO` (flags, route); flags 0 is the default engine.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Resident {
    ch_id: u32,
    _pad: u32,
    route_flags: u32,
    _pad2: u32,
    route: u64,
}
impl ControlParams for Resident {
    const CMD: u32 = 0x2080_121c;
}

/// `NV2080_CTRL_GPU_GET_PIDS_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GetPids {
    id_type: u32,
    id: u32,
    count: u32,
    pids: [u32; GET_PIDS_MAX],
}
impl ControlParams for GetPids {
    const CMD: u32 = 0x2080_018d;
}

#[derive(Parser)]
#[command(about = "What RM tells a third process about other processes' channels (GPU host)")]
struct Cli {
    /// The GPU (Valve's index, as `valvectl gpus` prints it).
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Channels, VEIDs and VA spaces of channel groups or channels, each named CLIENT:HANDLE (hex).
    Group { objects: Vec<String> },
    /// The channel resident on the compute engine, sampled `samples` times `interval_us` apart.
    Resident {
        #[arg(long, default_value_t = 1000)]
        samples: usize,
        #[arg(long, default_value_t = 1000)]
        interval_us: u64,
    },
    /// The pids that hold an MPS server object (class MPS_COMPUTE) on the GPU.
    MpsPids,
    /// The freeze-check probe: each channel's state (diag object), the resident compute
    /// channel and the allocated channel IDs, before, during and after a disable of the
    /// channels (all but `--leave-out`), each named CLIENT:HANDLE (hex).
    Freeze {
        channels: Vec<String>,
        /// Channels left enabled during the hold (a freeze the check must see fail).
        #[arg(long, value_delimiter = ',')]
        leave_out: Vec<String>,
        #[arg(long, default_value_t = 1000)]
        hold_ms: u64,
    },
}

fn hex(s: &str) -> Result<u32> {
    u32::from_str_radix(s.trim_start_matches("0x"), 16).with_context(|| format!("not hex: {s}"))
}

fn group(ctl: &Controller, sub: ObjectHandle, object: &str) -> Result<Value> {
    let Some((c, h)) = object.split_once(':') else {
        bail!("name an object as CLIENT:HANDLE, not {object}");
    };
    let mut p = GroupInfo {
        client: hex(c)?,
        channel_or_tsg: hex(h)?,
        tsg_id: 0,
        num_channels: 0,
        channel_unique_id: [0; MAX_CHANNELS_PER_TSG],
        vas_unique_id: [0; MAX_CHANNELS_PER_TSG],
        veid: [0; MAX_CHANNELS_PER_TSG],
    };
    let r = ctl.driver().control(ctl.client(), sub, &mut p);
    let n = (p.num_channels as usize).min(MAX_CHANNELS_PER_TSG);
    Ok(json!({
        "object": object, "result": format!("{r:?}"), "tsg_id": p.tsg_id, "channels": n,
        "channel_unique_ids": &p.channel_unique_id[..n], "veids": &p.veid[..n],
        "vas_unique_ids": &p.vas_unique_id[..n],
    }))
}

fn resident(ctl: &Controller, sub: ObjectHandle, samples: usize, interval: Duration) -> Value {
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    let t0 = Instant::now();
    for i in 0..samples {
        let mut p = Resident::default();
        let key = match ctl.driver().control(ctl.client(), sub, &mut p) {
            Ok(()) => format!("{:#x}", p.ch_id),
            Err(e) => format!("error {e:?}"),
        };
        *seen.entry(key).or_default() += 1;
        let next = interval * (i as u32 + 1);
        if let Some(wait) = next.checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    json!({"resident_channel_samples": seen, "samples": samples,
           "span_ms": t0.elapsed().as_secs_f64() * 1e3})
}

fn mps_pids(ctl: &Controller, sub: ObjectHandle) -> Value {
    let mut p = GetPids {
        id_type: 0,
        id: MPS_COMPUTE,
        count: 0,
        pids: [0; GET_PIDS_MAX],
    };
    let r = ctl.driver().control(ctl.client(), sub, &mut p);
    let n = (p.count as usize).min(GET_PIDS_MAX);
    json!({"mps_server_pids": &p.pids[..n], "result": format!("{r:?}")})
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let ctl = Controller::open()?;
    let Some(sub) = ctl.subdevice(cli.gpu) else {
        bail!("no GPU {} (valvectl gpus lists them)", cli.gpu);
    };
    let sub = ObjectHandle::from(sub);
    match cli.cmd {
        Cmd::Group { objects } => {
            for o in &objects {
                println!("{}", group(&ctl, sub, o)?);
            }
        }
        Cmd::Resident {
            samples,
            interval_us,
        } => println!(
            "{}",
            resident(&ctl, sub, samples, Duration::from_micros(interval_us))
        ),
        Cmd::MpsPids => println!("{}", mps_pids(&ctl, sub)),
        Cmd::Freeze {
            channels,
            leave_out,
            hold_ms,
        } => {
            let all = channels
                .iter()
                .map(|c| freeze::parse_target(cli.gpu, c))
                .collect::<Result<Vec<_>>>()?;
            let out = leave_out
                .iter()
                .map(|c| freeze::parse_target(cli.gpu, c))
                .collect::<Result<Vec<_>>>()?;
            let disable: Vec<_> = all.iter().filter(|t| !out.contains(t)).cloned().collect();
            let hold = Duration::from_millis(hold_ms);
            println!("{}", freeze::probe(&ctl, sub, &all, &disable, hold)?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RM checks `paramsSize` against its own struct: these are the sizes of the 580 headers.
    #[test]
    fn parameter_structs_have_the_driver_s_sizes() {
        assert_eq!(
            std::mem::size_of::<GroupInfo>(),
            16 + 3 * 4 * MAX_CHANNELS_PER_TSG
        );
        assert_eq!(std::mem::size_of::<Resident>(), 24);
        assert_eq!(std::mem::offset_of!(Resident, route_flags), 8);
        assert_eq!(std::mem::size_of::<GetPids>(), 12 + 4 * GET_PIDS_MAX);
    }

    #[test]
    fn objects_are_client_colon_handle_in_hex() {
        assert_eq!(hex("0xc1d00010").unwrap(), 0xc1d0_0010);
        assert_eq!(hex("5c000002").unwrap(), 0x5c00_0002);
        assert!(hex("zz").is_err());
    }
}
