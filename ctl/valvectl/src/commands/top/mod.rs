//! `valvectl top`: a live view of the node from the daemon: per GPU its online and offline
//! processes and whether they run or are frozen, freezes and releases per second, the disable
//! call's time, harvested and frozen offline time, pool handles per process and reclaims.
//!
//! [`sample`] reads the daemon (and the pool), [`view`] works out what to show from two
//! successive samples, [`render`] draws it with ratatui: on the terminal (crossterm, no mouse,
//! so it works over SSH) or, with `--once`, as plain text for scripts.

pub mod render;
pub mod sample;
pub mod view;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use ratatui::backend::CrosstermBackend;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen,
};
use ratatui::crossterm::{cursor, execute, ExecutableCommand};
use ratatui::Terminal;
use valve::Signals;

use crate::args::Globals;
use crate::error::CliError;
use sample::Sources;
use view::Tracker;

const HELP: &str = "\
What it shows:
  header     the daemon's socket and uptime; the gate (offline running or FROZEN, its freezes
             and releases with their rates); offline time harvested (run under the gate) and
             frozen; the memory pool's reclaims.
  GPU rows   ON/OFF: online and offline processes; FROZEN: processes frozen now; PREEMPT/s and
             RESUME/s: freezes and releases of this GPU per second; DISABLE ms: the latest
             disable call / the median since the daemon started; HARVEST: the share of the
             harvest profile's shortest window in which offline could run; POOL f/on/off: the
             pool's handles free / held by online / held by offline.
  processes  per GPU: pid, command, ROLE (online or offline for the gate; a process frozen by
             `valvectl preempt` counts as offline), STATE (running, frozen (gate) or frozen
             (preempt)), channels, and the pool handles it holds.

Per-GPU counts, the disable time, and harvested and frozen time come from the daemon's own
counters, read on its control socket (no --metrics-addr needed; a daemon older than this
valvectl shows only the gate's own counts). Pool figures need `valvectl daemon --pool`.

Keys: q, Esc or Ctrl-C quit (the terminal is restored on every exit). No mouse: works over SSH.

Examples:
  valvectl top                          # live, refreshed every second
  valvectl top --interval 250           # faster refresh; rates over 250 ms
  valvectl top --once                   # one frame as plain text (rates over one interval)
  valvectl top --once --json | jq '.gpus[].processes[] | select(.state == \"frozen\")'
  valvectl --socket /run/valve/valve.sock top --pool-socket /run/valve/pool.sock";

/// The arguments of `valvectl top`.
#[derive(Debug, Args)]
#[command(
    after_help = "Keys: q, Esc or Ctrl-C quit. `valvectl top --help` says what each column is.",
    after_long_help = HELP
)]
pub struct TopArgs {
    /// Refresh every this many milliseconds; rates are measured over it.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub interval: u64,
    /// Print one frame as plain text (no escape codes) and exit; with `--json`, the same data
    /// as one JSON object. It samples twice, one interval apart, so that rates are real;
    /// `--interval 0` samples once (no rates).
    #[arg(long)]
    pub once: bool,
    /// Width of the `--once` frame, in columns.
    #[arg(long, default_value_t = 80, value_name = "COLUMNS", requires = "once",
          value_parser = clap::value_parser!(u16).range(40..))]
    pub width: u16,
    /// The memory pool's socket (shown as not running if nothing answers).
    #[arg(long, default_value = "/run/valve/pool.sock", value_name = "PATH")]
    pub pool_socket: PathBuf,
}

/// Runs `top`: one frame (`--once`, `--json` with it), or the live view until a quit key.
pub fn exec(
    args: &TopArgs,
    g: Globals,
    out: &mut dyn Write,
    signals: &Signals,
) -> Result<(), CliError> {
    let src = Sources {
        socket: g.socket.to_path_buf(),
        pool_socket: args.pool_socket.clone(),
    };
    let interval = Duration::from_millis(args.interval);
    if args.once {
        let snap = once(&src, interval)?;
        if g.json {
            writeln!(out, "{}", serde_json::to_string(&snap).expect("serialises"))?;
        } else {
            write!(out, "{}", render::to_text(&snap, args.width))?;
        }
        return Ok(());
    }
    if g.json {
        return Err(CliError::Usage(
            "--json needs --once: the live view is for a terminal".into(),
        ));
    }
    if args.interval < 100 {
        return Err(CliError::Usage(
            "--interval must be at least 100 ms for the live view".into(),
        ));
    }
    if !std::io::stdout().is_terminal() {
        return Err(CliError::Usage(
            "the live view needs a terminal; for scripts use `valvectl top --once` (or \
             --once --json)"
                .into(),
        ));
    }
    // The first sample before the terminal is touched: a daemon that is not running is a
    // plain error on a plain terminal.
    let first = sample::take(&src)?;
    live(&src, first, interval, out, signals)
}

