//! The host's top-k over an aggregate, a row at a time in a `HashMap`, with DataFusion 55's
//! grouped accumulators' semantics: the reference the device's results are tested against.
//! A call with a filter ([`super::AggregateFilter`]) is the reference over the rows its
//! predicate passes: the caller hands it those rows alone (a row the device declines on, the
//! reference never sees: DataFusion answers such a query); with a `HAVING`
//! ([`super::AggregateHaving`]), the first k of the reference's groups in order (all of them
//! asked for) that pass it.

use std::cmp::Ordering;
use std::collections::HashMap;

use super::{AggValue, AggregateDecline, AggregateGroup, AggregateOp, AggregateOrder, RankBy};

/// A host column of 8-byte values (their bits: i64 or f64 by the op that reads them) and
/// their validity (`None`: no NULLs).
#[derive(Debug, Clone, Copy)]
pub struct HostColumn<'a> {
    pub values: &'a [u64],
    pub valid: Option<&'a [bool]>,
}

impl HostColumn<'_> {
    fn get(&self, row: usize) -> Option<u64> {
        self.valid.is_none_or(|v| v[row]).then(|| self.values[row])
    }
}

/// One op's state for a group.
#[derive(Debug, Clone, Copy)]
enum State {
    Count(u64),
    SumI64(Option<i64>),
    SumF64(Option<f64>),
    MinMaxI64(Option<i64>),
    /// DataFusion's value (from its start value) and whether a value was seen.
    MinMaxF64(f64, bool),
}

impl State {
    fn new(op: AggregateOp) -> Self {
        match op {
            AggregateOp::CountStar | AggregateOp::Count(_) => Self::Count(0),
            AggregateOp::SumI64(_) => Self::SumI64(None),
            AggregateOp::SumF64(_) | AggregateOp::SumI64AsF64(_) => Self::SumF64(None),
            AggregateOp::MinI64(_) | AggregateOp::MaxI64(_) => Self::MinMaxI64(None),
            AggregateOp::MinF64(_) => Self::MinMaxF64(f64::MAX, false),
            AggregateOp::MaxF64(_) => Self::MinMaxF64(f64::MIN, false),
        }
    }

    /// Adds a non-NULL value (`bits`; 0 for COUNT(*)). A NaN into an f64 extreme declines.
    fn update(&mut self, op: AggregateOp, bits: u64) -> Result<(), AggregateDecline> {
        let min = matches!(op, AggregateOp::MinI64(_) | AggregateOp::MinF64(_));
        match (self, op) {
            (Self::Count(c), _) => *c += 1,
            (Self::SumI64(s), _) => *s = Some(s.unwrap_or(0).wrapping_add(bits as i64)),
            (Self::SumF64(s), AggregateOp::SumI64AsF64(_)) => {
                *s = Some(s.unwrap_or(0.0) + bits as i64 as f64)
            }
            (Self::SumF64(s), _) => *s = Some(s.unwrap_or(0.0) + f64::from_bits(bits)),
            (Self::MinMaxI64(m), _) => {
                let v = bits as i64;
                *m = Some(m.map_or(v, |m| if min { m.min(v) } else { m.max(v) }));
            }
            (Self::MinMaxF64(m, seen), _) => {
                let v = f64::from_bits(bits);
                if v.is_nan() {
                    return Err(AggregateDecline::NanInMinMax);
                }
                // DataFusion's `primitive_min_accumulator` / `primitive_max_accumulator`.
                let want = if min {
                    Ordering::Less
                } else {
                    Ordering::Greater
                };
                if v.partial_cmp(m).is_none_or(|o| o == want) {
                    *m = v;
                }
                *seen = true;
            }
        }
        Ok(())
    }

    fn value(self) -> AggValue {
        match self {
            Self::Count(c) => AggValue::Count(c),
            Self::SumI64(s) | Self::MinMaxI64(s) => AggValue::I64(s),
            Self::SumF64(s) => AggValue::F64(s),
            // The device keeps +0.0 for a zero extreme.
            Self::MinMaxF64(m, seen) => {
                AggValue::F64(seen.then_some(if m == 0.0 { 0.0 } else { m }))
            }
        }
    }
}

