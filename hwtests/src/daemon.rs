//! A Valve daemon the hardware test starts on a socket and state directory of its own, and how
//! the test asks it things (`valvectl --json`, the socket's `status`); stopped when dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// A `valvectl daemon` on its own socket and state directory, stopped with SIGTERM on drop.
pub(crate) struct Daemon {
    child: Child,
}

impl Daemon {
    /// Starts it (stderr appended to `log`) and waits until `valvectl status` answers.
    pub(crate) fn start(vc: &Path, sock: &Path, state: &Path, log: &Path) -> Result<Daemon> {
        let err = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = Command::new(vc)
            .arg("--socket")
            .arg(sock)
            .args(["daemon", "--max-hold", "120s", "--state-dir"])
            .arg(state)
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .context("starting valvectl daemon")?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = Command::new(vc)
                .arg("--socket")
                .arg(sock)
                .arg("status")
                .output()?;
            if ok.status.success() {
                return Ok(Daemon { child });
            }
            if Instant::now() > deadline {
                bail!(
                    "the daemon did not answer within 20 s: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts it with the extra daemon flags `extra` (stderr appended to `log`) and waits until
    /// it answers a status request on its socket, asked from this process (no `valvectl`
    /// process is started or exits near the caller's next measurement). Returns the daemon
    /// and that status; a daemon that exits or does not answer within `timeout` is an error,
    /// and one that does not answer is stopped.
    pub(crate) fn start_answering(
        vc: &Path,
        sock: &Path,
        state: &Path,
        log: &Path,
        extra: &[&str],
        timeout: Duration,
    ) -> Result<(Daemon, Value)> {
        let err = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let _ = std::fs::remove_file(sock);
        let child = Command::new(vc)
            .arg("--socket")
            .arg(sock)
            .args(["daemon", "--max-hold", "120s", "--state-dir"])
            .arg(state)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .context("starting valvectl daemon")?;
        let mut d = Daemon { child };
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(status) = status_of(sock) {
                return Ok((d, status));
            }
            if let Some(exit) = d.child.try_wait()? {
                bail!(
                    "the daemon exited ({exit}) before answering; see {}",
                    log.display()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the daemon did not answer within {timeout:?}; see {}",
                    log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, then waits up to `timeout` for it to exit; past that, SIGKILL (an error).
    pub(crate) fn stop_within(mut self, timeout: Duration) -> Result<()> {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        let deadline = Instant::now() + timeout;
        while self.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                self.child.kill()?;
                self.child.wait()?;
                bail!("the daemon did not exit within {timeout:?} of SIGTERM and was killed");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }

    /// SIGKILL and reap it: a crash, as the restart check needs one (nothing of it runs after).
    pub(crate) fn kill(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// SIGTERM, then waits for it to exit.
    pub(crate) fn stop(mut self) -> Result<()> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = self.child.wait();
        }
    }
}

/// `valvectl --socket <sock> --json <args>`: (exit code, parsed stdout or null, stderr).
pub(crate) fn vc_json(vc: &Path, sock: &Path, args: &[&str]) -> Result<(i32, Value, String)> {
    let out = Command::new(vc)
        .arg("--socket")
        .arg(sock)
        .arg("--json")
        .args(args)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let v = serde_json::from_str(text.trim()).unwrap_or(Value::Null);
    Ok((
        out.status.code().unwrap_or(-1),
        v,
        String::from_utf8_lossy(&out.stderr).to_string(),
    ))
}

/// The daemon's `status` data, asked on its socket from this process (1 s timeouts).
pub(crate) fn status_of(sock: &Path) -> Result<Value> {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(sock)?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    s.set_write_timeout(Some(Duration::from_secs(1)))?;
    s.write_all(b"{\"op\":\"status\"}\n")?;
    let mut line = String::new();
    std::io::BufReader::new(s).read_line(&mut line)?;
    let reply: Value = serde_json::from_str(line.trim()).context("status reply")?;
    if !reply["error"].is_null() {
        bail!("status failed: {}", reply["error"]);
    }
    Ok(reply["data"].clone())
}
