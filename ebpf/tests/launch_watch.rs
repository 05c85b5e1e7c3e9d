//! Real uprobes in CI: a synthetic library exporting libcuda's launch symbols is compiled here,
//! called from this process, and the launch watcher must count exactly those calls.

use std::path::Path;
use std::time::{Duration, Instant};

mod common;
use common::monotonic_ns;
use valve_ebpf::{LaunchConfig, LaunchWatcher};

#[path = "common/fake_cuda.rs"]
mod fake_cuda;
use fake_cuda::{call, fake_cuda, FakeCuda};

fn start(lib: &Path, pids: Vec<u32>) -> Option<LaunchWatcher> {
    start_filtered(lib, pids, true)
}

fn start_filtered(lib: &Path, pids: Vec<u32>, filter: bool) -> Option<LaunchWatcher> {
    start_polling(lib, pids, filter, valve_ebpf::REQUEST_POLL)
}

fn start_polling(
    lib: &Path,
    pids: Vec<u32>,
    filter: bool,
    poll_period: Duration,
) -> Option<LaunchWatcher> {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIP: uprobes need root");
        return None;
    }
    match LaunchWatcher::start(LaunchConfig {
        library: lib.to_path_buf(),
        pids,
        filter,
        edge_gap: Duration::from_millis(5),
        track_waits: true,
        realtime: None,
        poll_period,
    }) {
        Ok(w) => Some(w),
        Err(e) => {
            println!("SKIP: uprobes unavailable here: {e}");
            None
        }
    }
}

#[test]
fn counts_kernel_and_graph_launches_and_reports_idle_edges() {
    let f = fake_cuda();
    let me = std::process::id();
    let Some(w) = start(&f.path, vec![me]) else {
        return;
    };
    assert!(w.attached().contains(&"cuLaunchKernel"));
    assert!(w.attached().contains(&"cuGraphLaunch"));
    call(&f, 1000, 10);
    let c = w.counts(me);
    assert_eq!((c.kernel_launches, c.graph_launches), (1000, 10), "{c:?}");
    let first = w
        .next_edge(Duration::from_secs(2))
        .expect("first launch is an edge");
    assert_eq!((first.pid, first.graph, first.idle_ns), (me, false, 0));
    std::thread::sleep(Duration::from_millis(20));
    call(&f, 0, 1);
    let edge = w
        .next_edge(Duration::from_secs(2))
        .expect("a launch after 20 ms idle is an edge");
    assert!(edge.graph && edge.idle_ns >= 5_000_000, "{edge:?}");
    assert!(
        w.next_edge(Duration::from_millis(50)).is_none(),
        "back-to-back launches are no edges"
    );
    assert_eq!(w.counts(me).edges, 2);
    // The counters keep the latest edge and the activity before it: an arrival in between
    // found the process idle (the gate reads them for arrivals while offline is frozen).
    let c = w.settled_counts(me).expect("no edge is being written");
    assert_eq!(
        (c.last_edge_ns, c.edge_prev_ns),
        (edge.ts_ns, edge.ts_ns - edge.idle_ns),
        "{c:?}"
    );
}

#[test]
fn a_thread_waiting_for_gpu_work_keeps_the_process_busy() {
    let f = fake_cuda();
    let me = std::process::id();
    let Some(w) = start(&f.path, vec![me]) else {
        return;
    };
    assert!(
        w.attached().contains(&"cuStreamSynchronize"),
        "{:?}",
        w.attached()
    );
    call(&f, 1, 0);
    assert!(
        w.next_edge(Duration::from_secs(2)).is_some(),
        "first launch"
    );
    std::thread::sleep(Duration::from_millis(20));
    // A 60 ms wait on another thread: the process is busy throughout.
    let sync = f.sync;
    // SAFETY: the fake sleeps for its argument in microseconds.
    let waiter = std::thread::spawn(move || unsafe { sync(60_000) });
    assert!(
        eventually(|| w.counts(me).in_sync == 1),
        "{:?}",
        w.counts(me)
    );
    std::thread::sleep(Duration::from_millis(20));
    // A launch meanwhile (after 40 ms without one) is no idle->busy edge: a thread is waiting.
    call(&f, 1, 0);
    assert!(w.next_edge(Duration::from_millis(10)).is_none());
    waiter.join().unwrap();
    let c = w.counts(me);
    assert_eq!((c.in_sync, c.syncs), (0, 1), "{c:?}");
    assert!(
        c.sync_end_ns > 0 && c.last_ns == c.sync_end_ns,
        "the wait's end is activity"
    );
    // A launch right after the wait is no edge either (the gap is from the wait's end), one
    // after 20 ms of real idleness is, and its idle time counts from the wait's end.
    call(&f, 1, 0);
    assert!(w.next_edge(Duration::from_millis(10)).is_none());
    let last = w.counts(me).last_ns;
    std::thread::sleep(Duration::from_millis(20));
    call(&f, 1, 0);
    let e = w
        .next_edge(Duration::from_secs(2))
        .expect("edge after idle");
    assert!(e.ts_ns - e.idle_ns == last, "{e:?} last {last}");
}

