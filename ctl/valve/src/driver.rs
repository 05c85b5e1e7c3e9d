//! The ioctl layer: the [`RmDriver`] trait (RM alloc/control/free, card info, device-file
//! registration) and [`NvDriver`], its implementation on the real `/dev/nvidia*` files.

use std::any::Any;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::errno::Errno;
use valve_ioctl_bindings::{
    self as b, CardInfo, ClientHandle, Nv0000GetAttachedIdsParams, Nv0000GetIdInfoV2Params,
    Nv0080AllocParams, Nv2080AllocParams, Nv2080FifoDisableChannelsParams, Nv2080GetGidInfoParams,
    Nv2080GetNameStringParams, Nv208fAllocParams, Nv208fGetChannelStateParams, Nvos00Free,
    Nvos54Control, Nvos64Alloc, ObjectHandle, RegisterFd, RmStatus, MAX_CARDS,
};

use crate::error::{Error, Result};

/// A control's parameter struct, tied to its control id. Implemented only for plain-data
/// `#[repr(C)]` structs of the bindings crate, so passing `&mut P` to RM is sound.
pub trait ControlParams: Copy + Any + Send {
    /// The control id (`NVOS54.cmd`).
    const CMD: u32;
}

/// An allocation's parameter struct, tied to its class.
pub trait AllocParams: Copy + Any + Send {
    /// The class id (`hClass`).
    const CLASS: u32;
}

macro_rules! control {
    ($ty:ty, $cmd:expr) => {
        impl ControlParams for $ty {
            const CMD: u32 = $cmd;
        }
    };
}
control!(
    Nv0000GetAttachedIdsParams,
    b::NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS
);
control!(
    Nv0000GetIdInfoV2Params,
    b::NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2
);
control!(
    Nv2080GetNameStringParams,
    b::NV2080_CTRL_CMD_GPU_GET_NAME_STRING
);
control!(Nv2080GetGidInfoParams, b::NV2080_CTRL_CMD_GPU_GET_GID_INFO);
control!(
    Nv2080FifoDisableChannelsParams,
    b::NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS
);

control!(
    Nv208fGetChannelStateParams,
    b::NV208F_CTRL_CMD_FIFO_GET_CHANNEL_STATE
);

impl AllocParams for Nv208fAllocParams {
    const CLASS: u32 = b::NV20_SUBDEVICE_DIAG;
}
impl AllocParams for Nv0080AllocParams {
    const CLASS: u32 = b::NV01_DEVICE_0;
}
impl AllocParams for Nv2080AllocParams {
    const CLASS: u32 = b::NV20_SUBDEVICE_0;
}

/// Why one RM call failed: the ioctl itself, or RM's status.
#[derive(Debug)]
pub enum RmCallError {
    /// The ioctl returned -1 (bad fd, size mismatch, ...).
    Os(Errno),
    /// The ioctl succeeded but RM wrote a non-OK status.
    Rm(RmStatus),
}

impl RmCallError {
    /// Turns this into the library error, naming the operation.
    pub fn into_error(self, op: impl Into<String>) -> Error {
        match self {
            RmCallError::Os(errno) => Error::Os {
                op: op.into(),
                source: std::io::Error::from(errno),
            },
            RmCallError::Rm(status) => Error::rm(op, status),
        }
    }
}

/// The RM operations Valve needs. [`NvDriver`] is the real one; unit tests use an in-memory fake.
pub trait RmDriver: Send + Sync + 'static {
    /// Allocates a root client; RM picks the handle.
    fn alloc_root_client(&self) -> Result<ClientHandle, RmCallError>;
    /// Allocates `new` of class `P::CLASS` under `parent`.
    fn alloc<P: AllocParams>(
        &self,
        client: ClientHandle,
        parent: ObjectHandle,
        new: ObjectHandle,
        params: &mut P,
    ) -> Result<(), RmCallError>;
    /// Runs control `P::CMD` on `object`.
    fn control<P: ControlParams>(
        &self,
        client: ClientHandle,
        object: ObjectHandle,
        params: &mut P,
    ) -> Result<(), RmCallError>;
    /// Frees `object` (and everything under it).
    fn free(
        &self,
        client: ClientHandle,
        parent: ObjectHandle,
        object: ObjectHandle,
    ) -> Result<(), RmCallError>;
    /// The GPUs the driver probed (CARD_INFO).
    fn card_info(&self) -> Result<Vec<CardInfo>, RmCallError>;
    /// Opens `/dev/nvidia<minor>` and ties it to this driver's control fd (REGISTER_FD); needed
    /// before a device object for that GPU can be allocated.
    fn register_device_file(&self, minor: u32) -> Result<(), Error>;
}

