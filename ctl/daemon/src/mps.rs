//! CUDA MPS on this node: which processes are MPS servers (and control daemons) and which are
//! their clients, read from `/proc` and the kernel's Unix-socket table, so Valve can refuse them.
//!
//! Under MPS a client's kernels run in a channel group the MPS server allocated; the client's own
//! discovered channels do not carry them, so disabling those stops nothing (`docs/mps.md`).
//! Valve therefore never reports an MPS client or server as frozen: it refuses to freeze them.
//!
//! A process is an MPS **client** when one of its Unix sockets is connected to a socket an MPS
//! server or control daemon holds (the kernel's `sock_diag` table gives each socket's peer), or
//! when it sees the same pipe directory (`CUDA_MPS_PIPE_DIRECTORY`, default `/tmp/nvidia-mps`,
//! compared by device and inode through each process's `/proc/PID/root`) as a running MPS
//! daemon: CUDA connects to MPS through that directory when it creates a context. The second
//! test can also mark a process that made its context before MPS started; that errs on the side
//! of refusing, never of a false freeze.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The MPS server's executable name.
pub const SERVER_EXE: &str = "nvidia-cuda-mps-server";
/// The MPS control daemon's executable name.
pub const CONTROL_EXE: &str = "nvidia-cuda-mps-control";
/// The environment variable that moves MPS's pipe directory.
pub const PIPE_DIR_VAR: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// MPS's pipe directory when [`PIPE_DIR_VAR`] is not set.
pub const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
/// What `/proc/PID/comm` shows for both MPS executables (the kernel cuts it at 15 bytes).
const COMM_PREFIX: &str = "nvidia-cuda-mps";

/// A running MPS server or control daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpsDaemon {
    /// Its pid.
    pub pid: u32,
    /// True for `nvidia-cuda-mps-server`, false for `nvidia-cuda-mps-control`.
    pub server: bool,
    /// The pipe directory it uses.
    pub pipe_dir: PathBuf,
    sockets: BTreeSet<u64>,
    dir_id: Option<(u64, u64)>,
}

/// How a process takes part in MPS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MpsRole {
    /// It is an MPS server or control daemon.
    Server,
    /// It is a client of the MPS daemon `daemon`.
    Client {
        /// The MPS server or control daemon it belongs to.
        daemon: u32,
        /// How that was found.
        evidence: Evidence,
    },
}

/// Why a process counts as an MPS client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Evidence {
    /// One of its Unix sockets is connected to one the MPS daemon holds.
    Socket,
    /// It sees the MPS daemon's pipe directory (this path, in its own mount namespace).
    PipeDir(PathBuf),
}

impl MpsRole {
    /// The role as the `ps` reply carries it (`"server"` or `"client"`).
    pub fn wire(&self) -> valve_protocol::control::MpsRole {
        match self {
            MpsRole::Server => valve_protocol::control::MpsRole::Server,
            MpsRole::Client { .. } => valve_protocol::control::MpsRole::Client,
        }
    }

    /// One clause saying what was found.
    pub fn describe(&self) -> String {
        match self {
            MpsRole::Server => "a CUDA MPS server".to_string(),
            MpsRole::Client {
                daemon,
                evidence: Evidence::Socket,
            } => format!("a CUDA MPS client (connected to MPS process {daemon})"),
            MpsRole::Client {
                daemon,
                evidence: Evidence::PipeDir(d),
            } => format!(
                "a CUDA MPS client (it sees the pipe directory {} of MPS process {daemon})",
                d.display()
            ),
        }
    }
}

/// The error text for refusing to freeze `pid`, which plays `role` in MPS.
pub fn refusal(pid: u32, comm: &str, role: &MpsRole) -> String {
    format!(
        "process {pid} ({comm}) cannot be frozen: it is {}. Under MPS its kernels run in the MPS \
         server's channel group, which Valve cannot freeze per client, so a freeze would be \
         reported while the work goes on. Run the job without MPS (stop MPS with `echo quit | \
         nvidia-cuda-mps-control`, or start the job with {PIPE_DIR_VAR} pointing to a \
         directory with no MPS daemon); see docs/mps.md",
        role.describe()
    )
}

