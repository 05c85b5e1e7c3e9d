//! A CUDA device by ordinal, and the allocation properties Valve uses for shareable memory.
//! No context is created here: physical memory can be created and exported without one.

use cudarc::driver::sys::{
    self, CUdevice, CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationGranularity_flags,
    CUmemAllocationHandleType, CUmemAllocationProp, CUmemAllocationType, CUmemLocation,
    CUmemLocationType,
};

use crate::check::{check, init};

/// One GPU, as CUDA numbers it (respecting `CUDA_VISIBLE_DEVICES`).
#[derive(Clone, Copy, Debug)]
pub struct Gpu {
    ordinal: i32,
    device: CUdevice,
}

impl Gpu {
    /// Initialises CUDA and looks the device up.
    pub fn open(ordinal: u32) -> crate::Result<Gpu> {
        init()?;
        let ordinal = i32::try_from(ordinal)
            .map_err(|_| crate::VmmError::Invalid(format!("GPU ordinal {ordinal} is too large")))?;
        let mut device: CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer for the duration of the call.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, ordinal)
        })?;
        Ok(Gpu { ordinal, device })
    }

    /// The device at PCI address `bus_id` (as `valvectl gpus` and NVML print it, e.g.
    /// `00000000:19:00.0`; case and the domain's width do not matter). CUDA's own numbering
    /// depends on `CUDA_DEVICE_ORDER` and `CUDA_VISIBLE_DEVICES`; the PCI address does not.
    pub fn open_pci(bus_id: &str) -> crate::Result<Gpu> {
        init()?;
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        let want = normalize_pci(bus_id);
        for ordinal in 0..count.max(0) as u32 {
            let gpu = Gpu::open(ordinal)?;
            if normalize_pci(&gpu.pci_bus_id()?) == want {
                return Ok(gpu);
            }
        }
        Err(crate::VmmError::Invalid(format!(
            "no CUDA device at PCI {bus_id} (is it hidden by CUDA_VISIBLE_DEVICES?)"
        )))
    }

    /// Its PCI address as CUDA prints it.
    pub fn pci_bus_id(&self) -> crate::Result<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer is writable for its full length, which is passed.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.device)
        })?;
        // SAFETY: cuDeviceGetPCIBusId NUL-terminates within the given length.
        let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        Ok(s.to_string_lossy().into_owned())
    }

    /// Makes this device's primary context current on the calling thread if no context is.
    /// VMM calls (map, set access) need one; a client library's own threads have none.
    pub fn ensure_context(&self) -> crate::Result<()> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `cur` is a valid out-pointer.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if !cur.is_null() {
            return Ok(());
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; the retained reference is kept for the life of
        // the process (the primary context is shared with the runtime and frameworks).
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, self.device)
        })?;
        // SAFETY: `ctx` is the live primary context just retained.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
    }

    /// The CUDA ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal as u32
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> crate::Result<String> {
        let mut buf = [0 as std::ffi::c_char; 128];
        // SAFETY: the buffer is writable for its full length, which is passed.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.device)
        })?;
        // SAFETY: cuDeviceGetName NUL-terminates within the given length.
        let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        Ok(s.to_string_lossy().into_owned())
    }

    /// The smallest size and alignment of a physical handle on this device (2 MiB on Hopper).
    pub fn granularity(&self) -> crate::Result<usize> {
        let prop = self.alloc_prop();
        let mut g = 0usize;
        // SAFETY: `prop` and `g` are valid for the call.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(g)
    }

    /// Pinned device memory on this GPU, exportable as a POSIX file descriptor.
    pub(crate) fn alloc_prop(&self) -> CUmemAllocationProp {
        // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is the documented
        // "no extra flags" value; the fields that matter are set below.
        let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = self.location();
        prop
    }

    fn location(&self) -> CUmemLocation {
        CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.ordinal,
        }
    }

    /// Read-write access for this GPU.
    pub(crate) fn access_desc(&self) -> CUmemAccessDesc {
        CUmemAccessDesc {
            location: self.location(),
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }
}

/// `0000:19:00.0`, `00000000:19:00.0` and `0000:19:00.0` in any case compare equal.
pub(crate) fn normalize_pci(s: &str) -> String {
    let s = s.trim().to_ascii_lowercase();
    match s.split_once(':') {
        Some((domain, rest)) if rest.contains(':') => {
            let d = u32::from_str_radix(domain, 16).unwrap_or(u32::MAX);
            format!("{d:08x}:{rest}")
        }
        _ => format!("00000000:{s}"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pci_addresses_compare_by_value() {
        use super::normalize_pci as n;
        assert_eq!(n("00000000:19:00.0"), n("0000:19:00.0"));
        assert_eq!(n("0000:1A:00.0"), n("00000000:1a:00.0"));
        assert_eq!(n("19:00.0"), n("0000:19:00.0"));
        assert_ne!(n("0000:19:00.0"), n("0000:1a:00.0"));
    }
}
