//! Unit tests of the per-group operator's parts.

use std::collections::HashMap;

use crate::select::groups::GroupIds;

/// Equal keys get one number, in order of arrival, whatever their length (the empty key,
/// and keys that are prefixes of others, included); each key reads back as it came.
#[test]
fn group_ids_number_keys_in_order_of_arrival() {
    let mut ids = GroupIds::default();
    let keys: Vec<Vec<u8>> = (0..20_000u32)
        .map(|i| {
            let n = (i % 23) as usize;
            (0..n)
                .map(|j| (i.wrapping_mul(31) >> (j % 4)) as u8)
                .collect()
        })
        .collect();
    let mut first: Vec<Vec<u8>> = Vec::new();
    let mut known: HashMap<Vec<u8>, usize> = HashMap::new();
    for round in 0..2 {
        for key in &keys {
            let id = ids.id(key);
            match known.get(key) {
                Some(&at) => assert_eq!(id, at, "{key:?}"),
                None => {
                    assert_eq!(round, 0);
                    assert_eq!(id, first.len());
                    known.insert(key.clone(), id);
                    first.push(key.clone());
                }
            }
        }
    }
    assert!(first.len() > 1000, "{} distinct keys", first.len());
    for (id, key) in first.iter().enumerate() {
        assert_eq!(ids.key(id), key.as_slice());
    }
}