/// Watches `pid` and waits for the poll thread's word that its probes are in.
fn wait_probed(w: &LaunchWatcher, pid: u32) {
    w.watch_acked(pid)
        .unwrap()
        .recv_timeout(Duration::from_secs(10))
        .expect("the launch-watch thread answers")
        .expect("the probes attach");
}

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
fn other_processes_are_not_counted() {
    let f = fake_cuda();
    let me = std::process::id();
    let Some(w) = start(&f.path, vec![1]) else {
        return;
    };
    call(&f, 100, 1);
    assert_eq!(w.counts(me).kernel_launches, 0);
    // Probing a newly watched process is the poll thread's (it does not hold up the caller);
    // its answer says the probes are in. The breakpoint byte alone is not enough: with one link
    // per symbol it is written when the uprobe is created, before the program is attached.
    wait_probed(&w, me);
    assert_eq!(first_byte(&f), 0xcc);
    call(&f, 7, 0);
    assert_eq!(w.counts(me).kernel_launches, 7);
}

/// Cost of the uprobe per launch (run: `cargo test -p valve-ebpf --release --test launch_watch
/// -- --ignored --nocapture`).
#[test]
#[ignore = "benchmark; run explicitly"]
fn bench_uprobe_cost_per_launch() {
    let f = fake_cuda();
    let n = 200_000;
    let time = |f: &FakeCuda| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                call(f, n, 0);
                t.elapsed().as_nanos() as f64 / f64::from(n)
            })
            .fold(f64::INFINITY, f64::min)
    };
    let base = time(&f);
    let Some(w) = start(&f.path, vec![std::process::id()]) else {
        return;
    };
    let probed = time(&f);
    println!(
        "launch call: {base:.0} ns without the uprobe, {probed:.0} ns with it (+{:.0} ns)",
        probed - base
    );
    drop(w);
}

/// Cost of the uprobe + uretprobe pair on a synchronising call that returns at once (run:
/// `cargo test -p valve-ebpf --release --test launch_watch -- --ignored --nocapture`).
#[test]
#[ignore = "benchmark; run explicitly"]
fn bench_wait_probe_cost_per_call() {
    let f = fake_cuda();
    let n = 200_000;
    let time = |f: &FakeCuda| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..n {
                    // SAFETY: 0 makes the fake return at once.
                    unsafe { (f.sync)(0) };
                }
                t.elapsed().as_nanos() as f64 / f64::from(n)
            })
            .fold(f64::INFINITY, f64::min)
    };
    let base = time(&f);
    let Some(w) = start(&f.path, vec![std::process::id()]) else {
        return;
    };
    let probed = time(&f);
    println!(
        "synchronising call: {base:.0} ns without the probes, {probed:.0} ns with uprobe + uretprobe (+{:.0} ns)",
        probed - base
    );
    drop(w);
}

