//! The composite containers (`u64`, `u128`, [`U256`]) and the placers that move a field's
//! value bits to their place in one, chosen once per column.

use std::ops::{BitAnd, BitOr, Not};

use super::U256;

/// A composite container (`u64`, `u128`, [`U256`]).
pub(super) trait Container:
    Copy + Default + BitOr<Output = Self> + BitAnd<Output = Self> + Not<Output = Self>
{
    /// `v << shift`, general and slow-ish: for loop-invariant constants. Callers guarantee the
    /// result fits.
    fn place(v: u128, shift: u32) -> Self;

    /// Runs `body` with the cheapest placer for `value_bits` value bits at `shift`. A variable
    /// shift of a `u128`/`U256` is a branchy multi-instruction sequence per row; most fields
    /// have ≤ 64 value bits inside one 64-bit word, where a plain `u64` shift does (about
    /// twice as fast in the per-row loop).
    fn with_placer<B: PlacerBody<Self>>(shift: u32, value_bits: u32, body: B) -> B::Output;
}

/// Moves a field's value bits (in the low bits of `v`) to their place in the container.
pub(super) trait Placer<C>: Copy {
    fn place(self, v: u128) -> C;
}

/// A loop generic over the placer chosen at run time (a generic closure, in effect).
pub(super) trait PlacerBody<C> {
    type Output;
    fn run<P: Placer<C>>(self, placer: P) -> Self::Output;
}

/// `u64` container: a plain shift.
#[derive(Clone, Copy)]
struct Shl64(u32);

impl Placer<u64> for Shl64 {
    #[inline(always)]
    fn place(self, v: u128) -> u64 {
        (v as u64) << self.0
    }
}

impl Container for u64 {
    #[inline(always)]
    fn place(v: u128, shift: u32) -> Self {
        (v as u64) << shift
    }

    #[inline(always)]
    fn with_placer<B: PlacerBody<Self>>(shift: u32, _value_bits: u32, body: B) -> B::Output {
        body.run(Shl64(shift))
    }
}

/// `u128` container, field within bits 0..64.
#[derive(Clone, Copy)]
struct LowWord(u32);

impl Placer<u128> for LowWord {
    #[inline(always)]
    fn place(self, v: u128) -> u128 {
        u128::from((v as u64) << self.0)
    }
}

/// `u128` container, field within bits 64..128 (holds `shift − 64`).
#[derive(Clone, Copy)]
struct HighWord(u32);

impl Placer<u128> for HighWord {
    #[inline(always)]
    fn place(self, v: u128) -> u128 {
        u128::from((v as u64) << self.0) << 64
    }
}

/// `u128` container, any field.
#[derive(Clone, Copy)]
struct Shl128(u32);

impl Placer<u128> for Shl128 {
    #[inline(always)]
    fn place(self, v: u128) -> u128 {
        v << self.0
    }
}

impl Container for u128 {
    #[inline(always)]
    fn place(v: u128, shift: u32) -> Self {
        v << shift
    }

    #[inline(always)]
    fn with_placer<B: PlacerBody<Self>>(shift: u32, value_bits: u32, body: B) -> B::Output {
        if value_bits <= 64 && shift + value_bits <= 64 {
            body.run(LowWord(shift))
        } else if value_bits <= 64 && shift >= 64 {
            body.run(HighWord(shift - 64))
        } else {
            body.run(Shl128(shift))
        }
    }
}

/// [`U256`] container, field within the low half, placed there by `P`.
#[derive(Clone, Copy)]
struct LowHalf<P>(P);

impl<P: Placer<u128>> Placer<U256> for LowHalf<P> {
    #[inline(always)]
    fn place(self, v: u128) -> U256 {
        U256 {
            hi: 0,
            lo: self.0.place(v),
        }
    }
}

/// [`U256`] container, field within the high half, placed there by `P`.
#[derive(Clone, Copy)]
struct HighHalf<P>(P);

impl<P: Placer<u128>> Placer<U256> for HighHalf<P> {
    #[inline(always)]
    fn place(self, v: u128) -> U256 {
        U256 {
            hi: self.0.place(v),
            lo: 0,
        }
    }
}

/// [`U256`] container, field straddling the halves.
#[derive(Clone, Copy)]
struct Shl256(u32);

impl Placer<U256> for Shl256 {
    #[inline(always)]
    fn place(self, v: u128) -> U256 {
        U256::shl_u128(v, self.0)
    }
}

/// Adapts a [`U256`] loop to a half's `u128` placer, so the halves reuse the `u128` choice.
struct InHalf<B> {
    body: B,
    high: bool,
}

impl<B: PlacerBody<U256>> PlacerBody<u128> for InHalf<B> {
    type Output = B::Output;

    #[inline(always)]
    fn run<P: Placer<u128>>(self, placer: P) -> B::Output {
        if self.high {
            self.body.run(HighHalf(placer))
        } else {
            self.body.run(LowHalf(placer))
        }
    }
}

impl Container for U256 {
    #[inline(always)]
    fn place(v: u128, shift: u32) -> Self {
        U256::shl_u128(v, shift)
    }

    #[inline(always)]
    fn with_placer<B: PlacerBody<Self>>(shift: u32, value_bits: u32, body: B) -> B::Output {
        if shift + value_bits <= 128 {
            u128::with_placer(shift, value_bits, InHalf { body, high: false })
        } else if shift >= 128 {
            u128::with_placer(shift - 128, value_bits, InHalf { body, high: true })
        } else {
            body.run(Shl256(shift))
        }
    }
}
