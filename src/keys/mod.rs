//! Order-preserving key encoding.
//!
//! Every sort key of an `ORDER BY` maps to an unsigned integer *field* whose unsigned order is
//! exactly DataFusion's order for that key (direction and `NULLS FIRST/LAST` included). The
//! fields of all keys are concatenated, key 0 most significant, into one composite integer of
//! 64, 128 or 256 bits, so that a top-k becomes "the k smallest composite integers". The row id
//! that breaks ties is *not* part of the composite: the selectors pair it with the key.
//!
//! Value bits of one key, ascending (the bit patterns are the type's native representation):
//!
//! | type                                                  | bits  | ascending value bits   |
//! |-------------------------------------------------------|-------|------------------------|
//! | `Boolean`                                             | 1     | `false` = 0, `true` = 1|
//! | `UInt8/16/32/64`                                      | 8…64  | as is                  |
//! | `Int8/16/32/64`, `Date32/64`, `Time32/64`, `Timestamp`, `Duration`, `Decimal32/64/128` | 8…128 | sign bit flipped |
//! | `Float16/32/64`                                       | 16…64 | sign set: all flipped; else sign bit flipped |
//!
//! The float mapping is IEEE 754 totalOrder, i.e. Rust's `total_cmp`, which is what arrow's sort
//! kernels and DataFusion's row format use: `−NaN < −inf < … < −0.0 < +0.0 < … < +inf < +NaN`.
//! NaNs are not canonicalised (x86 produces the sign-set `−NaN` for `0.0 / 0.0`, and DataFusion
//! sorts it first).
//!
//! `DESC` flips all value bits. A nullable key gets one more bit above its value bits, chosen so
//! that NULLs land on the requested side; NULL rows have all value bits zero, whatever the array
//! holds under the null slot, so all NULLs of a key tie:
//!
//! | field (`v` = value bits)  | valid row          | NULL row |
//! |---------------------------|--------------------|----------|
//! | not nullable              | `value`            | (error)  |
//! | nullable, `NULLS FIRST`   | `1 << v \| value`  | `0`      |
//! | nullable, `NULLS LAST`    | `0 << v \| value`  | `1 << v` |
//!
//! The composite is right-aligned: with `total_bits` = Σ field bits, key 0 occupies the highest
//! field bits just below `total_bits` ([`KeyLayout::field_shift`] gives each field's offset) and
//! the bits at and above `total_bits` are zero:
//!
//! ```text
//!   width-1     total_bits-1                                   0
//!   ┌─ 0 … 0 ─┬──────────────┬──────────────┬─────┬──────────────┐
//!   │  unused │ [n₀] value₀  │ [n₁] value₁  │  …  │ [nₘ] valueₘ  │
//!   └─────────┴──────────────┴──────────────┴─────┴──────────────┘
//! ```
//!
//! Encoding runs column by column into the composite vector: one type dispatch per column, then a
//! tight generic loop over the column's `values()` slice (NULL slots included, they are patched
//! afterwards from the validity bitmap, so the main loop stays branch-free and vectorisable).
//!
//! ## Prefix layouts
//!
//! Keys compared byte by byte (strings, binary, dictionaries of them, `Decimal256`) and keys
//! that together need more than 256 bits have no exact composite. [`KeyLayout::with_prefixes`]
//! then builds a *prefix* layout: the leading keys in full while they fit, then one truncated
//! field, and nothing of the keys after it (what follows a truncated field would break its
//! order). A byte key's field is its first bytes, zero-padded and big-endian (up to 16, sized
//! so the composite stays within 128 bits where the keys before it leave room for 8); a wide
//! fixed key keeps its high value bits. The prefix composite is *monotone*: a row that sorts
//! before another never has a larger composite, so a row whose composite exceeds the k-th
//! candidate's can never win, and only rows that tie it need the full comparison
//! ([`crate::select::prefix`]; over a whole table on the GPU, [`crate::select::table`], whose
//! program reads a string's bytes as its [`prefix_words`]). [`KeyLayout::exact`] tells the two
//! kinds apart.
//!
//! A byte key whose values are all short is exact after all: where every value of a column is
//! at most 16 bytes and none ends in a zero byte ([`short_bytes`], known for an in-memory
//! table at planning), its zero-padded prefix is the whole value, and
//! [`KeyLayout::with_short_bytes`] lays it out as a field of all its bytes. So is one of few
//! distinct values, however long, whose prefix words tell them all apart
//! ([`distinct_prefixes`]: a ship instruction, a country's name): equal words then mean equal
//! values, and the words' order is the values'.
//!
//! One file each: `spec` (a key's type and ordering), `layout` (where each field lies),
//! `encode` (the column encoder and the batch's composites), `fixed` (fixed-width value bits),
//! `bytes` (byte keys' prefix fields and prefix words), `composite` (the containers and the
//! placers that write a field into one).

use datafusion::arrow::datatypes::DataType;
use datafusion::error::DataFusionError;

mod bytes;
mod composite;
mod encode;
mod fixed;
mod layout;
mod spec;
#[cfg(test)]
mod tests;

pub use crate::device::plan::{KeyWidth, Native};
pub use crate::device::u256::U256;
#[cfg(test)]
pub(crate) use bytes::MAX_DISTINCT_PREFIXES;
pub(crate) use bytes::{
    PREFIX_WORD_BYTES, distinct_prefixes, has_prefix_words, prefix_words, short_bytes,
    write_prefix_words,
};
pub use encode::EncodedKeys;
#[cfg(test)]
pub(crate) use encode::encode_column_u128;
pub use layout::KeyLayout;
pub use spec::KeySpec;

fn unsupported_reason(key: usize, data_type: &DataType) -> String {
    format!(
        "sort key {} has type {data_type}, which the GPU top-k does not support",
        key + 1
    )
}

fn exec_error(message: String) -> DataFusionError {
    DataFusionError::Execution(message)
}

fn downcast_error(key: usize, spec: &KeySpec) -> DataFusionError {
    exec_error(format!(
        "key column {} could not be read as {}",
        key + 1,
        spec.data_type
    ))
}
