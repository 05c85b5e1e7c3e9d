//! Valve's GPU memory-sharing primitives: physical GPU memory in handles that free themselves,
//! reserved virtual ranges, mappings, and passing handles between processes as file descriptors.
//!
//! The pool (daemon) creates [`PhysicalHandle`]s and exports each as a POSIX file descriptor;
//! [`fdpass`] carries descriptors over a Unix socket (SCM_RIGHTS); a client imports them and maps
//! them into its own [`VaRange`]. CUDA is loaded at run time (`libcuda.so.1`), so this crate builds
//! and tests without a GPU; [`driver_present`] says whether a GPU test can run.

mod check;
pub mod fdpass;
mod gpu;
mod physical;
mod va;
pub mod wire;

pub use check::VmmError;
pub use gpu::Gpu;
pub use physical::PhysicalHandle;
pub use va::VaRange;

/// `Result` with [`VmmError`].
pub type Result<T> = std::result::Result<T, VmmError>;

/// Whether the CUDA driver library can be loaded here (false on machines without NVIDIA's driver).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda under its usual names; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU the types still refuse bad requests before touching CUDA, and say why.
    #[test]
    fn no_driver_is_a_named_error_not_a_panic() {
        if driver_present() {
            eprintln!("skipping: libcuda is present here; the GPU path is tested by hwtests");
            return;
        }
        let e = Gpu::open(0).unwrap_err();
        assert!(matches!(e, VmmError::NoDriver), "{e}");
        assert!(e.to_string().contains("libcuda"));
        assert!(matches!(
            VaRange::reserve(1 << 21, 0),
            Err(VmmError::NoDriver)
        ));
    }
}
