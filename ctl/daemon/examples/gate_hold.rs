//! What the gate's hold (`gate start --hold-budget`) catches and costs on replayed arrivals: the
//! real `GatePolicy`, fed by a simulated server that serves requests one at a time.
//!
//! Each request launches a prefill 0.15 ms after its service starts and then `--steps` decode
//! steps spread over `--service-ms`, each followed by a wait for the GPU 0.1 ms later (as the
//! graph server does). Ticks come every 0.5 ms. An idle arrival is one that finds no request in
//! service; it is caught when offline is already frozen then. Harvest is the share of the
//! server's idle time in which offline ran.
//!
//! `--restart-every S` starts a fresh gate every S seconds of the replay (as a gate restart, or a
//! benchmark run of S seconds, would): what the hold catches before it has a long history.
//! With `--keep-history` each new gate starts from the gaps the last one learned, as the daemon
//! does for a gate started again on the same online service.
//!
//! `--history-out FILE --history-service KEY` writes what the first hold-budget row's gate learned
//! as the daemon's `gate-hold-history.json`, for the service KEY (`ports=P label= pids=` for
//! `gate start --online-port P`); put it in a daemon's state directory before the daemon starts
//! and its first gate on that service starts from the replayed history. `--history-in FILE`
//! starts every row's gate from such a file (the same KEY), as that daemon's gate would.
//!
//! `--arrivals-out FILE` writes the first hold-budget row's idle arrivals as CSV: when each came
//! (s), the idle time before it past the server's last request (s), the hold in force (ms), the
//! gaps the hold was chosen over (how many, their sum in s, and how many of them the gate was
//! seeded with: `--history-in`'s, or after a restart with `--keep-history` the last gate's), and
//! whether it was caught.
//!
//!     cargo run --release -p valve-daemon --example gate_hold -- \
//!         sched/data/azure-llm-2023-code-arrivals-first20min.csv --rate 1.01
//!     cargo run --release -p valve-daemon --example gate_hold -- poisson --rate 1.01

use std::time::Duration;

use valve_daemon::gate::hold_history::HoldHistories;
use valve_daemon::gate::policy::{Action, GateConfig, GatePolicy, HoldHistory, HOLD_GAPS};

const MS: u64 = 1_000_000;
const US: u64 = 1_000;
const TICK: u64 = 500 * US;

struct Args {
    source: String,
    rate: f64,
    service_ns: u64,
    steps: u64,
    budgets: Vec<f64>,
    fixed_ms: Vec<u64>,
    restart_every_ns: Option<u64>,
    keep_history: bool,
    history_out: Option<String>,
    history_in: Option<String>,
    history_service: Option<String>,
    arrivals_out: Option<String>,
}

fn usage() -> ! {
    eprintln!(
        "usage: gate_hold (ARRIVALS.csv | poisson) [--rate PER_S] [--service-ms MS] [--steps N] \
         [--budgets PCT,...] [--fixed-ms MS,...] [--restart-every S [--keep-history]]\n  \
         [--history-out FILE] [--history-in FILE] --history-service KEY (with either)\n  \
         [--arrivals-out FILE]\n  ARRIVALS.csv: one column offset_us \
         (sched/data/azure-llm-2023-*-arrivals-first20min.csv)"
    );
    std::process::exit(2)
}

fn list<T: std::str::FromStr>(text: &str) -> Vec<T> {
    text.split(',')
        .map(|x| x.trim().parse().unwrap_or_else(|_| usage()))
        .collect()
}

