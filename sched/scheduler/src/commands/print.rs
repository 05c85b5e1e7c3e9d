//! How passes are shown: every decision of a single pass (`--once`, `explain`), or a line per
//! pass with what changed (the loop), or JSON.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde_json::json;
use valve_scheduler::agents::Agents;
use valve_scheduler::cycle::Plan;
use valve_scheduler::driver::Applied;
use valve_scheduler::monitor::Action;
use valve_scheduler::place::Outcome;

/// What the loop has logged, so that each pass logs only what changed: which nodes are
/// excluded and why, and why each pending or refused job waits.
#[derive(Debug, Default)]
pub struct LoopLog {
    /// Excluded nodes and the cause last logged.
    excluded: HashMap<String, String>,
    /// Pending jobs and the cause last logged.
    waiting: HashMap<String, String>,
    /// Refused jobs and the reason last logged.
    refused: HashMap<String, String>,
    /// The last summary printed, and when.
    last_summary: Option<(String, Instant)>,
}

/// An unchanged summary is printed again after this long, to show the loop is alive.
const HEARTBEAT: Duration = Duration::from_secs(600);

impl LoopLog {
    /// Whether to print this pass's `summary` at `now`: when it differs from the last one
    /// printed, when `changed` (the pass has lines of its own), or once a [`HEARTBEAT`].
    pub fn print_summary(&mut self, summary: &str, changed: bool, now: Instant) -> bool {
        let due = match &self.last_summary {
            None => true,
            Some((last, at)) => last != summary || now.duration_since(*at) >= HEARTBEAT,
        };
        if due || changed {
            self.last_summary = Some((summary.to_string(), now));
        }
        due || changed
    }

    /// The lines this pass adds: nodes newly excluded (or for another reason), with their
    /// agent's last error, and nodes no longer excluded; jobs newly pending or refused, or for
    /// another reason. Jobs that stop waiting are forgotten (a placement has its own line).
    pub fn changes(&mut self, plan: &Plan, agent_errors: &HashMap<String, String>) -> Vec<String> {
        let mut lines = Vec::new();
        let mut excluded = HashMap::new();
        for e in &plan.excluded {
            if self.excluded.get(&e.node) != Some(&e.cause) {
                let error = agent_errors
                    .get(&e.node)
                    .filter(|_| !e.why.starts_with("the engine"));
                let last = error.map_or(String::new(), |err| format!("; its agent: {err}"));
                lines.push(format!("node {}: excluded: {}{last}", e.node, e.why));
            }
            excluded.insert(e.node.clone(), e.cause.clone());
        }
        let mut back: Vec<&String> = self
            .excluded
            .keys()
            .filter(|n| !excluded.contains_key(*n))
            .collect();
        back.sort();
        lines.extend(back.iter().map(|n| format!("node {n}: no longer excluded")));
        self.excluded = excluded;
        let mut waiting = HashMap::new();
        for w in &plan.waiting {
            if self.waiting.get(&w.job) != Some(&w.cause) {
                lines.push(format!("job {}: pending: {}", w.job, w.why));
            }
            waiting.insert(w.job.clone(), w.cause.clone());
        }
        self.waiting = waiting;
        let mut refused = HashMap::new();
        for r in &plan.refused {
            if self.refused.get(&r.job) != Some(&r.why) {
                lines.push(format!("job {}: refused: {}", r.job, r.why));
            }
            refused.insert(r.job.clone(), r.why.clone());
        }
        self.refused = refused;
        lines
    }
}

/// The loop's line for a pass: what it did and what it found, counted, with the excluded
/// nodes named (up to five).
pub fn summary(plan: &Plan, applied: &Applied) -> String {
    let mut names: Vec<&str> = plan.excluded.iter().map(|e| e.node.as_str()).collect();
    names.sort_unstable();
    let named = match names.len() {
        0 => String::new(),
        1..=5 => format!(" ({})", names.join(", ")),
        n => format!(" ({}, and {} more)", names[..5].join(", "), n - 5),
    };
    format!(
        "pass: {} placed, {} evicted, {} pending, {} running, {} refused, {} node(s) excluded{named}",
        applied.placed.len(),
        applied.evicted.len(),
        plan.waiting.len(),
        plan.checks.len(),
        plan.refused.len(),
        plan.excluded.len()
    )
}

/// Prints one pass: all of it with `full`, else the loop's summary (where it says something new,
/// or as a heartbeat), what changed since the last pass (`log`) and the actions taken.
pub fn print_pass(
    plan: &Plan,
    applied: &Applied,
    agents: &Agents,
    json: bool,
    full: bool,
    log: &mut LoopLog,
) {
    if json {
        let errors: BTreeMap<_, _> = agents.errors.iter().collect();
        println!(
            "{}",
            json!({"plan": plan, "applied": applied, "agent_errors": errors})
        );
        return;
    }
    if full {
        print_plan(plan);
        for (node, e) in &agents.errors {
            println!("agent of {node}: {e}");
        }
    } else {
        let lines = log.changes(plan, &agents.errors);
        let acted =
            !(applied.placed.is_empty() && applied.evicted.is_empty() && applied.failed.is_empty());
        let line = summary(plan, applied);
        if log.print_summary(&line, acted || !lines.is_empty(), Instant::now()) {
            println!("{line}");
        }
        for line in lines {
            println!("  {line}");
        }
    }
    for (job, node) in &applied.placed {
        // The full listing already gave the reason.
        let why = plan
            .decisions
            .iter()
            .find(|d| &d.job == job)
            .filter(|_| !full);
        println!(
            "  placed {job} on {node}{}",
            why.map_or(String::new(), |d| format!(": {d}"))
        );
    }
    for (job, node) in &applied.evicted {
        println!("  evicted {job} from {node}");
    }
    for (job, e) in &applied.failed {
        println!("  FAILED {job}: {e}");
    }
}

