//! `PlanCache`: repeated statements reuse their plan and still give DataFusion's rows, over
//! every storage and with an aggregate, a join or a window below; any change to what a plan
//! was made from (a table's rows or files, a setting, a view, a prepared statement) plans the
//! statement again.

use std::sync::Arc;

use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::PlanCache;
use datafusion_gpu_topk::internal::device::started_gpu;

use crate::common::{STORAGES, Storage, exact_rows, plain_session, run_oracle, session, test_dir};
use crate::files::{assert_same, register_tables, ties_table};

/// Queries whose answer is one order (ties broken by `rid` in the oracle, by the input order
/// in ours, which is the same), with their oracles.
const QUERIES: &[(&str, &str)] = &[
    (
        "SELECT g, rid FROM t ORDER BY g LIMIT 400",
        "SELECT g, rid FROM t ORDER BY g, rid LIMIT 400",
    ),
    (
        "SELECT c, rid FROM t WHERE g <> 2 ORDER BY c DESC LIMIT 90 OFFSET 25",
        "SELECT c, rid FROM t WHERE g <> 2 ORDER BY c DESC, rid LIMIT 90 OFFSET 25",
    ),
    (
        "SELECT g, COUNT(*) AS n, SUM(w) AS s FROM t GROUP BY g ORDER BY s DESC LIMIT 3",
        "SELECT g, COUNT(*) AS n, SUM(w) AS s FROM t GROUP BY g ORDER BY s DESC LIMIT 3",
    ),
    (
        "SELECT t.rid, l.label FROM t JOIN l ON t.g = l.g ORDER BY t.w DESC, l.label LIMIT 20",
        "SELECT t.rid, l.label FROM t JOIN l ON t.g = l.g ORDER BY t.w DESC, l.label LIMIT 20",
    ),
    (
        "SELECT rid, g FROM (SELECT rid, g, ROW_NUMBER() OVER (PARTITION BY g ORDER BY w DESC) \
         AS rn FROM t) WHERE rn <= 2 ORDER BY g, rid",
        "SELECT rid, g FROM (SELECT rid, g, ROW_NUMBER() OVER (PARTITION BY g ORDER BY w DESC) \
         AS rn FROM t) WHERE rn <= 2 ORDER BY g, rid",
    ),
];

/// Runs `sql` through `plans` and checks it against `oracle` in `plain`.
async fn check(plans: &PlanCache, ours: &SessionContext, plain: &SessionContext, sql: &str) {
    check_against(plans, ours, plain, sql, sql).await
}

/// Runs the test alone among those that empty the column cache, with the device probed
/// first: a change of the device's state (started, calibrated) plans every statement again.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    let guard = crate::cache::CACHE.lock().await;
    let _ = datafusion_gpu_topk::internal::device::gpu_status();
    guard
}

/// Whether the next run of `sql` would reuse a kept plan (which it keeps or replaces).
async fn reused(plans: &PlanCache, ctx: &SessionContext, sql: &str) -> bool {
    plans.plan(ctx, sql).await.unwrap().reused()
}

/// Runs `sql` until its plan is reused: on a GPU the first runs load columns into the device
/// cache, which plans the statements again (the cost model sees them resident).
async fn warm_up(plans: &PlanCache, ctx: &SessionContext, sql: &str) {
    for _ in 0..4 {
        if reused(plans, ctx, sql).await {
            return;
        }
        plans.collect(ctx, sql).await.unwrap();
    }
    panic!("{sql}: never reused");
}

