//! The demo's node: the daemon's core and control socket, run as `valvectl daemon` runs them but
//! over the in-memory RM with one GPU, fed the RM events the eBPF watcher would report.

use std::cell::RefCell;
use std::collections::{BTreeSet, VecDeque};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use valve::controller::Controller;
use valve::fake::FakeRm;
use valve::state::StateFile;
use valve_daemon::audit::Audit;
use valve_daemon::gate::GateStarter;
use valve_daemon::metrics::{install_for_gate, Metrics};
use valve_daemon::server::{bind, EventSource, Server};
use valve_daemon::DaemonCore;
use valve_ebpf::{AllocEvent, RmEvent, RmEventKind};
use valve_ioctl_bindings::{self as b, ChannelHandle, ClientHandle, ObjectHandle};

use super::online::{OnlineServer, StandIn};
use crate::error::CliError;

/// The online server's channels on the GPU.
pub const ONLINE_CHANNELS: u32 = 2;
/// The offline job's channels on the GPU: what a freeze disables.
pub const OFFLINE_CHANNELS: u32 = 4;
/// The daemon's hold limit, as the packaged config sets it.
const MAX_HOLD: Duration = Duration::from_secs(60);

/// RM events, handed to the daemon's loop as the eBPF watcher would deliver them.
struct Queued(RefCell<VecDeque<RmEvent>>);

impl EventSource for Queued {
    fn next_event(&self) -> Option<RmEvent> {
        self.0.borrow_mut().pop_front()
    }
    fn alive(&self) -> bool {
        true
    }
}

/// The node: the fake GPU, the two workloads, the daemon's core and its socket in a temporary
/// directory that is removed when the node drops.
pub struct Node {
    /// The in-memory RM: which channels are disabled is its state.
    pub rm: Arc<FakeRm>,
    /// The simulated online server's launches.
    pub server: OnlineServer,
    /// The online server's process.
    pub online: StandIn,
    /// The offline job's process.
    pub offline: StandIn,
    /// The daemon's control socket.
    pub socket: PathBuf,
    core: DaemonCore<Arc<FakeRm>>,
    events: Queued,
    listener: UnixListener,
    // Last: removed after the socket is closed.
    dir: tempfile::TempDir,
}

impl Node {
    /// Starts the workloads and sets up the daemon (nothing is served before [`Node::serve`]).
    pub fn start() -> Result<Node, CliError> {
        let online = StandIn::spawn(c"online-server")?;
        let offline = StandIn::spawn(c"offline-job")?;
        let dir = tempfile::Builder::new().prefix("valve-demo-").tempdir()?;
        let rm = Arc::new(FakeRm::host(1));
        let ctl = Controller::with_driver(rm.clone())?;
        let instance = ctl.gpus()[0].device_instance;
        let mut core = DaemonCore::new(
            ctl,
            StateFile::in_dir(dir.path()),
            Some(MAX_HOLD),
            BTreeSet::new(),
        )?;
        // The daemon's metrics, as `--metrics-addr` sets them up: `top` reads its counters.
        let metrics = Metrics::new(1);
        install_for_gate(metrics.clone());
        core.set_metrics(metrics);
        let server = OnlineServer::new(online.pid());
        core.set_gate_starter(gate_starter(&rm, &server));
        let mut events = cuda_context(&rm, online.pid(), 0xc1d0_1000, instance, ONLINE_CHANNELS);
        events.extend(cuda_context(
            &rm,
            offline.pid(),
            0xc1d0_2000,
            instance,
            OFFLINE_CHANNELS,
        ));
        let socket = dir.path().join("valve.sock");
        let listener = bind(&socket, Some(nix::unistd::getegid().as_raw()))
            .map_err(|e| CliError::Daemon(e.code, e.message))?;
        Ok(Node {
            rm,
            server,
            online,
            offline,
            socket,
            core,
            events: Queued(RefCell::new(events.into())),
            listener,
            dir,
        })
    }

    /// Where the pool's socket would be: nothing answers there (the demo runs no pool).
    pub fn pool_socket(&self) -> PathBuf {
        self.dir.path().join("pool.sock")
    }

