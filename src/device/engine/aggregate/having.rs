//! `HAVING` on the device: after the aggregation, aggregate.cu's `agg_outputs` writes every
//! slot's values of the output columns a generated program reads (keys, and accumulators
//! decoded to their values, with validity bitmaps), and the program (src/fusion/aggregate.rs)
//! keeps the groups whose predicate holds: only those are ranked and selected.

use super::*;

/// The entry point of a generated `HAVING` program (src/fusion/aggregate.rs).
pub const AGG_HAVING_ENTRY: &str = "agg_having";

/// agg_outputs' column kinds (aggregate.cu `AGG_OUT_*`).
const AGG_OUT_KEY: u64 = 0;
const AGG_OUT_COUNT: u64 = 1;
const AGG_OUT_RAW: u64 = 2;
const AGG_OUT_ORD_I64: u64 = 3;
const AGG_OUT_ORD_F64: u64 = 4;

/// A column of the aggregation's output that a `HAVING` program reads: a key column, or the
/// value of one of the call's ops (i64, or f64 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HavingColumn {
    Key(usize),
    Op(usize),
}

/// A generated `HAVING` program and the output columns its inputs are, in order; a group it
/// rejects is never ranked. A group only the host evaluates declines the call
/// ([`AggregateDecline::HostOnlyRow`]).
#[derive(Debug, Clone, Copy)]
pub struct AggregateHaving<'a> {
    pub kernel: &'a GeneratedKernel,
    pub columns: &'a [HavingColumn],
}

/// agg_outputs' descriptor of `column`: its kind, key column or accumulator, and the
/// accumulator counting its non-NULL inputs (`AGG_NO_COLUMN`: never NULL).
fn output_descriptor(
    column: HavingColumn,
    keys: usize,
    ops: &[AggregateOp],
    plan: &AccumulatorPlan,
) -> GpuResult<u64> {
    let (kind, at, counted) = match column {
        HavingColumn::Key(j) if j < keys => (AGG_OUT_KEY, j, None),
        HavingColumn::Op(i) if i < ops.len() => {
            let kind = match ops[i] {
                AggregateOp::CountStar | AggregateOp::Count(_) => AGG_OUT_COUNT,
                AggregateOp::SumI64(_) | AggregateOp::SumF64(_) | AggregateOp::SumI64AsF64(_) => {
                    AGG_OUT_RAW
                }
                AggregateOp::MinI64(_) | AggregateOp::MaxI64(_) => AGG_OUT_ORD_I64,
                AggregateOp::MinF64(_) | AggregateOp::MaxF64(_) => AGG_OUT_ORD_F64,
            };
            (kind, i, plan.null_count[i])
        }
        other => return Err(GpuError(format!("HAVING reads {other:?}, not in the call"))),
    };
    let counted = counted.map_or(AGG_NO_COLUMN, |c| c as u64);
    Ok(kind | (at as u64) << 8 | counted << 16)
}

impl TopKEngine {
    /// The slots of the `groups` groups listed in `dense` that `having` keeps, and their
    /// number; `None` where a group sends the query to the host.
    pub(super) fn aggregate_having(
        &mut self,
        call: &AggregateCall<'_>,
        plan: &AccumulatorPlan,
        having: AggregateHaving<'_>,
        (table, dense): (&AggTable, &PooledBuffer),
        groups: usize,
    ) -> GpuResult<Option<(PooledBuffer, usize)>> {
        let (kw, cap) = (call.keys.len(), table.cap);
        let descriptors: Vec<u8> = (having.columns.iter())
            .map(|&c| output_descriptor(c, kw, call.ops, plan))
            .collect::<GpuResult<Vec<u64>>>()?
            .into_iter()
            .flat_map(u64::to_le_bytes)
            .collect();
        let n = having.columns.len();
        let desc = self
            .device
            .pool
            .alloc(descriptors.len().max(8), &self.stream)?;
        self.upload_bytes(&descriptors, desc.ptr())?;
        let out = self.device.pool.alloc(n.max(1) * cap * 8, &self.stream)?;
        let valid = self.device.pool.alloc(n.max(1) * cap / 8, &self.stream)?;
        self.launch(
            &format!("agg_outputs_w{kw}"),
            self.grid_for(cap, 4),
            AGG_THREADS,
            0,
            args![
                table.slots.ptr(),
                table.acc,
                cap,
                table.width,
                desc.ptr(),
                n as u32,
                out.ptr(),
                valid.ptr()
            ],
        )?;
        // Each input's four arguments: values, bit offset, validity, its bit offset.
        let mut args: Vec<Arg> = (0..n as u64)
            .flat_map(|j| {
                let values = out.ptr() + j * cap as u64 * 8;
                [values, 0, valid.ptr() + j * cap as u64 / 8, 0]
            })
            .map(Arg::U64)
            .collect();
        let kept = self.device.pool.alloc(groups.max(1) * 8, &self.stream)?;
        // The kept count (u64), then the error flags (u32).
        let words = self.device.pool.alloc(16, &self.stream)?;
        self.memset_zero(words.ptr(), 16)?;
        let rest = args![
            dense.ptr(),
            groups,
            kept.ptr(),
            words.ptr(),
            words.ptr() + 8
        ];
        args.extend_from_slice(rest);
        self.launch_function(
            &having.kernel.function,
            AGG_HAVING_ENTRY,
            self.grid_for(groups, 4),
            AGG_THREADS,
            0,
            &args,
        )?;
        let read = self.read_words(words.ptr(), 2)?;
        if read[1] as u32 != 0 {
            return Ok(None);
        }
        Ok(Some((kept, read[0] as usize)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys by column, counts as they are, sums raw, extremes decoded, each NULL where its
    /// column's count is 0.
    #[test]
    fn descriptors_name_each_columns_decoding() {
        let column = |nullable: bool| AggregateColumn {
            values: 0x1000,
            validity: if nullable { 0x2000 } else { 0 },
            validity_offset: 0,
        };
        let values = [column(true), column(false)];
        let ops = [
            AggregateOp::CountStar,
            AggregateOp::SumI64(0),
            AggregateOp::MaxF64(1),
            AggregateOp::MinI64(0),
        ];
        let plan = AccumulatorPlan::new(&values, &ops).unwrap();
        let d = |c| output_descriptor(c, 2, &ops, &plan).unwrap();
        assert_eq!(d(HavingColumn::Key(1)), 1 << 8 | 0xff << 16);
        assert_eq!(d(HavingColumn::Op(0)), AGG_OUT_COUNT | 0xff << 16);
        // The NULL count of column 0 is the accumulator after the ops.
        assert_eq!(d(HavingColumn::Op(1)), AGG_OUT_RAW | 1 << 8 | 4 << 16);
        assert_eq!(
            d(HavingColumn::Op(2)),
            AGG_OUT_ORD_F64 | 2 << 8 | 0xff << 16
        );
        assert_eq!(d(HavingColumn::Op(3)), AGG_OUT_ORD_I64 | 3 << 8 | 4 << 16);
        assert!(output_descriptor(HavingColumn::Key(2), 2, &ops, &plan).is_err());
        assert!(output_descriptor(HavingColumn::Op(4), 2, &ops, &plan).is_err());
    }
}
