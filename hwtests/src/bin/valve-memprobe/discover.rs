//! Finds the offline child's channels the way the daemon does (eBPF on the RM ioctls), and
//! turns them into a preemption plan for the library's controller.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use valve::{ChannelTarget, Controller, NvDriver, PreemptMode, PreemptPlan};
use valve_ebpf::{Registry, WatchConfig, Watcher};

pub struct Discovery {
    watcher: Watcher,
    registry: Registry,
}

impl Discovery {
    pub fn start() -> Result<Discovery> {
        Ok(Discovery {
            watcher: Watcher::start(WatchConfig::default())?,
            registry: Registry::new(),
        })
    }

    /// Every channel of `pid` on every GPU, once its context is up (waits up to 5 s).
    pub fn plan(&mut self, ctl: &Controller<NvDriver>, pid: u32) -> Result<(PreemptPlan, usize)> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            while let Some(ev) = self.watcher.poll(Duration::from_millis(20)) {
                self.registry.apply(&ev);
            }
            let targets = self.targets(ctl, pid);
            if !targets.is_empty() {
                let n = targets.len();
                return Ok((ctl.plan(&targets, PreemptMode::Preempt)?, n));
            }
            if Instant::now() > deadline {
                bail!(
                    "no channels of pid {pid} were seen: is the daemon's BPF program allowed here?"
                );
            }
        }
    }

    fn targets(&self, ctl: &Controller<NvDriver>, pid: u32) -> Vec<ChannelTarget> {
        let gpus = ctl.gpus();
        let mut out = Vec::new();
        for v in self.registry.gpus(pid) {
            let Some(g) = gpus
                .iter()
                .find(|g| Some(g.device_instance) == v.device_instance)
            else {
                continue;
            };
            out.extend(v.channels().map(|c| ChannelTarget {
                gpu: g.index,
                client: v.client,
                channel: c.handle,
            }));
        }
        out
    }
}
