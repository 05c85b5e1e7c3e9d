//! `#[repr(C)]` argument structs of the RM ioctls and of the controls Valve issues.
//! Field names are snake_case forms of NVIDIA's; each struct's size and offsets are tested below.

use crate::handles::{ChannelHandle, ClientHandle, ObjectHandle};

/// `NVOS00_PARAMETERS`: RM_FREE.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos00Free {
    /// `hRoot`: the client owning the object.
    pub h_root: ClientHandle,
    /// `hObjectParent`.
    pub h_object_parent: ObjectHandle,
    /// `hObjectOld`: the object to free (the client itself to free a whole client).
    pub h_object_old: ObjectHandle,
    /// `status`: RM status written by the driver.
    pub status: u32,
}

/// `NVOS21_PARAMETERS`: RM_ALLOC, 32-byte form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos21Alloc {
    /// `hRoot`: owning client (0 when allocating a root client).
    pub h_root: ClientHandle,
    /// `hObjectParent`.
    pub h_object_parent: ObjectHandle,
    /// `hObjectNew`: the new handle (0 lets RM choose for a root client; written back).
    pub h_object_new: ObjectHandle,
    /// `hClass`: the class id.
    pub h_class: u32,
    /// `pAllocParms`: user pointer to the class's allocation parameters, or 0.
    pub p_alloc_parms: u64,
    /// `paramsSize`: size of the parameters.
    pub params_size: u32,
    /// `status`.
    pub status: u32,
}

/// `NVOS64_PARAMETERS`: RM_ALLOC, 48-byte form (CUDA 13 uses this one).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos64Alloc {
    /// `hRoot`.
    pub h_root: ClientHandle,
    /// `hObjectParent`.
    pub h_object_parent: ObjectHandle,
    /// `hObjectNew`.
    pub h_object_new: ObjectHandle,
    /// `hClass`.
    pub h_class: u32,
    /// `pAllocParms`.
    pub p_alloc_parms: u64,
    /// `pRightsRequested`: user pointer to an access-rights mask, or 0.
    pub p_rights_requested: u64,
    /// `paramsSize`.
    pub params_size: u32,
    /// `flags`.
    pub flags: u32,
    /// `status`.
    pub status: u32,
    /// Tail padding to the 8-byte alignment of the struct.
    pub _pad: u32,
}

/// `NVOS54_PARAMETERS`: RM_CONTROL.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos54Control {
    /// `hClient`: the client issuing the control.
    pub h_client: ClientHandle,
    /// `hObject`: the object the control runs on.
    pub h_object: ObjectHandle,
    /// `cmd`: control id (e.g. [`crate::NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS`]).
    pub cmd: u32,
    /// `flags`.
    pub flags: u32,
    /// `params`: user pointer to the control's parameter struct.
    pub params: u64,
    /// `paramsSize`: must equal the control's parameter size.
    pub params_size: u32,
    /// `status`.
    pub status: u32,
}

/// `NVOS55_PARAMETERS`: RM_DUP_OBJECT.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nvos55DupObject {
    /// `hClient`: destination client.
    pub h_client: ClientHandle,
    /// `hParent`: destination parent.
    pub h_parent: ObjectHandle,
    /// `hObject`: new handle in the destination.
    pub h_object: ObjectHandle,
    /// `hClientSrc`.
    pub h_client_src: ClientHandle,
    /// `hObjectSrc`.
    pub h_object_src: ObjectHandle,
    /// `flags`.
    pub flags: u32,
    /// `status`.
    pub status: u32,
}

/// Entries in the array passed to CARD_INFO (`NV_MAX_DEVICES`).
pub const MAX_CARDS: usize = 32;

