//! The kernels under NVRTC (no GPU needed): every one compiles for sm_90 without spills,
//! waits for its predecessor first, and the CUBIN cache stores, reuses and rebuilds.

use super::*;

/// The engine launches kernels with programmatic stream serialisation (Hopper on): each kernel
/// must wait for the previous one's writes before it touches memory.
#[test]
fn every_kernel_waits_for_the_previous_kernel_first() {
    let sources = KernelSources::embedded();
    let mut kernels = 0;
    for (name, source) in sources.programs() {
        kernels += source.matches("__global__").count();
        let missing = kernels_without_dependency_wait(source);
        assert!(
            missing.is_empty(),
            "{name}: no grid_dependency_wait first in {missing:?}"
        );
    }
    assert!(kernels >= 39, "{kernels} kernel definitions");
    // The check itself: a wait after a store, or none, is reported; one first (in a macro too) is not.
    let late = "extern \"C\" __global__ void f(int *p) { *p = 1; grid_dependency_wait(); }";
    assert_eq!(kernels_without_dependency_wait(late).len(), 1);
    let none = "extern \"C\" __global__ void g(int *p) {}\n__global__ void h() { grid_dependency_wait(); }";
    assert_eq!(
        kernels_without_dependency_wait(none),
        vec!["__global__ void g(int *p)"]
    );
    let macro_def = "#define E(S) \\\n    extern \"C\" __global__ void e_##S() { \\\n  grid_dependency_wait(); }";
    assert!(kernels_without_dependency_wait(macro_def).is_empty());
}

#[test]
fn every_kernel_compiles_for_sm_90_without_spills_or_stack() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm_90_without_spills_or_stack") {
        return;
    }
    let sources = KernelSources::embedded();
    let headers = sources.headers();
    assert!(!sources.programs().is_empty());
    for (name, source) in sources.programs() {
        let compiled = compile_program(name, source, &headers, "sm_90", &["--ptxas-options=-v"])
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(compiled.cubin.len() > 64, "{name}: empty CUBIN");
        // The report has one "Function properties for NAME" block per entry point.
        let mut current = String::new();
        let mut reported = 0;
        for line in compiled.log.lines() {
            if let Some(f) = line.split("Function properties for ").nth(1) {
                current = f.trim().to_string();
            }
            if line.contains("spill stores") {
                assert!(
                    line.contains(" 0 bytes spill stores") && line.contains(" 0 bytes spill loads"),
                    "{name}: {current} spills: {line}"
                );
            }
            // Register arrays indexed at run time land in local memory (a stack frame).
            assert!(
                !line.contains("cumulative stack size"),
                "{name}: {current} uses a stack: {line}"
            );
            if line.contains("Used") && line.contains("registers") {
                eprintln!("{name:14} {current:28} {}", line.trim());
                reported += 1;
            }
        }
        // Every entry point is in the CUBIN's symbol table.
        for entry in entry_points(name) {
            let symbol = entry.as_bytes();
            assert!(
                compiled.cubin.windows(symbol.len()).any(|w| w == symbol),
                "{name}: no kernel {entry} in the CUBIN"
            );
        }
        // ptxas reports every kernel, unless the compile was served from a cache (seen on the
        // GPU machine: an empty log on repeated runs).
        if reported == 0 {
            eprintln!("{name}: NVRTC's log has no ptxas report (cached compile?)");
        } else {
            assert_eq!(
                reported,
                entry_points(name).len(),
                "{name}: {reported} register reports for {} entry points; NVRTC's log:\n{}",
                entry_points(name).len(),
                compiled.log
            );
        }
    }
}

#[test]
fn spill_bytes_adds_the_stores_and_loads_of_every_function() {
    let log = "ptxas info    : Compiling entry function 'a' for 'sm_90'\n\
               ptxas info    : Function properties for a\n\
               \x20   8 bytes stack frame, 28 bytes spill stores, 24 bytes spill loads\n\
               ptxas info    : Used 51 registers\n\
               ptxas info    : Function properties for b\n\
               \x20   0 bytes stack frame, 0 bytes spill stores, 4 bytes spill loads";
    assert_eq!(kernels::spill_bytes(log), 56);
    assert_eq!(kernels::spill_bytes("ptxas info    : Used 40 registers"), 0);
}

