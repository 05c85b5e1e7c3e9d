//! GPU enumeration: joins RM's attached GPU ids, their RM device instances and CARD_INFO's
//! device-file minors and PCI addresses (minor != instance on multi-GPU hosts), plus GPU selectors.

use std::str::FromStr;

use serde::Serialize;
use valve_ioctl_bindings::{
    CardInfo, ClientHandle, Nv0000GetAttachedIdsParams, Nv0000GetIdInfoV2Params, INVALID_GPU_ID,
};

use crate::driver::RmDriver;
use crate::error::{Error, Result};

/// One GPU as Valve sees it. `index` orders GPUs by PCI address, as `nvidia-smi` does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// Valve's index: position in PCI-address order (same as nvidia-smi's default numbering).
    pub index: usize,
    /// RM's GPU id (from GET_ATTACHED_IDS).
    pub gpu_id: u32,
    /// RM device instance: the `deviceId` of a device allocation.
    pub device_instance: u32,
    /// N of `/dev/nvidiaN`.
    pub minor: u32,
    /// PCI address, `dddd:bb:ss.f`.
    pub pci_bus_id: String,
    /// PCI device id.
    pub pci_device_id: u16,
    /// `GPU-xxxxxxxx-...`, empty if RM did not say.
    pub uuid: String,
    /// Marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
}

/// The part of enumeration that needs only the client: ids, instances, minors, PCI.
pub(crate) fn enumerate<D: RmDriver>(rm: &D, client: ClientHandle) -> Result<Vec<GpuInfo>> {
    let mut ids = Nv0000GetAttachedIdsParams::default();
    rm.control(client, client.into(), &mut ids)
        .map_err(|e| e.into_error("listing attached GPUs (GET_ATTACHED_IDS)"))?;
    let cards = rm
        .card_info()
        .map_err(|e| e.into_error("reading the driver's card list (CARD_INFO)"))?;
    let mut gpus = Vec::new();
    for &gpu_id in ids.gpu_ids.iter().take_while(|&&id| id != INVALID_GPU_ID) {
        let mut info = Nv0000GetIdInfoV2Params {
            gpu_id,
            ..Default::default()
        };
        rm.control(client, client.into(), &mut info)
            .map_err(|e| e.into_error(format!("reading GPU {gpu_id:#x} info (GET_ID_INFO_V2)")))?;
        let card = cards.iter().find(|c| c.gpu_id == gpu_id).ok_or_else(|| {
            Error::rm(
                format!("GPU id {gpu_id:#x} is attached but missing from CARD_INFO"),
                valve_ioctl_bindings::NV_ERR_OBJECT_NOT_FOUND,
            )
        })?;
        gpus.push(GpuInfo {
            index: 0,
            gpu_id,
            device_instance: info.device_instance,
            minor: card.minor_number,
            pci_bus_id: pci_bus_id(card),
            pci_device_id: card.pci_device_id,
            uuid: String::new(),
            name: String::new(),
        });
    }
    gpus.sort_by(|a, b| a.pci_bus_id.cmp(&b.pci_bus_id));
    for (i, g) in gpus.iter_mut().enumerate() {
        g.index = i;
    }
    Ok(gpus)
}

/// `dddd:bb:ss.f` as nvidia-smi and sysfs print it (lower case, 4-digit domain).
pub fn pci_bus_id(card: &CardInfo) -> String {
    format!(
        "{:04x}:{:02x}:{:02x}.{:x}",
        card.pci_domain, card.pci_bus, card.pci_slot, card.pci_function
    )
}

/// Text from a NUL-terminated byte buffer RM filled.
pub(crate) fn c_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&c| c == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).trim().to_string()
}

/// How a user names a GPU: Valve/nvidia-smi index, UUID (or a unique prefix), or PCI address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuSelector {
    /// `0`, `1`, ...
    Index(usize),
    /// `GPU-4c7f...` (a unique prefix is enough).
    Uuid(String),
    /// `0000:18:00.0` or `18:00.0`.
    PciBusId(String),
}

