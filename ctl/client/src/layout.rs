//! The geometry of a KV space: regions, the piece of a pool handle each region gets, slots and
//! KV blocks, checked against the pool's handle size and the GPU's granularity.

use std::ops::Range;

use crate::{Error, Result};

const MIB: u64 = 1 << 20;

/// What a KV space looks like, as [`crate::Client::kv_space`] made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSpace {
    /// Virtual ranges (one per KV tensor).
    pub regions: u32,
    /// Slots per region; one pool handle backs one slot in every region.
    pub slots: u32,
    /// Bytes of one handle in one region (`handle_bytes / regions`).
    pub piece_bytes: u64,
    /// Bytes of one KV block in one region.
    pub block_bytes: u64,
    /// KV blocks per slot (`piece_bytes / block_bytes`): slot `s` holds blocks
    /// `s * blocks_per_slot .. (s + 1) * blocks_per_slot`.
    pub blocks_per_slot: u32,
    /// Bytes of each region's slots (`slots * piece_bytes`).
    pub region_bytes: u64,
    /// Bytes mapped right after each region's slots and never reclaimed (the `tail_bytes` asked
    /// for, rounded up to the GPU's granularity; 0: none). One private block backs the tail of
    /// every region, so a region's tensor may extend `region_bytes + tail_bytes`.
    pub tail_bytes: u64,
    /// The pool's handle size.
    pub handle_bytes: u64,
    /// The first address of each region.
    pub region_ptrs: Vec<u64>,
}

impl KvSpace {
    /// All KV blocks of the space.
    pub fn blocks(&self) -> u32 {
        self.slots * self.blocks_per_slot
    }

    /// The KV blocks slot `slot` holds.
    pub fn slot_blocks(&self, slot: u32) -> Range<u32> {
        slot * self.blocks_per_slot..(slot + 1) * self.blocks_per_slot
    }
}

/// The numbers the mapper and the bookkeeping share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub regions: usize,
    pub piece: usize,
    pub slots: usize,
    pub block_bytes: usize,
    pub blocks_per_slot: usize,
    pub handle_bytes: usize,
    /// Bytes after the slots of each region backed by the client's own private memory.
    pub tail: usize,
}

impl Layout {
    /// Checks a request and works out the space. `slots_hint` is the pool's capacity in handles
    /// (the register reply's `pool_capacity_handles`); `whole_pool` makes it the slot count
    /// whatever the capacity asked (premapped online maps handle `h` at slot `h`).
    pub fn plan(
        regions: u32,
        capacity_bytes_per_region: u64,
        block_bytes: u64,
        handle_bytes: u64,
        granularity: u64,
        pool_handles: Option<u32>,
        whole_pool: bool,
    ) -> Result<Layout> {
        if regions == 0 || block_bytes == 0 {
            return Err(Error::Invalid(
                "a KV space needs at least one region and a block size above 0".into(),
            ));
        }
        let piece = handle_bytes / regions as u64;
        if handle_bytes % regions as u64 != 0 || piece % granularity != 0 || piece == 0 {
            let step = regions as u64 * granularity;
            return Err(Error::PieceNotAligned {
                handle_mib: handle_bytes / MIB,
                regions,
                piece_bytes: piece,
                granularity_mib: granularity / MIB,
                need_mib: handle_bytes.div_ceil(step).max(1) * step / MIB,
            });
        }
        if piece % block_bytes != 0 {
            return Err(Error::BlockNotAligned {
                piece_bytes: piece,
                block_bytes,
            });
        }
        let slots = Self::slots(capacity_bytes_per_region, piece, pool_handles, whole_pool)?;
        let blocks_per_slot = piece / block_bytes;
        if slots
            .checked_mul(blocks_per_slot)
            .is_none_or(|b| b > u32::MAX as u64)
        {
            return Err(Error::Invalid(format!(
                "{slots} slots of {blocks_per_slot} blocks do not fit 32-bit block ids: use larger blocks"
            )));
        }
        Ok(Layout {
            regions: regions as usize,
            piece: piece as usize,
            slots: slots as usize,
            block_bytes: block_bytes as usize,
            blocks_per_slot: blocks_per_slot as usize,
            handle_bytes: handle_bytes as usize,
            tail: 0,
        })
    }

    /// The same layout with `tail_bytes` after every region's slots, rounded up to whole pages
    /// of `granularity` (a framework's padding blocks, which must never be reclaimed).
    pub fn with_tail(mut self, tail_bytes: u64, granularity: u64) -> Result<Layout> {
        let tail = tail_bytes.div_ceil(granularity) * granularity;
        if tail > self.handle_bytes as u64 {
            return Err(Error::Invalid(format!(
                "a tail of {tail_bytes} bytes after each region is larger than a pool handle ({} bytes): the tail is for a framework's few padding blocks",
                self.handle_bytes
            )));
        }
        self.tail = tail as usize;
        Ok(self)
    }

