//! [`KeyLayout`]: where each key's field lies in the composite, exact or prefix.

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::row::SortField;
use datafusion::error::Result;

use super::composite::Container;
use super::encode::{EncodedKeys, Field, encode_column_into};
use super::{KeySpec, KeyWidth, exec_error, unsupported_reason};

/// The most bits a composite key may have.
pub(crate) const MAX_KEY_BITS: u32 = 256;

/// The most prefix bytes a byte key's field takes (one `u128`).
pub(crate) const MAX_PREFIX_BYTES: u32 = 16;

/// How one key is written into the composite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// All of its value bits.
    Whole,
    /// Its high value bits: `dropped` low bits are left out.
    High { dropped: u32 },
    /// Its first `bytes` bytes, zero-padded, big-endian.
    Bytes { bytes: u32 },
    /// All of its bytes, as [`Part::Bytes`]: every value is at most `bytes` long and none
    /// ends in a zero byte ([`short_bytes`](super::short_bytes)), so equal fields mean equal
    /// values.
    AllBytes { bytes: u32 },
}

/// How the sort keys of one query pack into a composite integer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLayout {
    specs: Vec<KeySpec>,
    total_bits: u32,
    /// Per key in the composite (the leading keys; all of them in an exact layout).
    parts: Vec<Part>,
    /// Per key in the composite: value bits kept (null bit excluded).
    value_bits: Vec<u32>,
    /// Per key in the composite: offset of the field's lowest bit.
    shifts: Vec<u32>,
}

