//! The measurements: preempt/resume cycles through the library and through a bare ioctl, frozen
//! checks, online-client latency, channel-subset sufficiency and serial vs parallel multi-GPU.

use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use anyhow::{bail, Result};
use serde::Serialize;
use valve::bindings::{
    self as b, ClientHandle, Nv2080FifoDisableChannelsParams, Nvos54Control, SubdeviceHandle,
};
use valve::stats::{summarize_us, Summary};
use valve::{ChannelTarget, Controller, DisabledChannels, PreemptMode, PreemptPlan};

use crate::clock::now_ns;
use crate::heartbeat::Heartbeat;
use crate::hog::Poller;

/// Times of one disable or enable: the whole call, and the ioctl(s) inside it.
#[derive(Clone, Copy, Debug)]
pub struct IssueTiming {
    /// From call to return.
    pub call_us: f64,
    /// Inside the ioctl(s).
    pub ioctl_us: f64,
}

/// Something that can freeze and release one set of channels.
pub trait Preempter {
    /// Disables.
    fn disable(&mut self) -> Result<IssueTiming>;
    /// Enables.
    fn enable(&mut self) -> Result<IssueTiming>;
}

/// Through the library (what Valve ships).
pub struct LibPreempter<'a> {
    ctl: &'a Controller,
    plan: &'a PreemptPlan,
    serial: bool,
    guard: Option<DisabledChannels<'a>>,
}

impl<'a> LibPreempter<'a> {
    /// A preempter for `plan`.
    pub fn new(ctl: &'a Controller, plan: &'a PreemptPlan, serial: bool) -> Self {
        LibPreempter {
            ctl,
            plan,
            serial,
            guard: None,
        }
    }
}

impl Preempter for LibPreempter<'_> {
    fn disable(&mut self) -> Result<IssueTiming> {
        let t0 = now_ns();
        let g = if self.serial {
            self.ctl.disable_serial(self.plan)?
        } else {
            self.ctl.disable_parallel(self.plan)?
        };
        let call_us = (now_ns() - t0) as f64 / 1e3;
        let ioctl_us = g
            .disable_report()
            .gpus
            .iter()
            .map(|t| t.ioctl.as_secs_f64() * 1e6)
            .fold(0.0, f64::max);
        self.guard = Some(g);
        Ok(IssueTiming { call_us, ioctl_us })
    }

    fn enable(&mut self) -> Result<IssueTiming> {
        let Some(g) = self.guard.take() else {
            bail!("enable without disable")
        };
        let t0 = now_ns();
        let rep = g.enable()?;
        let call_us = (now_ns() - t0) as f64 / 1e3;
        let ioctl_us = rep
            .gpus
            .iter()
            .map(|t| t.ioctl.as_secs_f64() * 1e6)
            .fold(0.0, f64::max);
        Ok(IssueTiming { call_us, ioctl_us })
    }
}

/// The baseline: one bare `ioctl(2)` on a prebuilt control, no library in between.
pub struct RawPreempter {
    fd: RawFd,
    client: ClientHandle,
    subdevice: SubdeviceHandle,
    params: Nv2080FifoDisableChannelsParams,
    disabled: bool,
}

impl RawPreempter {
    /// Up to 64 targets on one GPU, issued on the controller's own client and subdevice.
    pub fn new(ctl: &Controller, targets: &[ChannelTarget]) -> Result<Self> {
        let Some(first) = targets.first() else {
            bail!("no targets")
        };
        if targets.len() > b::FIFO_DISABLE_CHANNELS_MAX_ENTRIES
            || targets.iter().any(|t| t.gpu != first.gpu)
        {
            bail!("the raw baseline takes up to 64 channels on one GPU");
        }
        let mut p = Self::empty(ctl, first.gpu)?;
        for (i, t) in targets.iter().enumerate() {
            p.params.client_list[i] = t.client;
            p.params.channel_list[i] = t.channel;
        }
        p.params.num_channels = targets.len() as u32;
        Ok(p)
    }

    /// A control with an empty channel list (`numChannels` 0) on GPU `gpu`, which `new` fills in;
    /// never sent empty.
    fn empty(ctl: &Controller, gpu: usize) -> Result<Self> {
        let Some(subdevice) = ctl.subdevice(gpu) else {
            bail!("no GPU {gpu}")
        };
        Ok(RawPreempter {
            fd: ctl.driver().control_fd().as_raw_fd(),
            client: ctl.client(),
            subdevice,
            params: Nv2080FifoDisableChannelsParams::default(),
            disabled: false,
        })
    }

    /// One bare control: RM's status and the ioctl's time (us). An error only if `ioctl(2)`
    /// itself fails; a status RM refuses with is returned, not raised. After any disable that
    /// reached RM the channels count as disabled, so that `Drop` enables them again.
    pub fn control(&mut self, disable: bool) -> Result<(b::RmStatus, f64)> {
        let mut p = self.params;
        p.disable = u8::from(disable);
        let mut args = Nvos54Control {
            h_client: self.client,
            h_object: self.subdevice.into(),
            cmd: b::NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS,
            flags: 0,
            params: &mut p as *mut _ as u64,
            params_size: std::mem::size_of::<Nv2080FifoDisableChannelsParams>() as u32,
            status: 0,
        };
        let t0 = now_ns();
        // SAFETY: `args` and `p` are live locals of exactly the sizes the request code and
        // `params_size` state; `fd` is the controller's /dev/nvidiactl, open while it lives.
        let ret = unsafe { libc::ioctl(self.fd, b::NV_IOCTL_RM_CONTROL as _, &mut args) };
        let us = (now_ns() - t0) as f64 / 1e3;
        if ret != 0 {
            bail!("raw ioctl failed: {}", std::io::Error::last_os_error());
        }
        let status = b::RmStatus(args.status);
        if self.params.num_channels > 0 && (disable || status == b::NV_OK) {
            self.disabled = disable;
        }
        Ok((status, us))
    }

