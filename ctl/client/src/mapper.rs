//! Where a KV space's slots meet the GPU: the internal `Mapper` the bookkeeping calls, its CUDA
//! implementation over `valve-vmm`, and [`FakeGpu`], which records the calls instead.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use valve_vmm::{Gpu, PhysicalHandle, VaRange, VmmError};

use crate::layout::Layout;

/// Maps whole slots: piece `i` of a handle into region `i` at the slot's offset, with access.
pub(crate) trait Mapper: Send {
    /// The first address of `region`.
    fn region_ptr(&self, region: usize) -> u64;
    /// Imports a pool handle's descriptor and maps it at `slot` (which must be unmapped).
    fn map_pool(&mut self, slot: usize, fd: BorrowedFd<'_>) -> Result<(), VmmError>;
    /// Maps the process's quarantine at `slot` (which must be unmapped).
    fn map_quarantine(&mut self, slot: usize) -> Result<(), VmmError>;
    /// Unmaps whatever is mapped at `slot` in every region.
    fn unmap(&mut self, slot: usize) -> Result<(), VmmError>;
}

/// How a client reaches the GPU.
#[derive(Clone, Debug, Default)]
pub enum Backend {
    /// CUDA through `valve-vmm` (the real thing).
    #[default]
    Cuda,
    /// No GPU: addresses are made up and every map and unmap is recorded in the [`FakeGpu`].
    /// For tests of this library and of framework integrations on machines without a GPU.
    Fake(FakeGpu),
}

/// The GPU's mapping granularity (bytes).
pub(crate) fn granularity(backend: &Backend, ordinal: u32) -> crate::Result<u64> {
    match backend {
        Backend::Cuda => Ok(Gpu::open(ordinal)?.granularity()? as u64),
        Backend::Fake(f) => Ok(f.state().granularity),
    }
}

/// A mapper for `layout`: reserves the regions (and, with `quarantine`, creates the
/// handle-sized quarantine block).
pub(crate) fn open(
    backend: &Backend,
    ordinal: u32,
    layout: &Layout,
    quarantine: bool,
) -> crate::Result<Box<dyn Mapper>> {
    match backend {
        Backend::Cuda if layout.regions > 1 => Err(crate::Error::RegionsNeedSplitHandles {
            regions: layout.regions as u32,
        }),
        Backend::Cuda => Ok(Box::new(CudaMapper::open(ordinal, layout, quarantine)?)),
        Backend::Fake(f) => {
            let mut st = f.state();
            for region in (0..layout.regions).filter(|_| layout.tail > 0) {
                let bytes = layout.tail;
                st.calls.push(FakeCall::MapTail { region, bytes });
            }
            drop(st);
            Ok(Box::new(FakeMapper {
                gpu: f.clone(),
                layout: *layout,
                quarantine,
            }))
        }
    }
}

struct CudaMapper {
    /// Dropped first: each range unmaps what is left and frees its addresses.
    regions: Vec<VaRange>,
    quarantine: Option<PhysicalHandle>,
    /// The private block mapped after every region's slots (kept for the life of the space).
    _tail: Option<PhysicalHandle>,
    gpu: Gpu,
    piece: usize,
    handle_bytes: usize,
}

impl CudaMapper {
    fn open(ordinal: u32, layout: &Layout, quarantine: bool) -> crate::Result<CudaMapper> {
        let gpu = Gpu::open(ordinal)?;
        gpu.ensure_context()?;
        let mut regions = (0..layout.regions)
            .map(|_| VaRange::reserve(layout.reserved_bytes(), 0))
            .collect::<Result<Vec<_>, _>>()?;
        let quarantine = match quarantine {
            true => Some(zeroed_handle(&gpu, layout.handle_bytes)?),
            false => None,
        };
        let tail = match layout.tail {
            0 => None,
            n => Some(map_tail(&gpu, &mut regions, layout.region_bytes(), n)?),
        };
        Ok(CudaMapper {
            regions,
            quarantine,
            _tail: tail,
            gpu,
            piece: layout.piece,
            handle_bytes: layout.handle_bytes,
        })
    }

