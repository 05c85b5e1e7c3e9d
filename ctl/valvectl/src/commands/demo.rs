//! `valvectl demo`: the gate at work on a machine without a GPU, root or BPF. The daemon's own core
//! and socket run over the in-memory RM; a simulated online server's requests freeze an offline job.
//!
//! [`node`] is the daemon's side (the fake GPU, the two workloads' RM events, the loop), and
//! [`online`] the workloads (stand-in processes, the online server's launches). This module is
//! the viewer: it starts a gate over the socket as `valvectl gate start` does, lets the online
//! server serve requests, and prints what `valvectl top --once` shows each time the daemon's
//! state changes. Each frame is the daemon's answer; the fake RM's count of disabled channels is
//! printed beside it.

mod node;
mod online;

use std::io::Write;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use valve::fake::FakeRm;
use valve::Signals;
use valve_daemon::protocol::{GateReply, GateSpec, Request};

use crate::args::Globals;
use crate::client::daemon_call_within;
use crate::commands::top::render;
use crate::commands::top::sample::{self, Sources};
use crate::commands::top::view::{Snapshot, Tracker};
use crate::error::CliError;
use node::{Node, OFFLINE_CHANNELS, ONLINE_CHANNELS};
use online::OnlineServer;

const HELP: &str = "\
What runs: Valve's daemon (its registry, state file, control socket, metrics and gate thread,
the code `valvectl daemon` runs) on an in-memory GPU instead of the NVIDIA driver. Two
processes stand for the workloads: `online-server`, whose requests launch GPU work, and
`offline-job`. The daemon learns their GPU channels from the RM events the eBPF watcher would
report, and the gate sees the server's launches as its uprobes would. The gate runs with
--cooldown-floor 25ms: the simulated server's iterations are a thread's sleeps, whose gaps
stretch by milliseconds on a busy machine.

What it shows: a frame of `valvectl top --once` when the gate starts, when a request freezes
the offline job and when the gate releases it after the request. Nothing is installed or needs
root; the socket and state live in a temporary directory, removed at the end.

Examples:
  valvectl demo
  valvectl demo --requests 3 --busy 500
  valvectl demo --json | jq -c '{frame, caption, frozen: .top.gate.offline_frozen}'";

/// The arguments of `valvectl demo`.
#[derive(Debug, Args)]
#[command(after_long_help = HELP)]
pub struct DemoArgs {
    /// Requests the simulated online server serves, one after another.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=10))]
    pub requests: u32,
    /// How long each request keeps the online server launching GPU work, milliseconds.
    #[arg(long, default_value_t = 800, value_name = "MS",
          value_parser = clap::value_parser!(u64).range(100..=5000))]
    pub busy: u64,
    /// Width of each frame, in columns.
    #[arg(long, default_value_t = 80, value_name = "COLUMNS",
          value_parser = clap::value_parser!(u16).range(40..))]
    pub width: u16,
}

/// The longest the daemon may take to show a freeze or a release (it takes milliseconds).
const STATE_WITHIN: Duration = Duration::from_secs(5);
/// How often the viewer samples the daemon while it waits for a change.
const POLL: Duration = Duration::from_millis(25);
/// The gate's shortest cooldown (`--cooldown-floor`): the simulated iterations are sleeps of a
/// host thread, whose gaps stretch by milliseconds on a busy machine; a GPU server's do not.
const COOLDOWN_FLOOR: Duration = Duration::from_millis(25);
/// Idle time of the online server before and between its requests.
const IDLE: Duration = Duration::from_millis(400);

/// Runs the demo; frames go to `out` as they come.
pub fn exec(
    args: &DemoArgs,
    g: Globals,
    out: &mut dyn Write,
    signals: &Signals,
) -> Result<(), CliError> {
    let mut node = Node::start()?;
    let viewer = Viewer {
        src: Sources {
            socket: node.socket.clone(),
            pool_socket: node.pool_socket(),
        },
        rm: node.rm.clone(),
        server: node.server.clone(),
        online: node.online.pid(),
        offline: node.offline.pid(),
        requests: args.requests,
        busy: viewer_busy(args),
    };
    if !g.json {
        writeln!(out, "{}", intro(&viewer))?;
    }
    let (tx, rx) = mpsc::channel();
    let client = std::thread::spawn(move || viewer.run(&tx));
    // Each step takes milliseconds; this bounds a daemon that never answers.
    let within = (IDLE + viewer_busy(args) + 2 * STATE_WITHIN) * args.requests + 2 * STATE_WITHIN;
    let mut print = |rx: &Receiver<Frame>| -> Result<(), CliError> {
        for f in rx.try_iter() {
            f.write(out, g.json, args.width)?;
        }
        match signals.pending() {
            Some(s) => Err(CliError::Interrupted(s)),
            None => Ok(()),
        }
    };
    let summary = node.serve(client, within, || print(&rx))?;
    print(&rx)?;
    let summary = summary?;
    node.close()?;
    if !g.json {
        writeln!(
            out,
            "demo: done. The gate froze the offline job {} time(s) and released it {} time(s); \
             the daemon resumed everything at its shutdown and the demo's processes and files \
             are gone.",
            summary.freezes, summary.releases
        )?;
    }
    Ok(())
}

fn viewer_busy(args: &DemoArgs) -> Duration {
    Duration::from_millis(args.busy)
}

