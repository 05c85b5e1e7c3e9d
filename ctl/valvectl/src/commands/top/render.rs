//! Drawing a [`Snapshot`] with ratatui: a header (the daemon, the gate, offline time, the
//! pool), one row per GPU, one row per process on each GPU, then notes. The live view draws it
//! on the terminal; `--once` draws it into an off-screen buffer and prints that as plain text.

use ratatui::backend::TestBackend;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Cell, Paragraph, Row, Table};
use ratatui::{Frame, Terminal};

use super::view::{GpuView, ProcessView, Snapshot};

/// The GPU table's columns and widths (72 columns with the gaps: an 80-column terminal fits).
const GPU_COLUMNS: [(&str, u16); 9] = [
    ("GPU", 3),
    ("ON", 2),
    ("OFF", 3),
    ("FROZEN", 6),
    ("PREEMPT/s", 9),
    ("RESUME/s", 8),
    ("DISABLE ms", 11),
    ("HARVEST", 8),
    ("POOL f/on/off", 13),
];

/// The process table's columns and widths (70 columns with the gaps).
const PROCESS_COLUMNS: [(&str, u16); 7] = [
    ("GPU", 3),
    ("PID", 8),
    ("COMMAND", 16),
    ("ROLE", 7),
    ("STATE", 16),
    ("CHANNELS", 8),
    ("POOL", 6),
];

/// What the live view adds below the data: the keys, and the latest failure to refresh.
pub struct Footer<'a> {
    /// Why the latest refresh failed (the data shown is older).
    pub error: Option<&'a str>,
}

/// Draws `snap` over the whole frame; `footer` only in the live view.
pub fn draw(frame: &mut Frame, snap: &Snapshot, footer: Option<&Footer>) {
    let header = header(snap);
    let notes: Vec<Line> = wrap_notes(snap, frame.area().width)
        .into_iter()
        .map(Line::raw)
        .collect();
    let footer_lines = footer.map_or(0, |_| 1);
    let [head, gpus, gap, procs, notes_area, foot] = Layout::vertical([
        Constraint::Length(header.len() as u16),
        Constraint::Length(1 + snap.gpus.len() as u16),
        Constraint::Length(1),
        Constraint::Min(1),
        Constraint::Length(notes.len() as u16),
        Constraint::Length(footer_lines),
    ])
    .areas(frame.area());
    let _ = gap;
    frame.render_widget(Paragraph::new(header), head);
    frame.render_widget(gpu_table(snap), gpus);
    render_processes(frame, snap, procs);
    frame.render_widget(
        Paragraph::new(notes).style(Style::new().fg(Color::DarkGray)),
        notes_area,
    );
    if let Some(f) = footer {
        let mut spans = vec![Span::styled(
            " q/Esc/Ctrl-C quit ",
            Style::new().add_modifier(Modifier::REVERSED),
        )];
        if let Some(e) = f.error {
            spans.push(Span::styled(
                format!(" refresh failed, showing older data: {e}"),
                Style::new().fg(Color::Red),
            ));
        }
        frame.render_widget(Paragraph::new(Line::from(spans)), foot);
    }
}

/// The lines a frame of `snap` takes `width` columns wide, without a footer (the `--once`
/// height).
pub fn height(snap: &Snapshot, width: u16) -> u16 {
    let procs: usize = snap.gpus.iter().map(|g| g.processes.len()).sum();
    let notes = wrap_notes(snap, width).len();
    let rows = header(snap).len() + 1 + snap.gpus.len() + 1 + 1 + procs.max(1) + notes;
    rows.min(u16::MAX as usize) as u16
}

/// The notes, broken at spaces to fit `width` columns.
fn wrap_notes(snap: &Snapshot, width: u16) -> Vec<String> {
    let width = width.max(20) as usize;
    let mut lines = Vec::new();
    for note in &snap.notes {
        let mut line = String::new();
        for word in note.split(' ') {
            if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
                lines.push(std::mem::take(&mut line));
                line.push_str("  ");
            } else if !line.is_empty() && line != "  " {
                line.push(' ');
            }
            line.push_str(word);
        }
        lines.push(line);
    }
    lines
}

