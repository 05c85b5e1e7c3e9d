//! Physical GPU memory as a value: [`PhysicalHandle`] releases its reference on drop, and can be
//! exported as a file descriptor that another process imports.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys::{self, CUmemAllocationHandleType, CUmemGenericAllocationHandle};

use crate::check::{check, init};
use crate::{Gpu, VmmError};

/// One reference to a block of physical GPU memory. The memory is freed when every reference
/// (handles in any process, mappings, exported descriptors not yet imported) is gone.
#[derive(Debug)]
pub struct PhysicalHandle {
    raw: CUmemGenericAllocationHandle,
    size: usize,
}

impl PhysicalHandle {
    /// Allocates `size` bytes (a multiple of [`Gpu::granularity`]) on `gpu`, shareable as a
    /// POSIX file descriptor. Needs no CUDA context.
    pub fn create(gpu: &Gpu, size: usize) -> crate::Result<PhysicalHandle> {
        let g = gpu.granularity()?;
        if size == 0 || size % g != 0 {
            return Err(VmmError::Invalid(format!(
                "a physical handle must be a positive multiple of {g} bytes, not {size}"
            )));
        }
        let prop = gpu.alloc_prop();
        let mut raw: CUmemGenericAllocationHandle = 0;
        // SAFETY: `raw` and `prop` are valid for the call; on success we own one reference.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut raw, size, &prop, 0)
        })?;
        Ok(PhysicalHandle { raw, size })
    }

    /// Exports a new file descriptor for this memory (the caller owns it; it keeps the memory
    /// alive until closed or imported and released).
    pub fn export(&self) -> crate::Result<OwnedFd> {
        let mut fd: libc::c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the out-parameter is an int, which `fd` is.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut libc::c_int).cast(),
                self.raw,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: on success the driver returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Imports memory another process exported; `size` is what the exporter created (CUDA does
    /// not report it). The descriptor stays the caller's.
    pub fn import(fd: BorrowedFd<'_>, size: usize) -> crate::Result<PhysicalHandle> {
        init()?;
        let mut raw: CUmemGenericAllocationHandle = 0;
        // For POSIX file descriptors CUDA takes the descriptor's value cast to a pointer.
        let os_handle = fd.as_raw_fd() as usize as *mut std::ffi::c_void;
        // SAFETY: `raw` is a valid out-pointer; the descriptor is open for the whole call.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut raw,
                os_handle,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(PhysicalHandle { raw, size })
    }

    /// Its size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn raw(&self) -> CUmemGenericAllocationHandle {
        self.raw
    }
}

impl Drop for PhysicalHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` is a reference this value owns and has not released; mappings made from
        // it hold their own references, so releasing here never pulls memory from under them.
        let rc = unsafe { sys::cuMemRelease(self.raw) };
        if let Err(e) = check("cuMemRelease", rc) {
            eprintln!("valve-vmm: {e}");
        }
    }
}