/// `nv_ioctl_card_info_t`: one probed GPU as CARD_INFO reports it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CardInfo {
    /// `valid`: nonzero for a used entry.
    pub valid: u8,
    /// PCI domain.
    pub pci_domain: u32,
    /// PCI bus.
    pub pci_bus: u8,
    /// PCI slot (device).
    pub pci_slot: u8,
    /// PCI function.
    pub pci_function: u8,
    /// PCI vendor id (0x10de).
    pub pci_vendor_id: u16,
    /// PCI device id.
    pub pci_device_id: u16,
    /// `gpu_id`: the id RM's `GET_ATTACHED_IDS` reports.
    pub gpu_id: u32,
    /// `interrupt_line`.
    pub interrupt_line: u16,
    /// BAR0 address.
    pub reg_address: u64,
    /// BAR0 size.
    pub reg_size: u64,
    /// Framebuffer BAR address.
    pub fb_address: u64,
    /// Framebuffer BAR size.
    pub fb_size: u64,
    /// `minor_number`: the N of `/dev/nvidiaN`.
    pub minor_number: u32,
    /// `dev_name`.
    pub dev_name: [u8; 10],
}

/// `nv_ioctl_register_fd_t`: REGISTER_FD on a `/dev/nvidia<minor>` fd.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegisterFd {
    /// The `/dev/nvidiactl` fd to tie this device fd to.
    pub ctl_fd: i32,
}

/// `NV0080_ALLOC_PARAMETERS`: parameters of an `NV01_DEVICE_0` allocation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nv0080AllocParams {
    /// `deviceId`: the RM device instance (not the CUDA device number, not the minor).
    pub device_id: u32,
    /// `hClientShare`: client whose VA space to share; Valve passes its own client.
    pub h_client_share: ClientHandle,
    /// `hTargetClient`.
    pub h_target_client: ClientHandle,
    /// `hTargetDevice`.
    pub h_target_device: ObjectHandle,
    /// `flags`.
    pub flags: u32,
    /// Padding before the 8-byte fields.
    pub _pad0: u32,
    /// `vaSpaceSize`.
    pub va_space_size: u64,
    /// `vaStartInternal`.
    pub va_start_internal: u64,
    /// `vaLimitInternal`.
    pub va_limit_internal: u64,
    /// `vaMode`.
    pub va_mode: u32,
    /// Tail padding.
    pub _pad1: u32,
}

/// `NV2080_ALLOC_PARAMETERS`: parameters of an `NV20_SUBDEVICE_0` allocation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nv2080AllocParams {
    /// `subDeviceId`: 0 on non-SLI systems.
    pub sub_device_id: u32,
}

/// Entries in `NV0000_CTRL_GPU_GET_ATTACHED_IDS_PARAMS.gpuIds`.
pub const MAX_ATTACHED_GPUS: usize = 32;
/// Terminates the attached-ids list.
pub const INVALID_GPU_ID: u32 = 0xffff_ffff;

/// `NV0000_CTRL_GPU_GET_ATTACHED_IDS_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nv0000GetAttachedIdsParams {
    /// `gpuIds`: attached GPU ids, terminated by [`INVALID_GPU_ID`].
    pub gpu_ids: [u32; MAX_ATTACHED_GPUS],
}

impl Default for Nv0000GetAttachedIdsParams {
    fn default() -> Self {
        Self {
            gpu_ids: [INVALID_GPU_ID; MAX_ATTACHED_GPUS],
        }
    }
}

/// `NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nv0000GetIdInfoV2Params {
    /// `gpuId` (in).
    pub gpu_id: u32,
    /// `gpuFlags`.
    pub gpu_flags: u32,
    /// `deviceInstance`: the value a device allocation's `deviceId` takes.
    pub device_instance: u32,
    /// `subDeviceInstance`.
    pub sub_device_instance: u32,
    /// `sliStatus`.
    pub sli_status: u32,
    /// `boardId`.
    pub board_id: u32,
    /// `gpuInstance`.
    pub gpu_instance: u32,
    /// `numaId`.
    pub numa_id: i32,
}

/// Longest GPU name `GET_NAME_STRING` returns.
pub const GPU_NAME_STRING_LENGTH: usize = 0x40;