/// What an idle edge costs the launching thread: one launch after each 2-ms sleep, timed,
/// without the watcher, with it and no edges (an edge gap of 10 s), with every launch an edge
/// (200 us, the daemon's), and with every launch an edge while offline is held (written without
/// waking the reader), a thread draining the edges as the gate's does; the poll thread at normal
/// priority, then `SCHED_FIFO` 10 where allowed. Also how late edges reach that thread, and
/// how late the first edge after a resume does while held edges wait unread (run: `cargo test
/// -p valve-ebpf --test launch_watch -- --ignored --nocapture bench_edge`).
#[test]
#[ignore = "benchmark; run explicitly"]
fn bench_edge_cost_on_the_launching_thread() {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIP: uprobes need root");
        return;
    }
    let f = fake_cuda();
    let (p50, p90) = percentiles(sample_launch_calls(&f, 400));
    println!("no watcher: launch call p50 {p50:.1} us, p90 {p90:.1} us");
    let cases = [
        (10_000_000, None, false),
        (200, None, false),
        (200, None, true),
        (200, Some(10), false),
        (200, Some(10), true),
    ];
    for (edge_gap, realtime, held) in cases {
        let Some(w) = bench_watcher(&f, edge_gap, realtime) else {
            return;
        };
        if held {
            w.hold_edges(monotonic_ns()).unwrap();
        }
        let drain = Drain::start(&w);
        let (p50, p90) = percentiles(sample_launch_calls(&f, 400));
        let late = drain.stop();
        let n = late.len();
        let (l50, l90) = if n > 0 { percentiles(late) } else { (0.0, 0.0) };
        println!(
            "watcher, edge gap {edge_gap} us, poll thread {realtime:?}, offline held {held}: launch call p50 {p50:.1} us, p90 {p90:.1} us; {n} edges, reached the reader p50 {l50:.0} us, p90 {l90:.0} us late"
        );
    }
    let Some(w) = bench_watcher(&f, 200, None) else {
        return;
    };
    let drain = Drain::start(&w);
    for _ in 0..100 {
        w.hold_edges(monotonic_ns()).unwrap();
        std::thread::sleep(Duration::from_millis(1));
        call(&f, 1, 0); // held: unread until the poll period
        w.arm_resume(monotonic_ns()).unwrap();
        w.hold_edges(0).unwrap();
        std::thread::sleep(Duration::from_millis(1));
        call(&f, 1, 0); // after the resume: must wake the reader
        std::thread::sleep(Duration::from_millis(12));
    }
    let late = drain.stop();
    let after: Vec<f64> = late.iter().copied().skip(1).step_by(2).collect();
    let (l50, l90) = percentiles(after);
    println!(
        "first edge after a resume, a held edge unread before it: reached the reader p50 {l50:.0} us, p90 {l90:.0} us late ({} edges)",
        late.len()
    );
}

/// `n` launch calls, each after a 2-ms sleep, timed (us).
fn sample_launch_calls(f: &FakeCuda, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(2));
            let t0 = Instant::now();
            call(f, 1, 0);
            t0.elapsed().as_nanos() as f64 / 1e3
        })
        .collect()
}

/// p50 and p90 of `v`.
fn percentiles(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() * 9 / 10])
}

fn bench_watcher(
    f: &FakeCuda,
    edge_gap_us: u64,
    realtime: Option<u8>,
) -> Option<std::sync::Arc<LaunchWatcher>> {
    match LaunchWatcher::start(LaunchConfig {
        library: f.path.clone(),
        pids: vec![std::process::id()],
        filter: true,
        edge_gap: Duration::from_micros(edge_gap_us),
        track_waits: true,
        realtime,
        poll_period: valve_ebpf::REQUEST_POLL,
    }) {
        Ok(w) => Some(std::sync::Arc::new(w)),
        Err(e) => {
            println!("SKIP: uprobes unavailable here: {e}");
            None
        }
    }
}

/// A thread reading edges as the gate's does, noting how late each reached it (us).
struct Drain {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<f64>>,
}

impl Drain {
    fn start(w: &std::sync::Arc<LaunchWatcher>) -> Drain {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (w, flag) = (w.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut late = Vec::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(e) = w.next_edge(Duration::from_millis(20)) {
                    late.push(monotonic_ns().saturating_sub(e.ts_ns) as f64 / 1e3);
                }
            }
            late
        });
        Drain { stop, thread }
    }

    fn stop(self) -> Vec<f64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

