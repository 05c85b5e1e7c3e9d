//! RM control ids (`NVOS54.cmd`) and their flag values. The high 16 bits of an id name the class
//! the control runs on (0x0000 client, 0x2080 subdevice); sizes are those of the structs in `structs`.

/// `NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS`, on the client: [`crate::Nv0000GetAttachedIdsParams`].
pub const NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS: u32 = 0x0201;
/// `NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2`, on the client: [`crate::Nv0000GetIdInfoV2Params`].
pub const NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2: u32 = 0x0205;
/// `NV2080_CTRL_CMD_GPU_GET_NAME_STRING`, on a subdevice: [`crate::Nv2080GetNameStringParams`].
pub const NV2080_CTRL_CMD_GPU_GET_NAME_STRING: u32 = 0x2080_0110;
/// `NV2080_CTRL_CMD_GPU_GET_GID_INFO`, on a subdevice: [`crate::Nv2080GetGidInfoParams`].
pub const NV2080_CTRL_CMD_GPU_GET_GID_INFO: u32 = 0x2080_014A;
/// `NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS`, on a subdevice: [`crate::Nv2080FifoDisableChannelsParams`].
/// Non-privileged: it may name channels of any client on that GPU.
pub const NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS: u32 = 0x2080_110B;
/// `NV208F_CTRL_CMD_FIFO_GET_CHANNEL_STATE`, on a subdevice's diag object:
/// [`crate::Nv208fGetChannelStateParams`]. Names a channel of any client; RM asks GSP for the
/// channel's runlist state (enabled, scheduled).
pub const NV208F_CTRL_CMD_FIFO_GET_CHANNEL_STATE: u32 = 0x208F_0403;

/// `gpuNameStringFlags` value for an ASCII name.
pub const NV2080_GPU_NAME_STRING_ASCII: u32 = 0;
/// GID flags: ASCII `GPU-xxxxxxxx-xxxx-...` form.
pub const NV2080_GID_FORMAT_ASCII: u32 = 0;
/// GID flags: 16 raw bytes.
pub const NV2080_GID_FORMAT_BINARY: u32 = 2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subdevice_controls_carry_the_subdevice_class() {
        for cmd in [
            NV2080_CTRL_CMD_GPU_GET_NAME_STRING,
            NV2080_CTRL_CMD_GPU_GET_GID_INFO,
            NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS,
        ] {
            assert_eq!(cmd >> 16, crate::NV20_SUBDEVICE_0);
        }
        assert_eq!(NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS >> 16, 0);
        assert_eq!(
            NV208F_CTRL_CMD_FIFO_GET_CHANNEL_STATE >> 16,
            crate::NV20_SUBDEVICE_DIAG
        );
    }
}