/// A shared driver is a driver (e.g. one `NvDriver` behind several controllers, or tests).
impl<T: RmDriver> RmDriver for std::sync::Arc<T> {
    fn alloc_root_client(&self) -> Result<ClientHandle, RmCallError> {
        (**self).alloc_root_client()
    }
    fn alloc<P: AllocParams>(
        &self,
        client: ClientHandle,
        parent: ObjectHandle,
        new: ObjectHandle,
        params: &mut P,
    ) -> Result<(), RmCallError> {
        (**self).alloc(client, parent, new, params)
    }
    fn control<P: ControlParams>(
        &self,
        client: ClientHandle,
        object: ObjectHandle,
        params: &mut P,
    ) -> Result<(), RmCallError> {
        (**self).control(client, object, params)
    }
    fn free(
        &self,
        client: ClientHandle,
        parent: ObjectHandle,
        object: ObjectHandle,
    ) -> Result<(), RmCallError> {
        (**self).free(client, parent, object)
    }
    fn card_info(&self) -> Result<Vec<CardInfo>, RmCallError> {
        (**self).card_info()
    }
    fn register_device_file(&self, minor: u32) -> Result<(), Error> {
        (**self).register_device_file(minor)
    }
}

/// The RM ioctls as nix wrappers: `unsafe fn`s whose callers vouch for the argument they pass.
mod sys {
    use super::{b, CardInfo, Nvos00Free, Nvos54Control, Nvos64Alloc, RegisterFd};

    nix::ioctl_readwrite!(
        ioctl_rm_free,
        b::NV_IOCTL_MAGIC,
        b::NV_ESC_RM_FREE,
        Nvos00Free
    );
    nix::ioctl_readwrite!(
        ioctl_rm_control,
        b::NV_IOCTL_MAGIC,
        b::NV_ESC_RM_CONTROL,
        Nvos54Control
    );
    nix::ioctl_readwrite!(
        ioctl_rm_alloc,
        b::NV_IOCTL_MAGIC,
        b::NV_ESC_RM_ALLOC,
        Nvos64Alloc
    );
    nix::ioctl_readwrite!(
        ioctl_register_fd,
        b::NV_IOCTL_MAGIC,
        b::NV_ESC_REGISTER_FD,
        RegisterFd
    );
    nix::ioctl_readwrite_buf!(
        ioctl_card_info,
        b::NV_IOCTL_MAGIC,
        b::NV_ESC_CARD_INFO,
        CardInfo
    );
}
use sys::{ioctl_card_info, ioctl_register_fd, ioctl_rm_alloc, ioctl_rm_control, ioctl_rm_free};

/// Where the NVIDIA device files live.
pub const DEV_DIR: &str = "/dev";
/// The control device every RM client is opened on.
pub const NVIDIACTL: &str = "/dev/nvidiactl";
/// The driver's version file.
pub const PROC_VERSION: &str = "/proc/driver/nvidia/version";

/// The real driver: `/dev/nvidiactl` plus the per-GPU device files registered with it.
pub struct NvDriver {
    ctl: File,
    device_files: Mutex<HashMap<u32, File>>,
}

fn open_device_file(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::DriverMissing {
                path: path.to_path_buf(),
            },
            std::io::ErrorKind::PermissionDenied => Error::Permission {
                path: path.to_path_buf(),
            },
            _ => Error::Os {
                op: format!("opening {}", path.display()),
                source: e,
            },
        })
}

fn rm_result(ret: nix::Result<libc::c_int>, status: u32) -> Result<(), RmCallError> {
    ret.map_err(RmCallError::Os)?;
    if status != 0 {
        return Err(RmCallError::Rm(RmStatus(status)));
    }
    Ok(())
}