async fn check_against(
    plans: &PlanCache,
    ours: &SessionContext,
    plain: &SessionContext,
    sql: &str,
    oracle: &str,
) {
    let got = plans.collect(ours, sql).await.map(|b| exact_rows(&b));
    let want = run_oracle(plain, oracle).await;
    assert_same(
        sql,
        got.map_err(|e| e.to_string()),
        want.map_err(|e| e.to_string()),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reused_plans_give_datafusions_rows_over_every_storage() {
    let _serial = serial().await;
    let dir = test_dir("plan-cache-storages");
    let t = ties_table(71);
    for storage in STORAGES {
        let ours = session(true, 4, 100);
        let plain = plain_session(4, storage);
        register_tables(&[&ours, &plain], storage, &dir, &t).await;
        let plans = PlanCache::new();
        for round in 0..3 {
            for &(sql, oracle) in QUERIES {
                check_against(&plans, &ours, &plain, sql, oracle).await;
            }
            // Without a device nothing but the tables and settings can change a plan.
            if round == 0 && started_gpu().is_none() {
                assert_eq!(plans.stats().misses as usize, QUERIES.len(), "{storage:?}");
            }
        }
        for &(sql, oracle) in QUERIES {
            warm_up(&plans, &ours, sql).await;
            check_against(&plans, &ours, &plain, sql, oracle).await;
        }
        assert_eq!(plans.stats().entries, QUERIES.len(), "{storage:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changed_rows_and_files_are_planned_again() {
    let _serial = serial().await;
    let dir = test_dir("plan-cache-changes");
    let t = ties_table(72);
    let sql = "SELECT g, rid FROM t ORDER BY g, rid LIMIT 5";
    let newcomer = "(-1, -1, NULL, -7, 0)";
    for storage in [Storage::Memory, Storage::Parquet, Storage::Csv] {
        let ours = session(true, 3, 100);
        let plain = plain_session(3, storage);
        register_tables(&[&ours, &plain], storage, &dir.join("before"), &t).await;
        let plans = PlanCache::new();
        check(&plans, &ours, &plain, sql).await;
        warm_up(&plans, &ours, sql).await;
        check(&plans, &ours, &plain, sql).await;

        // A new row that sorts first, in both sessions: inserted into the in-memory table, in
        // a new file beside the others.
        let insert = match storage {
            Storage::Memory => format!("INSERT INTO t VALUES {newcomer}"),
            _ => {
                let table = dir
                    .join("before")
                    .join(format!("t-{storage:?}").to_lowercase());
                let format = if storage == Storage::Csv {
                    "CSV"
                } else {
                    "PARQUET"
                };
                let file = table.join(format!("zz-new.{}", format.to_lowercase()));
                format!(
                    "COPY (SELECT CAST(-1 AS BIGINT) AS rid, CAST(-1 AS INT) AS g, \
                     CAST(NULL AS INT) AS c, CAST(-7 AS DOUBLE) AS f, CAST(0 AS BIGINT) AS w) \
                     TO '{}' STORED AS {format}",
                    file.display()
                )
            }
        };
        ours.sql(&insert).await.unwrap().collect().await.unwrap();
        if storage == Storage::Memory {
            plain.sql(&insert).await.unwrap().collect().await.unwrap();
        } else {
            // DataFusion keeps each directory's listing until its list-files cache is cleared:
            // until then, a reused plan answers as DataFusion does, without the new file.
            check(&plans, &ours, &plain, sql).await;
            for ctx in [&ours, &plain] {
                let manager = &ctx.runtime_env().cache_manager;
                if let Some(listings) = manager.get_list_files_cache() {
                    listings.clear();
                }
            }
        }
        assert!(!reused(&plans, &ours, sql).await, "{storage:?}");
        check(&plans, &ours, &plain, sql).await;
        let rows = exact_rows(&plans.collect(&ours, sql).await.unwrap());
        assert_eq!(rows[1], "-1 | -1", "{storage:?}: {rows:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn settings_views_and_tables_redefined_are_planned_again() {
    let _serial = serial().await;
    let dir = test_dir("plan-cache-redefined");
    let (t, u) = (ties_table(73), ties_table(74));
    let ours = session(true, 4, 100);
    let plain = plain_session(4, Storage::Memory);
    register_tables(&[&ours, &plain], Storage::Memory, &dir, &t).await;
    let plans = PlanCache::new();
    let (sql, oracle) = QUERIES[1];
    check_against(&plans, &ours, &plain, sql, oracle).await;
    warm_up(&plans, &ours, sql).await;

    // A setting changed: planned again, same rows.
    plans
        .collect(&ours, "SET datafusion.execution.batch_size = 37")
        .await
        .unwrap();
    assert!(!reused(&plans, &ours, sql).await);
    check_against(&plans, &ours, &plain, sql, oracle).await;

    // A view replaced: the new definition's rows.
    for (view, n) in [("v", 3), ("v", 6)] {
        let create =
            format!("CREATE OR REPLACE VIEW {view} AS SELECT rid, w FROM t WHERE g < {n} - 2");
        for ctx in [&ours, &plain] {
            ctx.sql(&create).await.unwrap();
        }
        for _ in 0..2 {
            check(
                &plans,
                &ours,
                &plain,
                "SELECT rid FROM v ORDER BY w LIMIT 7",
            )
            .await;
        }
    }

    // Another table under the same name: its rows.
    warm_up(&plans, &ours, sql).await;
    for ctx in [&ours, &plain] {
        ctx.deregister_table("t").unwrap();
        crate::common::register(ctx, "t", u.clone());
    }
    check_against(&plans, &ours, &plain, sql, oracle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prepared_statements_reuse_their_plan_until_prepared_again() {
    let _serial = serial().await;
    let dir = test_dir("plan-cache-prepared");
    let t = ties_table(75);
    for storage in [Storage::Memory, Storage::Parquet] {
        let ours = session(true, 4, 100);
        let plain = plain_session(4, storage);
        register_tables(&[&ours, &plain], storage, &dir, &t).await;
        let prepare = |body: &str| format!("PREPARE q(INT) AS {body}");
        let first = "SELECT rid, c FROM t WHERE c > $1 ORDER BY c, rid LIMIT 6";
        let second = "SELECT rid, w FROM t WHERE g = $1 ORDER BY w DESC LIMIT 4";
        for ctx in [&ours, &plain] {
            ctx.sql(&prepare(first)).await.unwrap();
        }
        let plans = PlanCache::new();
        for _ in 0..3 {
            check(&plans, &ours, &plain, "EXECUTE q(30)").await;
            check(&plans, &ours, &plain, "EXECUTE q(10)").await;
        }
        warm_up(&plans, &ours, "EXECUTE q(30)").await;
        check(&plans, &ours, &plain, "EXECUTE q(30)").await;
        for ctx in [&ours, &plain] {
            ctx.sql("DEALLOCATE q").await.unwrap();
            ctx.sql(&prepare(second)).await.unwrap();
        }
        assert!(!reused(&plans, &ours, "EXECUTE q(30)").await, "{storage:?}");
        check(&plans, &ours, &plain, "EXECUTE q(3)").await;
        check(&plans, &ours, &plain, "EXECUTE q(30)").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn time_dependent_statements_and_errors_are_not_kept() {
    let _serial = serial().await;
    let dir = test_dir("plan-cache-not-kept");
    let t = ties_table(76);
    let ours = session(true, 4, 100);
    let plain = plain_session(4, Storage::Memory);
    register_tables(&[&ours, &plain], Storage::Memory, &dir, &t).await;
    let plans = PlanCache::new();
    let timed = "SELECT rid, now() > TIMESTAMP '2001-01-01' AS late FROM t ORDER BY w LIMIT 3";
    for _ in 0..2 {
        check(&plans, &ours, &plain, timed).await;
        assert!(!plans.plan(&ours, timed).await.unwrap().reused());
    }
    assert_eq!(plans.stats().entries, 0);

    // An error at planning is DataFusion's every time; one at execution too, from a kept plan.
    for sql in [
        "SELECT nope FROM t ORDER BY w LIMIT 3",
        "SELECT rid FROM t ORDER BY w / (g - g) LIMIT 3",
    ] {
        for _ in 0..3 {
            check(&plans, &ours, &plain, sql).await;
        }
    }
    assert_eq!(plans.stats().entries, 1);

    // Statements that change the session run every time, as `SessionContext::sql` runs them.
    plans
        .collect(
            &ours,
            "CREATE TABLE made AS SELECT rid, w FROM t WHERE g = 1",
        )
        .await
        .unwrap();
    plain
        .sql("CREATE TABLE made AS SELECT rid, w FROM t WHERE g = 1")
        .await
        .unwrap();
    check(
        &plans,
        &ours,
        &plain,
        "SELECT rid FROM made ORDER BY w DESC LIMIT 4",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_kept_plan_runs_in_many_queries_at_once() {
    let _serial = serial().await;
    let dir = test_dir("plan-cache-concurrent");
    let t = ties_table(77);
    for storage in [Storage::Memory, Storage::Parquet] {
        let ours = session(true, 4, 100);
        let plain = plain_session(4, storage);
        register_tables(&[&ours, &plain], storage, &dir, &t).await;
        let plans = Arc::new(PlanCache::new());
        let (sql, oracle) = QUERIES[1];
        let want = run_oracle(&plain, oracle).await.unwrap();
        plans.collect(&ours, sql).await.unwrap();
        warm_up(&plans, &ours, sql).await;
        let runs: Vec<_> = (0..24)
            .map(|_| {
                let (plans, ours) = (Arc::clone(&plans), ours.clone());
                tokio::spawn(async move { plans.collect(&ours, sql).await.map(|b| exact_rows(&b)) })
            })
            .collect();
        for run in runs {
            assert_eq!(run.await.unwrap().unwrap(), want, "{storage:?}");
        }
    }
}