/// Where the daemon looks for MPS: a `/proc` tree and a source of the Unix-socket table (both
/// replaced in tests).
#[derive(Clone, Debug)]
pub struct MpsLookup {
    /// The `/proc` tree.
    pub proc_root: PathBuf,
    /// Reads the socket table; `None` when it cannot be read (the pipe directory still counts).
    pub peers: fn() -> Option<PeerTable>,
}

impl Default for MpsLookup {
    fn default() -> Self {
        MpsLookup {
            proc_root: PathBuf::from("/proc"),
            peers: kernel_peers,
        }
    }
}

/// [`PeerTable::read`], logging why when it fails.
fn kernel_peers() -> Option<PeerTable> {
    PeerTable::read()
        .map_err(|e| tracing::warn!("MPS clients are found by their pipe directory only: {e}"))
        .ok()
}

impl MpsLookup {
    /// The MPS role of each of `pids` that has one, with MPS servers looked for among
    /// `candidates` (the processes known to hold GPU objects). Reads the socket table at most
    /// once, and only if an MPS daemon runs.
    pub fn roles(
        &self,
        candidates: impl IntoIterator<Item = u32>,
        pids: impl IntoIterator<Item = u32>,
    ) -> BTreeMap<u32, MpsRole> {
        self.roles_in(&self.scan(candidates), pids)
    }

    /// The MPS daemons among `candidates` (and their control daemons).
    pub fn scan(&self, candidates: impl IntoIterator<Item = u32>) -> MpsScan {
        MpsScan::find(&self.proc_root, candidates)
    }

    /// [`Self::roles`] against a scan already made.
    pub fn roles_in(
        &self,
        scan: &MpsScan,
        pids: impl IntoIterator<Item = u32>,
    ) -> BTreeMap<u32, MpsRole> {
        let mut table: Option<Option<PeerTable>> = None;
        let mut peers = || table.get_or_insert_with(self.peers).clone();
        pids.into_iter()
            .filter_map(|p| scan.role(p, &mut peers).map(|r| (p, r)))
            .collect()
    }
}

/// The MPS daemons found in a `/proc` tree, and the questions asked of them.
#[derive(Clone, Debug)]
pub struct MpsScan {
    root: PathBuf,
    daemons: Vec<MpsDaemon>,
}

impl MpsScan {
    /// Looks for MPS servers among `candidates` (the daemon passes the processes it knows to
    /// hold GPU objects) and adds each server's control daemon (its parent).
    pub fn find(root: &Path, candidates: impl IntoIterator<Item = u32>) -> MpsScan {
        let mut pids: BTreeSet<u32> = BTreeSet::new();
        for pid in candidates {
            if mps_exe(root, pid).is_some() {
                pids.insert(pid);
                if let Some(parent) = ppid(root, pid).filter(|&p| mps_exe(root, p).is_some()) {
                    pids.insert(parent);
                }
            }
        }
        let daemons = pids
            .into_iter()
            .filter_map(|pid| daemon(root, pid))
            .collect();
        MpsScan {
            root: root.to_path_buf(),
            daemons,
        }
    }

    /// Looks at every process in `root` (for `doctor`, which has no registry).
    pub fn all(root: &Path) -> MpsScan {
        let pids: Vec<u32> = std::fs::read_dir(root)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        Self::find(root, pids)
    }

    /// The MPS servers and control daemons found.
    pub fn daemons(&self) -> &[MpsDaemon] {
        &self.daemons
    }

