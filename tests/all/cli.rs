//! The `gpu-topk` shell as people use it: the REPL in a terminal (a pseudo-terminal here),
//! `-c` and `-f` with datafusion-cli's print formats, `CREATE EXTERNAL TABLE`, and the
//! tweets table generated only when a statement names it. The CPU path: these run in CI.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::test_dir;

fn gpu_topk() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpu-topk"));
    command
        .args(["--backend", "cpu", "--rows", "1000"])
        .env("RUST_BACKTRACE", "1")
        .env("HOME", std::env::temp_dir());
    command
}

fn run(args: &[&str]) -> (Output, String, String) {
    let out = gpu_topk().args(args).output().expect("run gpu-topk");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// `-c` runs each statement and exits; `--format csv` and `-q` print only the results, which
/// are DataFusion's rows; EXPLAIN shows the operator.
#[test]
fn commands_run_with_datafusion_clis_formats() {
    let sql = "SELECT id, likes_count FROM tweets ORDER BY likes_count DESC, id LIMIT 3";
    let (out, stdout, stderr) = run(&[
        "-q",
        "--format",
        "csv",
        "-c",
        sql,
        "-c",
        &format!("EXPLAIN {sql}"),
    ]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let rows = csv_block(&stdout, "id,likes_count");
    assert_eq!(rows.len(), 3, "{stdout}");
    assert!(stdout.contains("GpuTopKExec: k=3"), "{stdout}");
    // Quiet: not even the table's generation is reported.
    assert!(!stdout.contains("generated"), "{stdout}");

    // The same rows as DataFusion's own plan (the rule off by a setting).
    let plain = run(&[
        "-q",
        "--format",
        "csv",
        "-c",
        "SET gpu_topk.enabled = false",
        "-c",
        sql,
    ]);
    assert!(plain.0.status.success(), "{}", plain.2);
    assert_eq!(csv_block(&plain.1, "id,likes_count"), rows, "{}", plain.1);

    // A failing statement: DataFusion's message, exit code 1.
    let (out, stdout, stderr) = run(&["-q", "-c", "SELECT nope FROM tweets LIMIT 1"]);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        format!("{stdout}{stderr}").contains("No field named nope"),
        "{stdout}\n{stderr}"
    );
}

/// The rows below the CSV header `header` in `stdout`, up to the first line that is not a row.
fn csv_block(stdout: &str, header: &str) -> Vec<String> {
    let columns = header.split(',').count();
    stdout
        .lines()
        .skip_while(|l| *l != header)
        .skip(1)
        .take_while(|l| {
            l.split(',').count() == columns && l.starts_with(|c: char| c.is_ascii_digit())
        })
        .map(str::to_string)
        .collect()
}

/// A script (`-f`) over the user's own Parquet file: `CREATE EXTERNAL TABLE`, a top-k query,
/// and no tweets table generated, since nothing names it.
#[test]
fn scripts_read_the_users_files_without_generating_tweets() {
    let dir = test_dir("cli-script");
    let data = dir.join("events.parquet");
    let (out, stdout, stderr) = run(&[
        "-q",
        "-c",
        &format!(
            "COPY (SELECT column1 AS id, column2 AS v FROM (VALUES (1, 5), (2, 9), (3, 7), (4, 1))) \
             TO '{}' STORED AS PARQUET",
            data.display()
        ),
    ]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let script = dir.join("top.sql");
    std::fs::write(
        &script,
        format!(
            "-- the two largest values\n\
             CREATE EXTERNAL TABLE events STORED AS PARQUET LOCATION '{}';\n\
             SELECT id, v FROM events\n  ORDER BY v DESC LIMIT 2;\n",
            data.display()
        ),
    )
    .unwrap();
    let (out, stdout, stderr) = run(&["--format", "csv", "-f", &script.to_string_lossy()]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("id,v\n2,9\n3,7\n"), "{stdout}");
    assert!(!stdout.contains("tweets"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pseudo-terminal's two ends: the parent's (to type and read) and the child's.
fn pseudo_terminal() -> (std::fs::File, OwnedFd) {
    let (mut parent, mut child) = (-1, -1);
    // SAFETY: openpty writes the two descriptors it opens; null name, termios and size are
    // allowed.
    let rc = unsafe {
        libc::openpty(
            &mut parent,
            &mut child,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are open and owned by nothing else.
    unsafe {
        (
            std::fs::File::from_raw_fd(parent),
            OwnedFd::from_raw_fd(child),
        )
    }
}

/// The terminal's output so far, read until it contains `want` (or the time is up).
fn read_until(output: &mpsc::Receiver<Vec<u8>>, seen: &mut String, want: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !seen.contains(want) {
        let left = deadline.saturating_duration_since(Instant::now());
        match output.recv_timeout(left) {
            Ok(bytes) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            Err(_) => panic!("no {want:?} on the terminal within {limit:?}; it shows:\n{seen}"),
        }
    }
}

/// The REPL in a terminal, typed into as a person would: a statement over two lines, `\d`,
/// EXPLAIN showing the operator, an error that does not end the session, and `\q`.
#[test]
fn the_repl_answers_in_a_terminal() {
    let (mut terminal, child) = pseudo_terminal();
    let stdout = child.try_clone().unwrap();
    let stderr = child.try_clone().unwrap();
    // The REPL keeps its history in `.history` of its working directory.
    let dir = test_dir("cli-repl");
    let mut process = gpu_topk()
        .current_dir(&dir)
        .env("TERM", "dumb")
        .stdin(Stdio::from(child))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr))
        .spawn()
        .expect("start gpu-topk");
    let mut reader = terminal.try_clone().unwrap();
    let (send, output) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buffer = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buffer) {
            if n == 0 || send.send(buffer[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let limit = Duration::from_secs(60);
    let mut seen = String::new();
    let mut typed = |text: &str| terminal.write_all(text.as_bytes()).unwrap();
    read_until(&output, &mut seen, "gpu-topk", limit);
    typed("SELECT id, likes_count FROM tweets\r");
    typed("ORDER BY likes_count DESC, id LIMIT 2;\r");
    read_until(&output, &mut seen, "2 row(s) fetched", limit);
    assert!(seen.contains("generated"), "{seen}");
    typed("\\d\r");
    read_until(&output, &mut seen, "information_schema", limit);
    assert!(seen.contains("tweets"), "{seen}");
    typed("EXPLAIN SELECT id FROM tweets ORDER BY retweet_count DESC LIMIT 5;\r");
    read_until(&output, &mut seen, "GpuTopKExec: k=5", limit);
    typed("SELECT nope FROM tweets;\r");
    read_until(&output, &mut seen, "No field named", limit);
    typed("SELECT 40 + 2 AS answer;\r");
    read_until(&output, &mut seen, "42", limit);
    typed("\\q\r");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = process.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            let _ = process.kill();
            panic!("the REPL did not exit on \\q; the terminal shows:\n{seen}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{seen}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tweets`, the main job, still runs the four queries.
#[test]
fn the_tweets_command_runs_the_four_queries() {
    let (out, stdout, stderr) = run(&["tweets", "--show", "2"]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for name in ["Q1", "Q2", "Q3", "Q4"] {
        assert!(stdout.contains(&format!("== {name}:")), "{stdout}");
    }
    assert_eq!(
        stdout.matches("top-k: GpuTopKExec, backend=cpu").count(),
        3,
        "{stdout}"
    );
    // Q4, a top-k over an aggregation, is the aggregate operator's.
    assert_eq!(
        (stdout
            .matches("top-k over an aggregate: GpuAggregateTopKExec")
            .count()),
        1,
        "{stdout}"
    );
}

/// Under `auto`, a query the CPU path ends before the device could start does not start it:
/// over a small Parquet file `query` reports the CPU path and a device not started where
/// there is a GPU (a fresh process), and DataFusion's TopK with the reason where there is
/// none. The rows are DataFusion's either way.
#[test]
fn a_small_query_does_not_start_the_device() {
    use datafusion_gpu_topk::internal::device::{GpuStatus, gpu_status};

    let dir = test_dir("cli-lazy-device");
    let data = dir.join("small.parquet");
    let (out, stdout, stderr) = run(&[
        "-q",
        "-c",
        &format!(
            "COPY (SELECT value AS id, (value * 37) % 101 AS v FROM generate_series(1, 5000)) \
             TO '{}' STORED AS PARQUET",
            data.display()
        ),
    ]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let table = format!("t={}", data.display());
    let sql = "SELECT id, v FROM t ORDER BY v DESC, id LIMIT 3";
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-topk"))
        .args(["--backend", "auto", "query", "--table", &table, sql])
        .env("HOME", std::env::temp_dir())
        .output()
        .expect("run gpu-topk");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // v = 100 where id ≡ 30 (mod 101): the largest v, smallest ids first.
    let rows: Vec<Vec<&str>> = (stdout.lines())
        .filter(|l| l.starts_with('|'))
        .map(|l| {
            l.split('|')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .collect()
        })
        .collect();
    assert_eq!(
        rows,
        [["id", "v"], ["30", "100"], ["131", "100"], ["232", "100"]],
        "{stdout}"
    );
    match gpu_status() {
        GpuStatus::Available(_) => {
            assert!(stdout.contains("GPU: not started"), "{stdout}");
            assert!(stdout.contains("backend=cpu"), "{stdout}");
            assert!(stdout.contains("the GPU is not started"), "{stdout}");
        }
        GpuStatus::Unavailable(_) => assert!(stdout.contains("GPU: none ("), "{stdout}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Workers started with `gpu-topk worker` (a process each) serve a coordinator started with
/// `--workers`: the rows are the one process's. (The in-process cluster's tests check what
/// each worker runs.)
#[cfg(feature = "cluster")]
#[test]
fn workers_serve_a_coordinators_queries() {
    let dir = test_dir("cli-cluster");
    let data = dir.join("tweets");
    let spec = datafusion_gpu_topk::datasets::tweets::TweetsSpec::new(30_000);
    datafusion_gpu_topk::datasets::tweets::write_parquet(&spec, &data, 7_000, false)
        .expect("five files");
    let mut workers = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..2 {
        // A free port: the listener is dropped just before the worker binds it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = gpu_topk()
            .args(["worker", "--listen", &format!("127.0.0.1:{port}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a worker");
        workers.push(child);
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "worker on {port} not up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        urls.push(format!("http://127.0.0.1:{port}"));
    }
    let sql = "SELECT id, retweet_count FROM t WHERE lang <> 'en' ORDER BY retweet_count DESC \
               LIMIT 30";
    fn statements<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = extra.to_vec();
        args.extend(["-q", "--format", "csv", "-c"]);
        args
    }
    let create = format!(
        "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION '{}/'",
        data.display()
    );
    let urls = urls.join(",");
    let mut cluster_args = statements(&["--workers", &urls]);
    // A task per byte: this small table is split between both workers.
    cluster_args.extend([
        "SET distributed.file_scan_config_bytes_per_partition = 1",
        "-c",
        &create,
        "-c",
        sql,
        "-c",
    ]);
    let explain = format!("EXPLAIN {sql}");
    cluster_args.push(&explain);
    let (cluster, cluster_out, cluster_err) = run(&cluster_args);
    let mut local_args = statements(&[]);
    local_args.extend([create.as_str(), "-c", sql]);
    let (local, local_out, local_err) = run(&local_args);
    for mut worker in workers {
        let _ = worker.kill();
        let _ = worker.wait();
    }
    assert!(cluster.status.success(), "{cluster_out}\n{cluster_err}");
    assert!(local.status.success(), "{local_out}\n{local_err}");
    let rows = csv_block(&local_out, "id,retweet_count");
    assert_eq!(rows.len(), 30, "{local_out}");
    assert_eq!(
        csv_block(&cluster_out, "id,retweet_count"),
        rows,
        "{cluster_out}"
    );
    // Planned for the engine: a per-task operator under DataFusion's merge.
    assert!(cluster_out.contains("per_task"), "{cluster_out}");
}
