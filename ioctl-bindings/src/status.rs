//! RM status codes (`NV_STATUS`) as the driver writes them into a struct's `status` field, with
//! their NVIDIA names and what each usually means for an operator. Codes not listed keep their number.

/// An RM status code. RM reports failures here, not in the ioctl's return value.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RmStatus(pub u32);

/// One known status code: number, NVIDIA name, what it usually means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatusInfo {
    /// The code.
    pub code: u32,
    /// NVIDIA's name, e.g. `NV_ERR_INVALID_CHANNEL`.
    pub name: &'static str,
    /// What it usually means, for an operator.
    pub meaning: &'static str,
}

/// `NV_OK`: success.
pub const NV_OK: RmStatus = RmStatus(0x00);
/// `NV_ERR_GENERIC`: unspecified failure inside RM; check the kernel log (dmesg) for NVRM lines.
pub const NV_ERR_GENERIC: RmStatus = RmStatus(0x01);
/// `NV_ERR_BROKEN_FB`: the GPU's frame buffer is not usable.
pub const NV_ERR_BROKEN_FB: RmStatus = RmStatus(0x02);
/// `NV_ERR_BUFFER_TOO_SMALL`: the parameter buffer is too small for the answer.
pub const NV_ERR_BUFFER_TOO_SMALL: RmStatus = RmStatus(0x03);
/// `NV_ERR_BUSY_RETRY`: RM is busy; retry the call.
pub const NV_ERR_BUSY_RETRY: RmStatus = RmStatus(0x04);
/// `NV_ERR_CARD_NOT_PRESENT`: the GPU is not present (fallen off the bus or not attached).
pub const NV_ERR_CARD_NOT_PRESENT: RmStatus = RmStatus(0x06);
/// `NV_ERR_ECC_ERROR`: an uncorrectable ECC error was hit.
pub const NV_ERR_ECC_ERROR: RmStatus = RmStatus(0x0c);
/// `NV_ERR_FIFO_BAD_ACCESS`: bad access to the FIFO (channel) engine.
pub const NV_ERR_FIFO_BAD_ACCESS: RmStatus = RmStatus(0x0d);
/// `NV_ERR_GPU_IS_LOST`: the GPU is lost (Xid 79 class failure); it needs a reset by its owner.
pub const NV_ERR_GPU_IS_LOST: RmStatus = RmStatus(0x10);
/// `NV_ERR_GPU_IN_FULLCHIP_RESET`: the GPU is being reset.
pub const NV_ERR_GPU_IN_FULLCHIP_RESET: RmStatus = RmStatus(0x11);
/// `NV_ERR_GPU_NOT_FULL_POWER`: the GPU is not at full power.
pub const NV_ERR_GPU_NOT_FULL_POWER: RmStatus = RmStatus(0x12);
/// `NV_ERR_ILLEGAL_ACTION`: the action is not allowed in the object's current state.
pub const NV_ERR_ILLEGAL_ACTION: RmStatus = RmStatus(0x17);
/// `NV_ERR_IN_USE`: the object or resource is in use.
pub const NV_ERR_IN_USE: RmStatus = RmStatus(0x18);
/// `NV_ERR_INSUFFICIENT_PERMISSIONS`: the caller lacks the rights for this object (e.g. duplicating another process's object).
pub const NV_ERR_INSUFFICIENT_PERMISSIONS: RmStatus = RmStatus(0x1b);
/// `NV_ERR_INVALID_ADDRESS`: a user pointer in the parameters is not valid.
pub const NV_ERR_INVALID_ADDRESS: RmStatus = RmStatus(0x1e);
/// `NV_ERR_INVALID_ARGUMENT`: a parameter is out of range (e.g. too many channels, a nonzero kernel-only field).
pub const NV_ERR_INVALID_ARGUMENT: RmStatus = RmStatus(0x1f);
/// `NV_ERR_INVALID_CHANNEL`: no such channel under that client on this GPU: the handle is wrong, freed, or belongs to another GPU.
pub const NV_ERR_INVALID_CHANNEL: RmStatus = RmStatus(0x21);
/// `NV_ERR_INVALID_CLASS`: the class id is not supported by this GPU or driver.
pub const NV_ERR_INVALID_CLASS: RmStatus = RmStatus(0x22);
/// `NV_ERR_INVALID_CLIENT`: no such client: the process exited, freed it, or the handle is wrong.
pub const NV_ERR_INVALID_CLIENT: RmStatus = RmStatus(0x23);
/// `NV_ERR_INVALID_COMMAND`: the control id is not known to this object.
pub const NV_ERR_INVALID_COMMAND: RmStatus = RmStatus(0x24);
/// `NV_ERR_INVALID_DATA`: the data passed is not valid.
pub const NV_ERR_INVALID_DATA: RmStatus = RmStatus(0x25);
/// `NV_ERR_INVALID_DEVICE`: no such device (wrong device instance).
pub const NV_ERR_INVALID_DEVICE: RmStatus = RmStatus(0x26);
/// `NV_ERR_INVALID_FLAGS`: flags not valid for this call.
pub const NV_ERR_INVALID_FLAGS: RmStatus = RmStatus(0x29);
/// `NV_ERR_INVALID_INDEX`: an index is out of range.
pub const NV_ERR_INVALID_INDEX: RmStatus = RmStatus(0x2c);
/// `NV_ERR_INVALID_LOCK_STATE`: RM lock state does not allow this call.
pub const NV_ERR_INVALID_LOCK_STATE: RmStatus = RmStatus(0x2f);
/// `NV_ERR_INVALID_METHOD`: invalid method.
pub const NV_ERR_INVALID_METHOD: RmStatus = RmStatus(0x30);
/// `NV_ERR_INVALID_OBJECT`: the object is not valid for this call.
pub const NV_ERR_INVALID_OBJECT: RmStatus = RmStatus(0x31);
/// `NV_ERR_INVALID_OBJECT_HANDLE`: no object with that handle.
pub const NV_ERR_INVALID_OBJECT_HANDLE: RmStatus = RmStatus(0x33);
/// `NV_ERR_INVALID_OBJECT_NEW`: the new handle is invalid or already in use.
pub const NV_ERR_INVALID_OBJECT_NEW: RmStatus = RmStatus(0x34);
/// `NV_ERR_INVALID_OBJECT_OLD`: the handle to free is not valid.
pub const NV_ERR_INVALID_OBJECT_OLD: RmStatus = RmStatus(0x35);
/// `NV_ERR_INVALID_OBJECT_PARENT`: the parent handle is not valid.
pub const NV_ERR_INVALID_OBJECT_PARENT: RmStatus = RmStatus(0x36);
/// `NV_ERR_INVALID_OPERATION`: the operation is not valid here.
pub const NV_ERR_INVALID_OPERATION: RmStatus = RmStatus(0x38);
/// `NV_ERR_INVALID_OWNER`: the caller does not own the object.
pub const NV_ERR_INVALID_OWNER: RmStatus = RmStatus(0x39);
/// `NV_ERR_INVALID_PARAM_STRUCT`: the parameter struct size does not match what this driver expects (ABI mismatch).
pub const NV_ERR_INVALID_PARAM_STRUCT: RmStatus = RmStatus(0x3a);
/// `NV_ERR_INVALID_PARAMETER`: a parameter is not valid.
pub const NV_ERR_INVALID_PARAMETER: RmStatus = RmStatus(0x3b);
/// `NV_ERR_INVALID_POINTER`: a pointer is not valid.
pub const NV_ERR_INVALID_POINTER: RmStatus = RmStatus(0x3d);
/// `NV_ERR_INVALID_REQUEST`: the request is not valid.
pub const NV_ERR_INVALID_REQUEST: RmStatus = RmStatus(0x3f);
/// `NV_ERR_INVALID_STATE`: the object is in a state that does not allow this call.
pub const NV_ERR_INVALID_STATE: RmStatus = RmStatus(0x40);
/// `NV_ERR_NO_FREE_FIFOS`: no free channels left on this GPU.
pub const NV_ERR_NO_FREE_FIFOS: RmStatus = RmStatus(0x4f);
/// `NV_ERR_NO_MEMORY`: RM ran out of memory.
pub const NV_ERR_NO_MEMORY: RmStatus = RmStatus(0x51);
/// `NV_ERR_NOT_COMPATIBLE`: not compatible (e.g. user-space and kernel driver versions differ).
pub const NV_ERR_NOT_COMPATIBLE: RmStatus = RmStatus(0x54);
/// `NV_ERR_NOT_READY`: the GPU or RM is not ready.
pub const NV_ERR_NOT_READY: RmStatus = RmStatus(0x55);
/// `NV_ERR_NOT_SUPPORTED`: not supported by this GPU, driver or configuration.
pub const NV_ERR_NOT_SUPPORTED: RmStatus = RmStatus(0x56);
/// `NV_ERR_OBJECT_NOT_FOUND`: the object was not found.
pub const NV_ERR_OBJECT_NOT_FOUND: RmStatus = RmStatus(0x57);
/// `NV_ERR_OBJECT_TYPE_MISMATCH`: the handle names an object of another class (e.g. a TSG where a channel was expected).
pub const NV_ERR_OBJECT_TYPE_MISMATCH: RmStatus = RmStatus(0x58);
/// `NV_ERR_OPERATING_SYSTEM`: the kernel refused an operation RM needed (see dmesg).
pub const NV_ERR_OPERATING_SYSTEM: RmStatus = RmStatus(0x59);
/// `NV_ERR_OUT_OF_RANGE`: a value is out of range.
pub const NV_ERR_OUT_OF_RANGE: RmStatus = RmStatus(0x5b);
/// `NV_ERR_PROTECTION_FAULT`: protection fault.
pub const NV_ERR_PROTECTION_FAULT: RmStatus = RmStatus(0x5e);
/// `NV_ERR_RESET_REQUIRED`: the GPU needs a reset.
pub const NV_ERR_RESET_REQUIRED: RmStatus = RmStatus(0x5f);
/// `NV_ERR_TIMEOUT`: RM timed out (e.g. a preemption did not finish).
pub const NV_ERR_TIMEOUT: RmStatus = RmStatus(0x60);