    /// Maps piece `i` of `h` into region `i` at `slot`; on failure undoes the regions done.
    fn map_handle(
        regions: &mut [VaRange],
        gpu: &Gpu,
        piece: usize,
        slot: usize,
        h: &PhysicalHandle,
    ) -> Result<(), VmmError> {
        let off = slot * piece;
        for i in 0..regions.len() {
            let r = &mut regions[i];
            let done = r
                .map_piece(off, h, i * piece, piece)
                .and_then(|()| r.set_access(gpu, off, piece));
            if let Err(e) = done {
                for r in regions[..=i].iter_mut().filter(|r| r.is_mapped(off, piece)) {
                    let _ = r.unmap(off);
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

impl Mapper for CudaMapper {
    fn region_ptr(&self, region: usize) -> u64 {
        self.regions.get(region).map_or(0, VaRange::base)
    }

    fn map_pool(&mut self, slot: usize, fd: BorrowedFd<'_>) -> Result<(), VmmError> {
        // The callback thread maps too, and it has no context of its own.
        self.gpu.ensure_context()?;
        // The mappings keep the memory; this process's handle is released when `h` drops.
        let h = PhysicalHandle::import(fd, self.handle_bytes)?;
        Self::map_handle(&mut self.regions, &self.gpu, self.piece, slot, &h)
    }

    fn map_quarantine(&mut self, slot: usize) -> Result<(), VmmError> {
        self.gpu.ensure_context()?;
        let q = self.quarantine.as_ref().ok_or_else(|| {
            VmmError::Invalid("this client has no quarantine (only offline clients do)".into())
        })?;
        Self::map_handle(&mut self.regions, &self.gpu, self.piece, slot, q)
    }

    fn unmap(&mut self, slot: usize) -> Result<(), VmmError> {
        self.gpu.ensure_context()?;
        let off = slot * self.piece;
        let mut first = Ok(());
        for r in self.regions.iter_mut() {
            if let Err(e) = r.unmap(off) {
                first = first.and(Err(e));
            }
        }
        first
    }
}

/// A new handle of `bytes` whose memory reads as zeros: a quarantine that offline kernels read
/// after a reclaim must hold no NaN or Inf (a framework's masked attention would spread them).
fn zeroed_handle(gpu: &Gpu, bytes: usize) -> crate::Result<PhysicalHandle> {
    let h = PhysicalHandle::create(gpu, bytes)?;
    let mut scratch = VaRange::reserve(bytes, 0)?;
    scratch.map(0, &h)?;
    scratch.set_access(gpu, 0, bytes)?;
    scratch.zero(0, bytes)?;
    Ok(h) // `scratch` unmaps and frees its addresses here
}

/// Maps one zeroed private block of `bytes` at `offset` (after the slots) in every region: the
/// framework's padding blocks live there, so no reclaim can ever take them.
fn map_tail(
    gpu: &Gpu,
    regions: &mut [VaRange],
    offset: usize,
    bytes: usize,
) -> crate::Result<PhysicalHandle> {
    let tail = zeroed_handle(gpu, bytes)?;
    for r in regions.iter_mut() {
        r.map(offset, &tail)?;
        r.set_access(gpu, offset, bytes)?;
    }
    Ok(tail)
}

/// One call a [`FakeGpu`] saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FakeCall {
    /// Piece `piece` of `source` mapped into `region` at `slot`.
    Map {
        /// Region.
        region: usize,
        /// Slot.
        slot: usize,
        /// What was mapped: the descriptor's name (a memfd's name, else its /proc link), or
        /// `quarantine`.
        source: String,
        /// Which piece of it.
        piece: usize,
    },
    /// The mapping at `slot` of `region` removed.
    Unmap {
        /// Region.
        region: usize,
        /// Slot.
        slot: usize,
    },
    /// The private tail block mapped after the slots of `region`.
    MapTail {
        /// Region.
        region: usize,
        /// Bytes of the tail.
        bytes: usize,
    },
    /// The client's KV space went away with this many mappings left (all now unmapped).
    Dropped {
        /// Mappings the drop removed.
        unmapped: usize,
    },
}

/// A stand-in GPU that records what a client maps (one per client). Clones share the record.
#[derive(Clone, Debug)]
pub struct FakeGpu {
    inner: Arc<Mutex<FakeState>>,
}

#[derive(Debug)]
struct FakeState {
    granularity: u64,
    calls: Vec<FakeCall>,
    mapped: BTreeMap<(usize, usize), (String, usize)>,
    fail_next_map: bool,
}

impl Default for FakeGpu {
    fn default() -> Self {
        FakeGpu::new()
    }
}

impl FakeGpu {
    /// A fake GPU with a 2 MiB granularity, like an H100's.
    pub fn new() -> FakeGpu {
        FakeGpu {
            inner: Arc::new(Mutex::new(FakeState {
                granularity: 2 << 20,
                calls: Vec::new(),
                mapped: BTreeMap::new(),
                fail_next_map: false,
            })),
        }
    }

    fn state(&self) -> MutexGuard<'_, FakeState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<FakeCall> {
        self.state().calls.clone()
    }

    /// Forgets the calls recorded so far.
    pub fn clear_calls(&self) {
        self.state().calls.clear();
    }

    /// What is mapped now: `(region, slot) -> (source, piece)`.
    pub fn mapped(&self) -> BTreeMap<(usize, usize), (String, usize)> {
        self.state().mapped.clone()
    }

    /// The source mapped at `slot` of region 0, if any.
    pub fn source_at(&self, slot: usize) -> Option<String> {
        self.state().mapped.get(&(0, slot)).map(|(s, _)| s.clone())
    }

    /// Makes the next pool or quarantine map fail, as a CUDA error would.
    pub fn fail_next_map(&self) {
        self.state().fail_next_map = true;
    }
}

struct FakeMapper {
    gpu: FakeGpu,
    layout: Layout,
    quarantine: bool,
}

const FAKE_BASE: u64 = 0x7f00_0000_0000;

/// A descriptor's name: a memfd's name, or its /proc link.
fn fd_name(fd: BorrowedFd<'_>) -> String {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("fd {}", fd.as_raw_fd()));
    match link.strip_prefix("/memfd:") {
        Some(rest) => rest.trim_end_matches(" (deleted)").to_string(),
        None => link,
    }
}

impl FakeMapper {
    fn map(&mut self, slot: usize, source: String) -> Result<(), VmmError> {
        let mut st = self.gpu.state();
        if std::mem::take(&mut st.fail_next_map) {
            return Err(VmmError::Invalid("fake cuMemMap failure".into()));
        }
        if slot >= self.layout.slots || st.mapped.contains_key(&(0, slot)) {
            return Err(VmmError::Invalid(format!(
                "slot {slot} is outside the space or already mapped"
            )));
        }
        for region in 0..self.layout.regions {
            st.mapped.insert((region, slot), (source.clone(), region));
            let piece = region;
            let source = source.clone();
            st.calls.push(FakeCall::Map {
                region,
                slot,
                source,
                piece,
            });
        }
        Ok(())
    }
}

impl Mapper for FakeMapper {
    fn region_ptr(&self, region: usize) -> u64 {
        FAKE_BASE + (region * self.layout.reserved_bytes()) as u64
    }

    fn map_pool(&mut self, slot: usize, fd: BorrowedFd<'_>) -> Result<(), VmmError> {
        self.map(slot, fd_name(fd))
    }

    fn map_quarantine(&mut self, slot: usize) -> Result<(), VmmError> {
        if !self.quarantine {
            return Err(VmmError::Invalid("no quarantine".into()));
        }
        self.map(slot, "quarantine".into())
    }

    fn unmap(&mut self, slot: usize) -> Result<(), VmmError> {
        let mut st = self.gpu.state();
        if !st.mapped.contains_key(&(0, slot)) {
            return Err(VmmError::Invalid(format!(
                "nothing is mapped at slot {slot}"
            )));
        }
        for region in 0..self.layout.regions {
            st.mapped.remove(&(region, slot));
            st.calls.push(FakeCall::Unmap { region, slot });
        }
        Ok(())
    }
}

impl Drop for FakeMapper {
    fn drop(&mut self) {
        let mut st = self.gpu.state();
        let unmapped = std::mem::take(&mut st.mapped).len();
        st.calls.push(FakeCall::Dropped { unmapped });
    }
}
