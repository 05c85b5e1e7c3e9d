//! The probe's children and shared summaries: a child process of this binary with its socket, and
//! NVML's used memory, for the end-to-end run.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Child as Process, Command};

use anyhow::{Context, Result};
use serde_json::Value;
use valve::stats::summarize_us;

use crate::proto;

/// A child process with its socket; killed if still running when dropped.
pub struct Child {
    proc: Process,
    sock: UnixStream,
}

impl Child {
    pub fn spawn(role: &str, args: &[String]) -> Result<Child> {
        let (mine, theirs) = proto::seqpacket_pair()?;
        let fd = theirs.as_raw_fd();
        // The child's end must survive exec: clear close-on-exec on it only.
        nix::fcntl::fcntl(
            fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )?;
        let proc = Command::new(std::env::current_exe()?)
            .arg(role)
            .arg("--sock-fd")
            .arg(fd.to_string())
            .args(args)
            .spawn()
            .with_context(|| format!("starting the {role} child"))?;
        drop(theirs);
        Ok(Child { proc, sock: mine })
    }

    pub fn call(&self, m: Value, fds: &[OwnedFd]) -> Result<Value> {
        proto::call(&self.sock, &m, fds)
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

/// GPU 0's used memory as NVML reports it, bytes; `None` where NVML cannot answer.
pub fn nvml_used() -> Option<u64> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    let used = nvml.device_by_index(0).ok()?.memory_info().ok()?.used;
    Some(used)
}

/// p50/p99/max of microsecond samples.
pub fn summary_of(xs: &[f64]) -> Value {
    serde_json::to_value(summarize_us(xs)).unwrap_or(Value::Null)
}