/// Every status code Valve knows by name, in numeric order.
pub const STATUS_TABLE: &[StatusInfo] = &[
    StatusInfo { code: 0x00, name: "NV_OK", meaning: "success" },
    StatusInfo { code: 0x01, name: "NV_ERR_GENERIC", meaning: "unspecified failure inside RM; check the kernel log (dmesg) for NVRM lines" },
    StatusInfo { code: 0x02, name: "NV_ERR_BROKEN_FB", meaning: "the GPU's frame buffer is not usable" },
    StatusInfo { code: 0x03, name: "NV_ERR_BUFFER_TOO_SMALL", meaning: "the parameter buffer is too small for the answer" },
    StatusInfo { code: 0x04, name: "NV_ERR_BUSY_RETRY", meaning: "RM is busy; retry the call" },
    StatusInfo { code: 0x06, name: "NV_ERR_CARD_NOT_PRESENT", meaning: "the GPU is not present (fallen off the bus or not attached)" },
    StatusInfo { code: 0x0c, name: "NV_ERR_ECC_ERROR", meaning: "an uncorrectable ECC error was hit" },
    StatusInfo { code: 0x0d, name: "NV_ERR_FIFO_BAD_ACCESS", meaning: "bad access to the FIFO (channel) engine" },
    StatusInfo { code: 0x10, name: "NV_ERR_GPU_IS_LOST", meaning: "the GPU is lost (Xid 79 class failure); it needs a reset by its owner" },
    StatusInfo { code: 0x11, name: "NV_ERR_GPU_IN_FULLCHIP_RESET", meaning: "the GPU is being reset" },
    StatusInfo { code: 0x12, name: "NV_ERR_GPU_NOT_FULL_POWER", meaning: "the GPU is not at full power" },
    StatusInfo { code: 0x17, name: "NV_ERR_ILLEGAL_ACTION", meaning: "the action is not allowed in the object's current state" },
    StatusInfo { code: 0x18, name: "NV_ERR_IN_USE", meaning: "the object or resource is in use" },
    StatusInfo { code: 0x1b, name: "NV_ERR_INSUFFICIENT_PERMISSIONS", meaning: "the caller lacks the rights for this object (e.g. duplicating another process's object)" },
    StatusInfo { code: 0x1e, name: "NV_ERR_INVALID_ADDRESS", meaning: "a user pointer in the parameters is not valid" },
    StatusInfo { code: 0x1f, name: "NV_ERR_INVALID_ARGUMENT", meaning: "a parameter is out of range (e.g. too many channels, a nonzero kernel-only field)" },
    StatusInfo { code: 0x21, name: "NV_ERR_INVALID_CHANNEL", meaning: "no such channel under that client on this GPU: the handle is wrong, freed, or belongs to another GPU" },
    StatusInfo { code: 0x22, name: "NV_ERR_INVALID_CLASS", meaning: "the class id is not supported by this GPU or driver" },
    StatusInfo { code: 0x23, name: "NV_ERR_INVALID_CLIENT", meaning: "no such client: the process exited, freed it, or the handle is wrong" },
    StatusInfo { code: 0x24, name: "NV_ERR_INVALID_COMMAND", meaning: "the control id is not known to this object" },
    StatusInfo { code: 0x25, name: "NV_ERR_INVALID_DATA", meaning: "the data passed is not valid" },
    StatusInfo { code: 0x26, name: "NV_ERR_INVALID_DEVICE", meaning: "no such device (wrong device instance)" },
    StatusInfo { code: 0x29, name: "NV_ERR_INVALID_FLAGS", meaning: "flags not valid for this call" },
    StatusInfo { code: 0x2c, name: "NV_ERR_INVALID_INDEX", meaning: "an index is out of range" },
    StatusInfo { code: 0x2f, name: "NV_ERR_INVALID_LOCK_STATE", meaning: "RM lock state does not allow this call" },
    StatusInfo { code: 0x30, name: "NV_ERR_INVALID_METHOD", meaning: "invalid method" },
    StatusInfo { code: 0x31, name: "NV_ERR_INVALID_OBJECT", meaning: "the object is not valid for this call" },
    StatusInfo { code: 0x33, name: "NV_ERR_INVALID_OBJECT_HANDLE", meaning: "no object with that handle" },
    StatusInfo { code: 0x34, name: "NV_ERR_INVALID_OBJECT_NEW", meaning: "the new handle is invalid or already in use" },
    StatusInfo { code: 0x35, name: "NV_ERR_INVALID_OBJECT_OLD", meaning: "the handle to free is not valid" },
    StatusInfo { code: 0x36, name: "NV_ERR_INVALID_OBJECT_PARENT", meaning: "the parent handle is not valid" },
    StatusInfo { code: 0x38, name: "NV_ERR_INVALID_OPERATION", meaning: "the operation is not valid here" },
    StatusInfo { code: 0x39, name: "NV_ERR_INVALID_OWNER", meaning: "the caller does not own the object" },
    StatusInfo { code: 0x3a, name: "NV_ERR_INVALID_PARAM_STRUCT", meaning: "the parameter struct size does not match what this driver expects (ABI mismatch)" },
    StatusInfo { code: 0x3b, name: "NV_ERR_INVALID_PARAMETER", meaning: "a parameter is not valid" },
    StatusInfo { code: 0x3d, name: "NV_ERR_INVALID_POINTER", meaning: "a pointer is not valid" },
    StatusInfo { code: 0x3f, name: "NV_ERR_INVALID_REQUEST", meaning: "the request is not valid" },
    StatusInfo { code: 0x40, name: "NV_ERR_INVALID_STATE", meaning: "the object is in a state that does not allow this call" },
    StatusInfo { code: 0x4f, name: "NV_ERR_NO_FREE_FIFOS", meaning: "no free channels left on this GPU" },
    StatusInfo { code: 0x51, name: "NV_ERR_NO_MEMORY", meaning: "RM ran out of memory" },
    StatusInfo { code: 0x54, name: "NV_ERR_NOT_COMPATIBLE", meaning: "not compatible (e.g. user-space and kernel driver versions differ)" },
    StatusInfo { code: 0x55, name: "NV_ERR_NOT_READY", meaning: "the GPU or RM is not ready" },
    StatusInfo { code: 0x56, name: "NV_ERR_NOT_SUPPORTED", meaning: "not supported by this GPU, driver or configuration" },
    StatusInfo { code: 0x57, name: "NV_ERR_OBJECT_NOT_FOUND", meaning: "the object was not found" },
    StatusInfo { code: 0x58, name: "NV_ERR_OBJECT_TYPE_MISMATCH", meaning: "the handle names an object of another class (e.g. a TSG where a channel was expected)" },
    StatusInfo { code: 0x59, name: "NV_ERR_OPERATING_SYSTEM", meaning: "the kernel refused an operation RM needed (see dmesg)" },
    StatusInfo { code: 0x5b, name: "NV_ERR_OUT_OF_RANGE", meaning: "a value is out of range" },
    StatusInfo { code: 0x5e, name: "NV_ERR_PROTECTION_FAULT", meaning: "protection fault" },
    StatusInfo { code: 0x5f, name: "NV_ERR_RESET_REQUIRED", meaning: "the GPU needs a reset" },
    StatusInfo { code: 0x60, name: "NV_ERR_TIMEOUT", meaning: "RM timed out (e.g. a preemption did not finish)" },
];

