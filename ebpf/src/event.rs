//! Typed RM events decoded from the BPF ring buffer: an object allocated, an object freed,
//! a process gone. `RawEvent` mirrors `struct rm_event` of `src/bpf/rm_watch.bpf.c` byte for byte.

use valve_ioctl_bindings::{ClientHandle, ObjectHandle};

/// Size of `struct rm_event` in the BPF program.
pub const RAW_EVENT_SIZE: usize = 48;

const KIND_ALLOC: u32 = 1;
const KIND_FREE: u32 = 2;
const KIND_EXIT: u32 = 3;
const FLAG_NVOS64: u32 = 1;
const FLAG_EXTRA_VALID: u32 = 2;

/// One observation: who did it, when, and what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmEvent {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) when the syscall returned.
    pub ts_ns: u64,
    /// Process id (thread-group id).
    pub pid: u32,
    /// Thread id of the caller (equals `pid` for exits).
    pub tid: u32,
    /// What happened.
    pub kind: RmEventKind,
}

/// What an [`RmEvent`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmEventKind {
    /// A successful `RM_ALLOC` (ioctl returned 0 and RM status 0).
    Alloc(AllocEvent),
    /// A successful `RM_FREE`.
    Free(FreeEvent),
    /// The whole thread group of `pid` exited.
    Exit,
}

/// A successful `RM_ALLOC`, as RM left the struct on return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocEvent {
    /// `hRoot`: the client the object belongs to (for a root-client alloc as passed in, often 0).
    pub client: ClientHandle,
    /// `hObjectParent`.
    pub parent: ObjectHandle,
    /// `hObjectNew`: the new object's handle (for a root client: the kernel-assigned client handle).
    pub object: ObjectHandle,
    /// `hClass`.
    pub class: u32,
    /// For `NV01_DEVICE_0`: `deviceId` (the RM device instance); for `NV20_SUBDEVICE_0`:
    /// `subDeviceId`. `None` for other classes or when the params could not be read.
    pub extra: Option<u32>,
    /// Minor number of the device file the ioctl went to (255 = nvidiactl).
    pub minor: u32,
    /// The 48-byte `NVOS64` form (CUDA 13) rather than the 32-byte `NVOS21` form.
    pub nvos64: bool,
}

/// A successful `RM_FREE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreeEvent {
    /// `hRoot`.
    pub client: ClientHandle,
    /// `hObjectParent`.
    pub parent: ObjectHandle,
    /// `hObjectOld`: the freed object (equal to `client` when the client itself is freed).
    pub object: ObjectHandle,
    /// Minor number of the device file the ioctl went to.
    pub minor: u32,
}

/// A ring-buffer record that could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than `struct rm_event`.
    #[error("BPF event of {0} bytes, expected {RAW_EVENT_SIZE}")]
    Short(usize),
    /// Unknown `kind` field.
    #[error("BPF event of unknown kind {0}")]
    UnknownKind(u32),
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

impl RmEvent {
    /// Decodes one `struct rm_event` record (native byte order, as the ring buffer holds it).
    pub fn decode(b: &[u8]) -> Result<RmEvent, DecodeError> {
        if b.len() < RAW_EVENT_SIZE {
            return Err(DecodeError::Short(b.len()));
        }
        let mut ts = [0u8; 8];
        ts.copy_from_slice(&b[0..8]);
        let ts_ns = u64::from_ne_bytes(ts);
        let kind = u32_at(b, 8);
        let pid = u32_at(b, 12);
        let tid = u32_at(b, 16);
        let h_root = u32_at(b, 20);
        let h_parent = u32_at(b, 24);
        let h_object = u32_at(b, 28);
        let h_class = u32_at(b, 32);
        let extra = u32_at(b, 36);
        let minor = u32_at(b, 40);
        let flags = u32_at(b, 44);
        let kind = match kind {
            KIND_ALLOC => RmEventKind::Alloc(AllocEvent {
                client: ClientHandle(h_root),
                parent: ObjectHandle(h_parent),
                object: ObjectHandle(h_object),
                class: h_class,
                extra: (flags & FLAG_EXTRA_VALID != 0).then_some(extra),
                minor,
                nvos64: flags & FLAG_NVOS64 != 0,
            }),
            KIND_FREE => RmEventKind::Free(FreeEvent {
                client: ClientHandle(h_root),
                parent: ObjectHandle(h_parent),
                object: ObjectHandle(h_object),
                minor,
            }),
            KIND_EXIT => RmEventKind::Exit,
            k => return Err(DecodeError::UnknownKind(k)),
        };
        Ok(RmEvent {
            ts_ns,
            pid,
            tid,
            kind,
        })
    }
}