impl NvDriver {
    /// Opens `/dev/nvidiactl`.
    pub fn open() -> Result<Self> {
        Ok(NvDriver {
            ctl: open_device_file(Path::new(NVIDIACTL))?,
            device_files: Mutex::new(HashMap::new()),
        })
    }
}

impl NvDriver {
    /// The `/dev/nvidiactl` descriptor (for the hardware test's bare-ioctl baseline).
    pub fn control_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.ctl.as_fd()
    }
}

impl RmDriver for NvDriver {
    fn alloc_root_client(&self) -> Result<ClientHandle, RmCallError> {
        let mut args = Nvos64Alloc {
            h_class: b::NV01_ROOT_CLIENT,
            ..Default::default()
        };
        // SAFETY: `args` is a live, exclusively borrowed NVOS64 whose size matches the request
        // code; a root-client alloc takes no params (null pointer, size 0), so the driver reads
        // and writes only `args`.
        let ret = unsafe { ioctl_rm_alloc(self.ctl.as_raw_fd(), &mut args) };
        rm_result(ret, args.status)?;
        Ok(ClientHandle(args.h_object_new.0))
    }

    fn alloc<P: AllocParams>(
        &self,
        client: ClientHandle,
        parent: ObjectHandle,
        new: ObjectHandle,
        params: &mut P,
    ) -> Result<(), RmCallError> {
        let mut args = Nvos64Alloc {
            h_root: client,
            h_object_parent: parent,
            h_object_new: new,
            h_class: P::CLASS,
            p_alloc_parms: params as *mut P as u64,
            params_size: std::mem::size_of::<P>() as u32,
            ..Default::default()
        };
        // SAFETY: `args` is a live NVOS64 matching the request size; `p_alloc_parms` points to
        // `params`, a plain-data #[repr(C)] struct of exactly `params_size` bytes that is
        // exclusively borrowed for the duration of the call (AllocParams is only implemented
        // for the class's own parameter struct).
        let ret = unsafe { ioctl_rm_alloc(self.ctl.as_raw_fd(), &mut args) };
        rm_result(ret, args.status)
    }

    fn control<P: ControlParams>(
        &self,
        client: ClientHandle,
        object: ObjectHandle,
        params: &mut P,
    ) -> Result<(), RmCallError> {
        let mut args = Nvos54Control {
            h_client: client,
            h_object: object,
            cmd: P::CMD,
            flags: 0,
            params: params as *mut P as u64,
            params_size: std::mem::size_of::<P>() as u32,
            status: 0,
        };
        // SAFETY: `args` is a live NVOS54 matching the request size; `params` points to the
        // control's own plain-data #[repr(C)] parameter struct (ControlParams ties struct and
        // command), exclusively borrowed and exactly `params_size` bytes long.
        let ret = unsafe { ioctl_rm_control(self.ctl.as_raw_fd(), &mut args) };
        rm_result(ret, args.status)
    }

    fn free(
        &self,
        client: ClientHandle,
        parent: ObjectHandle,
        object: ObjectHandle,
    ) -> Result<(), RmCallError> {
        let mut args = Nvos00Free {
            h_root: client,
            h_object_parent: parent,
            h_object_old: object,
            status: 0,
        };
        // SAFETY: `args` is a live NVOS00 matching the request size; it holds no pointers.
        let ret = unsafe { ioctl_rm_free(self.ctl.as_raw_fd(), &mut args) };
        rm_result(ret, args.status)
    }

    fn card_info(&self) -> Result<Vec<CardInfo>, RmCallError> {
        let mut cards = [CardInfo::default(); MAX_CARDS];
        // SAFETY: the buffer is a live array of plain-data CardInfo; the request encodes its
        // full byte size, which bounds what the driver writes.
        let ret = unsafe { ioctl_card_info(self.ctl.as_raw_fd(), &mut cards) };
        ret.map_err(RmCallError::Os)?;
        Ok(cards.into_iter().filter(|c| c.valid != 0).collect())
    }