fn intro(v: &Viewer) -> String {
    format!(
        "valvectl demo: Valve's daemon on an in-memory GPU (no GPU, root or BPF needed).\n\
         online-server (pid {}, {ONLINE_CHANNELS} channels) and offline-job (pid {}, \
         {OFFLINE_CHANNELS} channels) share GPU 0; the gate lets offline run only while online \
         is idle.\nEach frame is what `valvectl top --once` shows at that moment.\n",
        v.online, v.offline
    )
}

/// One frame: what the viewer did last, and what `top` and the fake RM showed after it.
struct Frame {
    n: u32,
    t_s: f64,
    caption: String,
    disabled: usize,
    snap: Snapshot,
}

/// A [`Frame`] as one `--json` line.
#[derive(serde::Serialize)]
struct FrameLine<'a> {
    frame: u32,
    t_s: f64,
    caption: &'a str,
    driver_disabled_channels: usize,
    driver_channels: u32,
    top: &'a Snapshot,
}

impl Frame {
    fn write(&self, out: &mut dyn Write, json: bool, width: u16) -> Result<(), CliError> {
        if json {
            let line = FrameLine {
                frame: self.n,
                t_s: self.t_s,
                caption: &self.caption,
                driver_disabled_channels: self.disabled,
                driver_channels: ONLINE_CHANNELS + OFFLINE_CHANNELS,
                top: &self.snap,
            };
            writeln!(out, "{}", crate::print::json(&line))?;
        } else {
            writeln!(
                out,
                "── frame {} at {:.2} s: {}\n   (the fake driver has {} of {} channels disabled)",
                self.n,
                self.t_s,
                self.caption,
                self.disabled,
                ONLINE_CHANNELS + OFFLINE_CHANNELS
            )?;
            write!(out, "{}", render::to_text(&self.snap, width))?;
            writeln!(out)?;
        }
        out.flush()?;
        Ok(())
    }
}

/// The gate's own counts at the end.
struct Summary {
    freezes: u64,
    releases: u64,
}

/// The client side of the demo, on its own thread: talks to the daemon over its socket only.
struct Viewer {
    src: Sources,
    rm: Arc<FakeRm>,
    server: OnlineServer,
    online: u32,
    offline: u32,
    requests: u32,
    busy: Duration,
}

/// Frames and the tracker their rates come from.
struct Frames<'a> {
    tx: &'a Sender<Frame>,
    shown: Tracker,
    n: u32,
    t0: Instant,
}

impl Viewer {
    fn run(&self, tx: &Sender<Frame>) -> Result<Summary, CliError> {
        let mut frames = Frames {
            tx,
            shown: Tracker::new(&self.src.socket),
            n: 0,
            t0: Instant::now(),
        };
        let spec = GateSpec {
            online: vec![self.online],
            offline: vec![self.offline],
            // Normal scheduling: the demo runs as any user.
            realtime_priority: Some(0),
            cooldown_floor_us: Some(COOLDOWN_FLOOR.as_micros() as u64),
            ..GateSpec::default()
        };
        let started = self.call(Request::GateStart(Box::new(spec)))?;
        if matches!(
            started,
            GateReply::Idle {
                starting: false,
                ..
            }
        ) {
            return Err(CliError::Daemon(
                1,
                "demo: the daemon answered the gate start with no gate running or starting".into(),
            ));
        }
        let caption = "gate started; the online server is idle";
        let mut last = self.show(&mut frames, caption, "the gate to run", |s| {
            s.gate.running && !s.gate.offline_frozen
        })?;
        for r in 1..=self.requests {
            std::thread::sleep(IDLE);
            let server = self.server.clone();
            let busy = self.busy;
            let serving = std::thread::spawn(move || server.serve(busy));
            let caption = format!("request {r} arrives: the online server launches GPU work");
            self.show(&mut frames, &caption, "the gate to freeze offline", |s| {
                s.gate.offline_frozen
            })?;
            let _ = serving.join();
            let caption = format!("request {r} done: the online server is idle again");
            last = self.show(&mut frames, &caption, "the gate to release offline", |s| {
                !s.gate.offline_frozen
            })?;
        }
        // The daemon's shutdown stops the gate, as a SIGTERM to `valvectl daemon` would.
        Ok(Summary {
            freezes: last.gate.preemptions,
            releases: last.gate.resumes,
        })
    }

    /// Sends `req`; its reply read as the gate's state (all the demo asks for is the gate).
    fn call(&self, req: Request) -> Result<GateReply, CliError> {
        daemon_call_within(&self.src.socket, &req, Duration::from_secs(10))
    }

    /// Samples the daemon until `until` holds for what `top` would show, then sends that frame.
    fn show(
        &self,
        frames: &mut Frames<'_>,
        caption: &str,
        waiting_for: &str,
        until: impl Fn(&Snapshot) -> bool,
    ) -> Result<Snapshot, CliError> {
        let deadline = Instant::now() + STATE_WITHIN;
        loop {
            let s = sample::take(&self.src)?;
            let disabled = self.rm.disabled().len();
            // A throw-away tracker reads the state; the frames' own one keeps rates between frames.
            let probe = Tracker::new(&self.src.socket).update(s.clone());
            if until(&probe) {
                let snap = frames.shown.update(s);
                frames.n += 1;
                let _ = frames.tx.send(Frame {
                    n: frames.n,
                    t_s: frames.t0.elapsed().as_secs_f64(),
                    caption: caption.to_string(),
                    disabled,
                    snap: snap.clone(),
                });
                return Ok(snap);
            }
            if Instant::now() > deadline {
                return Err(CliError::Daemon(
                    1,
                    format!("demo: waited {STATE_WITHIN:?} for {waiting_for}, in vain"),
                ));
            }
            std::thread::sleep(POLL);
        }
    }
}