    fn slots(capacity: u64, piece: u64, pool: Option<u32>, whole_pool: bool) -> Result<u64> {
        let slots = match (pool, whole_pool, capacity) {
            (Some(n), true, _) | (Some(n), false, 0) => n as u64,
            (None, _, 0) => {
                return Err(Error::Protocol(
                    "the daemon did not say how many handles its pool holds (`pool_capacity_handles` in the register reply): pass a capacity per region".into(),
                ))
            }
            (_, _, c) => c / piece,
        };
        if slots == 0 {
            return Err(Error::Invalid(format!(
                "a capacity of {capacity} bytes per region holds no {piece}-byte piece of a pool handle: ask for at least {piece}"
            )));
        }
        Ok(slots)
    }

    /// Bytes of each region's slots (the tail follows them).
    pub fn region_bytes(&self) -> usize {
        self.slots * self.piece
    }

    /// Bytes of address space each region reserves: its slots and its tail.
    pub fn reserved_bytes(&self) -> usize {
        self.region_bytes() + self.tail
    }

    /// The blocks of `slot`.
    pub fn slot_blocks(&self, slot: usize) -> Range<u32> {
        let b = self.blocks_per_slot;
        (slot * b) as u32..((slot + 1) * b) as u32
    }

    /// All blocks.
    pub fn blocks(&self) -> usize {
        self.slots * self.blocks_per_slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 * MIB;

    #[test]
    fn a_handle_splits_into_pieces_of_whole_pages_and_blocks_tile_them() {
        let l = Layout::plan(4, 64 * MIB, MIB, 64 * MIB, G, Some(100), false).unwrap();
        assert_eq!((l.piece, l.slots, l.blocks_per_slot), (16 << 20, 4, 16));
        assert_eq!(l.slot_blocks(2), 32..48);
        // Capacity 0: the whole pool.
        let l = Layout::plan(4, 0, MIB, 64 * MIB, G, Some(100), false).unwrap();
        assert_eq!(l.slots, 100);
        // Premapped online covers the pool whatever it asked.
        let l = Layout::plan(4, 64 * MIB, MIB, 64 * MIB, G, Some(100), true).unwrap();
        assert_eq!(l.slots, 100);
    }

    #[test]
    fn pieces_below_the_granularity_name_the_handle_size_the_daemon_needs() {
        // 64 layers x (K, V) = 128 regions of a 64 MiB handle: 512 KiB pieces.
        let e = Layout::plan(128, 0, 1 << 16, 64 * MIB, G, Some(8), false).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, Error::PieceNotAligned { need_mib: 256, .. }),
            "{msg}"
        );
        assert!(msg.contains("--pool-handle-mib 256"), "{msg}");
        // 3 regions: the smallest handle at least 64 MiB that splits into whole pages is 3 x 22 MiB.
        let e = Layout::plan(3, 0, 1 << 16, 64 * MIB, G, Some(8), false).unwrap_err();
        assert!(e.to_string().contains("--pool-handle-mib 66"), "{e}");
    }

    #[test]
    fn blocks_must_tile_a_piece_and_capacity_must_hold_one() {
        let e = Layout::plan(2, 0, 3 * MIB, 64 * MIB, G, Some(8), false).unwrap_err();
        assert!(matches!(e, Error::BlockNotAligned { .. }), "{e}");
        let e = Layout::plan(2, MIB, MIB, 64 * MIB, G, Some(8), false).unwrap_err();
        assert!(e.to_string().contains("at least 33554432"), "{e}");
        let e = Layout::plan(2, 0, MIB, 64 * MIB, G, None, false).unwrap_err();
        assert!(e.to_string().contains("pool_capacity_handles"), "{e}");
        assert!(Layout::plan(0, 0, MIB, 64 * MIB, G, Some(1), false).is_err());
    }

    #[test]
    fn a_tail_is_whole_pages_after_the_slots_and_smaller_than_a_handle() {
        let l = Layout::plan(4, 0, MIB, 64 * MIB, G, Some(10), false).unwrap();
        assert_eq!(l.tail, 0);
        assert_eq!(l.reserved_bytes(), l.region_bytes());
        let t = l.with_tail(512 << 10, G).unwrap();
        assert_eq!(t.tail, 2 << 20, "512 KiB rounds up to one 2 MiB page");
        assert_eq!(t.reserved_bytes(), 10 * (16 << 20) + (2 << 20));
        assert_eq!(l.with_tail(G + 1, G).unwrap().tail, 4 << 20);
        let e = l.with_tail(65 * MIB, G).unwrap_err();
        assert!(e.to_string().contains("larger than a pool handle"), "{e}");
    }
}
