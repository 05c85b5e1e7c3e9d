//! The arrival program for real, on loopback: data sent to a watched port must produce an edge
//! and be counted; a connect without data, a close, and data to another port must not.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

mod common;
use common::monotonic_ns;
use valve_ebpf::{enable_run_time_stats, ArrivalConfig, ArrivalWatcher, WatchedPort};

fn start(ports: Vec<WatchedPort>) -> Option<ArrivalWatcher> {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIP: BPF needs root");
        return None;
    }
    match ArrivalWatcher::start(ArrivalConfig {
        ports,
        edge_gap: Duration::from_millis(5),
        ..ArrivalConfig::default()
    }) {
        Ok(w) => Some(w),
        Err(e) => {
            println!("SKIP: tp_btf/sk_data_ready unavailable here: {e}");
            None
        }
    }
}

fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

/// The network namespace inode of this process (what the daemon reads for a pid).
fn own_netns() -> u32 {
    let link = std::fs::read_link("/proc/self/ns/net").unwrap();
    let s = link.to_string_lossy();
    s.trim_start_matches("net:[")
        .trim_end_matches(']')
        .parse()
        .unwrap()
}

/// Waits until `f` holds (the program runs in softirq context; on loopback that is before
/// `write` returns, but the counters are read through a map).
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

#[test]
fn data_to_the_watched_port_is_an_edge_and_other_traffic_is_not() {
    let (watched, port) = listener();
    let (other, other_port) = listener();
    let Some(w) = start(vec![WatchedPort { port, netns: 0 }]) else {
        return;
    };
    // A connection without data (a TCP health probe) is no arrival.
    let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (mut server, _) = watched.accept().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(w.counts(port).arrivals, 0, "a bare connect is not data");
    assert!(w.next_edge(Duration::from_millis(10)).is_none());

    let before = monotonic_ns();
    client.write_all(b"POST /v1/chat/completions").unwrap();
    let e = w
        .next_edge(Duration::from_secs(2))
        .expect("request data on the watched port is an edge");
    assert_eq!(e.port, port);
    assert_eq!(e.netns, own_netns());
    assert!(e.ts_ns >= before, "{} < {before}", e.ts_ns);
    assert_eq!(e.idle_ns, 0, "the first arrival seen");
    let mut buf = [0u8; 64];
    let n = server.read(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"POST /v1/chat/completions");

    // More data within the edge gap is counted but is no new edge; after the gap it is.
    client.write_all(b"more").unwrap();
    assert!(eventually(|| w.counts(port).arrivals == 2));
    assert!(w.next_edge(Duration::from_millis(2)).is_none());
    std::thread::sleep(Duration::from_millis(10));
    client.write_all(b"next request").unwrap();
    let e2 = w
        .next_edge(Duration::from_secs(2))
        .expect("edge after idle");
    assert!(e2.idle_ns >= 5_000_000, "{e2:?}");
    let c = w.counts(port);
    assert_eq!((c.arrivals, c.edges), (3, 2), "{c:?}");
    assert_eq!(c.last_ns, e2.ts_ns);

    // The server's replies go the other way: no arrivals on the watched port.
    server.write_all(b"data: token\n\n").unwrap();
    let _ = client.read(&mut buf).unwrap();
    // The client closing (a FIN without data) wakes the reader but is no arrival.
    let _ = server.read(&mut buf).unwrap();
    drop(client);
    assert_eq!(server.read(&mut buf).unwrap(), 0, "EOF seen");
    assert_eq!(w.counts(port).arrivals, 3, "FIN is not data");

    // Another port: nothing.
    let mut c2 = TcpStream::connect(("127.0.0.1", other_port)).unwrap();
    let (mut s2, _) = other.accept().unwrap();
    c2.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let n = s2.read(&mut buf).unwrap();
    assert!(n > 0);
    assert_eq!(w.counts(other_port).arrivals, 0);
    assert!(w.next_edge(Duration::from_millis(20)).is_none());

    // Watching it later works; unwatching stops the counting.
    w.watch_port(WatchedPort {
        port: other_port,
        netns: own_netns(),
    })
    .unwrap();
    c2.write_all(b"x").unwrap();
    let e3 = w.next_edge(Duration::from_secs(2)).expect("now watched");
    assert_eq!(e3.port, other_port);
    w.unwatch_port(other_port);
    std::thread::sleep(Duration::from_millis(10));
    c2.write_all(b"y").unwrap();
    let _ = s2.read(&mut buf).unwrap();
    assert_eq!(w.counts(other_port).arrivals, 0);
}

