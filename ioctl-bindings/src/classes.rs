//! RM class ids Valve allocates or recognises: root client, device, subdevice, its diag object,
//! channel group (TSG),
//! and the GPFIFO channel, compute and copy classes of every generation from Volta to Blackwell.

/// `NV01_ROOT_CLIENT`.
pub const NV01_ROOT_CLIENT: u32 = 0x0041;
/// `NV01_DEVICE_0`: params [`crate::Nv0080AllocParams`].
pub const NV01_DEVICE_0: u32 = 0x0080;
/// `NV20_SUBDEVICE_0`: params [`crate::Nv2080AllocParams`].
pub const NV20_SUBDEVICE_0: u32 = 0x2080;
/// `NV20_SUBDEVICE_DIAG`: a subdevice's diagnostic object, allocated without params
/// ([`crate::Nv208fAllocParams`]); the freeze check reads channel state through it.
pub const NV20_SUBDEVICE_DIAG: u32 = 0x208F;
/// `KEPLER_CHANNEL_GROUP_A`: a TSG.
pub const KEPLER_CHANNEL_GROUP_A: u32 = 0xA06C;

/// `VOLTA_CHANNEL_GPFIFO_A`.
pub const VOLTA_CHANNEL_GPFIFO_A: u32 = 0xC36F;
/// `TURING_CHANNEL_GPFIFO_A`.
pub const TURING_CHANNEL_GPFIFO_A: u32 = 0xC46F;
/// `AMPERE_CHANNEL_GPFIFO_A`.
pub const AMPERE_CHANNEL_GPFIFO_A: u32 = 0xC56F;
/// `HOPPER_CHANNEL_GPFIFO_A`.
pub const HOPPER_CHANNEL_GPFIFO_A: u32 = 0xC86F;
/// `BLACKWELL_CHANNEL_GPFIFO_A`.
pub const BLACKWELL_CHANNEL_GPFIFO_A: u32 = 0xC96F;
/// `BLACKWELL_CHANNEL_GPFIFO_B`.
pub const BLACKWELL_CHANNEL_GPFIFO_B: u32 = 0xCA6F;

/// Every GPFIFO channel class, oldest first.
pub const CHANNEL_GPFIFO_CLASSES: [u32; 6] = [
    VOLTA_CHANNEL_GPFIFO_A,
    TURING_CHANNEL_GPFIFO_A,
    AMPERE_CHANNEL_GPFIFO_A,
    HOPPER_CHANNEL_GPFIFO_A,
    BLACKWELL_CHANNEL_GPFIFO_A,
    BLACKWELL_CHANNEL_GPFIFO_B,
];

/// `VOLTA_COMPUTE_A`.
pub const VOLTA_COMPUTE_A: u32 = 0xC3C0;
/// `TURING_COMPUTE_A`.
pub const TURING_COMPUTE_A: u32 = 0xC5C0;
/// `AMPERE_COMPUTE_A`.
pub const AMPERE_COMPUTE_A: u32 = 0xC6C0;
/// `AMPERE_COMPUTE_B`.
pub const AMPERE_COMPUTE_B: u32 = 0xC7C0;
/// `ADA_COMPUTE_A`.
pub const ADA_COMPUTE_A: u32 = 0xC9C0;
/// `HOPPER_COMPUTE_A`.
pub const HOPPER_COMPUTE_A: u32 = 0xCBC0;
/// `BLACKWELL_COMPUTE_A`.
pub const BLACKWELL_COMPUTE_A: u32 = 0xCDC0;
/// `BLACKWELL_COMPUTE_B`.
pub const BLACKWELL_COMPUTE_B: u32 = 0xCEC0;

/// Every compute engine class, oldest first.
pub const COMPUTE_CLASSES: [u32; 8] = [
    VOLTA_COMPUTE_A,
    TURING_COMPUTE_A,
    AMPERE_COMPUTE_A,
    AMPERE_COMPUTE_B,
    ADA_COMPUTE_A,
    HOPPER_COMPUTE_A,
    BLACKWELL_COMPUTE_A,
    BLACKWELL_COMPUTE_B,
];

/// `VOLTA_DMA_COPY_A`.
pub const VOLTA_DMA_COPY_A: u32 = 0xC3B5;
/// `TURING_DMA_COPY_A`.
pub const TURING_DMA_COPY_A: u32 = 0xC5B5;
/// `AMPERE_DMA_COPY_A`.
pub const AMPERE_DMA_COPY_A: u32 = 0xC6B5;
/// `AMPERE_DMA_COPY_B`.
pub const AMPERE_DMA_COPY_B: u32 = 0xC7B5;
/// `HOPPER_DMA_COPY_A`.
pub const HOPPER_DMA_COPY_A: u32 = 0xC8B5;
/// `BLACKWELL_DMA_COPY_A`.
pub const BLACKWELL_DMA_COPY_A: u32 = 0xC9B5;
/// `BLACKWELL_DMA_COPY_B`.
pub const BLACKWELL_DMA_COPY_B: u32 = 0xCAB5;

/// Every copy engine class, oldest first.
pub const COPY_CLASSES: [u32; 7] = [
    VOLTA_DMA_COPY_A,
    TURING_DMA_COPY_A,
    AMPERE_DMA_COPY_A,
    AMPERE_DMA_COPY_B,
    HOPPER_DMA_COPY_A,
    BLACKWELL_DMA_COPY_A,
    BLACKWELL_DMA_COPY_B,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_classes_all_end_in_6f_and_are_distinct() {
        for (i, c) in CHANNEL_GPFIFO_CLASSES.iter().enumerate() {
            assert_eq!(c & 0xff, 0x6f, "{c:#x}");
            assert!(!CHANNEL_GPFIFO_CLASSES[i + 1..].contains(c));
        }
        assert!(COMPUTE_CLASSES.iter().all(|c| c & 0xff == 0xc0));
        assert!(COPY_CLASSES.iter().all(|c| c & 0xff == 0xb5));
    }
}