#[test]
fn compile_cubin_reports_errors_with_the_log_and_rejects_virtual_targets() {
    if !nvrtc_or_skip("compile_cubin_reports_errors_with_the_log_and_rejects_virtual_targets") {
        return;
    }
    let ok =
        "#include \"common.cuh\"\nextern \"C\" __global__ void f(u64 *p) { p[threadIdx.x] = 1; }";
    assert!(!compile_cubin(ok, "sm_90", &[]).unwrap().is_empty());
    let err = compile_cubin(
        "extern \"C\" __global__ void f() { undeclared(); }",
        "sm_90",
        &[],
    )
    .unwrap_err();
    assert!(
        err.contains("undeclared"),
        "the error carries NVRTC's log: {err}"
    );
    let err = compile_cubin(ok, "compute_90", &[]).unwrap_err();
    assert!(err.contains("compute_90"), "{err}");
}

#[test]
fn kernel_sources_load_from_a_directory() {
    let dir = test_dir("sources");
    for (name, text) in kernels::EMBEDDED {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let from_dir = KernelSources::from_dir(&dir).unwrap();
    for (name, text) in kernels::EMBEDDED {
        assert_eq!(from_dir.get(name), Some(*text));
    }
    std::fs::remove_file(dir.join("radix.cu")).unwrap();
    assert!(
        KernelSources::from_dir(&dir)
            .unwrap_err()
            .contains("radix.cu")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cache_files_detect_corruption_truncation_and_stale_keys() {
    let dir = test_dir("cache-files");
    let path = dir.join("x.cubin");
    let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let key = cache_key(&[b"source", b"sm_90"]);
    assert_ne!(key, cache_key(&[b"source", b"sm_80"]));
    assert_ne!(cache_key(&[b"ab", b"c"]), cache_key(&[b"a", b"bc"]));
    write_cache_file(&path, key, &payload).unwrap();
    assert_eq!(read_cache_file(&path, key), Some(payload.clone()));
    assert_eq!(read_cache_file(&path, key ^ 1), None, "another key");
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(read_cache_file(&path, key), None, "corrupt payload");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert_eq!(read_cache_file(&path, key), None, "truncated");
    std::fs::write(&path, b"").unwrap();
    assert_eq!(read_cache_file(&path, key), None, "empty");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cubin_cache_stores_reuses_and_rebuilds() {
    if !nvrtc_or_skip("cubin_cache_stores_reuses_and_rebuilds") {
        return;
    }
    let dir = test_dir("cubin-cache");
    let sources = KernelSources::embedded();
    let first = cubin_cached("candidates.cu", &sources, "sm_90", &[], 13000, Some(&dir)).unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "one cache file: {files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().to_string();
    assert!(
        name.starts_with("candidates-sm_90-") && name.ends_with(".cubin"),
        "{name}"
    );
    let bytes = std::fs::read(&files[0]).unwrap();
    assert_eq!(&bytes[48..], &first[..]);
    // A valid entry is used as is: a marker payload under the same key comes back.
    let key = u128::from_le_bytes(bytes[16..32].try_into().unwrap());
    write_cache_file(&files[0], key, b"marker").unwrap();
    let marker = cubin_cached("candidates.cu", &sources, "sm_90", &[], 13000, Some(&dir)).unwrap();
    assert_eq!(marker, b"marker");
    // A corrupt entry is rebuilt and rewritten.
    let mut corrupt = bytes.clone();
    corrupt[100] ^= 0xff;
    std::fs::write(&files[0], &corrupt).unwrap();
    let again = cubin_cached("candidates.cu", &sources, "sm_90", &[], 13000, Some(&dir)).unwrap();
    assert_eq!(again, first);
    assert_eq!(std::fs::read(&files[0]).unwrap(), bytes);
    // Another driver version is another key, another file.
    cubin_cached("candidates.cu", &sources, "sm_90", &[], 13010, Some(&dir)).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}
