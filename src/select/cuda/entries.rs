//! Lower-level entries for tests and benchmarks: selection of host-encoded keys on the
//! device, and the device encoding alone, to compare bit for bit with the keys module.

use super::*;

/// Host-encoded composite keys, one per row.
#[derive(Debug, Clone, Copy)]
pub enum HostKeys<'a> {
    U32(&'a [u32]),
    U64(&'a [u64]),
    U128(&'a [u128]),
    U256(&'a [U256]),
}

impl HostKeys<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            HostKeys::U32(v) => v.len(),
            HostKeys::U64(v) => v.len(),
            HostKeys::U128(v) => v.len(),
            HostKeys::U256(v) => v.len(),
        }
    }

    pub fn kind(&self) -> KeyWidth {
        match self {
            HostKeys::U32(_) => KeyWidth::W32,
            HostKeys::U64(_) => KeyWidth::W64,
            HostKeys::U128(_) => KeyWidth::W128,
            HostKeys::U256(_) => KeyWidth::W256,
        }
    }

    /// The keys in the device layout: little-endian words, least significant first.
    pub(crate) fn device_bytes(&self) -> Vec<u8> {
        match self {
            HostKeys::U32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostKeys::U64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostKeys::U128(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostKeys::U256(v) => v
                .iter()
                .flat_map(|x| {
                    let mut b = [0u8; 32];
                    b[..16].copy_from_slice(&x.lo.to_le_bytes());
                    b[16..].copy_from_slice(&x.hi.to_le_bytes());
                    b
                })
                .collect(),
        }
    }
}

/// Selects the `k` smallest (key, row id) pairs of host-encoded keys on the device and returns
/// their row ids sorted by (key, row id): the first min(n, k) of a stable sort.
pub fn select_topk_device(
    device: &Arc<GpuDevice>,
    keys: HostKeys<'_>,
    ids: &[u64],
    k: usize,
    algorithm: DeviceAlgorithm,
) -> GpuResult<Vec<u64>> {
    if keys.len() != ids.len() {
        return Err(GpuError(format!(
            "{} keys and {} row ids",
            keys.len(),
            ids.len()
        )));
    }
    let mut engine = TopKEngine::new(device, keys.kind())?;
    let n = ids.len();
    let mut pairs = engine.upload_pairs(&keys.device_bytes(), ids)?;
    // Ids 0..n: passes that only filter may skip reading them.
    pairs.set_positional(ids.iter().enumerate().all(|(i, &id)| id == i as u64));
    let (sorted, m) = engine.select_sorted(&pairs, n, k, algorithm)?;
    engine.download_ids(&sorted, m)
}

/// Encodes one batch of key columns on the device (the selector's path) and returns the
/// composites in the layout's width, to compare with [`KeyLayout::encode`].
pub fn encode_keys_device(
    device: &Arc<GpuDevice>,
    layout: &KeyLayout,
    columns: &[ArrayRef],
) -> Result<EncodedKeys> {
    let plans = plan_columns(layout, columns)?;
    let n = columns.first().map_or(0, |c| c.len());
    let kind = layout.width();
    let bytes = (|| {
        let mut engine = TopKEngine::new(device, kind)?;
        if n == 0 {
            return Ok(vec![]);
        }
        let mut buffer = None;
        let batch = encode_batch(&mut engine, &mut buffer, &plans, n, &RowIds::Range(0))?;
        engine.read_bytes(batch.keys, n * kind.key_bytes())
    })()
    .map_err(gpu_error)?;
    let words = |size: usize| bytes.chunks_exact(size);
    Ok(match layout.width() {
        KeyWidth::W32 => EncodedKeys::W64(
            words(4)
                .map(|c| u64::from(u32::from_le_bytes(c.try_into().unwrap())))
                .collect(),
        ),
        KeyWidth::W64 => EncodedKeys::W64(
            words(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        KeyWidth::W128 => EncodedKeys::W128(
            words(16)
                .map(|c| u128::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        KeyWidth::W256 => EncodedKeys::W256(
            words(32)
                .map(|c| U256 {
                    lo: u128::from_le_bytes(c[..16].try_into().unwrap()),
                    hi: u128::from_le_bytes(c[16..].try_into().unwrap()),
                })
                .collect(),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u256_device_layout_is_little_endian_words() {
        let key = U256 {
            hi: (4u128 << 64) | 3,
            lo: (2u128 << 64) | 1,
        };
        let bytes = HostKeys::U256(&[key]).device_bytes();
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(words, vec![1, 2, 3, 4]);
    }
}