    /// How `pid` takes part in MPS, if at all. `peers` reads the Unix-socket peer table; it is
    /// called only when an MPS daemon runs and `pid` is not one.
    pub fn role(&self, pid: u32, peers: &mut dyn FnMut() -> Option<PeerTable>) -> Option<MpsRole> {
        if self.daemons.is_empty() {
            return None;
        }
        if self.daemons.iter().any(|d| d.pid == pid) {
            return Some(MpsRole::Server);
        }
        let mine = socket_inodes(&self.root, pid);
        if !mine.is_empty() {
            if let Some(table) = peers() {
                let connected = |d: &&MpsDaemon| {
                    mine.iter()
                        .filter_map(|s| table.peer(*s))
                        .any(|p| d.sockets.contains(&p))
                };
                if let Some(d) = self.daemons.iter().find(connected) {
                    return Some(MpsRole::Client {
                        daemon: d.pid,
                        evidence: Evidence::Socket,
                    });
                }
            }
        }
        let dir = pipe_dir(&self.root, pid);
        let id = dir_id(&self.root, pid, &dir)?;
        let d = self.daemons.iter().find(|d| d.dir_id == Some(id))?;
        Some(MpsRole::Client {
            daemon: d.pid,
            evidence: Evidence::PipeDir(dir),
        })
    }
}

/// Which MPS executable `pid` runs, from its command line (`comm` is cut short for both).
fn mps_exe(root: &Path, pid: u32) -> Option<bool> {
    let dir = root.join(pid.to_string());
    let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
    if !comm.trim().starts_with(COMM_PREFIX) {
        return None;
    }
    let cmdline = std::fs::read(dir.join("cmdline")).ok()?;
    let argv0 = cmdline.split(|&b| b == 0).next()?;
    let name = Path::new(std::str::from_utf8(argv0).ok()?).file_name()?;
    match name.to_str()? {
        SERVER_EXE => Some(true),
        CONTROL_EXE => Some(false),
        _ => None,
    }
}

fn daemon(root: &Path, pid: u32) -> Option<MpsDaemon> {
    let server = mps_exe(root, pid)?;
    let pipe_dir = pipe_dir(root, pid);
    Some(MpsDaemon {
        pid,
        server,
        dir_id: dir_id(root, pid, &pipe_dir),
        pipe_dir,
        sockets: socket_inodes(root, pid),
    })
}

/// The parent pid, from `/proc/PID/stat` (the field after the command's closing parenthesis).
fn ppid(root: &Path, pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(root.join(pid.to_string()).join("stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The MPS pipe directory `pid` would use: its `CUDA_MPS_PIPE_DIRECTORY`, else the default.
pub fn pipe_dir(root: &Path, pid: u32) -> PathBuf {
    let environ = std::fs::read(root.join(pid.to_string()).join("environ")).unwrap_or_default();
    let prefix = format!("{PIPE_DIR_VAR}=");
    environ
        .split(|&b| b == 0)
        .filter_map(|v| std::str::from_utf8(v).ok())
        .find_map(|v| v.strip_prefix(prefix.as_str()).map(PathBuf::from))
        .filter(|p| p.is_absolute())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PIPE_DIR))
}

/// Device and inode of `dir` as `pid` sees it (through `/proc/PID/root`), if it exists.
fn dir_id(root: &Path, pid: u32, dir: &Path) -> Option<(u64, u64)> {
    let rel = dir.strip_prefix("/").unwrap_or(dir);
    let m = std::fs::metadata(root.join(pid.to_string()).join("root").join(rel)).ok()?;
    m.is_dir().then(|| (m.dev(), m.ino()))
}

/// The socket inodes among `pid`'s file descriptors.
fn socket_inodes(root: &Path, pid: u32) -> BTreeSet<u64> {
    let Ok(dir) = std::fs::read_dir(root.join(pid.to_string()).join("fd")) else {
        return BTreeSet::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            l.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// Each connected Unix socket's peer, by inode, as the kernel's `sock_diag` reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerTable(BTreeMap<u64, u64>);

/// `SOCK_DIAG_BY_FAMILY`, the netlink message type of a socket-table dump.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// Ask for each socket's peer inode.
const UDIAG_SHOW_PEER: u32 = 0x4;
/// The attribute that carries it.
const UNIX_DIAG_PEER: u16 = 2;

impl PeerTable {
    /// A table from (socket, peer) pairs (tests, and callers with their own source).
    pub fn from_pairs(pairs: impl IntoIterator<Item = (u64, u64)>) -> PeerTable {
        PeerTable(pairs.into_iter().collect())
    }

    /// The peer of socket `inode`, if it is a connected Unix socket.
    pub fn peer(&self, inode: u64) -> Option<u64> {
        self.0.get(&inode).copied()
    }

    /// Dumps the kernel's Unix-socket table over `NETLINK_SOCK_DIAG` (no privilege needed; the
    /// kernel needs `CONFIG_UNIX_DIAG`).
    pub fn read() -> Result<PeerTable, String> {
        use nix::sys::socket::{
            recv, sendto, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol,
            SockType,
        };
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkSockDiag,
        )
        .map_err(|e| format!("opening a sock_diag netlink socket: {e}"))?;
        sendto(
            fd.as_raw_fd(),
            &diag_request(),
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )
        .map_err(|e| format!("asking for the Unix-socket table: {e}"))?;
        let mut table = BTreeMap::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())
                .map_err(|e| format!("reading the Unix-socket table: {e}"))?;
            if n == 0 || parse_diag(&buf[..n], &mut table)? {
                return Ok(PeerTable(table));
            }
        }
    }
}