impl core::fmt::Display for RmEvent {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "pid {} tid {}: ", self.pid, self.tid)?;
        match &self.kind {
            RmEventKind::Alloc(a) => {
                write!(
                    f,
                    "alloc client {} parent {} object {} class {:#06x}",
                    a.client, a.parent, a.object, a.class
                )?;
                if let Some(x) = a.extra {
                    write!(f, " param0 {x}")?;
                }
                write!(f, " (minor {})", a.minor)
            }
            RmEventKind::Free(x) => write!(
                f,
                "free client {} parent {} object {} (minor {})",
                x.client, x.parent, x.object, x.minor
            ),
            RmEventKind::Exit => write!(f, "exit"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(words: [u32; 10], ts: u64) -> Vec<u8> {
        let mut v = ts.to_ne_bytes().to_vec();
        for w in words {
            v.extend_from_slice(&w.to_ne_bytes());
        }
        v
    }

    #[test]
    fn decodes_device_alloc_with_instance() {
        let b = raw(
            [
                KIND_ALLOC,
                10,
                11,
                0xc1d0_0001,
                0xc1d0_0001,
                0x5c00_0001,
                0x80,
                2,
                255,
                3,
            ],
            77,
        );
        let e = RmEvent::decode(&b).unwrap();
        assert_eq!(e.ts_ns, 77);
        assert_eq!((e.pid, e.tid), (10, 11));
        let RmEventKind::Alloc(a) = e.kind else {
            panic!("{e:?}")
        };
        assert_eq!(a.client, ClientHandle(0xc1d0_0001));
        assert_eq!(a.object, ObjectHandle(0x5c00_0001));
        assert_eq!(a.class, 0x80);
        assert_eq!(a.extra, Some(2));
        assert!(a.nvos64);
        assert_eq!(a.minor, 255);
    }

    #[test]
    fn extra_is_none_without_flag_and_free_exit_decode() {
        let b = raw([KIND_ALLOC, 1, 1, 1, 2, 3, 0xa06c, 9, 0, 0], 0);
        let RmEventKind::Alloc(a) = RmEvent::decode(&b).unwrap().kind else {
            panic!()
        };
        assert_eq!(a.extra, None);
        assert!(!a.nvos64);
        let b = raw([KIND_FREE, 1, 2, 5, 6, 7, 0, 0, 0, 0], 0);
        assert!(matches!(
            RmEvent::decode(&b).unwrap().kind,
            RmEventKind::Free(FreeEvent {
                object: ObjectHandle(7),
                ..
            })
        ));
        let b = raw([KIND_EXIT, 1, 1, 0, 0, 0, 0, 0, 0, 0], 0);
        assert_eq!(RmEvent::decode(&b).unwrap().kind, RmEventKind::Exit);
    }

    #[test]
    fn rejects_short_and_unknown() {
        assert_eq!(RmEvent::decode(&[0; 8]), Err(DecodeError::Short(8)));
        let b = raw([9, 0, 0, 0, 0, 0, 0, 0, 0, 0], 0);
        assert_eq!(RmEvent::decode(&b), Err(DecodeError::UnknownKind(9)));
    }
}
