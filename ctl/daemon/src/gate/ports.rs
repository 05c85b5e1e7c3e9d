//! Which TCP ports a process listens on, and which processes listen on a port, from `/proc`: how
//! `gate start` names the online service by pid, label or port for the arrival trigger.
//!
//! A socket is a process's if one of its fds links to `socket:[INODE]`; a listening socket is a
//! `/proc/PID/net/tcp{,6}` line in state 0A (that file shows the process's network namespace).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use valve_ebpf::WatchedPort;

/// TCP_LISTEN in `/proc/net/tcp`'s `st` column.
const LISTEN: &str = "0A";

/// The inode number in a `/proc` link such as `socket:[123]` or `net:[4026531840]`.
fn link_inode(link: &str, kind: &str) -> Option<u64> {
    link.strip_prefix(kind)?
        .strip_prefix(":[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// The socket inodes among `pid`'s file descriptors.
fn socket_inodes(proc_root: &Path, pid: u32) -> BTreeSet<u64> {
    let Ok(dir) = std::fs::read_dir(proc_root.join(pid.to_string()).join("fd")) else {
        return BTreeSet::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| link_inode(&l.to_string_lossy(), "socket"))
        .collect()
}

/// The network namespace of `pid` (the inode number of `/proc/PID/ns/net`).
pub fn netns_of(proc_root: &Path, pid: u32) -> Option<u32> {
    let l = std::fs::read_link(proc_root.join(pid.to_string()).join("ns/net")).ok()?;
    link_inode(&l.to_string_lossy(), "net").and_then(|i| u32::try_from(i).ok())
}

/// Listening sockets in a `/proc/net/tcp`-format text: (port, inode).
pub fn parse_listening(text: &str) -> Vec<(u16, u64)> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != LISTEN {
                return None;
            }
            let port = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
            Some((port, f[9].parse().ok()?))
        })
        .collect()
}

/// Listening sockets as `pid`'s network namespace shows them.
fn listening_in_netns_of(proc_root: &Path, pid: u32) -> Vec<(u16, u64)> {
    ["net/tcp", "net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(proc_root.join(pid.to_string()).join(f)).ok())
        .flat_map(|t| parse_listening(&t))
        .collect()
}

/// The TCP ports `pid` listens on, each in `pid`'s network namespace.
pub fn listening_ports(proc_root: &Path, pid: u32) -> Vec<WatchedPort> {
    let Some(netns) = netns_of(proc_root, pid) else {
        return Vec::new();
    };
    let mine = socket_inodes(proc_root, pid);
    let mut ports: Vec<WatchedPort> = listening_in_netns_of(proc_root, pid)
        .into_iter()
        .filter(|(_, inode)| mine.contains(inode))
        .map(|(port, _)| WatchedPort { port, netns })
        .collect();
    ports.sort();
    ports.dedup();
    ports
}

/// The processes among `pids` that listen on `port` (in their own network namespace). Each
/// namespace's socket tables are read once.
pub fn port_owners(proc_root: &Path, port: u16, pids: &[u32]) -> Vec<u32> {
    let mut tables: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    pids.iter()
        .copied()
        .filter(|&pid| {
            let Some(netns) = netns_of(proc_root, pid) else {
                return false;
            };
            let listening = tables.entry(netns).or_insert_with(|| {
                listening_in_netns_of(proc_root, pid)
                    .into_iter()
                    .filter(|(p, _)| *p == port)
                    .map(|(_, inode)| inode)
                    .collect()
            });
            !listening.is_empty() && {
                let mine = socket_inodes(proc_root, pid);
                listening.iter().any(|i| mine.contains(i))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 4243 1 0000000000000000 20 4 30 10 -1
   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 17 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn listening_lines_are_parsed_and_connections_skipped() {
        assert_eq!(parse_listening(TCP), vec![(8080, 4242), (22, 17)]);
        assert_eq!(parse_listening("header only\n"), vec![]);
        assert_eq!(link_inode("socket:[4242]", "socket"), Some(4242));
        assert_eq!(link_inode("pipe:[1]", "socket"), None);
        assert_eq!(link_inode("net:[4026531840]", "net"), Some(4026531840));
    }

    #[test]
    fn this_process_listening_on_a_port_is_found_both_ways() {
        let proc_root = Path::new("/proc");
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let me = std::process::id();
        let netns = netns_of(proc_root, me).expect("own netns");
        let ports = listening_ports(proc_root, me);
        assert!(ports.contains(&WatchedPort { port, netns }), "{ports:?}");
        assert_eq!(port_owners(proc_root, port, &[1, me]), vec![me]);
        // A connected (not listening) socket's port is no service port.
        let c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let local = c.local_addr().unwrap().port();
        assert!(!listening_ports(proc_root, me)
            .iter()
            .any(|p| p.port == local));
        drop(l);
        assert!(port_owners(proc_root, port, &[me]).is_empty());
    }
}