/// The netlink request: an `nlmsghdr` and a `unix_diag_req` for every socket, with peers.
fn diag_request() -> Vec<u8> {
    let mut m = Vec::with_capacity(40);
    m.extend_from_slice(&40u32.to_ne_bytes());
    m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes()); // sequence number
    m.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
    m.push(nix::libc::AF_UNIX as u8); // sdiag_family
    m.push(0); // sdiag_protocol
    m.extend_from_slice(&0u16.to_ne_bytes()); // pad
    m.extend_from_slice(&u32::MAX.to_ne_bytes()); // udiag_states: all
    m.extend_from_slice(&0u32.to_ne_bytes()); // udiag_ino: any
    m.extend_from_slice(&UDIAG_SHOW_PEER.to_ne_bytes());
    m.extend_from_slice(&[0xff; 8]); // udiag_cookie: none
    m
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Folds one buffer of netlink replies into `table` (socket inode -> peer inode); true once the
/// dump's end (`NLMSG_DONE`) was in it.
pub fn parse_diag(buf: &[u8], table: &mut BTreeMap<u64, u64>) -> Result<bool, String> {
    let mut at = 0;
    while at + 16 <= buf.len() {
        let len = u32_at(buf, at).unwrap_or(0) as usize;
        let kind = u16_at(buf, at + 4).unwrap_or(0);
        if len < 16 || at + len > buf.len() {
            return Err(format!(
                "a sock_diag reply of {len} bytes does not fit the buffer"
            ));
        }
        match kind {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let errno = u32_at(buf, at + 16).map(|e| -(e as i32)).unwrap_or(0);
                return Err(format!(
                    "the kernel refused the Unix-socket table dump ({}); it needs \
                     CONFIG_UNIX_DIAG (module unix_diag)",
                    std::io::Error::from_raw_os_error(errno)
                ));
            }
            _ => fold_message(&buf[at + 16..at + len], table),
        }
        at += (len + 3) & !3;
    }
    Ok(false)
}

/// One `unix_diag_msg` (16 bytes: family, type, state, pad, inode, cookie) and its attributes.
fn fold_message(msg: &[u8], table: &mut BTreeMap<u64, u64>) {
    let Some(inode) = u32_at(msg, 4) else { return };
    let mut at = 16;
    while at + 4 <= msg.len() {
        let len = u16_at(msg, at).unwrap_or(0) as usize;
        if len < 4 || at + len > msg.len() {
            return;
        }
        if u16_at(msg, at + 2) == Some(UNIX_DIAG_PEER) {
            if let Some(peer) = u32_at(msg, at + 4).filter(|&p| p != 0) {
                table.insert(u64::from(inode), u64::from(peer));
            }
        }
        at += (len + 3) & !3;
    }
}

#[cfg(test)]
mod tests;
