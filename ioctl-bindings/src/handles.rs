//! Typed RM object handles: a channel handle is not a client handle. All are `u32` on the wire
//! and `#[repr(transparent)]`, so they can sit directly in the ABI structs.

macro_rules! rm_handle {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u32);

        impl core::fmt::Display for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                write!(f, "{:#010x}", self.0)
            }
        }

        impl core::fmt::LowerHex for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                core::fmt::LowerHex::fmt(&self.0, f)
            }
        }

        impl From<$name> for ObjectHandle {
            fn from(h: $name) -> ObjectHandle {
                ObjectHandle(h.0)
            }
        }
    };
}

/// Any RM object, when the kind does not matter (the `hObject` of a control or free).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectHandle(pub u32);

impl core::fmt::Display for ObjectHandle {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{:#010x}", self.0)
    }
}

rm_handle!(
    /// A root client (class `NV01_ROOT_CLIENT`): the top of one process's object tree.
    /// Kernel-assigned, unique on the node while it lives.
    ClientHandle
);
rm_handle!(
    /// A device object (`NV01_DEVICE_0`) under a client. Chosen by the process; repeats across processes.
    DeviceHandle
);
rm_handle!(
    /// A subdevice object (`NV20_SUBDEVICE_0`) under a device: the target of per-GPU controls.
    SubdeviceHandle
);
rm_handle!(
    /// A channel group / TSG (`KEPLER_CHANNEL_GROUP_A`): channels scheduled together.
    TsgHandle
);
rm_handle!(
    /// A GPFIFO channel (any generation's `*_CHANNEL_GPFIFO_*` class).
    ChannelHandle
);
