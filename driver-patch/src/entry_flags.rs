//! Reads the flags that a compiled object or module (`g_subdevice_nvoc.o`, `nv-kernel.o`,
//! `nvidia.ko`) carries for FIFO_DISABLE_CHANNELS, to show that the patched value reached the binary.
//!
//! The exported-method table entry is laid out as: pointer, u32 flags, u32 accessRight, u32
//! methodId; so each little-endian occurrence of the method id preceded by a small accessRight (and
//! a flags value below 2^24) is reported. The bytes are scanned as they are rather than parsed as
//! ELF: the three u32 fields are plain data in relocatable objects and linked modules alike (only
//! the pointer before them is relocated), so no section or symbol lookup is needed.

use std::fs;
use std::path::Path;

use crate::{PatchError, METHOD_ID};

/// The flags of every entry-shaped occurrence of [`METHOD_ID`] in `data`, in file order.
pub fn entry_flags_in(data: &[u8]) -> Vec<u32> {
    let needle = METHOD_ID.to_le_bytes();
    let u32_at =
        |at: usize| u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
    data.windows(4)
        .enumerate()
        .filter(|&(at, window)| at >= 8 && window == needle)
        .map(|(at, _)| (u32_at(at - 8), u32_at(at - 4)))
        .filter(|&(flags, access)| access < 0x100 && flags < 0x100_0000)
        .map(|(flags, _)| flags)
        .collect()
}

/// [`entry_flags_in`] of the file at `path`.
pub fn entry_flags(path: &Path) -> Result<Vec<u32>, PatchError> {
    let data = fs::read(path).map_err(|e| PatchError::io(path, e))?;
    Ok(entry_flags_in(&data))
}

#[cfg(test)]
mod tests {
    use super::entry_flags_in;

    fn entry(flags: u32, access: u32, method: u32) -> Vec<u8> {
        [
            0u64.to_le_bytes().as_slice(),
            &flags.to_le_bytes(),
            &access.to_le_bytes(),
            &method.to_le_bytes(),
        ]
        .concat()
    }

    #[test]
    fn finds_entry_shaped_occurrences_only() {
        let mut data = vec![0u8; 16];
        data.extend(entry(0x10118, 0, 0x2080_110b));
        assert_eq!(entry_flags_in(&data), [0x10118]);
        // A large accessRight or flags value is not an entry; neither is the id at offset < 8.
        data.extend(entry(0x850, 0x100, 0x2080_110b));
        data.extend(entry(0x100_0000, 0, 0x2080_110b));
        assert_eq!(entry_flags_in(&data), [0x10118]);
        assert!(entry_flags_in(&0x2080_110bu32.to_le_bytes()).is_empty());
        data.extend(entry(0x850, 0xff, 0x2080_110b));
        assert_eq!(entry_flags_in(&data), [0x10118, 0x850]);
        assert!(entry_flags_in(b"").is_empty());
    }
}