fn parse_args() -> Args {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        source: it.next().unwrap_or_else(|| usage()),
        rate: 1.01,
        service_ns: 353_500 * US,
        steps: 64,
        budgets: vec![0.0, 5.0, 10.0, 20.0],
        fixed_ms: vec![50, 200, 500],
        restart_every_ns: None,
        keep_history: false,
        history_out: None,
        history_in: None,
        history_service: None,
        arrivals_out: None,
    };
    while let Some(flag) = it.next() {
        if flag == "--keep-history" {
            a.keep_history = true;
            continue;
        }
        let value = it.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--rate" => a.rate = value.parse().unwrap_or_else(|_| usage()),
            "--service-ms" => {
                a.service_ns = (value.parse::<f64>().unwrap_or_else(|_| usage()) * 1e6) as u64
            }
            "--steps" => a.steps = value.parse().unwrap_or_else(|_| usage()),
            "--budgets" => a.budgets = list(&value),
            "--fixed-ms" if value == "none" => a.fixed_ms = vec![],
            "--fixed-ms" => a.fixed_ms = list(&value),
            "--history-out" => a.history_out = Some(value),
            "--history-in" => a.history_in = Some(value),
            "--history-service" => a.history_service = Some(value),
            "--arrivals-out" => a.arrivals_out = Some(value),
            "--restart-every" => {
                let s: f64 = value.parse().unwrap_or_else(|_| usage());
                if s.is_nan() || s < 1.0 {
                    usage()
                }
                a.restart_every_ns = Some((s * 1e9) as u64)
            }
            _ => usage(),
        }
    }
    if (a.history_out.is_some() || a.history_in.is_some()) != a.history_service.is_some() {
        fail(
            "--history-out and --history-in need --history-service KEY (the gate's service, e.g. \
              'ports=8000 label= pids='), and --history-service needs one of them",
        );
    }
    if a.history_out.is_some() && !a.budgets.iter().any(|&b| b > 0.0) {
        fail("--history-out writes a hold's history: give a hold budget above 0 in --budgets");
    }
    a
}

fn fail(why: &str) -> ! {
    eprintln!("gate_hold: {why}");
    std::process::exit(2)
}

/// The history `--history-in` names for `--history-service` (none given: none).
fn seed_history(a: &Args) -> Option<HoldHistory> {
    let (path, service) = (a.history_in.as_ref()?, a.history_service.as_ref()?);
    let path = std::path::Path::new(path);
    if !path.exists() {
        fail(&format!("{}: no such file (--history-in)", path.display()));
    }
    let (histories, warning) = HoldHistories::load(path);
    if let Some(w) = warning {
        fail(&w);
    }
    let now = unix_now_s();
    match histories.for_service(service, now) {
        Some((history, _age)) => Some(history),
        None => fail(&format!(
            "{}: no history for service '{service}' (or older than a day): write it with \
             --history-out and the same --history-service",
            path.display()
        )),
    }
}

/// Writes `history` as the daemon's hold-history file for `--history-service`. The replay's
/// clock is not the host's monotonic clock, so the last activity is left out.
fn write_history(a: &Args, path: &str, mut history: HoldHistory) {
    history.last_activity_ns = None;
    let gaps = history.gaps.len();
    let mut histories = HoldHistories::default();
    let service = a.history_service.clone().unwrap_or_default();
    if !histories.keep(service.clone(), history, unix_now_s()) {
        fail("the replay left the hold no gaps to keep (too few requests, or a service name over 1000 characters)");
    }
    if let Err(e) = histories.save(std::path::Path::new(path)) {
        fail(&format!("{path}: {e}"));
    }
    println!("{path}: {gaps} gaps for service '{service}'");
}

fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Arrival times (ns), scaled so that they come at `rate` a second on average.
fn arrivals(a: &Args) -> Vec<u64> {
    let offsets: Vec<f64> = if a.source == "poisson" {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut t = 0.0;
        (0..4000)
            .map(|_| {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                t += -(((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64).ln();
                t
            })
            .collect()
    } else {
        let text = std::fs::read_to_string(&a.source).unwrap_or_else(|e| {
            eprintln!("gate_hold: {}: {e}", a.source);
            std::process::exit(2)
        });
        text.lines()
            .skip(1)
            .filter_map(|l| l.trim().parse::<f64>().ok())
            .map(|us| us / 1e6)
            .collect()
    };
    let span = offsets.last().copied().unwrap_or(0.0) - offsets[0];
    // Time is stretched (or squeezed) by the trace's own rate over the one asked for.
    let scale = (offsets.len() - 1).max(1) as f64 / span / a.rate;
    offsets
        .iter()
        .map(|t| ((t - offsets[0]) * scale * 1e9) as u64 + MS)
        .collect()
}

/// What happens at an instant; at equal times in this order (a request ends before the next
/// one, queued behind it, starts).
#[derive(Clone, Copy, PartialEq, PartialOrd)]
enum Kind {
    Arrival,
    End,
    Start,
    Launch,
    WaitEnd,
}

/// The events of a FIFO server serving every request for `service_ns`.
fn events(arrivals: &[u64], a: &Args) -> Vec<(u64, Kind)> {
    let mut out = Vec::new();
    let mut free = 0;
    for &t in arrivals {
        out.push((t, Kind::Arrival));
        let start = t.max(free);
        let end = start + a.service_ns;
        out.push((start, Kind::Start));
        let step = (a.service_ns - 150 * US) / a.steps.max(1);
        for k in 0..=a.steps {
            let launch = start + 150 * US + k * step;
            out.push((launch, Kind::Launch));
            out.push((launch + 100 * US, Kind::WaitEnd));
        }
        out.push((end, Kind::End));
        free = end;
    }
    out.sort_by(|x, y| x.partial_cmp(y).unwrap());
    out
}

#[derive(Default)]
struct Outcome {
    idle_arrivals: u64,
    caught: u64,
    idle_ns: u64,
    offline_in_idle_ns: u64,
    preemptions: u64,
    hold: Duration,
    cooldown: Duration,
    history: HoldHistory,
    /// The idle arrivals, for `--arrivals-out` (only when asked for).
    records: Vec<IdleArrival>,
}

/// One idle arrival as `--arrivals-out` writes it.
struct IdleArrival {
    t_ns: u64,
    idle_ns: u64,
    hold: Duration,
    gaps: usize,
    gaps_sum_ns: u64,
    seeded: usize,
    caught: bool,
}

/// How many of the hold's gaps came from the seed: they are its oldest, and each gap the gate
/// notes past [`HOLD_GAPS`] pushes one out.
struct SeedCount {
    seeded: usize,
    own: usize,
    last: (usize, Option<u64>),
}

impl SeedCount {
    fn new(g: &GatePolicy) -> Self {
        let gaps = g.hold_history().gaps;
        SeedCount {
            seeded: gaps.len(),
            own: 0,
            last: (gaps.len(), gaps.last().copied()),
        }
    }

    /// After an arrival (which notes the gap before it, if any): the record of it.
    fn record(&mut self, g: &GatePolicy, t_ns: u64, idle_ns: u64, caught: bool) -> IdleArrival {
        let hold = g.hold();
        let gaps = g.hold_history().gaps;
        let last = (gaps.len(), gaps.last().copied());
        self.own += usize::from(last != self.last);
        self.last = last;
        IdleArrival {
            t_ns,
            idle_ns,
            hold,
            gaps: gaps.len(),
            gaps_sum_ns: gaps.iter().sum(),
            seeded: self.seeded.min(HOLD_GAPS.saturating_sub(self.own)),
            caught,
        }
    }
}

fn write_records(path: &str, records: &[IdleArrival]) {
    let mut text = String::from("t_s,idle_s,hold_ms,gaps,gaps_sum_s,seeded_gaps,caught\n");
    for r in records {
        text += &format!(
            "{:.3},{:.3},{:.1},{},{:.1},{},{}\n",
            r.t_ns as f64 / 1e9,
            r.idle_ns as f64 / 1e9,
            r.hold.as_secs_f64() * 1e3,
            r.gaps,
            r.gaps_sum_ns as f64 / 1e9,
            r.seeded,
            u8::from(r.caught)
        );
    }
    if let Err(e) = std::fs::write(path, text) {
        fail(&format!("{path}: {e}"));
    }
}

fn run(
    events: &[(u64, Kind)],
    cfg: GateConfig,
    a: &Args,
    seed: Option<&HoldHistory>,
    record: bool,
) -> Outcome {
    let restart_every_ns = a.restart_every_ns;
    let mut g = GatePolicy::new(cfg);
    if let Some(h) = seed {
        g.seed_hold_history(h);
    }
    let mut o = Outcome::default();
    let mut seeded = SeedCount::new(&g);
    let (mut running, mut busy, mut now, mut free) = (true, false, 0u64, 0u64);
    let mut next_restart = restart_every_ns.unwrap_or(u64::MAX);
    let apply = |action: Option<Action>, running: &mut bool| match action {
        Some(Action::Preempt) => *running = false,
        Some(Action::Resume) => *running = true,
        None => {}
    };
    for &(t, kind) in events {
        // Ticks up to the event, counting offline's time while the server is idle.
        while now < t {
            let next = (now / TICK + 1) * TICK;
            let until = next.min(t);
            if !busy {
                o.idle_ns += until - now;
                o.offline_in_idle_ns += if running { until - now } else { 0 };
            }
            now = until;
            if now == next {
                apply(g.on_tick(now), &mut running);
            }
            if now >= next_restart {
                // A stopped gate resumes offline; the new one knows nothing yet.
                o.preemptions += g.preemptions();
                let history = g.hold_history();
                g = GatePolicy::new(cfg);
                if a.keep_history {
                    g.seed_hold_history(&history);
                }
                seeded = SeedCount::new(&g);
                running = true;
                next_restart = next_restart.saturating_add(restart_every_ns.unwrap_or(u64::MAX));
            }
        }
        match kind {
            Kind::Arrival => {
                let caught = !busy && !running;
                if !busy {
                    o.idle_arrivals += 1;
                    o.caught += u64::from(caught);
                }
                apply(g.on_arrival(t), &mut running);
                if record && !busy {
                    let idle = t.saturating_sub(free);
                    o.records.push(seeded.record(&g, t, idle, caught));
                }
            }
            Kind::Start => busy = true,
            Kind::Launch => apply(g.on_launch(t), &mut running),
            Kind::WaitEnd => g.saw_wait_end(t),
            Kind::End => (busy, free) = (false, t),
        }
    }
    o.preemptions += g.preemptions();
    o.hold = g.hold();
    o.cooldown = g.learned_cooldown();
    o.history = g.hold_history();
    o
}

fn main() {
    let a = parse_args();
    let arrivals = arrivals(&a);
    let events = events(&arrivals, &a);
    let span_s = *arrivals.last().unwrap() as f64 / 1e9;
    let seed = seed_history(&a);
    println!(
        "{}: {} requests over {:.0} s ({:.2}/s), service {:.1} ms in {} steps{}",
        a.source,
        arrivals.len(),
        span_s,
        arrivals.len() as f64 / span_s,
        a.service_ns as f64 / 1e6,
        a.steps,
        a.restart_every_ns
            .map(|ns| format!(
                ", a fresh gate every {:.0} s{}",
                ns as f64 / 1e9,
                if a.keep_history {
                    " (keeping the last one's gaps)"
                } else {
                    ""
                }
            ))
            .unwrap_or_default()
    );
    if let (Some(path), Some(h)) = (&a.history_in, &seed) {
        println!(
            "every gate starts from {path}'s history: {} gaps",
            h.gaps.len()
        );
    }
    println!("| gate | idle arrivals | caught (offline already off) | harvest (offline ran in idle time) | preemptions | learned cooldown / hold at the end |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let mut rows: Vec<(String, GateConfig)> = a
        .budgets
        .iter()
        .map(|&pct| {
            let name = if pct == 0.0 {
                "learned cooldown".to_string()
            } else {
                format!("hold budget {pct}%")
            };
            let budget = (pct > 0.0).then_some(pct / 100.0);
            (
                name,
                GateConfig {
                    hold_budget: budget,
                    ..GateConfig::default()
                },
            )
        })
        .collect();
    rows.extend(a.fixed_ms.iter().map(|&ms| {
        (
            format!("fixed cooldown {ms} ms"),
            GateConfig {
                fixed_cooldown: Some(Duration::from_millis(ms)),
                ..GateConfig::default()
            },
        )
    }));
    let mut out = a.history_out.clone();
    let mut records_out = a.arrivals_out.clone();
    for (name, cfg) in rows {
        let record = cfg.hold_budget.is_some() && records_out.is_some();
        let o = run(&events, cfg, &a, seed.as_ref(), record);
        println!(
            "| {name} | {} | {:.1}% | {:.1}% | {} | {:.1} / {:.0} ms |",
            o.idle_arrivals,
            100.0 * o.caught as f64 / o.idle_arrivals.max(1) as f64,
            100.0 * o.offline_in_idle_ns as f64 / o.idle_ns.max(1) as f64,
            o.preemptions,
            o.cooldown.as_secs_f64() * 1e3,
            o.hold.as_secs_f64() * 1e3
        );
        if cfg.hold_budget.is_some() {
            if let Some(path) = records_out.take() {
                write_records(&path, &o.records);
            }
            if let Some(path) = out.take() {
                write_history(&a, &path, o.history);
            }
        }
    }
}