/// `NV2080_CTRL_GPU_GET_NAME_STRING_PARAMS` (ASCII form of the union).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nv2080GetNameStringParams {
    /// `gpuNameStringFlags`: [`crate::NV2080_GPU_NAME_STRING_ASCII`].
    pub flags: u32,
    /// The union of `ascii[64]` and `unicode[64]` (u16): 128 bytes.
    pub name: [u8; 2 * GPU_NAME_STRING_LENGTH],
}

impl Default for Nv2080GetNameStringParams {
    fn default() -> Self {
        Self {
            flags: 0,
            name: [0; 2 * GPU_NAME_STRING_LENGTH],
        }
    }
}

/// Longest GID `GET_GID_INFO` returns.
pub const GPU_GID_LENGTH: usize = 0x100;

/// `NV2080_CTRL_GPU_GET_GID_INFO_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nv2080GetGidInfoParams {
    /// `index`: 0.
    pub index: u32,
    /// `flags`: [`crate::NV2080_GID_FORMAT_ASCII`] gives the `GPU-xxxxxxxx-...` string.
    pub flags: u32,
    /// `length`: bytes written to `data`.
    pub length: u32,
    /// `data`.
    pub data: [u8; GPU_GID_LENGTH],
}

impl Default for Nv2080GetGidInfoParams {
    fn default() -> Self {
        Self {
            index: 0,
            flags: 0,
            length: 0,
            data: [0; GPU_GID_LENGTH],
        }
    }
}

/// Most (client, channel) pairs one FIFO_DISABLE_CHANNELS control can name.
pub const FIFO_DISABLE_CHANNELS_MAX_ENTRIES: usize = 64;

/// `NV2080_CTRL_FIFO_DISABLE_CHANNELS_PARAMS`: disable (and preempt) or enable channels of any client.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nv2080FifoDisableChannelsParams {
    /// `bDisable`: 1 disables, 0 enables.
    pub disable: u8,
    /// `numChannels`: entries used in the lists.
    pub num_channels: u32,
    /// `bOnlyDisableScheduling`: 1 keeps running work running (no preemption).
    pub only_disable_scheduling: u8,
    /// `bRewindGpPut`.
    pub rewind_gp_put: u8,
    /// `pRunlistPreemptEvent`: kernel-internal; must be 0 from user space.
    pub p_runlist_preempt_event: u64,
    /// `hClientList`: the client owning each channel.
    pub client_list: [ClientHandle; FIFO_DISABLE_CHANNELS_MAX_ENTRIES],
    /// `hChannelList`: the channels (or TSGs).
    pub channel_list: [ChannelHandle; FIFO_DISABLE_CHANNELS_MAX_ENTRIES],
}

impl Default for Nv2080FifoDisableChannelsParams {
    fn default() -> Self {
        Self {
            disable: 0,
            num_channels: 0,
            only_disable_scheduling: 0,
            rewind_gp_put: 0,
            p_runlist_preempt_event: 0,
            client_list: [ClientHandle(0); FIFO_DISABLE_CHANNELS_MAX_ENTRIES],
            channel_list: [ChannelHandle(0); FIFO_DISABLE_CHANNELS_MAX_ENTRIES],
        }
    }
}

/// Parameters of an `NV20_SUBDEVICE_DIAG` allocation: none (`paramsSize` 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nv208fAllocParams;

