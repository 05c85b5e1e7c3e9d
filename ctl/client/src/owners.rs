//! Which framework request owns each KV block and how many tokens it costs to recompute: the
//! input of Algorithm 1, kept up to date by the framework's block-owner calls.
//!
//! Requests get dense indices so that a reclaim's selection works on vectors, not maps. A request
//! whose blocks a reclaim invalidated is *doomed*: it costs nothing in later selections (it is
//! recomputed anyway) until the framework collects the invalidation, which forgets it.

use std::collections::HashMap;
use std::ops::Range;

use crate::{Error, Result};

const NONE: u32 = u32::MAX;

/// The block table.
#[derive(Debug, Default)]
pub(crate) struct Owners {
    /// Per block: the owning request's dense index, or `NONE`.
    block: Vec<u32>,
    /// Per dense request: its id, tokens, blocks owned, doomed.
    requests: Vec<Request>,
    index: HashMap<u64, u32>,
    free: Vec<u32>,
}

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Request {
    pub id: u64,
    pub tokens: u64,
    pub blocks: u32,
    pub doomed: bool,
}

impl Owners {
    /// A table for `blocks` blocks, all free.
    pub fn new(blocks: usize) -> Owners {
        Owners {
            block: vec![NONE; blocks],
            ..Owners::default()
        }
    }

    fn check(&self, block: u32) -> Result<usize> {
        let b = block as usize;
        if b >= self.block.len() {
            return Err(Error::Invalid(format!(
                "block {block} is outside the KV space's {} blocks",
                self.block.len()
            )));
        }
        Ok(b)
    }

    /// `request` owns `block` now and costs `tokens` to recompute (the latest call wins).
    pub fn set(&mut self, block: u32, request: u64, tokens: u64) -> Result<()> {
        let b = self.check(block)?;
        let idx = match self.index.get(&request) {
            Some(&i) => i,
            None => self.add(request),
        };
        let r = &mut self.requests[idx as usize];
        r.tokens = tokens;
        if self.block[b] != idx {
            r.blocks += 1;
            let old = std::mem::replace(&mut self.block[b], idx);
            self.release(old);
        }
        Ok(())
    }

    /// Nobody owns `block` now.
    pub fn clear(&mut self, block: u32) -> Result<()> {
        let b = self.check(block)?;
        let old = std::mem::replace(&mut self.block[b], NONE);
        self.release(old);
        Ok(())
    }

    fn add(&mut self, id: u64) -> u32 {
        let r = Request {
            id,
            ..Request::default()
        };
        let idx = match self.free.pop() {
            Some(i) => {
                self.requests[i as usize] = r;
                i
            }
            None => {
                self.requests.push(r);
                (self.requests.len() - 1) as u32
            }
        };
        self.index.insert(id, idx);
        idx
    }

    /// One block fewer for request `idx`; a request with none left (and not doomed) is forgotten.
    fn release(&mut self, idx: u32) {
        if idx == NONE {
            return;
        }
        let r = &mut self.requests[idx as usize];
        r.blocks -= 1;
        if r.blocks == 0 && !r.doomed {
            let id = r.id;
            self.forget(idx, id);
        }
    }

    fn forget(&mut self, idx: u32, id: u64) {
        self.index.remove(&id);
        self.requests[idx as usize] = Request::default();
        self.free.push(idx);
    }

    /// The owner of `block` (a dense index), if any.
    pub fn owner(&self, block: usize) -> Option<u32> {
        Some(self.block[block]).filter(|&i| i != NONE)
    }

    /// Request `idx`.
    pub fn request(&self, idx: u32) -> &Request {
        &self.requests[idx as usize]
    }

    /// Dense indices in use are below this.
    pub fn index_bound(&self) -> usize {
        self.requests.len()
    }

    /// The blocks in `blocks` are gone (their slot was reclaimed): their owners are doomed and
    /// the blocks are free.
    pub fn invalidate(&mut self, blocks: Range<u32>) {
        for b in blocks {
            let idx = std::mem::replace(&mut self.block[b as usize], NONE);
            if idx != NONE {
                let r = &mut self.requests[idx as usize];
                r.doomed = true;
                r.blocks -= 1;
            }
        }
    }

    /// The framework has dropped every doomed request: forget them and free their blocks.
    pub fn drop_doomed(&mut self) {
        if !self.requests.iter().any(|r| r.doomed) {
            return;
        }
        for b in self.block.iter_mut() {
            if *b != NONE && self.requests[*b as usize].doomed {
                *b = NONE;
            }
        }
        for idx in 0..self.requests.len() as u32 {
            let r = self.requests[idx as usize];
            if r.doomed {
                self.forget(idx, r.id);
            }
        }
    }

    /// Requests known now (for stats and tests).
    pub fn live_requests(&self) -> usize {
        self.index.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_follow_set_and_clear_and_the_latest_tokens_win() {
        let mut o = Owners::new(8);
        o.set(0, 42, 10).unwrap();
        o.set(1, 42, 20).unwrap();
        o.set(2, 7, 5).unwrap();
        let i = o.owner(0).unwrap();
        assert_eq!(o.owner(1), Some(i));
        assert_eq!(
            (o.request(i).id, o.request(i).tokens, o.request(i).blocks),
            (42, 20, 2)
        );
        // Re-setting a block to the same request does not count it twice.
        o.set(1, 42, 21).unwrap();
        assert_eq!(o.request(i).blocks, 2);
        // Reassigning moves the block.
        o.set(1, 7, 6).unwrap();
        assert_eq!(o.request(i).blocks, 1);
        o.clear(0).unwrap();
        assert_eq!(o.live_requests(), 1, "request 42 has no block left");
        assert!(o.set(8, 1, 1).is_err() && o.clear(9).is_err());
    }

    #[test]
    fn invalidated_requests_stay_doomed_until_dropped() {
        let mut o = Owners::new(8);
        o.set(0, 1, 10).unwrap();
        o.set(4, 1, 10).unwrap();
        o.set(5, 2, 3).unwrap();
        o.invalidate(0..4);
        let i = o.owner(4).unwrap();
        assert!(o.request(i).doomed);
        assert_eq!(o.owner(0), None);
        // The framework still reports blocks for it during the step: still doomed.
        o.set(6, 1, 11).unwrap();
        assert!(o.request(o.owner(6).unwrap()).doomed);
        o.drop_doomed();
        assert_eq!((o.owner(4), o.owner(6)), (None, None));
        assert!(o.owner(5).is_some());
        assert_eq!(o.live_requests(), 1);
        // Re-admitted later, it is an ordinary request again.
        o.set(0, 1, 12).unwrap();
        assert!(!o.request(o.owner(0).unwrap()).doomed);
    }
}
