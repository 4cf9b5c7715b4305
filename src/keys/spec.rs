//! [`KeySpec`]: one sort key's type and ordering options.

use datafusion::arrow::compute::SortOptions;
use datafusion::arrow::datatypes::DataType;

use super::Native;

/// One sort key: its type and its SQL ordering options.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeySpec {
    /// Type of the key column (after any expression evaluation).
    pub data_type: DataType,
    /// `DESC` when true.
    pub descending: bool,
    /// `NULLS FIRST` when true, `NULLS LAST` otherwise.
    pub nulls_first: bool,
    /// Whether the column may hold NULLs; only then does the key spend a null bit.
    pub nullable: bool,
}

impl KeySpec {
    /// A key of `data_type` ordered by arrow's `SortOptions`.
    pub fn new(data_type: DataType, options: SortOptions, nullable: bool) -> Self {
        Self {
            data_type,
            descending: options.descending,
            nulls_first: options.nulls_first,
            nullable,
        }
    }

    /// Number of value bits (null bit excluded); `None` when the type is not supported.
    pub fn value_bits(&self) -> Option<u32> {
        Native::for_data_type(&self.data_type).map(Native::bits)
    }

    /// Number of bits of this key's field in the composite: value bits plus one null bit when
    /// nullable; `None` when the type is not supported.
    pub fn bits(&self) -> Option<u32> {
        self.value_bits().map(|b| b + u32::from(self.nullable))
    }

    /// Whether the key is compared byte by byte (strings, binary, dictionaries of them,
    /// `Decimal256`): only a prefix layout takes it.
    pub fn by_bytes(&self) -> bool {
        bytes_type(&self.data_type)
    }

    /// arrow's `SortOptions` of the key.
    pub fn options(&self) -> SortOptions {
        SortOptions {
            descending: self.descending,
            nulls_first: self.nulls_first,
        }
    }

    /// Whether a column of this key may be compared with a threshold value by arrow's
    /// comparison kernels (and so by a predicate) in the key's own order: not floats, whose
    /// NaNs and zeros those order otherwise than the sort does, nor dictionaries, whose
    /// comparison with a literal DataFusion may not plan.
    pub fn compares_with_threshold(&self) -> bool {
        !self.data_type.is_floating() && !matches!(self.data_type, DataType::Dictionary(..))
    }
}

/// Types compared byte by byte, whose composite field is a prefix of their bytes.
pub(super) fn bytes_type(data_type: &DataType) -> bool {
    use DataType::*;
    match data_type {
        Utf8 | LargeUtf8 | Utf8View | Binary | LargeBinary | BinaryView | FixedSizeBinary(_)
        | Decimal256(..) => true,
        Dictionary(_, values) => matches!(
            values.as_ref(),
            Utf8 | LargeUtf8 | Utf8View | Binary | LargeBinary | BinaryView
        ),
        _ => false,
    }
}