    fn issue(&mut self, disable: bool) -> Result<IssueTiming> {
        let (status, us) = self.control(disable)?;
        if status != b::NV_OK {
            bail!("raw control failed: {status}");
        }
        Ok(IssueTiming {
            call_us: us,
            ioctl_us: us,
        })
    }
}

impl Preempter for RawPreempter {
    fn disable(&mut self) -> Result<IssueTiming> {
        self.issue(true)
    }
    fn enable(&mut self) -> Result<IssueTiming> {
        self.issue(false)
    }
}

impl Drop for RawPreempter {
    fn drop(&mut self) {
        if self.disabled {
            let _ = self.issue(false);
        }
    }
}

/// One preempt/resume cycle's measurements (microseconds, host clock).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Cycle {
    /// Disable call (library: whole call; raw: the ioctl).
    pub disable_call_us: f64,
    /// Disable ioctl.
    pub disable_ioctl_us: f64,
    /// Last heartbeat after the disable was issued (negative: it had stopped before).
    pub stop_us: f64,
    /// Enable call.
    pub enable_call_us: f64,
    /// Enable ioctl.
    pub enable_ioctl_us: f64,
    /// First heartbeat after the enable was issued.
    pub resume_us: Option<f64>,
    /// Nothing (no slot, no copy) advanced during the hold.
    pub frozen: bool,
}

/// Disable, hold, check frozen, enable, wait for the heartbeat to resume.
pub fn cycle(
    p: &mut dyn Preempter,
    hb: &Heartbeat,
    poller: &Poller,
    hold: Duration,
) -> Result<Cycle> {
    poller.wait_ticking(Duration::from_secs(2))?;
    let t0 = now_ns();
    let d = p.disable()?;
    // Let the preemption settle (it takes well under 2 ms), then watch the hold.
    let settle = Duration::from_millis(2).min(hold / 2);
    std::thread::sleep(settle);
    let before = hb.snapshot();
    std::thread::sleep(hold.saturating_sub(settle));
    let after = hb.snapshot();
    let stop_us = (poller.last_change() as f64 - t0 as f64) / 1e3;
    let t2 = now_ns();
    poller.arm(t2);
    let e = p.enable();
    let e = match e {
        Ok(e) => e,
        Err(err) => bail!("enable failed: {err}"),
    };
    let resumed = poller.wait_first_after_arm(Duration::from_secs(2));
    Ok(Cycle {
        disable_call_us: d.call_us,
        disable_ioctl_us: d.ioctl_us,
        stop_us,
        enable_call_us: e.call_us,
        enable_ioctl_us: e.ioctl_us,
        resume_us: resumed.map(|r| (r as f64 - t2 as f64) / 1e3),
        frozen: before == after,
    })
}

/// Summaries over cycles.
#[derive(Clone, Debug, Serialize)]
pub struct CycleStats {
    /// Cycles.
    pub cycles: usize,
    /// Cycles whose hold was not frozen.
    pub not_frozen: usize,
    /// Cycles whose heartbeat did not resume within 2 s.
    pub not_resumed: usize,
    /// Disable call.
    pub disable_call: Summary,
    /// Disable ioctl.
    pub disable_ioctl: Summary,
    /// GPU stop after issue.
    pub stop: Summary,
    /// Enable call.
    pub enable_call: Summary,
    /// Enable ioctl.
    pub enable_ioctl: Summary,
    /// First heartbeat after enable issue.
    pub resume: Summary,
}

/// Summarises cycles.
pub fn stats(cycles: &[Cycle]) -> CycleStats {
    let col = |f: &dyn Fn(&Cycle) -> Option<f64>| {
        summarize_us(&cycles.iter().filter_map(f).collect::<Vec<_>>())
    };
    CycleStats {
        cycles: cycles.len(),
        not_frozen: cycles.iter().filter(|c| !c.frozen).count(),
        not_resumed: cycles.iter().filter(|c| c.resume_us.is_none()).count(),
        disable_call: col(&|c| Some(c.disable_call_us)),
        disable_ioctl: col(&|c| Some(c.disable_ioctl_us)),
        stop: col(&|c| Some(c.stop_us)),
        enable_call: col(&|c| Some(c.enable_call_us)),
        enable_ioctl: col(&|c| Some(c.enable_ioctl_us)),
        resume: col(&|c| c.resume_us),
    }
}

/// A plan for targets in the default preempt mode.
pub fn plan(ctl: &Controller, targets: &[ChannelTarget]) -> Result<PreemptPlan> {
    Ok(ctl.plan(targets, PreemptMode::Preempt)?)
}
