//! A flags value as written in C hex literals, of any width (the applier never truncates what it
//! reads, so a value is printed back exactly as the number it is).

use std::fmt;

/// An unsigned integer of any width; `Display` prints it like C/Python `0x..` (lowercase, no
/// leading zeros, `0x0` for zero).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct FlagValue {
    /// Little-endian 64-bit limbs, without high zero limbs (so equal values compare equal).
    limbs: Vec<u64>,
}

impl FlagValue {
    /// Parses hex digits (no `0x`); returns `None` on an empty string or a non-hex character.
    pub fn from_hex(digits: &str) -> Option<Self> {
        if digits.is_empty() {
            return None;
        }
        let mut limbs = Vec::with_capacity(digits.len() / 16 + 1);
        let nibbles: Vec<u64> = digits
            .chars()
            .map(|c| c.to_digit(16).map(u64::from))
            .collect::<Option<_>>()?;
        for chunk in nibbles.rchunks(16) {
            limbs.push(chunk.iter().fold(0u64, |acc, n| (acc << 4) | n));
        }
        Some(Self::normalized(limbs))
    }

    /// The value of a `u64`.
    pub fn from_u64(value: u64) -> Self {
        Self::normalized(vec![value])
    }

    /// The value, if it fits in a `u64`.
    pub fn to_u64(&self) -> Option<u64> {
        match self.limbs.as_slice() {
            [] => Some(0),
            [v] => Some(*v),
            _ => None,
        }
    }

    pub fn is_zero(&self) -> bool {
        self.limbs.is_empty()
    }

    /// Exactly one bit set.
    pub fn is_single_bit(&self) -> bool {
        self.limbs.iter().map(|l| l.count_ones()).sum::<u32>() == 1
    }

    /// `self & other != 0`.
    pub fn intersects(&self, other: &Self) -> bool {
        self.limbs.iter().zip(&other.limbs).any(|(a, b)| a & b != 0)
    }

    /// `self | other`.
    pub fn or(&self, other: &Self) -> Self {
        let n = self.limbs.len().max(other.limbs.len());
        let limb = |v: &Self, i: usize| v.limbs.get(i).copied().unwrap_or(0);
        Self::normalized((0..n).map(|i| limb(self, i) | limb(other, i)).collect())
    }

    /// `self & !other`: `self` with `other`'s bits cleared.
    pub fn and_not(&self, other: &Self) -> Self {
        let limbs = self
            .limbs
            .iter()
            .enumerate()
            .map(|(i, a)| a & !other.limbs.get(i).copied().unwrap_or(0))
            .collect();
        Self::normalized(limbs)
    }

    fn normalized(mut limbs: Vec<u64>) -> Self {
        while limbs.last() == Some(&0) {
            limbs.pop();
        }
        Self { limbs }
    }
}

impl fmt::Display for FlagValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some((top, rest)) = self.limbs.split_last() else {
            return f.write_str("0x0");
        };
        write!(f, "{top:#x}")?;
        for limb in rest.iter().rev() {
            write!(f, "{limb:016x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for FlagValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl From<u64> for FlagValue {
    fn from(value: u64) -> Self {
        Self::from_u64(value)
    }
}

#[cfg(test)]
mod tests {
    use super::FlagValue;

    fn hex(s: &str) -> FlagValue {
        FlagValue::from_hex(s).unwrap()
    }

    #[test]
    fn parses_and_prints_like_python_hex() {
        assert_eq!(hex("0").to_string(), "0x0");
        assert_eq!(hex("000").to_string(), "0x0");
        assert_eq!(hex("0010108").to_string(), "0x10108");
        assert_eq!(hex("2080110B").to_string(), "0x2080110b");
        assert_eq!(hex("2080110b0").to_string(), "0x2080110b0");
        let wide = "1000000000000000000000000000000f";
        assert_eq!(hex(wide).to_string(), format!("0x{wide}"));
        assert_eq!(hex("00000000000000000000000000000001"), FlagValue::from(1));
        assert_eq!(hex("2080110b").to_u64(), Some(0x2080_110b));
        assert_eq!(hex(wide).to_u64(), None);
        assert!(FlagValue::from_hex("").is_none());
        assert!(FlagValue::from_hex("12g").is_none());
    }

    #[test]
    fn bit_operations() {
        let old = hex("10108");
        let bit = hex("10");
        assert!(bit.is_single_bit());
        assert!(!hex("18").is_single_bit());
        assert!(!hex("0").is_single_bit());
        assert!(hex("0").is_zero());
        assert!(hex("100000000000000000").is_single_bit());
        assert_eq!(old.or(&bit).to_string(), "0x10118");
        assert!(!old.intersects(&bit));
        assert!(old.or(&bit).intersects(&bit));
        assert_eq!(old.or(&bit).and_not(&bit), old);
        assert_eq!(hex("10").and_not(&hex("10")), hex("0"));
        let big = hex("100000000000000000");
        assert_eq!(big.or(&bit).to_string(), "0x100000000000000010");
        assert_eq!(big.or(&bit).and_not(&big).to_string(), "0x10");
    }
}
