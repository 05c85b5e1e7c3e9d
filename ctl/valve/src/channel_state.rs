//! Channel state as RM and GSP keep it (enabled on its runlist or not), read through a diag
//! object under Valve's subdevice: how a freeze is confirmed after the disable returned.

use std::time::{Duration, Instant};

use valve_ioctl_bindings::{Nv208fAllocParams, Nv208fGetChannelStateParams, ObjectHandle};

use crate::controller::{ChannelTarget, Controller, OpenGpu, OWN_HANDLE_BASE};
use crate::driver::RmDriver;

/// One channel's state, as RM answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelState {
    /// Enabled on its runlist: work on it runs (0 once a disable took hold).
    pub enabled: bool,
    /// On a runlist.
    pub scheduled: bool,
}

/// What RM said about one channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelReading {
    /// The channel.
    pub target: ChannelTarget,
    /// Its state, or why RM could not say.
    pub state: Result<ChannelState, String>,
}

/// The readings of a set of channels, and how long they took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateReport {
    /// One per channel asked about, in order; stops early if a reading says `enabled`.
    pub readings: Vec<ChannelReading>,
    /// From the first call to the last answer.
    pub took: Duration,
}

impl StateReport {
    /// The channels RM reported enabled.
    pub fn enabled(&self) -> impl Iterator<Item = &ChannelTarget> {
        self.readings
            .iter()
            .filter(|r| r.state.as_ref().is_ok_and(|s| s.enabled))
            .map(|r| &r.target)
    }

    /// The readings RM could not give, with why.
    pub fn unreadable(&self) -> impl Iterator<Item = (&ChannelTarget, &str)> {
        self.readings
            .iter()
            .filter_map(|r| r.state.as_ref().err().map(|e| (&r.target, e.as_str())))
    }
}

impl<D: RmDriver> Controller<D> {
    /// Reads each target's state; with `stop_at_enabled` it stops at the first channel found
    /// enabled (a freeze that did not take: the answer is known). Never disables or enables.
    pub fn channel_states(&self, targets: &[ChannelTarget], stop_at_enabled: bool) -> StateReport {
        let t0 = Instant::now();
        let mut readings = Vec::with_capacity(targets.len());
        for t in targets {
            let state = self.channel_state(t);
            let stop = stop_at_enabled && state.as_ref().is_ok_and(|s| s.enabled);
            readings.push(ChannelReading { target: *t, state });
            if stop {
                break;
            }
        }
        StateReport {
            readings,
            took: t0.elapsed(),
        }
    }

    fn channel_state(&self, t: &ChannelTarget) -> Result<ChannelState, String> {
        let gpu = self
            .inner
            .gpus
            .get(t.gpu)
            .ok_or_else(|| format!("no GPU {}", t.gpu))?;
        let diag = self.diag(gpu)?;
        let mut p = Nv208fGetChannelStateParams {
            channel: t.channel,
            client: t.client,
            ..Default::default()
        };
        self.inner
            .rm
            .control(self.inner.client, diag, &mut p)
            .map_err(|e| format!("reading channel {:#x}'s state: {e:?}", t.channel.0))?;
        Ok(ChannelState {
            enabled: p.enabled != 0,
            scheduled: p.scheduled != 0,
        })
    }

    /// The GPU's diag object, allocated the first time (freed with the client).
    fn diag(&self, gpu: &OpenGpu) -> Result<ObjectHandle, String> {
        gpu.diag
            .get_or_init(|| {
                let h = ObjectHandle(OWN_HANDLE_BASE | (gpu.info.device_instance << 8) | 3);
                self.inner
                    .rm
                    .alloc(
                        self.inner.client,
                        gpu.subdevice.into(),
                        h,
                        &mut Nv208fAllocParams,
                    )
                    .map(|()| h)
                    .map_err(|e| format!("RM refused a diag object (NV20_SUBDEVICE_DIAG): {e:?}"))
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use valve_ioctl_bindings::ClientHandle;

    use crate::controller::{Controller, PreemptMode};
    use crate::fake::FakeRm;

    use super::*;

    fn setup() -> (Arc<FakeRm>, Controller<Arc<FakeRm>>, Vec<ChannelTarget>) {
        let rm = Arc::new(FakeRm::host(1));
        let targets = rm.process_on_first_gpu(ClientHandle(0xc1d0_0100), 0x10, 4);
        let ctl = Controller::with_driver(rm.clone()).unwrap();
        (rm, ctl, targets)
    }

    #[test]
    fn disabled_channels_read_disabled_and_enabled_ones_enabled() {
        let (_rm, ctl, targets) = setup();
        assert_eq!(ctl.channel_states(&targets, false).enabled().count(), 4);
        let plan = ctl.plan(&targets, PreemptMode::Preempt).unwrap();
        let guard = ctl.disable(&plan).unwrap();
        let report = ctl.channel_states(&targets, false);
        assert_eq!(report.readings.len(), 4);
        assert_eq!(report.enabled().count(), 0);
        assert_eq!(report.unreadable().count(), 0);
        drop(guard);
        assert_eq!(ctl.channel_states(&targets, false).enabled().count(), 4);
    }

    #[test]
    fn a_channel_the_disable_did_not_reach_is_found_and_the_reading_stops_there() {
        let (rm, ctl, targets) = setup();
        rm.state
            .lock()
            .unwrap()
            .ignore_disable
            .insert((targets[1].client, targets[1].channel));
        let plan = ctl.plan(&targets, PreemptMode::Preempt).unwrap();
        let _guard = ctl.disable(&plan).unwrap();
        let report = ctl.channel_states(&targets, true);
        assert_eq!(report.enabled().collect::<Vec<_>>(), vec![&targets[1]]);
        assert_eq!(
            report.readings.len(),
            2,
            "stops at the first enabled channel"
        );
    }

    #[test]
    fn without_a_diag_object_every_reading_says_why() {
        let (rm, ctl, targets) = setup();
        rm.state.lock().unwrap().refuse_diag = true;
        let report = ctl.channel_states(&targets, false);
        assert_eq!(report.unreadable().count(), 4);
        assert!(report.unreadable().all(|(_, why)| why.contains("diag")));
    }
}