/// One frame as plain text, `width` columns wide: no escape codes, trailing blanks trimmed.
pub fn to_text(snap: &Snapshot, width: u16) -> String {
    let mut term = Terminal::new(TestBackend::new(width, height(snap, width)))
        .expect("an off-screen terminal");
    term.draw(|f| draw(f, snap, None))
        .expect("drawing off-screen cannot fail");
    let buf = term.backend().buffer();
    let mut out = String::new();
    for y in 0..buf.area.height {
        let mut line = String::new();
        for x in 0..buf.area.width {
            line.push_str(buf[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn header(snap: &Snapshot) -> Vec<Line<'static>> {
    let bold = Style::new().add_modifier(Modifier::BOLD);
    let rates = snap
        .interval_s
        .map_or("rates after the next refresh".into(), |s| {
            format!("rates over {s:.1} s")
        });
    let mut lines = vec![Line::from(vec![
        Span::styled("valvectl top", bold),
        Span::raw(format!(
            ": daemon on {}, up {}, {rates}",
            snap.socket,
            duration(snap.uptime_s)
        )),
    ])];
    let g = &snap.gate;
    if g.running {
        let (state, style) = if g.offline_frozen {
            (
                "offline FROZEN",
                Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
            )
        } else {
            ("offline running", Style::new().fg(Color::Green))
        };
        let mut spans = vec![Span::raw("gate: "), Span::styled(state, style)];
        if g.pinned {
            spans.push(Span::raw(" (busy signal)"));
        }
        if let Some(c) = g.cooldown_us {
            spans.push(Span::raw(format!(", cooldown {:.1} ms", c / 1e3)));
        }
        if let Some(l) = &g.offline_label {
            spans.push(Span::raw(format!(", offline label {l}")));
        }
        lines.push(Line::from(spans));
        lines.push(Line::raw(format!(
            "  {} freezes ({}/s), {} releases ({}/s)",
            g.preemptions,
            rate(g.preemptions_per_s),
            g.resumes,
            rate(g.resumes_per_s)
        )));
        if let Some(h) = &g.hold {
            lines.push(Line::raw(format!(
                "  hold {:.1} ms: caught {} of {} arrivals after idle time",
                h.hold_us / 1e3,
                h.caught,
                h.idle_arrivals
            )));
        }
    } else {
        lines.push(Line::raw(
            "gate: not running (start one with `valvectl gate start`)",
        ));
    }
    lines.push(Line::raw(format!(
        "offline time: harvested {}, frozen {}",
        g.harvested_s.map_or("?".into(), duration),
        g.frozen_s.map_or("?".into(), duration)
    )));
    let p = &snap.pool;
    lines.push(Line::raw(if p.running {
        format!(
            "pool: {} reclaims ({}/s), {} handles taken back, {} killed, last {}",
            opt(p.reclaims),
            rate(p.reclaims_per_s),
            opt(p.handles_reclaimed),
            opt(p.killed),
            p.last_reclaim_us
                .map_or("-".into(), |u| format!("{:.2} ms", u as f64 / 1e3))
        )
    } else {
        format!("pool: {}", p.error.as_deref().unwrap_or("not running"))
    }));
    lines
}

fn title_row<const N: usize>(columns: &[(&'static str, u16); N]) -> Row<'static> {
    Row::new(columns.iter().map(|(t, _)| *t))
        .style(Style::new().add_modifier(Modifier::REVERSED | Modifier::BOLD))
}

fn widths<const N: usize>(columns: &[(&'static str, u16); N]) -> Vec<Constraint> {
    columns
        .iter()
        .map(|(_, w)| Constraint::Length(*w))
        .collect()
}

fn gpu_table(snap: &Snapshot) -> Table<'static> {
    let rows = snap.gpus.iter().map(gpu_row);
    Table::new(rows, widths(&GPU_COLUMNS)).header(title_row(&GPU_COLUMNS))
}

fn gpu_row(g: &GpuView) -> Row<'static> {
    let frozen_style = if g.frozen > 0 {
        Style::new().fg(Color::Red).add_modifier(Modifier::BOLD)
    } else {
        Style::new()
    };
    let ms = |us: Option<f64>| us.map_or("-".into(), |u| format!("{:.2}", u / 1e3));
    let harvest = match (g.offline_could_run, g.harvest_window_s) {
        (Some(f), Some(w)) => format!("{:.0}%/{w}s", f * 100.0),
        _ => "-".into(),
    };
    let pool = g.pool.as_ref().map_or("-".into(), |p| {
        format!("{}/{}/{}", p.free, p.online, p.offline)
    });
    let cells: Vec<Cell> = vec![
        g.index.to_string().into(),
        g.online.to_string().into(),
        g.offline.to_string().into(),
        Span::styled(g.frozen.to_string(), frozen_style).into(),
        rate(g.preemptions_per_s).into(),
        rate(g.resumes_per_s).into(),
        format!("{}/{}", ms(g.disable_last_us), ms(g.disable_p50_us)).into(),
        harvest.into(),
        pool.into(),
    ];
    Row::new(cells)
}

fn render_processes(frame: &mut Frame, snap: &Snapshot, area: Rect) {
    let all: Vec<(usize, &ProcessView)> = snap
        .gpus
        .iter()
        .flat_map(|g| g.processes.iter().map(move |p| (g.index, p)))
        .collect();
    let mut rows: Vec<Row> = all.iter().map(|(i, p)| process_row(*i, p)).collect();
    if rows.is_empty() {
        rows.push(Row::new(vec![
            String::new(),
            String::new(),
            "(none)".into(),
        ]));
    }
    // The title takes a line; say what does not fit instead of cutting it silently.
    let room = area.height.saturating_sub(1) as usize;
    let mut table_area = area;
    if rows.len() > room && area.height >= 2 {
        let [top, last] = Layout::vertical([Constraint::Min(1), Constraint::Length(1)]).areas(area);
        table_area = top;
        let shown = room - 1;
        let note = format!(
            "... {} more (a taller terminal, or --once, shows all)",
            rows.len() - shown
        );
        rows.truncate(shown);
        frame.render_widget(Paragraph::new(note), last);
    }
    let table = Table::new(rows, widths(&PROCESS_COLUMNS)).header(title_row(&PROCESS_COLUMNS));
    frame.render_widget(table, table_area);
}

fn process_row(gpu: usize, p: &ProcessView) -> Row<'static> {
    let role_style = match p.role {
        "online" => Style::new().fg(Color::Green),
        "offline" => Style::new().fg(Color::Yellow),
        _ => Style::new(),
    };
    let (state, state_style) = match p.frozen_by {
        Some(by) => (
            format!("{} ({by})", p.state),
            Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
        ),
        None => (p.state.to_string(), Style::new()),
    };
    let cells: Vec<Cell> = vec![
        gpu.to_string().into(),
        p.pid.to_string().into(),
        p.comm.clone().into(),
        Span::styled(p.role, role_style).into(),
        Span::styled(state, state_style).into(),
        p.channels.to_string().into(),
        opt(p.pool_handles).into(),
    ];
    Row::new(cells)
}

fn rate(r: Option<f64>) -> String {
    r.map_or("-".into(), |r| format!("{r:.1}"))
}

fn opt(v: Option<u64>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

/// Seconds as `12.3 s`, `4m05s` or `1h02m`.
fn duration(s: f64) -> String {
    if s < 60.0 {
        format!("{s:.1} s")
    } else if s < 3600.0 {
        let s = s as u64;
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        let s = s as u64;
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::view::tests::sample;
    use super::super::view::Tracker;
    use super::*;

    fn snapshot() -> Snapshot {
        let t0 = Instant::now();
        let mut tr = Tracker::new(std::path::Path::new("/run/valve/valve.sock"));
        tr.update(sample(t0, 10.0, 3));
        tr.update(sample(t0 + Duration::from_secs(2), 16.0, 4))
    }

    #[test]
    fn a_frame_fits_80_columns_as_plain_text() {
        let text = to_text(&snapshot(), 80);
        assert!(!text.contains('\x1b'), "escape codes in:\n{text}");
        for line in text.lines() {
            assert!(line.chars().count() <= 80, "too wide: {line:?}");
        }
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with(
                "valvectl top: daemon on /run/valve/valve.sock, up 1h02m, rates over 2.0 s"
            ),
            "{text}"
        );
        assert!(
            text.contains("gate: offline FROZEN, cooldown 12.0 ms, offline label batch"),
            "{text}"
        );
        assert!(
            text.contains("16 freezes (3.0/s), 15 releases (3.0/s)"),
            "{text}"
        );
        assert!(
            !text.contains("hold"),
            "no hold line without a hold:\n{text}"
        );
        let mut held = snapshot();
        held.gate.hold = Some(super::super::view::HoldView {
            hold_us: 2150.0,
            idle_arrivals: 35,
            caught: 20,
        });
        let text = to_text(&held, 80);
        assert!(
            text.contains("  hold 2.1 ms: caught 20 of 35 arrivals after idle time"),
            "{text}"
        );
        assert!(
            text.contains("offline time: harvested 13m32s, frozen 45.5 s"),
            "{text}"
        );
        assert!(
            text.contains(
                "pool: 4 reclaims (0.5/s), 12 handles taken back, 0 killed, last 1.80 ms"
            ),
            "{text}"
        );
        // The GPU rows, under their titles.
        let gpu_title = lines
            .iter()
            .position(|l| l.starts_with("GPU ON OFF FROZEN"))
            .expect(&text);
        assert_eq!(
            lines[gpu_title + 1].split_whitespace().collect::<Vec<_>>(),
            [
                "0",
                "1",
                "1",
                "1",
                "3.0",
                "3.0",
                "0.70/0.96",
                "75%/60s",
                "2/5/3"
            ],
            "{text}"
        );
        assert_eq!(
            lines[gpu_title + 2].split_whitespace().collect::<Vec<_>>(),
            ["1", "0", "2", "2", "0.0", "0.0", "-/-", "-", "-"],
            "{text}"
        );
        let row = |pid: &str| {
            lines
                .iter()
                .find(|l| l.split_whitespace().nth(1) == Some(pid))
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .expect(&text)
        };
        assert_eq!(
            row("100"),
            ["0", "100", "vllm", "online", "running", "20", "5"]
        );
        assert_eq!(
            row("200"),
            ["0", "200", "train.py", "offline", "frozen", "(gate)", "20", "3"]
        );
        assert_eq!(
            row("300"),
            [
                "1",
                "300",
                "bench",
                "offline",
                "frozen",
                "(preempt)",
                "8",
                "-"
            ]
        );
        assert!(
            text.contains("1 process(es) started before the daemon"),
            "{text}"
        );
        assert!(
            text.ends_with("  seen; see `valvectl ps`)\n"),
            "wrapped, not cut: {text}"
        );
    }

    #[test]
    fn a_short_terminal_says_how_many_processes_it_hides() {
        let snap = snapshot();
        let mut term = Terminal::new(TestBackend::new(80, 15)).unwrap();
        term.draw(|f| {
            draw(
                f,
                &snap,
                Some(&Footer {
                    error: Some("timed out"),
                }),
            )
        })
        .unwrap();
        let buf = term.backend().buffer();
        let text: String = (0..buf.area.height)
            .map(|y| {
                let l: String = (0..80).map(|x| buf[(x, y)].symbol()).collect();
                l.trim_end().to_string() + "\n"
            })
            .collect();
        assert!(
            text.contains("... 3 more (a taller terminal, or --once, shows all)"),
            "{text}"
        );
        assert!(text.contains("q/Esc/Ctrl-C quit"), "{text}");
        assert!(
            text.contains("refresh failed, showing older data: timed out"),
            "{text}"
        );
    }

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(duration(12.34), "12.3 s");
        assert_eq!(duration(245.0), "4m05s");
        assert_eq!(duration(3725.0), "1h02m");
    }
}
