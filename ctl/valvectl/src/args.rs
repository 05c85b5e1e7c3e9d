//! Arguments several commands share: the global flags, which channels (`--pid`, `--gpu`/
//! `--client`/`--channel`, `--target`), and the parsers of handles and durations.

use std::path::Path;
use std::time::Duration;

use clap::Args;
use valve::controller::ChannelTarget;
use valve::gpu::{GpuInfo, GpuSelector};
use valve_ioctl_bindings::{ChannelHandle, ClientHandle};

use crate::error::CliError;

/// The global flags (`--json`, `--socket`), as every command sees them.
#[derive(Clone, Copy, Debug)]
pub struct Globals<'a> {
    /// Print machine-readable JSON on stdout instead of tables.
    pub json: bool,
    /// The daemon's socket.
    pub socket: &'a Path,
}

/// Which channels: one GPU and client with `--gpu/--client/--channel`, or any mix with `--target`.
#[derive(Debug, Args, Clone, Default)]
pub struct TargetArgs {
    /// A process discovered by the daemon: all of its channels (on --gpu only, if given).
    #[arg(long, conflicts_with_all = ["client", "channels", "targets"])]
    pub pid: Option<u32>,
    /// GPU: index from `valvectl gpus`, UUID (GPU-...) or PCI address.
    #[arg(long)]
    pub gpu: Option<GpuSelector>,
    /// The owning process's RM client handle (hex).
    #[arg(long, value_parser = parse_handle, requires = "gpu")]
    pub client: Option<u32>,
    /// Channel handles (hex), comma-separated or repeated.
    #[arg(long = "channel", value_parser = parse_handle, value_delimiter = ',', requires = "gpu")]
    pub channels: Vec<u32>,
    /// GPU:CLIENT:CHANNEL[,CHANNEL...]; repeat for several GPUs or clients.
    #[arg(long = "target", value_parser = parse_target, value_name = "GPU:CLIENT:CHANNELS")]
    pub targets: Vec<TargetSpec>,
}

/// One `--target` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetSpec {
    /// The GPU.
    pub gpu: GpuSelector,
    /// The client.
    pub client: u32,
    /// Its channels.
    pub channels: Vec<u32>,
}

/// Parses an RM handle: hexadecimal, optional 0x.
pub fn parse_handle(s: &str) -> Result<u32, String> {
    let t = s.trim();
    let digits = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if digits.is_empty() || digits.len() > 8 {
        return Err(format!(
            "'{s}' is not an RM handle (8 hex digits at most, e.g. c1d00042)"
        ));
    }
    u32::from_str_radix(digits, 16)
        .map_err(|_| format!("'{s}' is not an RM handle: handles are hexadecimal, e.g. 5c000030"))
}

fn parse_target(s: &str) -> Result<TargetSpec, String> {
    // The GPU part may itself contain ':' (a PCI address), so split from the right.
    let mut parts = s.rsplitn(3, ':');
    let (Some(chans), Some(client), Some(gpu)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(format!(
            "'{s}' is not GPU:CLIENT:CHANNEL[,CHANNEL...] (e.g. 0:c1d00042:5c000030)"
        ));
    };
    let channels = chans
        .split(',')
        .map(parse_handle)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(TargetSpec {
        gpu: gpu.parse()?,
        client: parse_handle(client)?,
        channels,
    })
}

/// Parses `500ms`, `2s`, `1.5s`, `100us`, `1m`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    valve_daemon::config::parse_duration_with(s, true)
}

/// A share given in percent, with or without the sign ("10%", "2.5"): more than 0, at most 50.
pub fn parse_percent(s: &str) -> Result<f64, String> {
    let number = s.trim().trim_end_matches('%');
    let pct: f64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a percentage (e.g. 10%)"))?;
    if !(pct.is_finite() && pct > 0.0 && pct <= 50.0) {
        return Err(format!("{s} is outside more than 0% and at most 50%"));
    }
    Ok(pct)
}

impl TargetArgs {
    /// Checks the combinations clap cannot express.
    pub fn validate(&self) -> Result<(), CliError> {
        if self.pid.is_none()
            && self.gpu.is_some()
            && (self.client.is_none() || self.channels.is_empty())
        {
            return Err(CliError::Usage(
                "--gpu needs --client and --channel (or use --pid with the daemon)".into(),
            ));
        }
        Ok(())
    }

    /// Resolves GPUs and handles into channel targets.
    pub fn resolve(&self, gpus: &[GpuInfo]) -> Result<Vec<ChannelTarget>, CliError> {
        let mut out = Vec::new();
        let mut add = |gpu: &GpuSelector, client: u32, channels: &[u32]| -> Result<(), CliError> {
            let gpu = gpu.resolve(gpus)?;
            out.extend(channels.iter().map(|&c| ChannelTarget {
                gpu,
                client: ClientHandle(client),
                channel: ChannelHandle(c),
            }));
            Ok(())
        };
        if let (Some(gpu), Some(client)) = (&self.gpu, self.client) {
            add(gpu, client, &self.channels)?;
        }
        for t in &self.targets {
            add(&t.gpu, t.client, &t.channels)?;
        }
        if out.is_empty() {
            return Err(CliError::Usage(
                "name the channels: --gpu G --client C --channel CH[,CH...], or --target G:C:CH[,CH...]"
                    .into(),
            ));
        }
        Ok(out)
    }

    /// The `--target` flags that name `targets` (the resume command `preempt --detach` prints).
    pub fn as_command_line(&self, gpus: &[GpuInfo], targets: &[ChannelTarget]) -> String {
        let mut by: std::collections::BTreeMap<(usize, u32), Vec<u32>> = Default::default();
        for t in targets {
            by.entry((t.gpu, t.client.0)).or_default().push(t.channel.0);
        }
        by.iter()
            .map(|((g, c), chans)| {
                let id = gpus
                    .get(*g)
                    .map(|g| g.pci_bus_id.clone())
                    .unwrap_or(g.to_string());
                let list: Vec<String> = chans.iter().map(|c| format!("{c:x}")).collect();
                format!("--target {id}:{c:x}:{}", list.join(","))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_durations_and_targets_parse() {
        assert_eq!(parse_handle("c1d00042"), Ok(0xc1d0_0042));
        assert_eq!(parse_handle("0x5C000030"), Ok(0x5c00_0030));
        assert!(parse_handle("xyz").unwrap_err().contains("hexadecimal"));
        assert!(parse_handle("123456789").is_err());
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("100us"), Ok(Duration::from_micros(100)));
        assert!(parse_duration("5 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        let t = parse_target("0000:18:00.0:c1d00042:5c000030,5c000031").unwrap();
        assert_eq!(t.gpu, GpuSelector::PciBusId("0000:18:00.0".into()));
        assert_eq!(t.client, 0xc1d0_0042);
        assert_eq!(t.channels, vec![0x5c00_0030, 0x5c00_0031]);
        assert!(parse_target("0:c1d00042").is_err());
    }
}