impl RmStatus {
    /// The table entry for this code, if it is one Valve knows.
    pub fn info(self) -> Option<&'static StatusInfo> {
        STATUS_TABLE.iter().find(|s| s.code == self.0)
    }

    /// NVIDIA's name of the code, if known.
    pub fn name(self) -> Option<&'static str> {
        self.info().map(|s| s.name)
    }
}

impl core::fmt::Display for RmStatus {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.info() {
            Some(s) => write!(f, "{} ({:#x})", s.name, self.0),
            None => write!(f, "RM status {:#x}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_sorted_unique_and_matches_the_consts() {
        assert!(STATUS_TABLE.windows(2).all(|w| w[0].code < w[1].code));
        assert_eq!(
            NV_ERR_INVALID_CHANNEL.name(),
            Some("NV_ERR_INVALID_CHANNEL")
        );
        assert_eq!(NV_ERR_INVALID_CLIENT.0, 0x23);
        assert_eq!(NV_ERR_INSUFFICIENT_PERMISSIONS.0, 0x1B);
        assert_eq!(NV_ERR_OBJECT_NOT_FOUND.0, 0x57);
        assert_eq!(NV_ERR_INVALID_ARGUMENT.0, 0x1F);
        assert_eq!(NV_OK.0, 0);
    }

    #[test]
    fn display_names_known_and_unknown_codes() {
        assert_eq!(
            NV_ERR_INVALID_CHANNEL.to_string(),
            "NV_ERR_INVALID_CHANNEL (0x21)"
        );
        assert_eq!(RmStatus(0x1234).to_string(), "RM status 0x1234");
    }
}
