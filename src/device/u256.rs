//! [`U256`]: the 256-bit unsigned integer that holds the widest composite keys on the host.

use std::ops::{BitAnd, BitOr, Not};

/// A 256-bit unsigned integer, ordered by `hi` then `lo` (field order makes the derived `Ord`
/// lexicographic, which is numeric order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct U256 {
    /// Bits 128..256.
    pub hi: u128,
    /// Bits 0..128.
    pub lo: u128,
}

impl U256 {
    /// Zero.
    pub const ZERO: Self = Self { hi: 0, lo: 0 };
    /// All bits set.
    pub const MAX: Self = Self {
        hi: u128::MAX,
        lo: u128::MAX,
    };

    /// `v` zero-extended to 256 bits.
    pub const fn from_u128(v: u128) -> Self {
        Self { hi: 0, lo: v }
    }

    /// `v << shift` (shift < 256); bits shifted past bit 255 are lost.
    pub const fn shl_u128(v: u128, shift: u32) -> Self {
        if shift == 0 {
            Self { hi: 0, lo: v }
        } else if shift < 128 {
            Self {
                hi: v >> (128 - shift),
                lo: v << shift,
            }
        } else {
            Self {
                hi: v << (shift - 128),
                lo: 0,
            }
        }
    }
}

impl BitOr for U256 {
    type Output = Self;
    #[inline(always)]
    fn bitor(self, rhs: Self) -> Self {
        Self {
            hi: self.hi | rhs.hi,
            lo: self.lo | rhs.lo,
        }
    }
}

impl BitAnd for U256 {
    type Output = Self;
    #[inline(always)]
    fn bitand(self, rhs: Self) -> Self {
        Self {
            hi: self.hi & rhs.hi,
            lo: self.lo & rhs.lo,
        }
    }
}

impl Not for U256 {
    type Output = Self;
    #[inline(always)]
    fn not(self) -> Self {
        Self {
            hi: !self.hi,
            lo: !self.lo,
        }
    }
}