#[test]
fn the_first_launch_after_a_resume_is_an_edge_whatever_its_gap() {
    let f = fake_cuda();
    let me = std::process::id();
    let Some(w) = start(&f.path, vec![me]) else {
        return;
    };
    call(&f, 1, 0);
    assert!(
        w.next_edge(Duration::from_secs(2)).is_some(),
        "first launch"
    );
    // A short wait, then a launch right after it: no idle edge (the gap is from the wait's end).
    // SAFETY: the fake sleeps for its argument in microseconds.
    unsafe { (f.sync)(100) };
    call(&f, 1, 0);
    assert!(w.next_edge(Duration::from_millis(20)).is_none());
    // The gate resumes offline: the next launch is an edge although it comes as soon, and says
    // that only the resume made it one; the launch after it is not.
    w.arm_resume(monotonic_ns()).unwrap();
    // SAFETY: as above.
    unsafe { (f.sync)(100) };
    call(&f, 1, 1);
    let e = w
        .next_edge(Duration::from_secs(2))
        .expect("the first launch after the resume is an edge");
    assert!(e.after_resume && !e.graph && e.idle_ns < 5_000_000, "{e:?}");
    assert!(
        w.next_edge(Duration::from_millis(20)).is_none(),
        "only the first"
    );
    let c = w.counts(me);
    assert!(c.last_launch_ns > e.ts_ns && c.edges == 2, "{c:?}");
    // Armed, then disarmed (the resume was called off): no edge.
    w.arm_resume(monotonic_ns()).unwrap();
    w.arm_resume(0).unwrap();
    // SAFETY: as above.
    unsafe { (f.sync)(100) };
    call(&f, 1, 0);
    assert!(w.next_edge(Duration::from_millis(20)).is_none(), "disarmed");
    // While another thread waits, the first launch after a resume is an edge too.
    let sync = f.sync;
    // SAFETY: as above.
    let waiter = std::thread::spawn(move || unsafe { sync(60_000) });
    assert!(eventually(|| w.counts(me).in_sync == 1));
    w.arm_resume(monotonic_ns()).unwrap();
    call(&f, 1, 0);
    let e = w
        .next_edge(Duration::from_secs(2))
        .expect("edge during a wait");
    assert!(e.after_resume, "{e:?}");
    waiter.join().unwrap();
}

#[test]
fn edges_while_offline_is_held_wake_nobody_and_still_arrive() {
    let f = fake_cuda();
    let me = std::process::id();
    let Some(w) = start(&f.path, vec![me]) else {
        return;
    };
    let idle_launch = || {
        std::thread::sleep(Duration::from_millis(6));
        call(&f, 1, 0);
    };
    idle_launch();
    let e = w.next_edge(Duration::from_secs(2)).expect("an edge");
    assert_eq!(w.counts(me).quiet_edges, 0, "not held: it woke the reader");
    // The gate holds offline: the edges are written quietly, and drained all the same.
    w.hold_edges(monotonic_ns()).unwrap();
    idle_launch();
    idle_launch();
    let held: Vec<_> = (0..2)
        .map(|_| {
            w.next_edge(Duration::from_secs(2))
                .expect("a held edge is drained")
        })
        .collect();
    assert!(
        held[0].ts_ns > e.ts_ns && held[1].ts_ns > held[0].ts_ns,
        "{held:?}"
    );
    assert!(!e.quiet && held.iter().all(|h| h.quiet), "{held:?}");
    assert_eq!(w.counts(me).quiet_edges, 2);
    // The resume's arm ends the hold before offline runs: its edge wakes the reader again.
    w.arm_resume(monotonic_ns()).unwrap();
    idle_launch();
    assert!(!w.next_edge(Duration::from_secs(2)).unwrap().quiet);
    assert_eq!(w.counts(me).quiet_edges, 2);
    // A resume called off (disarmed) leaves offline held: quiet again, until the mark is cleared.
    w.hold_edges(monotonic_ns()).unwrap();
    w.arm_resume(monotonic_ns()).unwrap();
    w.arm_resume(0).unwrap();
    idle_launch();
    assert!(w.next_edge(Duration::from_secs(2)).is_some());
    assert_eq!(w.counts(me).quiet_edges, 3);
    w.hold_edges(0).unwrap();
    idle_launch();
    assert!(w.next_edge(Duration::from_secs(2)).is_some());
    assert_eq!(w.counts(me).quiet_edges, 3);
}