#[test]
fn another_network_namespace_is_not_the_watched_one() {
    let (l, port) = listener();
    // The port is watched only in a namespace this process is not in.
    let Some(w) = start(vec![WatchedPort {
        port,
        netns: own_netns().wrapping_add(1),
    }]) else {
        return;
    };
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (mut s, _) = l.accept().unwrap();
    c.write_all(b"hello").unwrap();
    let mut buf = [0u8; 8];
    let _ = s.read(&mut buf).unwrap();
    assert_eq!(w.counts(port).arrivals, 0);
    // The same traffic in the watched namespace counts.
    w.watch_port(WatchedPort {
        port,
        netns: own_netns(),
    })
    .unwrap();
    c.write_all(b"hello").unwrap();
    let _ = s.read(&mut buf).unwrap();
    assert!(eventually(|| w.counts(port).arrivals == 1));
}

/// Cost per readable event, two ways (run: `cargo test -p valve-ebpf --release --test
/// arrival_watch -- --ignored --nocapture`): the kernel's run-time statistics of the program,
/// and loopback ping-pong round trips without and with the program, on a watched and on an
/// unwatched port.
#[test]
#[ignore = "benchmark; run explicitly"]
fn bench_cost_per_packet() {
    let rounds = 50_000;
    let ping_pong = |watched_port: Option<&ArrivalWatcher>| -> (f64, u16) {
        let (l, port) = listener();
        if let Some(w) = watched_port {
            w.watch_port(WatchedPort { port, netns: 0 }).unwrap();
        }
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_nodelay(true).unwrap();
            let mut b = [0u8; 64];
            while let Ok(n) = s.read(&mut b) {
                if n == 0 || s.write_all(&b[..n]).is_err() {
                    break;
                }
            }
        });
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.set_nodelay(true).unwrap();
        let mut b = [0u8; 64];
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t0 = Instant::now();
            for _ in 0..rounds / 5 {
                c.write_all(b"0123456789abcdef").unwrap();
                c.read_exact(&mut b[..16]).unwrap();
            }
            best = best.min(t0.elapsed().as_nanos() as f64 / (rounds / 5) as f64);
        }
        drop(c);
        t.join().unwrap();
        (best, port)
    };
    let (base, _) = ping_pong(None);
    let Some(w) = start(Vec::new()) else {
        return;
    };
    let _stats = enable_run_time_stats().expect("BPF_ENABLE_STATS");
    let s0 = w.program_stats();
    let (unwatched, _) = ping_pong(None);
    let s1 = w.program_stats();
    let (watched, port) = ping_pong(Some(&w));
    let s2 = w.program_stats();
    let per_run = |a: valve_ebpf::ProgramStats, b: valve_ebpf::ProgramStats| {
        (b.run_time_ns - a.run_time_ns) as f64 / (b.run_cnt - a.run_cnt).max(1) as f64
    };
    println!(
        "program run time (BPF_ENABLE_STATS): {:.0} ns per readable event on an unwatched port \
         ({} runs), {:.0} ns on the watched port ({} runs, {} arrivals counted)",
        per_run(s0, s1),
        s1.run_cnt - s0.run_cnt,
        per_run(s1, s2),
        s2.run_cnt - s1.run_cnt,
        w.counts(port).arrivals
    );
    // In the watched run the client's side (an unwatched ephemeral port) runs the program too:
    // take its share out at the unwatched cost to get the cost of one counted arrival.
    let arrivals = w.counts(port).arrivals;
    let unwatched_cost = per_run(s0, s1);
    let other_runs = (s2.run_cnt - s1.run_cnt).saturating_sub(arrivals) as f64;
    let per_arrival = ((s2.run_time_ns - s1.run_time_ns) as f64 - unwatched_cost * other_runs)
        / arrivals.max(1) as f64;
    println!("so one counted arrival on the watched port costs about {per_arrival:.0} ns");
    println!(
        "loopback round trip (16 B each way, best of 5 x {}): {base:.0} ns without the program, \
         {unwatched:.0} ns with it on an unwatched port, {watched:.0} ns on the watched port \
         (stats on in both)",
        rounds / 5
    );
}
