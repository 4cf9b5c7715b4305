use datafusion::arrow::array::{Float64Array, Int64Array, UInt64Array};
use datafusion::arrow::compute::take_record_batch;
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::physical_plan::{collect_partitioned, displayable};
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};

use super::*;
use crate::device::{EncodedChunk, EncodedColumn};

/// The Parquet input of `sql`'s plan (a bare scan), its store and its layout.
async fn scanned(
    ctx: &SessionContext,
    sql: &str,
) -> (ParquetInput, Arc<dyn ObjectStore>, RowGroupLayout) {
    let plan = (ctx.sql(sql).await.unwrap())
        .create_physical_plan()
        .await
        .unwrap();
    let input = parquet_input(&plan).expect("a Parquet scan");
    let store = ctx.runtime_env().object_store(input.store()).unwrap();
    let layout = input.layout(&store).await.unwrap();
    (input, store, layout)
}

/// Files of several row groups, split into byte ranges over more partitions than files:
/// the columns read as a table and the rows read at positions are the scan's, in its order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_scan_reads_as_its_rows_in_input_order() {
    let dir = std::env::temp_dir().join(format!("gpu-topk-parquet-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("x", DataType::Float64, true),
    ]));
    for file in 0..3i64 {
        let properties = WriterProperties::builder()
            .set_max_row_group_row_count(Some(1000 + 300 * file as usize))
            .build();
        let out = std::fs::File::create(dir.join(format!("f{file}.parquet"))).unwrap();
        let mut writer = ArrowWriter::try_new(out, Arc::clone(&schema), Some(properties)).unwrap();
        let ids: Vec<i64> = (0..7000).map(|i| file * 10_000 + i).collect();
        let xs: Vec<Option<f64>> = ids
            .iter()
            .map(|&i| (i % 7 != 0).then_some((i * 37 % 101) as f64))
            .collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(Float64Array::from(xs)),
            ],
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }
    let config = SessionConfig::new()
        .with_target_partitions(5)
        .with_repartition_file_min_size(1024);
    let ctx = SessionContext::new_with_config(config);
    let path = dir.to_str().unwrap();
    ctx.register_parquet("t", path, ParquetReadOptions::default())
        .await
        .unwrap();
    // Columns, and a column computed in the scan (evaluated here on every row).
    for sql in [
        "SELECT x, id FROM t",
        "SELECT x * 2.0 - 1.0 AS y, id FROM t",
    ] {
        let plan = ctx
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let scan = plan.with_preserve_order(true).unwrap_or(plan);
        let text = displayable(scan.as_ref()).indent(true).to_string();
        assert!(text.contains(".parquet:"), "ranges expected: {text}");
        let input = parquet_input(&scan).expect("a Parquet scan");
        assert_eq!(input.columns[1].to_string(), "id@0", "{sql}");
        let computed = input.columns[0].downcast_ref::<Column>().is_none();
        assert_eq!(computed, sql.contains('*'), "{sql}: {}", input.columns[0]);
        let partitions = collect_partitioned(Arc::clone(&scan), ctx.task_ctx())
            .await
            .unwrap();
        let batches: Vec<RecordBatch> = partitions.into_iter().flatten().collect();
        let want = concat_batches(&scan.schema(), &batches).unwrap();
        assert_eq!(want.num_rows(), 21_000);

        let store = ctx.runtime_env().object_store(input.store()).unwrap();
        let layout = input.layout(&store).await.unwrap();
        assert_eq!(layout.rows, 21_000);
        let read = input.read_columns(&store, &layout, &[0, 1]).await.unwrap();
        for (column, chunks) in read.iter().enumerate() {
            let arrays: Vec<&dyn datafusion::arrow::array::Array> =
                chunks.iter().map(|a| a.as_ref()).collect();
            let got = datafusion::arrow::compute::concat(&arrays).unwrap();
            assert_eq!(
                got.as_ref(),
                want.column(column).as_ref(),
                "{sql}: {column}"
            );
        }
        // Winners in any order, from several files and row groups, one repeated.
        let positions: Vec<u64> = vec![20_999, 5, 7000, 13_999, 1001, 5, 14_000, 3300];
        let (batches, at) = input
            .read_rows(&store, &layout, &positions, &[1, 0])
            .await
            .unwrap();
        for (i, &p) in positions.iter().enumerate() {
            let (slot, row) = at[i];
            let expected = take_record_batch(&want, &UInt64Array::from(vec![p])).unwrap();
            for (got, column) in [(0, 1), (1, 0)] {
                let got = batches[slot][got].slice(row, 1);
                assert_eq!(&got, expected.column(column), "{sql}: position {p}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Row groups' statistics read as chunk zones: each row group's least and greatest values
/// and NULLs, as the column cache derives them from the decoded row groups, for the
/// scan's row groups of split files; none for floats or where the session turns pruning
/// off. A prefix layout holds the whole row groups of the first rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_group_statistics_are_the_zones_of_the_row_groups() {
    let dir = std::env::temp_dir().join(format!("gpu-topk-zones-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ms = DataType::Timestamp(datafusion::arrow::datatypes::TimeUnit::Millisecond, None);
    let schema = Arc::new(Schema::new(vec![
        Field::new("t", DataType::Int64, true),
        Field::new("x", DataType::Float64, true),
        Field::new("ms", ms, false),
    ]));
    for file in 0..2i64 {
        let properties = WriterProperties::builder()
            .set_max_row_group_row_count(Some(700))
            .build();
        let out = std::fs::File::create(dir.join(format!("f{file}.parquet"))).unwrap();
        let mut writer = ArrowWriter::try_new(out, Arc::clone(&schema), Some(properties)).unwrap();
        // Ascending, NULL every 11th row, and all NULL in one row group.
        let ts: Vec<Option<i64>> = (0..3000i64)
            .map(|i| (i % 11 != 0 && !(1400..2100).contains(&i)).then_some(file * 5000 + i))
            .collect();
        let xs: Vec<f64> = (0..3000).map(|i| i as f64).collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ts)),
                Arc::new(Float64Array::from(xs)),
                Arc::new(datafusion::arrow::array::TimestampMillisecondArray::from(
                    (0..3000).collect::<Vec<i64>>(),
                )),
            ],
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }
    for pruning in [true, false] {
        let config = SessionConfig::new()
            .with_target_partitions(3)
            .with_repartition_file_min_size(1024)
            .set_bool("datafusion.execution.parquet.pruning", pruning);
        let ctx = SessionContext::new_with_config(config);
        let path = dir.to_str().unwrap();
        ctx.register_parquet("t", path, ParquetReadOptions::default())
            .await
            .unwrap();
        let (input, store, layout) = scanned(&ctx, "SELECT t, x, ms FROM t").await;
        assert_eq!(layout.rows, 6000);
        assert!(input.row_group_zones(&layout, 1).is_none(), "floats");
        assert_eq!(input.row_group_zones(&layout, 2).is_some(), pruning);
        // The same files read as timestamps of another unit: their statistics are not
        // those values.
        let micros = DataType::Timestamp(datafusion::arrow::datatypes::TimeUnit::Microsecond, None);
        let read_as = Schema::new(vec![
            Field::new("t", DataType::Int64, true),
            Field::new("x", DataType::Float64, true),
            Field::new("ms", micros, false),
        ]);
        let options = ParquetReadOptions::default().schema(&read_as);
        ctx.register_parquet("u", path, options).await.unwrap();
        let (other, _, other_layout) = scanned(&ctx, "SELECT ms FROM u").await;
        assert!(
            other.row_group_zones(&other_layout, 0).is_none(),
            "another unit"
        );
        let Some(zones) = input.row_group_zones(&layout, 0) else {
            assert!(!pruning, "zones expected");
            continue;
        };
        assert!(pruning, "no zones without pruning");
        let chunks = input.read_columns(&store, &layout, &[0]).await.unwrap();
        assert_eq!(chunks[0].len(), 10, "five row groups a file");
        let want = crate::input::zones::derive_zones(&chunks[0]).unwrap();
        assert_eq!(zones.mins.as_ref(), want.mins.as_ref());
        assert_eq!(zones.maxs.as_ref(), want.maxs.as_ref());
        assert_eq!(zones.nulls.as_ref(), want.nulls.as_ref());
        assert_eq!(zones.rows.as_ref(), want.rows.as_ref());
        // The first rows, in whole row groups.
        for (rows, groups) in [(1, 1), (700, 1), (701, 2), (3001, 6), (6000, 10)] {
            let prefix = layout.prefix(rows);
            let held: usize = chunks[0][..groups].iter().map(|a| a.len()).sum();
            assert_eq!(prefix.rows, held, "{rows}");
            let read = input.read_columns(&store, &prefix, &[0]).await.unwrap();
            assert_eq!(read[0].len(), groups, "{rows}");
            for (got, want) in read[0].iter().zip(&chunks[0]) {
                assert_eq!(got.as_ref(), want.as_ref(), "{rows}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Row groups' dictionaries renumbered into one: every row's code names its string (NULL
/// keys stay NULL, a NULL entry stays one), entries in the order they first appear,
/// the same for the same row groups; too many entries for the key type are an error.
#[test]
fn row_groups_codes_are_renumbered_into_one_dictionary() {
    use datafusion::arrow::array::{Array, AsArray, DictionaryArray, Int8Array, StringArray};
    use datafusion::arrow::datatypes::{Int8Type, Int32Type};
    let group = |keys: Vec<Option<i32>>, values: Vec<Option<&str>>| -> ArrayRef {
        let keys = datafusion::arrow::array::Int32Array::from(keys);
        Arc::new(
            DictionaryArray::<Int32Type>::try_new(keys, Arc::new(StringArray::from(values)))
                .unwrap(),
        )
    };
    let chunks = vec![
        group(
            vec![Some(0), Some(1), None, Some(1)],
            vec![Some("en"), Some("es")],
        ),
        group(
            vec![Some(2), Some(0), Some(1), Some(0)],
            vec![Some("fr"), None, Some("en")],
        ),
        group(vec![Some(0)], vec![Some("ja"), Some("unused")]),
    ];
    let (codes, dictionary) = global_codes(&chunks).unwrap();
    let dictionary = dictionary.as_string::<i32>();
    let order: Vec<Option<&str>> = dictionary.iter().collect();
    assert_eq!(
        order,
        vec![
            Some("en"),
            Some("es"),
            Some("fr"),
            None,
            Some("ja"),
            Some("unused")
        ]
    );
    for (chunk, codes) in chunks.iter().zip(&codes) {
        let chunk = chunk.as_dictionary::<Int32Type>();
        let codes = codes.as_primitive::<Int32Type>();
        assert_eq!(codes.len(), chunk.len());
        for row in 0..chunk.len() {
            assert_eq!(codes.is_null(row), chunk.is_null(row), "row {row}");
            if chunk.is_null(row) {
                continue;
            }
            let values = chunk.values().as_string::<i32>();
            let key = chunk.keys().value(row) as usize;
            let want = values.is_valid(key).then(|| values.value(key));
            let code = codes.value(row) as usize;
            let got = dictionary.is_valid(code).then(|| dictionary.value(code));
            assert_eq!(got, want, "row {row}");
        }
    }
    let (again, _) = global_codes(&chunks).unwrap();
    assert_eq!(again, codes);
    // 200 entries do not fit Int8 keys.
    let wide: Vec<ArrayRef> = (0..2)
        .map(|g| {
            let values: Vec<String> = (0..100).map(|i| format!("{g}-{i}")).collect();
            let keys = Int8Array::from_iter_values(0..100);
            Arc::new(
                DictionaryArray::<Int8Type>::try_new(keys, Arc::new(StringArray::from(values)))
                    .unwrap(),
            ) as ArrayRef
        })
        .collect();
    let error = global_codes(&wide).unwrap_err().to_string();
    assert!(error.contains("do not fit"), "{error}");
    assert!(global_codes(&[Arc::new(StringArray::from(vec!["x"])) as ArrayRef]).is_err());
}

/// What parquet.cu computes from a column's pages, on the host: each row's value (its
/// image bytes, little-endian) and validity, walking the same runs.
fn decode_like_the_device(column: &EncodedColumn) -> (Vec<u64>, Vec<bool>) {
    let chunks: Vec<EncodedChunk> = (0..column.chunk_count)
        .map(|_| column.next_chunk().unwrap())
        .collect();
    assert!(
        chunks.iter().any(|c| c.pages.len() > 1),
        "pages of 300 rows"
    );
    fn runs(stream: &[u8], bits: u32, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n);
        let mut at = 0;
        while out.len() < n {
            let (mut header, mut shift) = (0u32, 0);
            loop {
                let b = stream[at];
                at += 1;
                header |= u32::from(b & 0x7f) << shift;
                shift += 7;
                if b & 0x80 == 0 {
                    break;
                }
            }
            if header & 1 == 1 {
                let count = (header >> 1) as usize * 8;
                for i in 0..count {
                    let bit = at * 8 + i * bits as usize;
                    let mut word = 0u64;
                    for j in 0..8 {
                        word |= u64::from(*stream.get(bit / 8 + j).unwrap_or(&0)) << (8 * j);
                    }
                    out.push(((word >> (bit % 8)) & ((1u64 << bits) - 1)) as u32);
                }
                at += (header >> 1) as usize * bits as usize;
            } else {
                let bytes = bits.div_ceil(8) as usize;
                let mut value = 0u32;
                for j in 0..bytes {
                    value |= u32::from(stream[at + j]) << (8 * j);
                }
                at += bytes;
                out.extend(std::iter::repeat_n(value, (header >> 1) as usize));
            }
        }
        out.truncate(n);
        out
    }
    let (stored, width) = (column.stored_width, column.width);
    let value = |bytes: &[u8], i: usize| {
        let mut v = 0u64;
        for j in 0..stored {
            v |= u64::from(bytes[i * stored + j]) << (8 * j);
        }
        if width < 8 {
            v & ((1u64 << (8 * width)) - 1)
        } else {
            v
        }
    };
    let (mut values, mut valid) = (vec![0; column.rows], vec![false; column.rows]);
    // Chunks arrive in any order; each page knows its rows.
    for chunk in &chunks {
        for page in &chunk.pages {
            let bytes = &page.bytes;
            let rows = page.rows as usize;
            let levels = &bytes[page.levels.start as usize..page.levels.end as usize];
            let here: Vec<bool> = match levels.is_empty() {
                true => vec![true; rows],
                false => runs(levels, 1, rows).into_iter().map(|l| l == 1).collect(),
            };
            let data = &bytes[page.values.start as usize..page.values.end as usize];
            let count = here.iter().filter(|&&v| v).count();
            let taken: Vec<u64> = match (page.dictionary, &chunk.dictionary) {
                (true, Some((dictionary, entries))) => runs(&data[1..], u32::from(data[0]), count)
                    .into_iter()
                    .map(|i| {
                        assert!(u64::from(i) < *entries);
                        value(dictionary, i as usize)
                    })
                    .collect(),
                (true, None) => panic!("a dictionary page without a dictionary"),
                (false, _) => (0..count).map(|i| value(data, i)).collect(),
            };
            let mut next = taken.into_iter();
            for (i, is_valid) in here.into_iter().enumerate() {
                let row = page.first_row as usize + i;
                values[row] = if is_valid { next.next().unwrap() } else { 0 };
                valid[row] = is_valid;
            }
        }
    }
    (values, valid)
}

/// Every type the device decodes, NULLs and none, over files written with dictionaries,
/// without them and with a dictionary that overflows into PLAIN pages; v1 and v2 pages;
/// uncompressed, zstd, snappy and lz4; many pages a row group: the pages read for the
/// device decode, as the kernel does, to the values the host's reader decodes. Columns in
/// an encoding the device does not decode (DELTA_BINARY_PACKED, strings) are not read as
/// pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_decode_to_the_readers_values() {
    use datafusion::arrow::array::{
        Array, Date32Array, Float32Array, Int8Array, Int16Array, Int32Array, StringArray,
        TimestampMicrosecondArray, TimestampNanosecondArray, UInt8Array, UInt16Array, UInt32Array,
    };
    use datafusion::arrow::datatypes::TimeUnit;
    use datafusion::parquet::basic::{Compression, ZstdLevel};
    use datafusion::parquet::file::properties::WriterVersion;
    let n = 9000usize;
    let null = |i: usize| i % 11 == 3;
    let v = |i: usize| ((i * 7919) % 1000) as i64 - 500;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("i8", DataType::Int8, true),
        Field::new("i16", DataType::Int16, true),
        Field::new("i32", DataType::Int32, false),
        Field::new("u8", DataType::UInt8, true),
        Field::new("u16", DataType::UInt16, true),
        Field::new("u32", DataType::UInt32, true),
        Field::new("u64", DataType::UInt64, true),
        Field::new("f32", DataType::Float32, true),
        Field::new("f64", DataType::Float64, true),
        Field::new("d", DataType::Date32, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new(
            "tz",
            DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
            true,
        ),
        Field::new("all", DataType::Int64, true),
        Field::new("s", DataType::Utf8, true),
    ]));
    let opt = |i: usize, x: i64| (!null(i)).then_some(x);
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(
            (0..n).map(|i| i as i64 * 1_000_003),
        )),
        Arc::new(Int8Array::from_iter(
            (0..n).map(|i| opt(i, v(i) % 128).map(|x| x as i8)),
        )),
        Arc::new(Int16Array::from_iter(
            (0..n).map(|i| opt(i, v(i) * 60).map(|x| x as i16)),
        )),
        Arc::new(Int32Array::from_iter_values(
            (0..n).map(|i| v(i) as i32 * 4_000_000),
        )),
        Arc::new(UInt8Array::from_iter(
            (0..n).map(|i| opt(i, v(i) + 500).map(|x| x as u8)),
        )),
        Arc::new(UInt16Array::from_iter(
            (0..n).map(|i| opt(i, v(i) * 99).map(|x| x as u16)),
        )),
        Arc::new(UInt32Array::from_iter(
            (0..n).map(|i| opt(i, v(i) << 22).map(|x| x as u32)),
        )),
        Arc::new(UInt64Array::from_iter(
            (0..n).map(|i| opt(i, v(i) << 50).map(|x| x as u64)),
        )),
        Arc::new(Float32Array::from_iter(
            (0..n).map(|i| opt(i, v(i)).map(|x| x as f32 / 3.0)),
        )),
        Arc::new(Float64Array::from_iter(
            (0..n).map(|i| opt(i, i as i64).map(|x| x as f64 * 0.1)),
        )),
        Arc::new(Date32Array::from_iter(
            (0..n).map(|i| opt(i, v(i) * 40).map(|x| x as i32)),
        )),
        Arc::new(TimestampMicrosecondArray::from_iter(
            (0..n).map(|i| opt(i, v(i) << 30)),
        )),
        Arc::new(
            TimestampNanosecondArray::from_iter((0..n).map(|i| opt(i, i as i64 * 999_983)))
                .with_timezone("UTC"),
        ),
        Arc::new(Int64Array::from_iter(
            (0..n).map(|i| (i >= n / 2).then_some(v(i))),
        )),
        Arc::new(StringArray::from_iter(
            (0..n).map(|i| opt(i, v(i)).map(|x| x.to_string())),
        )),
    ];
    let batch = RecordBatch::try_new(Arc::clone(&schema), columns).unwrap();
    let zstd = Compression::ZSTD(ZstdLevel::default());
    // Without a dictionary, v2 pages store integers DELTA_BINARY_PACKED: host-decoded.
    let writers = [
        (
            "dictionary",
            true,
            WriterVersion::PARQUET_1_0,
            Compression::UNCOMPRESSED,
            1 << 20,
        ),
        (
            "plain-zstd",
            false,
            WriterVersion::PARQUET_1_0,
            zstd,
            1 << 20,
        ),
        (
            "dictionary-v2-snappy",
            true,
            WriterVersion::PARQUET_2_0,
            Compression::SNAPPY,
            1 << 20,
        ),
        (
            "overflow-lz4",
            true,
            WriterVersion::PARQUET_1_0,
            Compression::LZ4_RAW,
            512,
        ),
        (
            "delta-v2",
            false,
            WriterVersion::PARQUET_2_0,
            Compression::UNCOMPRESSED,
            1 << 20,
        ),
    ];
    for (name, dictionary, version, compression, dictionary_bytes) in writers {
        let dir =
            std::env::temp_dir().join(format!("gpu-topk-pages-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for file in 0..2 {
            let properties = WriterProperties::builder()
                .set_max_row_group_row_count(Some(2000 + 700 * file))
                .set_data_page_row_count_limit(300)
                .set_write_batch_size(100)
                .set_dictionary_enabled(dictionary)
                .set_dictionary_page_size_limit(dictionary_bytes)
                .set_writer_version(version)
                .set_compression(compression)
                .build();
            let out = std::fs::File::create(dir.join(format!("f{file}.parquet"))).unwrap();
            let mut writer =
                ArrowWriter::try_new(out, Arc::clone(&schema), Some(properties)).unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
        }
        let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(3));
        ctx.register_parquet("t", dir.to_str().unwrap(), ParquetReadOptions::default())
            .await
            .unwrap();
        let (input, store, layout) = scanned(&ctx, "SELECT * FROM t").await;
        assert_eq!(layout.rows, 2 * n);
        let strings = schema.fields().len() - 1;
        assert!(
            input
                .read_pages(&store, &layout, strings, false)
                .await
                .unwrap()
                .is_none()
        );
        for c in 0..strings {
            let streaming = c % 2 == 0;
            let pages = input
                .read_pages(&store, &layout, c, streaming)
                .await
                .unwrap();
            let float = matches!(
                schema.field(c).data_type(),
                DataType::Float32 | DataType::Float64
            );
            if name == "delta-v2" && !float {
                assert!(pages.is_none(), "{name}: column {c} is DELTA_BINARY_PACKED");
                continue;
            }
            let pages = pages.unwrap_or_else(|| panic!("{name}: column {c} as pages"));
            let chunks = input
                .read_columns(&store, &layout, &[c])
                .await
                .unwrap()
                .remove(0);
            let arrays: Vec<&dyn Array> = chunks.iter().map(|a| a.as_ref()).collect();
            let want = datafusion::arrow::compute::concat(&arrays).unwrap();
            assert_eq!(pages.rows, want.len());
            assert_eq!(
                pages.nullable,
                want.null_count() > 0 || c == strings - 1,
                "{name} {c}"
            );
            let (values, valid) = decode_like_the_device(&pages);
            let data = want.to_data();
            let bytes = data.buffers()[0].as_slice();
            for row in 0..want.len() {
                assert_eq!(
                    valid[row],
                    want.is_valid(row),
                    "{name}: column {c} row {row}"
                );
                if valid[row] {
                    let w = pages.width;
                    let at = (data.offset() + row) * w;
                    let mut expected = 0u64;
                    for j in 0..w {
                        expected |= u64::from(bytes[at + j]) << (8 * j);
                    }
                    assert_eq!(values[row], expected, "{name}: column {c} row {row}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