#[test]
fn the_first_edge_after_a_resume_wakes_the_reader_while_held_edges_wait_unread() {
    // A poll period longer than the waits below: only a wake-up delivers edges in time (the
    // watcher's drop waits for the period's end).
    let f = fake_cuda();
    let me = std::process::id();
    let Some(w) = start_polling(&f.path, vec![me], true, Duration::from_secs(4)) else {
        return;
    };
    w.hold_edges(monotonic_ns()).unwrap();
    call(&f, 1, 0);
    assert!(
        w.next_edge(Duration::from_millis(300)).is_none(),
        "a held edge wakes nobody"
    );
    assert_eq!(w.counts(me).quiet_edges, 1);
    // Resumed: the next edge must wake the reader although the held one is still unread (an
    // edge that wakes only a reader with nothing left to read would not).
    w.arm_resume(monotonic_ns()).unwrap();
    w.hold_edges(0).unwrap();
    call(&f, 1, 0);
    let both: Vec<_> = (0..2)
        .filter_map(|_| w.next_edge(Duration::from_secs(2)))
        .collect();
    assert_eq!(both.len(), 2, "the resume's edge woke the reader: {both:?}");
    assert!(both[1].ts_ns > both[0].ts_ns, "{both:?}");
    assert_eq!(w.counts(me).quiet_edges, 1);
}

/// The first byte of the fake's `cuLaunchKernel` as this process sees it: an installed uprobe
/// shows as a breakpoint (int3, 0xcc) in the probed process's copy of the page only.
fn first_byte(f: &FakeCuda) -> u8 {
    // SAFETY: the function's code is mapped readable for as long as `f` holds the library.
    unsafe { std::ptr::read_volatile(f.launch as *const u8) }
}

#[test]
fn only_watched_processes_carry_the_probes() {
    let f = fake_cuda();
    let me = std::process::id();
    let clean = first_byte(&f);
    assert_ne!(clean, 0xcc, "the fake starts with a real instruction");
    let Some(w) = start(&f.path, Vec::new()) else {
        return;
    };
    // Filtering and nobody watched: launches here trap nowhere and count nothing.
    assert_eq!(
        first_byte(&f),
        clean,
        "an unwatched process must not be probed"
    );
    call(&f, 10, 0);
    assert_eq!(w.counts(me).kernel_launches, 0);
    wait_probed(&w, me);
    assert_eq!(first_byte(&f), 0xcc, "a watched process gets its probes");
    call(&f, 10, 0);
    assert_eq!(w.counts(me).kernel_launches, 10);
    w.unwatch(me);
    assert!(
        eventually(|| first_byte(&f) == clean),
        "unwatching removes the probes"
    );
    drop(w);
    assert_eq!(first_byte(&f), clean);
}

#[test]
fn a_process_has_one_link_per_program_where_the_kernel_has_uprobe_multi() {
    let f = fake_cuda();
    let me = std::process::id();
    let Some(w) = start(&f.path, vec![me]) else {
        return;
    };
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release.trim().split(|c: char| !c.is_ascii_digit());
    let (major, minor): (u32, u32) = (
        v.next().and_then(|x| x.parse().ok()).unwrap_or(0),
        v.next().and_then(|x| x.parse().ok()).unwrap_or(0),
    );
    let wanted =
        (major, minor) >= (6, 6) && std::env::var("VALVE_UPROBE_MULTI").as_deref() != Ok("0");
    assert_eq!(w.multi_links(), wanted, "kernel {release}");
    // Either way the same symbols are probed and launches are counted.
    assert!(w.attached().contains(&"cuStreamSynchronize"));
    call(&f, 7, 2);
    let c = w.counts(me);
    assert_eq!((c.kernel_launches, c.graph_launches), (7, 2), "{c:?}");
}

#[test]
fn an_unfiltered_watcher_counts_every_process_without_being_told_of_it() {
    let f = fake_cuda();
    let Some(w) = start_filtered(&f.path, Vec::new(), false) else {
        return;
    };
    call(&f, 5, 1);
    let c = w.counts(std::process::id());
    assert_eq!((c.kernel_launches, c.graph_launches), (5, 1), "{c:?}");
}
