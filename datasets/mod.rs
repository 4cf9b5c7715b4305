//! Synthetic data sets for tests, the CLI and the benchmarks.
//!
//! [`tweets`] models the 250M tweets of May 2017 used by the SIGMOD'18 bitonic top-k
//! evaluation, together with its four headline queries ([`QUERIES`]). [`hits`] is shaped like
//! ClickBench's `hits` table, with top-k queries over its aggregations ([`hits::queries`]).

pub mod hits;
mod shared;
pub mod tweets;

pub use shared::WriteSummary;
pub use tweets::{
    DEFAULT_SEED, LANGS, QUERIES, TABLE_NAME, TIME_END_MS, TIME_START_MS, TweetsSpec,
    generate_rows, q1_with_selectivity, time_bound_for_selectivity, tweets_gpu_table,
    tweets_mem_table, tweets_partitions, tweets_schema, write_parquet,
};