impl FromStr for GpuSelector {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Ok(i) = s.parse::<usize>() {
            return Ok(GpuSelector::Index(i));
        }
        if s.len() > 4 && s[..4].eq_ignore_ascii_case("GPU-") {
            return Ok(GpuSelector::Uuid(s.to_ascii_lowercase()));
        }
        if s.contains(':') {
            return Ok(GpuSelector::PciBusId(s.to_ascii_lowercase()));
        }
        Err(format!(
            "'{s}' is not a GPU: give an index (0, 1, ...), a UUID (GPU-...) or a PCI address (0000:18:00.0)"
        ))
    }
}

impl std::fmt::Display for GpuSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuSelector::Index(i) => write!(f, "{i}"),
            GpuSelector::Uuid(u) | GpuSelector::PciBusId(u) => f.write_str(u),
        }
    }
}

impl GpuSelector {
    /// The index of the one GPU this selects.
    pub fn resolve(&self, gpus: &[GpuInfo]) -> Result<usize> {
        let unknown = || Error::UnknownGpu {
            selector: self.to_string(),
            count: gpus.len(),
        };
        let found: Vec<&GpuInfo> = match self {
            GpuSelector::Index(i) => gpus.iter().filter(|g| g.index == *i).collect(),
            GpuSelector::Uuid(u) => gpus
                .iter()
                .filter(|g| g.uuid.to_ascii_lowercase().starts_with(u.as_str()))
                .collect(),
            GpuSelector::PciBusId(p) => gpus
                .iter()
                .filter(|g| {
                    g.pci_bus_id == *p || g.pci_bus_id.ends_with(&format!(":{p}")) && p.len() >= 7
                })
                .collect(),
        };
        match found.as_slice() {
            [one] => Ok(one.index),
            _ => Err(unknown()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: usize, pci: &str, uuid: &str) -> GpuInfo {
        GpuInfo {
            index,
            gpu_id: 0,
            device_instance: 0,
            minor: 0,
            pci_bus_id: pci.into(),
            pci_device_id: 0x2330,
            uuid: uuid.into(),
            name: "NVIDIA H100 80GB HBM3".into(),
        }
    }

    #[test]
    fn selectors_parse_and_resolve() {
        let gpus = [
            gpu(0, "0000:18:00.0", "GPU-aaaa1111-0000"),
            gpu(1, "0000:2a:00.0", "GPU-aaaa2222-0000"),
        ];
        let sel = |s: &str| s.parse::<GpuSelector>().unwrap().resolve(&gpus);
        assert_eq!(sel("1").unwrap(), 1);
        assert_eq!(sel("GPU-AAAA2").unwrap(), 1);
        assert_eq!(sel("0000:18:00.0").unwrap(), 0);
        assert_eq!(sel("2a:00.0").unwrap(), 1);
        let err = sel("7").unwrap_err().to_string();
        assert!(
            err.contains("no GPU matches '7'") && err.contains("2 GPU(s)"),
            "{err}"
        );
        // An ambiguous UUID prefix selects nothing rather than guessing.
        assert!(sel("GPU-aaaa").is_err());
        assert!("GPU-".parse::<GpuSelector>().is_err());
        assert!("banana"
            .parse::<GpuSelector>()
            .unwrap_err()
            .contains("not a GPU"));
    }

    #[test]
    fn pci_formatting_and_c_strings() {
        let card = CardInfo {
            pci_domain: 0,
            pci_bus: 0x18,
            pci_slot: 0,
            pci_function: 0,
            ..Default::default()
        };
        assert_eq!(pci_bus_id(&card), "0000:18:00.0");
        assert_eq!(c_string(b"NVIDIA H100\0junk"), "NVIDIA H100");
        assert_eq!(c_string(b"no-nul"), "no-nul");
    }
}