/// A ranking value, compared as DataFusion sorts it (f64 by `total_cmp`).
#[derive(Debug, Clone, Copy)]
enum Rank {
    Null,
    U(u64),
    I(i64),
    F(f64),
}

fn rank_of(by: RankBy, key: &[Option<i64>], values: &[AggValue]) -> Rank {
    let f = |v: AggValue| match v {
        AggValue::Count(c) => Some(c as f64),
        AggValue::I64(v) => v.map(|v| v as f64),
        AggValue::F64(v) => v,
    };
    match by {
        RankBy::Op(i) => match values[i] {
            AggValue::Count(c) => Rank::U(c),
            AggValue::I64(v) => v.map_or(Rank::Null, Rank::I),
            AggValue::F64(v) => v.map_or(Rank::Null, Rank::F),
        },
        RankBy::Avg { sum, count } => match (f(values[sum]), values[count]) {
            (Some(s), AggValue::Count(c)) if c > 0 => Rank::F(s / c as f64),
            _ => Rank::Null,
        },
        RankBy::Key(j) => key[j].map_or(Rank::Null, Rank::I),
    }
}

fn compare(
    a: &(Rank, &Vec<Option<i64>>),
    b: &(Rank, &Vec<Option<i64>>),
    order: AggregateOrder,
) -> Ordering {
    let by_value = match (a.0, b.0) {
        (Rank::Null, Rank::Null) => Ordering::Equal,
        (Rank::Null, _) if order.nulls_first => Ordering::Less,
        (Rank::Null, _) => Ordering::Greater,
        (_, Rank::Null) if order.nulls_first => Ordering::Greater,
        (_, Rank::Null) => Ordering::Less,
        (x, y) => {
            let o = match (x, y) {
                (Rank::U(x), Rank::U(y)) => x.cmp(&y),
                (Rank::I(x), Rank::I(y)) => x.cmp(&y),
                (Rank::F(x), Rank::F(y)) => x.total_cmp(&y),
                _ => unreachable!("one op ranks every group"),
            };
            if order.descending { o.reverse() } else { o }
        }
    };
    // Ties: keys ascending, NULL after every value, the first column first.
    by_value.then_with(|| {
        let key = |k: &Option<i64>| (k.is_none(), k.unwrap_or(0));
        a.1.iter().map(key).cmp(b.1.iter().map(key))
    })
}

/// The min(k, groups) best groups of `keys`' groups by `order` (ties by the group key, as on
/// the device), and the number of groups; or why the device declines such a query.
pub fn aggregate_top_k_host(
    keys: &[HostColumn<'_>],
    values: &[HostColumn<'_>],
    ops: &[AggregateOp],
    order: AggregateOrder,
    k: usize,
) -> Result<(Vec<AggregateGroup>, usize), AggregateDecline> {
    let rows = keys.first().map_or(0, |c| c.values.len());
    let mut groups: HashMap<Vec<Option<i64>>, Vec<State>> = HashMap::new();
    for row in 0..rows {
        let key: Vec<Option<i64>> = keys.iter().map(|c| c.get(row).map(|v| v as i64)).collect();
        let states = groups
            .entry(key)
            .or_insert_with(|| ops.iter().map(|op| State::new(*op)).collect());
        for (state, op) in states.iter_mut().zip(ops) {
            let bits = match op.column() {
                None => Some(0),
                Some(c) => values[c].get(row),
            };
            if let Some(bits) = bits {
                state.update(*op, bits)?;
            }
        }
    }
    let count = groups.len();
    let all: Vec<AggregateGroup> = (groups.into_iter())
        .map(|(key, states)| AggregateGroup {
            key,
            values: states.into_iter().map(State::value).collect(),
        })
        .collect();
    let mut ranked: Vec<(Rank, &AggregateGroup)> = all
        .iter()
        .map(|g| (rank_of(order.by, &g.key, &g.values), g))
        .collect();
    ranked.sort_by(|a, b| compare(&(a.0, &a.1.key), &(b.0, &b.1.key), order));
    let top = ranked.into_iter().take(k).map(|(_, g)| g.clone()).collect();
    Ok((top, count))
}