    /// Runs the daemon's loop until `client` (which talks to it over the socket) has finished,
    /// at most `within`, calling `each_turn` between turns (an error from it ends the loop); then
    /// shuts the daemon down as a SIGTERM would: the gate stops and everything frozen is resumed.
    pub fn serve<T>(
        &mut self,
        client: JoinHandle<T>,
        within: Duration,
        mut each_turn: impl FnMut() -> Result<(), CliError>,
    ) -> Result<T, CliError> {
        let deadline = Instant::now() + within;
        let audit = Audit::log_only();
        let gid = Some(nix::unistd::getegid().as_raw());
        let mut server = Server::new(&self.listener, gid, &audit);
        let mut served = Ok(());
        while !client.is_finished() && served.is_ok() {
            served = if Instant::now() > deadline {
                Err(CliError::Daemon(
                    1,
                    format!("demo: it did not finish within {within:?}"),
                ))
            } else {
                server
                    .step(&mut self.core, &self.events, Duration::from_millis(5))
                    .map_err(|e| CliError::Daemon(e.code, format!("demo: {}", e.message)))
                    .and_then(|()| each_turn())
            };
        }
        let down = self.core.shutdown();
        served?;
        if let Some(e) = down.error {
            return Err(CliError::Daemon(
                e.code,
                format!("demo: shutdown: {}", e.message),
            ));
        }
        let left = self.rm.disabled().len();
        if left != 0 {
            return Err(CliError::Daemon(
                1,
                format!("demo: {left} channel(s) still disabled after the daemon's shutdown"),
            ));
        }
        client
            .join()
            .map_err(|_| CliError::Daemon(1, "demo: the viewer thread panicked".into()))
    }

    /// Ends the workloads and removes the temporary directory, and checks that both are gone.
    pub fn close(self) -> Result<(), CliError> {
        let Node {
            online,
            offline,
            core,
            listener,
            dir,
            ..
        } = self;
        drop((core, listener));
        let pids = [online.pid(), offline.pid()];
        drop((online, offline));
        let path = dir.path().to_path_buf();
        dir.close().map_err(|e| {
            CliError::Io(std::io::Error::other(format!(
                "removing the demo's directory {}: {e}",
                path.display()
            )))
        })?;
        match pids
            .iter()
            .find(|p| Path::new(&format!("/proc/{p}")).exists())
        {
            Some(p) => Err(CliError::Daemon(
                1,
                format!("demo: its stand-in process {p} is still there"),
            )),
            None => Ok(()),
        }
    }
}

/// Gate threads on the fake RM, watching `server` instead of libcuda's uprobes.
fn gate_starter(rm: &Arc<FakeRm>, server: &OnlineServer) -> GateStarter {
    let (rm, server) = (rm.clone(), server.clone());
    Arc::new(move |cfg| {
        let (rm, server) = (rm.clone(), server.clone());
        valve_daemon::gate::runtime::spawn(cfg, move |tx| {
            let ctl = Controller::with_driver(rm).map_err(|e| e.to_string())?;
            Ok((ctl, server.launch_source(tx)))
        })
    })
}

fn alloc(
    pid: u32,
    client: u32,
    parent: u32,
    object: u32,
    class: u32,
    extra: Option<u32>,
) -> RmEvent {
    RmEvent {
        ts_ns: 0,
        pid,
        tid: pid,
        kind: RmEventKind::Alloc(AllocEvent {
            client: ClientHandle(client),
            parent: ObjectHandle(parent),
            object: ObjectHandle(object),
            class,
            extra,
            minor: 255,
            nvos64: true,
        }),
    }
}

/// What the watcher reports for a CUDA context on device `instance`: client, device, a TSG of
/// `n` channels (each with its compute object). The channels are registered with the fake RM.
fn cuda_context(rm: &FakeRm, pid: u32, client: u32, instance: u32, n: u32) -> Vec<RmEvent> {
    let (dev, tsg) = (0x5c00_0001, 0x5c00_0002);
    let mut ev = vec![
        alloc(pid, 0, 0, client, b::NV01_ROOT_CLIENT, None),
        alloc(pid, client, client, dev, b::NV01_DEVICE_0, Some(instance)),
        alloc(pid, client, dev, tsg, b::KEPLER_CHANNEL_GROUP_A, None),
    ];
    let chans: Vec<ChannelHandle> = (0..n).map(|i| ChannelHandle(0x5c00_0010 + i)).collect();
    for c in &chans {
        ev.push(alloc(
            pid,
            client,
            tsg,
            c.0,
            b::HOPPER_CHANNEL_GPFIFO_A,
            None,
        ));
        ev.push(alloc(
            pid,
            client,
            c.0,
            c.0 + 0x80,
            b::HOPPER_COMPUTE_A,
            None,
        ));
    }
    rm.add_channels(ClientHandle(client), instance, &chans);
    ev
}
