//! A reserved virtual address range and the physical handles mapped into it, by offset.
//! Dropping the range unmaps whatever is still mapped and gives the addresses back.

use std::collections::BTreeMap;

use cudarc::driver::sys::{self, CUdeviceptr};

use crate::check::{check, init};
use crate::{Gpu, PhysicalHandle, VmmError};

/// Virtual addresses reserved in this process for one GPU's memory, mapped in slots.
#[derive(Debug)]
pub struct VaRange {
    base: CUdeviceptr,
    size: usize,
    /// offset -> length of each live mapping.
    mapped: BTreeMap<usize, usize>,
}

impl VaRange {
    /// Reserves `size` bytes of addresses aligned to `align` (both multiples of the granularity).
    pub fn reserve(size: usize, align: usize) -> crate::Result<VaRange> {
        init()?;
        if size == 0 {
            return Err(VmmError::Invalid("cannot reserve an empty range".into()));
        }
        let mut base: CUdeviceptr = 0;
        // SAFETY: `base` is a valid out-pointer; no fixed address is requested.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size, align, 0, 0)
        })?;
        Ok(VaRange {
            base,
            size,
            mapped: BTreeMap::new(),
        })
    }

    /// The first address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Its size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes mapped now.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped.values().sum()
    }

    /// Whether `[offset, offset + len)` overlaps a live mapping.
    pub fn is_mapped(&self, offset: usize, len: usize) -> bool {
        self.mapped
            .range(..offset + len)
            .next_back()
            .is_some_and(|(&o, &l)| o + l > offset)
    }

    fn check_slot(&self, offset: usize, len: usize) -> crate::Result<()> {
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(VmmError::Invalid(format!(
                "[{offset:#x}, +{len:#x}) is outside the {:#x}-byte range",
                self.size
            )));
        }
        Ok(())
    }

    /// Maps all of `handle` at `offset`. The mapping holds its own reference to the memory,
    /// so `handle` may be dropped afterwards. Access must still be granted with
    /// [`VaRange::set_access`].
    pub fn map(&mut self, offset: usize, handle: &PhysicalHandle) -> crate::Result<()> {
        self.map_piece(offset, handle, 0, handle.size())
    }

    /// Maps `len` bytes of `handle`, starting `handle_offset` bytes into it, at `offset`: one
    /// handle can back several ranges (a KV space maps piece `i` of a pool handle into region
    /// `i`). Offsets and `len` must be multiples of the GPU's granularity (CUDA refuses others).
    /// Like [`VaRange::map`], the mapping holds its own reference and needs
    /// [`VaRange::set_access`].
    pub fn map_piece(
        &mut self,
        offset: usize,
        handle: &PhysicalHandle,
        handle_offset: usize,
        len: usize,
    ) -> crate::Result<()> {
        self.check_slot(offset, len)?;
        if handle_offset
            .checked_add(len)
            .is_none_or(|end| end > handle.size())
        {
            return Err(VmmError::Invalid(format!(
                "[{handle_offset:#x}, +{len:#x}) is outside the {:#x}-byte handle",
                handle.size()
            )));
        }
        if self.is_mapped(offset, len) {
            return Err(VmmError::Invalid(format!(
                "[{offset:#x}, +{len:#x}) is already mapped: unmap it first"
            )));
        }
        // SAFETY: the target `[offset, offset + len)` lies inside our reservation and nothing is
        // mapped there (both checked above); `[handle_offset, handle_offset + len)` lies inside
        // the live handle (checked above), so the driver maps memory that exists and takes its
        // own reference to it. Misaligned values are refused by cuMemMap with an error status.
        check("cuMemMap", unsafe {
            sys::cuMemMap(
                self.base + offset as u64,
                len,
                handle_offset,
                handle.raw(),
                0,
            )
        })?;
        self.mapped.insert(offset, len);
        Ok(())
    }

    /// Grants `gpu` read-write access to `[offset, offset + len)`, which must be mapped.
    pub fn set_access(&self, gpu: &Gpu, offset: usize, len: usize) -> crate::Result<()> {
        self.check_slot(offset, len)?;
        let desc = gpu.access_desc();
        // SAFETY: the slot lies inside our reservation; `desc` is valid for the call.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(self.base + offset as u64, len, &desc, 1)
        })
    }

    /// Writes zeros over `[offset, offset + len)`, which must be mapped with access granted, and
    /// waits for it. Needs a current context (see [`Gpu::ensure_context`]). For set-up only: it
    /// synchronises the whole context.
    pub fn zero(&self, offset: usize, len: usize) -> crate::Result<()> {
        self.check_slot(offset, len)?;
        if !self.is_mapped(offset, len) {
            return Err(VmmError::Invalid(format!(
                "[{offset:#x}, +{len:#x}) is not mapped: map it before zeroing it"
            )));
        }
        // SAFETY: the bytes lie inside our reservation and are mapped (checked above); the
        // caller granted access, and a memset of device memory touches nothing on the host.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.base + offset as u64, 0, len)
        })?;
        // SAFETY: no arguments; waits for the memset (and anything else queued) to finish.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Unmaps the mapping that starts at `offset`. Kernels that touch it afterwards fault, so
    /// callers map a quarantine in its place before the owning process's work may run again.
    pub fn unmap(&mut self, offset: usize) -> crate::Result<()> {
        let Some(&len) = self.mapped.get(&offset) else {
            return Err(VmmError::Invalid(format!(
                "nothing is mapped at {offset:#x}"
            )));
        };
        // SAFETY: exactly one mapping of `len` bytes starts at this address in our range.
        check("cuMemUnmap", unsafe {
            sys::cuMemUnmap(self.base + offset as u64, len)
        })?;
        self.mapped.remove(&offset);
        Ok(())
    }
}

impl Drop for VaRange {
    fn drop(&mut self) {
        let offsets: Vec<usize> = self.mapped.keys().copied().collect();
        for o in offsets {
            if let Err(e) = self.unmap(o) {
                eprintln!("valve-vmm: {e}");
            }
        }
        // SAFETY: the reservation is ours and nothing is mapped in it any more.
        let rc = unsafe { sys::cuMemAddressFree(self.base, self.size) };
        if let Err(e) = check("cuMemAddressFree", rc) {
            eprintln!("valve-vmm: {e}");
        }
    }
}
