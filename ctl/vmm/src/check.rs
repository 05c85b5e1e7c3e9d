//! CUDA driver status codes turned into [`VmmError`]s that name the call that failed.
//! Every CUDA call in this crate goes through [`check`].

use std::ffi::CStr;

use cudarc::driver::sys::{self, CUresult};

/// A CUDA driver call failed, or the driver is not there.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The call returned an error status.
    #[error("{call} failed: {name} ({code})")]
    Cuda {
        /// The driver entry point, e.g. `cuMemMap`.
        call: &'static str,
        /// CUDA's name for the status, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// The numeric status.
        code: u32,
    },
    /// libcuda.so.1 cannot be loaded here.
    #[error("the CUDA driver (libcuda.so.1) is not installed or not loadable: GPU memory needs NVIDIA's driver")]
    NoDriver,
    /// A request the types cannot express safely (bad size, offset, or alignment).
    #[error("{0}")]
    Invalid(String),
    /// An operating-system call on a descriptor failed.
    #[error("{op}: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

impl VmmError {
    /// Whether the driver said it is out of device memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, VmmError::Cuda { code, .. } if *code == CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32)
    }
}

fn error_name(status: CUresult) -> String {
    let mut ptr: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName only writes a pointer to a static string into `ptr`.
    let rc = unsafe { sys::cuGetErrorName(status, &mut ptr) };
    if rc != CUresult::CUDA_SUCCESS || ptr.is_null() {
        return format!("{status:?}");
    }
    // SAFETY: on success `ptr` points to a NUL-terminated string with static lifetime.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// Turns a status into a `Result`, naming `call` on failure.
pub(crate) fn check(call: &'static str, status: CUresult) -> crate::Result<()> {
    if status == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(VmmError::Cuda {
        call,
        name: error_name(status),
        code: status as u32,
    })
}

/// `cuInit(0)` once per process (further calls are cheap no-ops in the driver).
pub(crate) fn init() -> crate::Result<()> {
    if !crate::driver_present() {
        return Err(VmmError::NoDriver);
    }
    // SAFETY: cuInit takes no pointers; libcuda was just found loadable.
    check("cuInit", unsafe { sys::cuInit(0) })
}