    fn register_device_file(&self, minor: u32) -> Result<(), Error> {
        let mut files = self.device_files.lock().unwrap_or_else(|p| p.into_inner());
        if files.contains_key(&minor) {
            return Ok(());
        }
        let path = PathBuf::from(format!("{DEV_DIR}/nvidia{minor}"));
        let file = open_device_file(&path)?;
        let mut args = RegisterFd {
            ctl_fd: self.ctl.as_raw_fd(),
        };
        // SAFETY: `args` is a live RegisterFd (one int) matching the request size; the ctl fd it
        // names stays open as long as `self`, which also keeps `file` open.
        let ret = unsafe { ioctl_register_fd(file.as_raw_fd(), &mut args) };
        ret.map_err(|e| Error::Os {
            op: format!("registering {} with {NVIDIACTL}", path.display()),
            source: e.into(),
        })?;
        files.insert(minor, file);
        Ok(())
    }
}

/// What `/proc/driver/nvidia/version` says about the loaded driver.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DriverInfo {
    /// The driver version, e.g. `580.159.04`.
    pub version: String,
    /// Whether it is the open kernel module.
    pub open_module: bool,
    /// The full first line.
    pub banner: String,
}

impl DriverInfo {
    /// Reads the running driver's version file.
    pub fn read() -> Result<Self> {
        match std::fs::read_to_string(PROC_VERSION) {
            Ok(text) => Ok(Self::parse(&text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::DriverMissing {
                path: PROC_VERSION.into(),
            }),
            Err(e) => Err(Error::Os {
                op: format!("reading {PROC_VERSION}"),
                source: e,
            }),
        }
    }

    /// Parses the version file's text. The open module's banner says "Open Kernel Module".
    pub fn parse(text: &str) -> Self {
        let banner = text.lines().next().unwrap_or("").trim().to_string();
        let version = banner
            .split_whitespace()
            .find(|w| {
                w.split('.').count() >= 2
                    && w.split('.')
                        .all(|p| p.chars().all(|c| c.is_ascii_digit()) && !p.is_empty())
            })
            .unwrap_or("unknown")
            .to_string();
        DriverInfo {
            open_module: banner.contains("Open Kernel Module"),
            version,
            banner,
        }
    }

    /// Fails with [`Error::NotOpenModule`] for the proprietary module.
    pub fn require_open(&self) -> Result<()> {
        if self.open_module {
            Ok(())
        } else {
            Err(Error::NotOpenModule {
                version: self.banner.clone(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nix_request_codes_equal_the_bindings() {
        assert_eq!(
            nix::request_code_readwrite!(b'F', b::NV_ESC_RM_CONTROL, 32),
            b::NV_IOCTL_RM_CONTROL
        );
        assert_eq!(
            nix::request_code_readwrite!(
                b::NV_IOCTL_MAGIC,
                b::NV_ESC_RM_ALLOC,
                std::mem::size_of::<Nvos64Alloc>()
            ),
            b::NV_IOCTL_RM_ALLOC_NVOS64
        );
    }

    #[test]
    fn driver_banner_parsing() {
        let open = DriverInfo::parse(
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)  Thu Oct  2 2025\nGCC version: gcc 12\n",
        );
        assert!(open.open_module);
        assert_eq!(open.version, "580.159.04");
        assert!(open.require_open().is_ok());
        let prop = DriverInfo::parse(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n",
        );
        assert!(!prop.open_module);
        assert_eq!(prop.version, "535.104.05");
        let err = prop.require_open().unwrap_err().to_string();
        assert!(
            err.contains("proprietary") && err.contains("open kernel module"),
            "{err}"
        );
    }

    #[test]
    fn missing_device_file_is_driver_missing() {
        let err = open_device_file(Path::new("/nonexistent/nvidiactl")).unwrap_err();
        assert!(matches!(err, Error::DriverMissing { .. }), "{err:?}");
        assert!(err.to_string().contains("driver is not loaded"));
    }

    #[test]
    fn rm_status_becomes_a_named_error() {
        let e = RmCallError::Rm(b::NV_ERR_INVALID_CHANNEL).into_error("disable");
        let text = e.to_string();
        assert!(text.contains("NV_ERR_INVALID_CHANNEL (0x21)"), "{text}");
        assert_eq!(e.rm_status(), Some(b::NV_ERR_INVALID_CHANNEL));
    }
}
