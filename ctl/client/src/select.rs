//! Algorithm 1 for a KV space's slots: which handles to give back so that the fewest tokens are
//! recomputed, greedily by marginal cost; FIFO (oldest grant first) is the baseline.
//!
//! A slot's marginal cost is the tokens of the requests owning its blocks that no slot chosen
//! earlier in the same selection already affects (doomed requests cost nothing: they are being
//! recomputed anyway). Costs only fall as slots are chosen, so they are kept incrementally:
//! choosing a slot subtracts each newly affected request from every candidate that holds it.
//! Scratch vectors are kept between calls, so a reclaim allocates nothing once warm.

use crate::owners::Owners;

/// How a reclaim picks the handles it gives back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Selection {
    /// Algorithm 1: lowest marginal token cost first (ties: oldest grant first).
    #[default]
    Greedy,
    /// The slots granted earliest first, whatever they hold.
    Fifo,
}

/// A slot that may be given back, and when it was granted (smaller is older).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub slot: u32,
    pub seq: u64,
}

/// Reusable state of the selection.
#[derive(Debug, Default)]
pub(crate) struct Selector {
    /// Per candidate: its distinct (not doomed) requests, `by_cand[start[c]..start[c + 1]]`.
    by_cand: Vec<u32>,
    start: Vec<usize>,
    /// `(request, candidate)` pairs sorted by request: the candidates holding each request.
    by_req: Vec<(u32, u32)>,
    cost: Vec<u64>,
    taken: Vec<bool>,
    /// Per request: the generation that last saw it (dedupe) / affected it.
    seen: Vec<u64>,
    affected: Vec<u64>,
    generation: u64,
    order: Vec<usize>,
}

impl Selector {
    /// Appends to `out` the slots of up to `count` candidates, in the order chosen.
    pub fn choose(
        &mut self,
        policy: Selection,
        candidates: &[Candidate],
        count: usize,
        blocks_per_slot: usize,
        owners: &Owners,
        out: &mut Vec<u32>,
    ) {
        let count = count.min(candidates.len());
        match policy {
            Selection::Fifo => self.fifo(candidates, count, out),
            Selection::Greedy => {
                self.index(candidates, blocks_per_slot, owners);
                self.greedy(candidates, count, owners, out);
            }
        }
    }

    fn fifo(&mut self, candidates: &[Candidate], count: usize, out: &mut Vec<u32>) {
        self.order.clear();
        self.order.extend(0..candidates.len());
        self.order
            .sort_unstable_by_key(|&c| (candidates[c].seq, candidates[c].slot));
        out.extend(self.order[..count].iter().map(|&c| candidates[c].slot));
    }

    /// Builds the per-candidate request lists, the inverted index and the initial costs.
    fn index(&mut self, candidates: &[Candidate], blocks_per_slot: usize, owners: &Owners) {
        let n_req = owners.index_bound();
        if self.seen.len() < n_req {
            self.seen.resize(n_req, 0);
            self.affected.resize(n_req, 0);
        }
        self.by_cand.clear();
        self.start.clear();
        self.by_req.clear();
        self.cost.clear();
        self.taken.clear();
        for (c, cand) in candidates.iter().enumerate() {
            self.generation += 1;
            self.start.push(self.by_cand.len());
            let first = cand.slot as usize * blocks_per_slot;
            let mut cost = 0u64;
            for b in first..first + blocks_per_slot {
                let Some(r) = owners.owner(b) else { continue };
                let req = owners.request(r);
                if self.seen[r as usize] == self.generation || req.doomed {
                    continue;
                }
                self.seen[r as usize] = self.generation;
                self.by_cand.push(r);
                self.by_req.push((r, c as u32));
                cost = cost.saturating_add(req.tokens);
            }
            self.cost.push(cost);
            self.taken.push(false);
        }
        self.start.push(self.by_cand.len());
        self.by_req.sort_unstable();
    }