/// Every decision, refusal, check and exclusion of a plan, one per line.
pub fn print_plan(plan: &Plan) {
    let waiting: HashMap<&str, &str> = plan
        .waiting
        .iter()
        .map(|w| (w.job.as_str(), w.why.as_str()))
        .collect();
    for d in &plan.decisions {
        match (&d.outcome, waiting.get(d.job.as_str())) {
            (Outcome::Pending(_), Some(why)) => println!("job {}: pending: {why}", d.job),
            _ => println!("{d}"),
        }
    }
    for r in &plan.refused {
        println!("job {}: refused: {}", r.job, r.why);
    }
    for c in &plan.checks {
        let act = match c.action {
            Action::Keep => "running",
            Action::Evict => "EVICT",
            Action::EvictLater => "evict (capped)",
        };
        let note = if c.note.is_empty() {
            "not judged this pass"
        } else {
            c.note.as_str()
        };
        println!(
            "job {}: {act} on {}: SLA {:.2}, {} missed window(s) in a row; {note}",
            c.job, c.node, c.sla, c.misses
        );
    }
    for e in &plan.excluded {
        println!("node {}: excluded: {}", e.node, e.why);
    }
    for s in &plan.speeds {
        println!(
            "node {}: speed factor {:.2} (measured over predicted, median of its last {} judged windows): every prediction there is multiplied by it",
            s.node, s.factor, s.samples
        );
    }
    for l in &plan.levels {
        println!(
            "job {}: level {:.2} (measured over predicted where it ran, median of its judged windows): its profile's rates are multiplied by it",
            l.job, l.level
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use valve_scheduler::cycle::{Excluded, Refusal, Waiting};

    fn excluded(node: &str, why: &str, cause: &str) -> Excluded {
        Excluded {
            node: node.into(),
            why: why.into(),
            cause: cause.into(),
        }
    }

    fn waiting(job: &str, why: &str, cause: &str) -> Waiting {
        Waiting {
            job: job.into(),
            why: why.into(),
            cause: cause.into(),
        }
    }

    #[test]
    fn the_loop_logs_each_exclusion_and_reason_once_and_again_only_when_it_changes() {
        let mut log = LoopLog::default();
        let errors = HashMap::from([("n2".to_string(), "GET http://n2: refused".to_string())]);
        let mut plan = Plan {
            excluded: vec![excluded("n2", "silent for 61 s", "silent since 5")],
            waiting: vec![waiting("7", "all 3 open node(s) are full", "full")],
            refused: vec![Refusal {
                job: "8".into(),
                why: "no profile".into(),
            }],
            ..Plan::default()
        };
        assert_eq!(
            log.changes(&plan, &errors),
            [
                "node n2: excluded: silent for 61 s; its agent: GET http://n2: refused",
                "job 7: pending: all 3 open node(s) are full",
                "job 8: refused: no profile",
            ]
        );
        // The next pass: older, same causes: nothing new.
        plan.excluded[0].why = "silent for 71 s".into();
        assert!(log.changes(&plan, &errors).is_empty());
        // Job 7's reason changes, n2 answers again, job 8 is cancelled.
        plan.excluded.clear();
        plan.waiting[0] = waiting("7", "below its SLA on n1", "below n1");
        plan.refused.clear();
        assert_eq!(
            log.changes(&plan, &errors),
            [
                "node n2: no longer excluded",
                "job 7: pending: below its SLA on n1"
            ]
        );
        // A closed node's line carries the engine's reason, not a stale agent error.
        plan.excluded = vec![excluded("n2", "the engine reports it down", "down")];
        assert_eq!(
            log.changes(&plan, &errors),
            ["node n2: excluded: the engine reports it down"]
        );
    }

    #[test]
    fn an_unchanged_summary_is_printed_only_as_a_heartbeat() {
        let mut log = LoopLog::default();
        let t0 = Instant::now();
        let a = "pass: 0 placed, 2 pending";
        assert!(log.print_summary(a, false, t0), "the first");
        assert!(!log.print_summary(a, false, t0 + Duration::from_secs(10)));
        assert!(
            log.print_summary(a, true, t0 + Duration::from_secs(20)),
            "with news"
        );
        assert!(log.print_summary("pass: 1 placed", false, t0 + Duration::from_secs(30)));
        assert!(!log.print_summary("pass: 1 placed", false, t0 + Duration::from_secs(40)));
        let later = t0 + Duration::from_secs(30) + HEARTBEAT;
        assert!(
            log.print_summary("pass: 1 placed", false, later),
            "the heartbeat"
        );
    }

    #[test]
    fn the_summary_names_the_excluded_nodes() {
        let mut plan = Plan {
            excluded: vec![excluded("b", "x", "x"), excluded("a", "y", "y")],
            ..Plan::default()
        };
        let line = summary(&plan, &Applied::default());
        assert!(line.ends_with("2 node(s) excluded (a, b)"), "{line}");
        plan.excluded = (0..7)
            .map(|i| excluded(&format!("n{i}"), "x", "x"))
            .collect();
        let line = summary(&plan, &Applied::default());
        assert!(line.ends_with("(n0, n1, n2, n3, n4, and 2 more)"), "{line}");
    }
}