/// `NV208F_CTRL_FIFO_GET_CHANNEL_STATE_PARAMS`: one channel's state as RM and GSP keep it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nv208fGetChannelStateParams {
    /// `hChannel`.
    pub channel: ChannelHandle,
    /// `hClient`: the channel's owner (any client).
    pub client: ClientHandle,
    /// `bBound`.
    pub bound: u8,
    /// `bEnabled`: 0 once FIFO_DISABLE_CHANNELS took hold.
    pub enabled: u8,
    /// `bScheduled`: on its runlist.
    pub scheduled: u8,
    /// `bCpuMap`.
    pub cpu_map: u8,
    /// `bContention`.
    pub contention: u8,
    /// `bRunlistSet`.
    pub runlist_set: u8,
    /// `bDeferRC`.
    pub defer_rc: u8,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assert_layout;

    #[test]
    fn nvos00_layout() {
        assert_layout!(Nvos00Free, size = 16, h_root @ 0, h_object_parent @ 4, h_object_old @ 8, status @ 12);
    }

    #[test]
    fn nvos21_layout() {
        assert_layout!(Nvos21Alloc, size = 32, h_root @ 0, h_object_parent @ 4, h_object_new @ 8,
            h_class @ 12, p_alloc_parms @ 16, params_size @ 24, status @ 28);
    }

    #[test]
    fn nvos64_layout() {
        assert_layout!(Nvos64Alloc, size = 48, h_root @ 0, h_object_parent @ 4, h_object_new @ 8,
            h_class @ 12, p_alloc_parms @ 16, p_rights_requested @ 24, params_size @ 32,
            flags @ 36, status @ 40);
    }

    #[test]
    fn nvos54_layout() {
        assert_layout!(Nvos54Control, size = 32, h_client @ 0, h_object @ 4, cmd @ 8, flags @ 12,
            params @ 16, params_size @ 24, status @ 28);
    }

    #[test]
    fn nvos55_layout() {
        assert_layout!(Nvos55DupObject, size = 28, h_client @ 0, h_parent @ 4, h_object @ 8,
            h_client_src @ 12, h_object_src @ 16, flags @ 20, status @ 24);
    }

    #[test]
    fn card_info_layout() {
        assert_layout!(CardInfo, size = 72, valid @ 0, pci_domain @ 4, pci_bus @ 8, pci_slot @ 9,
            pci_function @ 10, pci_vendor_id @ 12, pci_device_id @ 14, gpu_id @ 16,
            interrupt_line @ 20, reg_address @ 24, reg_size @ 32, fb_address @ 40, fb_size @ 48,
            minor_number @ 56, dev_name @ 60);
    }

    #[test]
    fn register_fd_layout() {
        assert_layout!(RegisterFd, size = 4, ctl_fd @ 0);
    }

    #[test]
    fn device_alloc_params_layout() {
        assert_layout!(Nv0080AllocParams, size = 56, device_id @ 0, h_client_share @ 4,
            h_target_client @ 8, h_target_device @ 12, flags @ 16, va_space_size @ 24,
            va_start_internal @ 32, va_limit_internal @ 40, va_mode @ 48);
        assert_layout!(Nv2080AllocParams, size = 4, sub_device_id @ 0);
    }

    #[test]
    fn gpu_id_controls_layout() {
        assert_layout!(Nv0000GetAttachedIdsParams, size = 128, gpu_ids @ 0);
        assert_layout!(Nv0000GetIdInfoV2Params, size = 32, gpu_id @ 0, gpu_flags @ 4,
            device_instance @ 8, sub_device_instance @ 12, sli_status @ 16, board_id @ 20,
            gpu_instance @ 24, numa_id @ 28);
        assert_layout!(Nv2080GetNameStringParams, size = 132, flags @ 0, name @ 4);
        assert_layout!(Nv2080GetGidInfoParams, size = 268, index @ 0, flags @ 4, length @ 8, data @ 12);
    }

    #[test]
    fn disable_channels_layout() {
        assert_layout!(Nv2080FifoDisableChannelsParams, size = 536, disable @ 0, num_channels @ 4,
            only_disable_scheduling @ 8, rewind_gp_put @ 9, p_runlist_preempt_event @ 16,
            client_list @ 24, channel_list @ 280);
    }

    #[test]
    fn channel_state_layout() {
        assert_layout!(Nv208fGetChannelStateParams, size = 16, channel @ 0, client @ 4,
            bound @ 8, enabled @ 9, scheduled @ 10, defer_rc @ 14);
        assert_eq!(std::mem::size_of::<Nv208fAllocParams>(), 0);
    }

    #[test]
    fn attached_ids_default_is_terminated() {
        assert!(Nv0000GetAttachedIdsParams::default()
            .gpu_ids
            .iter()
            .all(|&id| id == INVALID_GPU_ID));
    }
}