    fn greedy(
        &mut self,
        candidates: &[Candidate],
        count: usize,
        owners: &Owners,
        out: &mut Vec<u32>,
    ) {
        self.generation += 1;
        let selection = self.generation;
        for _ in 0..count {
            let Some(c) = (0..candidates.len())
                .filter(|&c| !self.taken[c])
                .min_by_key(|&c| (self.cost[c], candidates[c].seq, candidates[c].slot))
            else {
                break;
            };
            self.taken[c] = true;
            out.push(candidates[c].slot);
            for k in self.start[c]..self.start[c + 1] {
                let r = self.by_cand[k];
                if self.affected[r as usize] == selection {
                    continue;
                }
                self.affected[r as usize] = selection;
                let tokens = owners.request(r).tokens;
                let from = self.by_req.partition_point(|&(q, _)| q < r);
                for &(q, holder) in &self.by_req[from..] {
                    if q != r {
                        break;
                    }
                    let cost = &mut self.cost[holder as usize];
                    *cost = cost.saturating_sub(tokens);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4 blocks per slot; `owners` lists (block, request, tokens).
    fn pick(
        policy: Selection,
        slots: &[(u32, u64)],
        owners: &[(u32, u64, u64)],
        count: usize,
    ) -> Vec<u32> {
        let mut o = Owners::new(64);
        for &(b, r, t) in owners {
            o.set(b, r, t).unwrap();
        }
        let cands: Vec<Candidate> = slots
            .iter()
            .map(|&(slot, seq)| Candidate { slot, seq })
            .collect();
        let mut out = Vec::new();
        Selector::default().choose(policy, &cands, count, 4, &o, &mut out);
        out
    }

    #[test]
    fn free_slots_cost_nothing_and_go_first() {
        // Slot 0 holds request 1 (100 tokens), slot 1 is empty, slot 2 holds request 2 (5).
        let owners = [(0, 1, 100), (8, 2, 5)];
        assert_eq!(
            pick(Selection::Greedy, &[(0, 0), (1, 1), (2, 2)], &owners, 2),
            vec![1, 2]
        );
    }

    #[test]
    fn a_request_spread_over_slots_is_counted_once() {
        // Slot 0: request 1 (40). Slot 1: request 1 and request 2 (10). Slot 2: request 3 (45).
        // By their own costs (40, 50, 45) two slots would be 0 and 2: 85 tokens recomputed.
        // Marginally, once slot 0 is chosen slot 1 costs only request 2: 50 tokens in all.
        let owners = [(0, 1, 40), (4, 1, 40), (5, 2, 10), (8, 3, 45)];
        let cands = [(0, 0), (1, 1), (2, 2)];
        assert_eq!(pick(Selection::Greedy, &cands, &owners, 2), vec![0, 1]);
        // A request with several blocks in one slot counts once there too.
        let owners = [(0, 1, 40), (1, 1, 40), (2, 1, 40), (8, 3, 45)];
        assert_eq!(pick(Selection::Greedy, &cands, &owners, 1), vec![1]);
        assert_eq!(
            pick(Selection::Greedy, &[(0, 0), (2, 1)], &owners, 1),
            vec![0]
        );
    }

    #[test]
    fn marginal_costs_drop_as_requests_become_affected() {
        // Slot 0: requests 1 (10) and 2 (10). Slot 1: request 1 and 3 (15). Slot 2: request 4 (12).
        // Greedy: slot 2 (12) < slot 0 (20) < slot 1 (25); take 2, then 0 (20); now slot 1 costs 15.
        let owners = [(0, 1, 10), (1, 2, 10), (4, 1, 10), (5, 3, 15), (8, 4, 12)];
        let cands = [(0, 0), (1, 1), (2, 2)];
        assert_eq!(pick(Selection::Greedy, &cands, &owners, 3), vec![2, 0, 1]);
    }

    #[test]
    fn ties_go_to_the_oldest_grant_and_fifo_ignores_costs() {
        let owners = [(0, 1, 100)];
        // Slots 1..3 are free; their grant order is 3, 1, 2.
        let cands = [(0, 0), (1, 5), (2, 9), (3, 2)];
        assert_eq!(pick(Selection::Greedy, &cands, &owners, 2), vec![3, 1]);
        assert_eq!(pick(Selection::Fifo, &cands, &owners, 2), vec![0, 3]);
    }

    #[test]
    fn asking_for_more_than_there_is_gives_everything_once() {
        let cands = [(4, 0), (7, 1)];
        let mut got = pick(Selection::Greedy, &cands, &[(16, 1, 3)], 5);
        got.sort();
        assert_eq!(got, vec![4, 7]);
        assert_eq!(pick(Selection::Fifo, &cands, &[], 5), vec![4, 7]);
        assert!(pick(Selection::Greedy, &[], &[], 3).is_empty());
    }

    #[test]
    fn doomed_requests_cost_nothing() {
        let mut o = Owners::new(64);
        o.set(0, 1, 1000).unwrap(); // slot 0
        o.set(4, 1, 1000).unwrap(); // slot 1
        o.set(8, 2, 10).unwrap(); // slot 2
        o.invalidate(0..4); // slot 0 was reclaimed: request 1 is doomed
        let cands = [Candidate { slot: 1, seq: 1 }, Candidate { slot: 2, seq: 0 }];
        let mut out = Vec::new();
        Selector::default().choose(Selection::Greedy, &cands, 1, 4, &o, &mut out);
        assert_eq!(out, vec![1]);
    }

    #[test]
    fn the_selector_is_reusable_across_reclaims() {
        let mut o = Owners::new(64);
        o.set(0, 1, 5).unwrap();
        o.set(4, 2, 1).unwrap();
        let cands = [Candidate { slot: 0, seq: 0 }, Candidate { slot: 1, seq: 1 }];
        let mut s = Selector::default();
        for _ in 0..3 {
            let mut out = Vec::new();
            s.choose(Selection::Greedy, &cands, 1, 4, &o, &mut out);
            assert_eq!(out, vec![1]);
        }
        o.set(8, 3, 1).unwrap(); // a new request after the scratch was sized
        let mut out = Vec::new();
        s.choose(Selection::Greedy, &cands, 2, 4, &o, &mut out);
        assert_eq!(out, vec![1, 0]);
    }
}
