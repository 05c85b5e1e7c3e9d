//! Escape numbers of the NVIDIA character devices and the `_IOWR('F', nr, size)` request codes
//! built from them. The driver checks the size encoded in the request against the argument.

use crate::structs::{
    CardInfo, Nvos00Free, Nvos21Alloc, Nvos54Control, Nvos55DupObject, Nvos64Alloc, RegisterFd,
    MAX_CARDS,
};

/// `NV_IOCTL_MAGIC`: the ioctl type byte of every NVIDIA device-file ioctl.
pub const NV_IOCTL_MAGIC: u8 = b'F';

/// Frees an RM object and its descendants (`NVOS00`).
pub const NV_ESC_RM_FREE: u8 = 0x29;
/// Runs a control on an RM object (`NVOS54`).
pub const NV_ESC_RM_CONTROL: u8 = 0x2A;
/// Allocates an RM object (`NVOS21` or `NVOS64`).
pub const NV_ESC_RM_ALLOC: u8 = 0x2B;
/// Duplicates an object into another client (`NVOS55`).
pub const NV_ESC_RM_DUP_OBJECT: u8 = 0x34;
/// Lists the GPUs the driver probed (array of [`CardInfo`]), on `/dev/nvidiactl`.
pub const NV_ESC_CARD_INFO: u8 = 200;
/// Ties a `/dev/nvidia<minor>` fd to a `/dev/nvidiactl` fd ([`RegisterFd`]).
pub const NV_ESC_REGISTER_FD: u8 = 201;

/// Linux `_IOC` direction bits for read+write.
const IOC_READ_WRITE: u64 = 3;
const IOC_NRSHIFT: u64 = 0;
const IOC_TYPESHIFT: u64 = 8;
const IOC_SIZESHIFT: u64 = 16;
const IOC_DIRSHIFT: u64 = 30;
/// The size field of an ioctl request is 14 bits wide.
pub const IOC_SIZE_MAX: usize = (1 << 14) - 1;

/// `_IOWR(NV_IOCTL_MAGIC, nr, size)`. Sizes over 14 bits are a compile-time error where used in a const.
pub const fn nv_iowr(nr: u8, size: usize) -> u64 {
    assert!(
        size <= IOC_SIZE_MAX,
        "ioctl argument too large for the size field"
    );
    (IOC_READ_WRITE << IOC_DIRSHIFT)
        | ((size as u64) << IOC_SIZESHIFT)
        | ((NV_IOCTL_MAGIC as u64) << IOC_TYPESHIFT)
        | ((nr as u64) << IOC_NRSHIFT)
}

/// Request code of RM_FREE.
pub const NV_IOCTL_RM_FREE: u64 = nv_iowr(NV_ESC_RM_FREE, core::mem::size_of::<Nvos00Free>());
/// Request code of RM_CONTROL.
pub const NV_IOCTL_RM_CONTROL: u64 =
    nv_iowr(NV_ESC_RM_CONTROL, core::mem::size_of::<Nvos54Control>());
/// Request code of RM_ALLOC in its 32-byte (`NVOS21`) form.
pub const NV_IOCTL_RM_ALLOC_NVOS21: u64 =
    nv_iowr(NV_ESC_RM_ALLOC, core::mem::size_of::<Nvos21Alloc>());
/// Request code of RM_ALLOC in its 48-byte (`NVOS64`) form, the one CUDA 13 uses.
pub const NV_IOCTL_RM_ALLOC_NVOS64: u64 =
    nv_iowr(NV_ESC_RM_ALLOC, core::mem::size_of::<Nvos64Alloc>());
/// Request code of RM_DUP_OBJECT.
pub const NV_IOCTL_RM_DUP_OBJECT: u64 = nv_iowr(
    NV_ESC_RM_DUP_OBJECT,
    core::mem::size_of::<Nvos55DupObject>(),
);
/// Request code of CARD_INFO for an array of [`MAX_CARDS`] entries.
pub const NV_IOCTL_CARD_INFO: u64 = nv_iowr(
    NV_ESC_CARD_INFO,
    core::mem::size_of::<[CardInfo; MAX_CARDS]>(),
);
/// Request code of REGISTER_FD.
pub const NV_IOCTL_REGISTER_FD: u64 =
    nv_iowr(NV_ESC_REGISTER_FD, core::mem::size_of::<RegisterFd>());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_codes_match_the_kernel_iowr_encoding() {
        // nix computes the kernel's _IOWR independently of our const fn.
        let nix_alloc = nix::request_code_readwrite!(b'F', 0x2B, 48);
        assert_eq!(NV_IOCTL_RM_ALLOC_NVOS64, nix_alloc);
        assert_eq!(
            NV_IOCTL_RM_ALLOC_NVOS21,
            nix::request_code_readwrite!(b'F', 0x2B, 32)
        );
        assert_eq!(
            NV_IOCTL_RM_CONTROL,
            nix::request_code_readwrite!(b'F', 0x2A, 32)
        );
        assert_eq!(
            NV_IOCTL_RM_FREE,
            nix::request_code_readwrite!(b'F', 0x29, 16)
        );
        assert_eq!(
            NV_IOCTL_RM_DUP_OBJECT,
            nix::request_code_readwrite!(b'F', 0x34, 28)
        );
        assert_eq!(
            NV_IOCTL_REGISTER_FD,
            nix::request_code_readwrite!(b'F', 201, 4)
        );
        assert_eq!(
            NV_IOCTL_CARD_INFO,
            nix::request_code_readwrite!(b'F', 200, 72 * MAX_CARDS)
        );
    }

    #[test]
    fn known_literal_request_code() {
        // _IOWR('F', 0x2A, 32) = 0xC020462A, as seen in strace of any CUDA program.
        assert_eq!(NV_IOCTL_RM_CONTROL, 0xC020_462A);
        assert_eq!(NV_IOCTL_RM_ALLOC_NVOS64, 0xC030_462B);
    }
}
