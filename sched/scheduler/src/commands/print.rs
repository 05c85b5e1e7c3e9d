//! How passes are shown: every decision of a single pass (`--once`, `explain`), or a line per
//! pass with what changed (the loop), or JSON.

use std::collections::BTreeMap;

use serde_json::json;
use valve_scheduler::agents::Agents;
use valve_scheduler::cycle::Plan;
use valve_scheduler::driver::Applied;
use valve_scheduler::monitor::Action;
use valve_scheduler::place::Outcome;

/// Prints one pass: all of it with `full`, else a summary and the actions taken.
pub fn print_pass(plan: &Plan, applied: &Applied, agents: &Agents, json: bool, full: bool) {
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
        let pending = plan
            .decisions
            .iter()
            .filter(|d| matches!(d.outcome, Outcome::Pending(_)))
            .count();
        println!(
            "pass: {} placed, {} evicted, {} pending, {} running, {} refused, {} nodes excluded",
            applied.placed.len(),
            applied.evicted.len(),
            pending,
            plan.checks.len(),
            plan.refused.len(),
            plan.excluded.len()
        );
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
    for d in &plan.decisions {
        println!("{d}");
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