/// One snapshot: two samples `interval` apart (rates over it), or one if it is zero.
fn once(src: &Sources, interval: Duration) -> Result<view::Snapshot, CliError> {
    let mut tracker = Tracker::new(&src.socket);
    let mut snap = tracker.update(sample::take(src)?);
    if !interval.is_zero() {
        std::thread::sleep(interval);
        snap = tracker.update(sample::take(src)?);
    }
    Ok(snap)
}

/// Raw mode and the alternate screen while it lives; restored when it drops, and by the panic
/// hook it installs before a panic's message is printed.
struct TerminalGuard;

impl TerminalGuard {
    fn enter(out: &mut dyn Write) -> std::io::Result<Self> {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore_terminal();
            previous(info);
        }));
        enable_raw_mode()?;
        // From here on, Drop restores whatever of this was done.
        let guard = TerminalGuard;
        out.execute(EnterAlternateScreen)?.execute(cursor::Hide)?;
        Ok(guard)
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore_terminal();
        // The panic hook goes back to the default one for the rest of the process (not while
        // unwinding: take_hook panics on a panicking thread, and the hook has restored already).
        if !std::thread::panicking() {
            let _ = std::panic::take_hook();
        }
    }
}

fn restore_terminal() {
    let _ = disable_raw_mode();
    let _ = execute!(std::io::stdout(), LeaveAlternateScreen, cursor::Show);
}

/// Whether `key` ends the live view: q, Esc or Ctrl-C (raw mode turns Ctrl-C into a key).
fn quits(key: &KeyEvent) -> bool {
    key.kind != KeyEventKind::Release
        && match key.code {
            KeyCode::Char('q') | KeyCode::Char('Q') | KeyCode::Esc => true,
            KeyCode::Char('c') => key.modifiers.contains(KeyModifiers::CONTROL),
            _ => false,
        }
}

/// What ended a wait for the next refresh.
enum Wake {
    Quit,
    Redraw,
    Refresh,
}

/// Waits until `until`, watching keys, resizes and SIGTERM/SIGHUP (which `valvectl` reads from
/// a signalfd).
fn wait(until: Instant, signals: &Signals) -> Result<Wake, CliError> {
    loop {
        if signals.pending().is_some() {
            return Ok(Wake::Quit);
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(Wake::Refresh);
        }
        // Short polls, so that a signal is seen within 100 ms.
        if event::poll(left.min(Duration::from_millis(100)))? {
            match event::read()? {
                Event::Key(k) if quits(&k) => return Ok(Wake::Quit),
                Event::Resize(..) => return Ok(Wake::Redraw),
                _ => {}
            }
        }
    }
}

fn live(
    src: &Sources,
    first: sample::Sample,
    interval: Duration,
    out: &mut dyn Write,
    signals: &Signals,
) -> Result<(), CliError> {
    let mut tracker = Tracker::new(&src.socket);
    let mut snap = tracker.update(first);
    let mut error: Option<String> = None;
    let guard = TerminalGuard::enter(out)?;
    let mut term = Terminal::new(CrosstermBackend::new(&mut *out))?;
    term.clear()?;
    let mut next = Instant::now() + interval;
    loop {
        let footer = render::Footer {
            error: error.as_deref(),
        };
        term.draw(|f| render::draw(f, &snap, Some(&footer)))?;
        match wait(next, signals)? {
            Wake::Quit => break,
            Wake::Redraw => continue,
            Wake::Refresh => {}
        }
        next = Instant::now() + interval;
        match sample::take(src) {
            Ok(s) => {
                snap = tracker.update(s);
                error = None;
            }
            // The daemon may come back (a restart): keep showing the last data.
            Err(e) => error = Some(e.to_string()),
        }
    }
    drop(term);
    drop(guard);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q_esc_and_ctrl_c_quit_and_nothing_else_does() {
        let key = |code, modifiers| KeyEvent::new(code, modifiers);
        assert!(quits(&key(KeyCode::Char('q'), KeyModifiers::NONE)));
        assert!(quits(&key(KeyCode::Esc, KeyModifiers::NONE)));
        assert!(quits(&key(KeyCode::Char('c'), KeyModifiers::CONTROL)));
        assert!(!quits(&key(KeyCode::Char('c'), KeyModifiers::NONE)));
        assert!(!quits(&key(KeyCode::Char('x'), KeyModifiers::NONE)));
    }

    #[test]
    fn once_without_a_daemon_names_the_socket_and_how_to_start_it() {
        let dir = tempfile::tempdir().unwrap();
        let src = Sources {
            socket: dir.path().join("valve.sock"),
            pool_socket: dir.path().join("pool.sock"),
        };
        let e = once(&src, Duration::ZERO).unwrap_err();
        assert_eq!(e.exit_code(), valve_daemon::EXIT_NO_DAEMON);
        let msg = e.to_string();
        assert!(
            msg.contains(&dir.path().join("valve.sock").display().to_string()),
            "{msg}"
        );
        assert!(msg.contains("sudo valvectl daemon"), "{msg}");
    }
}