impl KeyLayout {
    /// Lays out `specs` (key 0 most significant). `Err` carries a reason fit for `EXPLAIN` when
    /// a key's type is not supported, there are no keys, or the keys need more than
    /// [`MAX_KEY_BITS`] bits. Keys are numbered from 1 in the reason, in `ORDER BY` order.
    pub fn try_new(specs: Vec<KeySpec>) -> std::result::Result<Self, String> {
        if specs.is_empty() {
            return Err("the GPU top-k needs at least one sort key".to_string());
        }
        let mut value_bits = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            match spec.value_bits() {
                Some(b) => value_bits.push(b),
                None => return Err(unsupported_reason(i, &spec.data_type)),
            }
        }
        let field_bits: Vec<u32> = specs
            .iter()
            .zip(&value_bits)
            .map(|(s, b)| b + u32::from(s.nullable))
            .collect();
        let total_bits: u32 = field_bits.iter().sum();
        if total_bits > MAX_KEY_BITS {
            let parts: Vec<String> = field_bits
                .iter()
                .enumerate()
                .map(|(i, b)| format!("key {}: {b}", i + 1))
                .collect();
            return Err(format!(
                "sort keys need {total_bits} bits ({}), more than the GPU top-k's \
                 {MAX_KEY_BITS}-bit limit",
                parts.join(", ")
            ));
        }
        let parts = vec![Part::Whole; specs.len()];
        Ok(Self::placed(specs, parts, value_bits))
    }

    /// Lays out `specs` exactly where [`try_new`](Self::try_new) can, else as a prefix layout
    /// (see the [module documentation](super)). `Err` carries a reason fit for `EXPLAIN` when a
    /// key's type is neither fixed-width nor compared by bytes, or there are no keys.
    pub fn with_prefixes(specs: Vec<KeySpec>) -> std::result::Result<Self, String> {
        Self::with_known_bytes(specs, &[])
    }

    /// [`with_prefixes`](Self::with_prefixes), where `short[i]` (if any) is
    /// [`short_bytes`](super::short_bytes) of byte key `i`'s values: such a key's field holds
    /// all of its bytes, equal fields meaning equal values, and the keys after it follow in
    /// the composite; so rows tying a short string (a status, a country) are ranked by the next
    /// keys instead of all being compared in full on the host.
    pub fn with_known_bytes(
        specs: Vec<KeySpec>,
        short: &[Option<u32>],
    ) -> std::result::Result<Self, String> {
        if specs.is_empty() {
            return Err("the GPU top-k needs at least one sort key".to_string());
        }
        if let Some((i, spec)) =
            (specs.iter().enumerate()).find(|(_, s)| s.value_bits().is_none() && !s.by_bytes())
        {
            return Err(unsupported_reason(i, &spec.data_type));
        }
        if !specs.iter().any(KeySpec::by_bytes)
            && let Ok(exact) = Self::try_new(specs.clone())
        {
            return Ok(exact);
        }
        let (mut parts, mut value_bits, mut used) = (Vec::new(), Vec::new(), 0u32);
        for (i, spec) in specs.iter().enumerate() {
            let null = u32::from(spec.nullable);
            let known = short
                .get(i)
                .copied()
                .flatten()
                .filter(|&b| b <= MAX_PREFIX_BYTES);
            if let (None, Some(bytes)) = (spec.value_bits(), known) {
                // An empty field would have no bits: one byte holds the empty value.
                let bytes = bytes.max(1);
                if used + null + 8 * bytes <= MAX_KEY_BITS {
                    parts.push(Part::AllBytes { bytes });
                    value_bits.push(8 * bytes);
                    used += null + 8 * bytes;
                    continue;
                }
            }
            match spec.value_bits() {
                Some(v) if used + null + v <= MAX_KEY_BITS => {
                    parts.push(Part::Whole);
                    value_bits.push(v);
                    used += null + v;
                }
                Some(v) => {
                    let kept = MAX_KEY_BITS.saturating_sub(used + null);
                    if kept > 0 {
                        parts.push(Part::High { dropped: v - kept });
                        value_bits.push(kept);
                    }
                    break;
                }
                None => {
                    let cap = if used + null + 64 <= 128 {
                        128
                    } else {
                        MAX_KEY_BITS
                    };
                    let bytes = (cap.saturating_sub(used + null) / 8).min(MAX_PREFIX_BYTES);
                    if bytes > 0 {
                        parts.push(Part::Bytes { bytes });
                        value_bits.push(8 * bytes);
                    }
                    break;
                }
            }
        }
        Ok(Self::placed(specs, parts, value_bits))
    }

    /// An exact layout where every byte key has a known short length: `short[i]` is
    /// [`short_bytes`](super::short_bytes) of key `i`'s values, and a byte key's field holds
    /// all of its bytes. `None` where a byte key's length is not known or the fields need more
    /// than [`MAX_KEY_BITS`] bits.
    pub fn with_short_bytes(specs: Vec<KeySpec>, short: &[Option<u32>]) -> Option<Self> {
        let (mut parts, mut value_bits, mut used) = (Vec::new(), Vec::new(), 0u32);
        for (i, spec) in specs.iter().enumerate() {
            let (part, bits) = match (spec.value_bits(), short.get(i).copied().flatten()) {
                (Some(bits), _) => (Part::Whole, bits),
                (None, Some(bytes)) if spec.by_bytes() && bytes <= MAX_PREFIX_BYTES => {
                    // An empty field would have no bits: one byte holds the empty value.
                    let bytes = bytes.max(1);
                    (Part::AllBytes { bytes }, 8 * bytes)
                }
                _ => return None,
            };
            used += bits + u32::from(spec.nullable);
            parts.push(part);
            value_bits.push(bits);
        }
        (used <= MAX_KEY_BITS).then(|| Self::placed(specs, parts, value_bits))
    }

    /// The layout of the leading `parts.len()` keys, `value_bits` kept of each.
    fn placed(specs: Vec<KeySpec>, parts: Vec<Part>, value_bits: Vec<u32>) -> Self {
        let field_bits: Vec<u32> = (specs.iter().zip(&value_bits))
            .map(|(s, b)| b + u32::from(s.nullable))
            .collect();
        let total_bits: u32 = field_bits.iter().sum();
        let mut shifts = vec![0; field_bits.len()];
        let mut shift = total_bits;
        for (s, b) in shifts.iter_mut().zip(&field_bits) {
            shift -= b;
            *s = shift;
        }
        Self {
            specs,
            total_bits,
            parts,
            value_bits,
            shifts,
        }
    }

    /// Whether the composite holds every key in full: equal composites then mean equal keys.
    /// A prefix layout's composite is only monotone (see the [module documentation](super)).
    pub fn exact(&self) -> bool {
        self.parts.len() == self.specs.len()
            && (self.parts.iter()).all(|p| matches!(p, Part::Whole | Part::AllBytes { .. }))
    }

    /// For EXPLAIN, in a prefix layout: which keys the composite holds in part, and how.
    pub fn prefix_note(&self) -> Option<String> {
        if self.exact() {
            return None;
        }
        let last = self.parts.len() - 1;
        let cut = match self.parts[last] {
            Part::Bytes { bytes } => format!("sort key {} by its first {bytes} bytes", last + 1),
            Part::High { dropped } => {
                let kept = self.value_bits[last];
                let of = kept + dropped;
                format!("sort key {} by its high {kept} of {of} bits", last + 1)
            }
            Part::Whole | Part::AllBytes { .. } if self.parts.len() < self.specs.len() => {
                format!("sort keys 1..={} in full", self.parts.len())
            }
            Part::Whole | Part::AllBytes { .. } => unreachable!("an inexact layout cuts a key"),
        };
        Some(format!(
            "the composite holds {cut}; ties there are compared in full on the host"
        ))
    }

    /// Keys with a field in the composite: all of them in an exact layout, the leading ones
    /// up to the truncated field in a prefix layout.
    pub fn composite_keys(&self) -> usize {
        self.parts.len()
    }

    /// Bits of key `key`'s field value (null bit excluded): its type's value bits, or what a
    /// prefix layout keeps of it. Panics if the key has no field.
    pub fn field_value_bits(&self, key: usize) -> u32 {
        self.value_bits[key]
    }

    /// The bytes of key `key` its field holds, where that field is a prefix of a byte key's
    /// bytes; `None` for a fixed-width field and for a key without one.
    pub fn prefix_bytes(&self, key: usize) -> Option<u32> {
        match self.parts.get(key) {
            Some(Part::Bytes { bytes } | Part::AllBytes { bytes }) => Some(*bytes),
            _ => None,
        }
    }

    /// The low value bits of key `key` its field leaves out: non-zero where the field holds
    /// only the high bits of a fixed-width key.
    pub fn dropped_bits(&self, key: usize) -> u32 {
        match self.parts.get(key) {
            Some(Part::High { dropped }) => *dropped,
            _ => 0,
        }
    }

    /// arrow's row-format fields of the keys: DataFusion's own comparison of whole keys.
    pub fn sort_fields(&self) -> Vec<SortField> {
        (self.specs.iter())
            .map(|s| SortField::new_with_options(s.data_type.clone(), s.options()))
            .collect()
    }

    /// The keys, most significant first.
    pub fn specs(&self) -> &[KeySpec] {
        &self.specs
    }

    /// Sum of the keys' field bits; composites are `< 2^total_bits`.
    pub fn total_bits(&self) -> u32 {
        self.total_bits
    }

    /// The narrowest key width that holds `total_bits`.
    pub fn width(&self) -> KeyWidth {
        KeyWidth::for_total_bits(self.total_bits)
    }

    /// Offset of the lowest bit of key `key`'s field in the composite (the last key is at 0).
    /// Panics if `key` is out of range.
    pub fn field_shift(&self, key: usize) -> u32 {
        self.shifts[key]
    }

    /// Encodes one batch: `columns[i]` holds key `i`, all columns of the same length. Errors
    /// (never panics) on a column count, length or type that does not match the layout, and on
    /// NULLs in a key declared not nullable.
    pub fn encode(&self, columns: &[ArrayRef]) -> Result<EncodedKeys> {
        let mut out = EncodedKeys::new(self.width());
        self.encode_into(columns, &mut out)?;
        Ok(out)
    }

    /// [`encode`](Self::encode) into `out`, reusing its allocation when its width matches the
    /// layout's (a fresh vector per batch costs page faults comparable to the encoding itself).
    /// On error `out`'s contents are unspecified.
    pub fn encode_into(&self, columns: &[ArrayRef], out: &mut EncodedKeys) -> Result<()> {
        if columns.len() != self.specs.len() {
            return Err(exec_error(format!(
                "key encoding expects {} columns, got {}",
                self.specs.len(),
                columns.len()
            )));
        }
        let n = columns[0].len();
        if let Some((i, c)) = columns.iter().enumerate().find(|(_, c)| c.len() != n) {
            return Err(exec_error(format!(
                "key column {} has {} rows, key column 1 has {n}",
                i + 1,
                c.len()
            )));
        }
        if out.width() != self.width().host() {
            *out = EncodedKeys::new(self.width());
        }
        match out {
            EncodedKeys::W64(v) => self.encode_as(columns, n, v),
            EncodedKeys::W128(v) => self.encode_as(columns, n, v),
            EncodedKeys::W256(v) => self.encode_as(columns, n, v),
        }
    }

    fn encode_as<C: Container>(
        &self,
        columns: &[ArrayRef],
        n: usize,
        out: &mut Vec<C>,
    ) -> Result<()> {
        out.clear();
        out.resize(n, C::default());
        for (i, part) in self.parts.iter().enumerate() {
            let field = Field::new(&self.specs[i], self.value_bits[i], self.shifts[i]);
            encode_column_into(i, &self.specs[i], *part, &field, columns[i].as_ref(), out)?;
        }
        Ok(())
    }
}
