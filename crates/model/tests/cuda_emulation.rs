//! The CUDA kernels on the CPU: builds the C++ harness in `kernels/emulation/` with the system
//! C++ compiler (`c++`) and runs it. The harness `#include`s the real `kernels/*.cu` files on top
//! of a host shim of the CUDA built-ins (one fiber per CUDA thread), launches every exported
//! kernel with the launch shapes of `src/ops/cuda/*.rs` for f32, f64 and bf16, and compares the
//! results with double-precision references (`kernels/emulation/main.cpp` lists the checks).
//!
//! Runs in the default, CUDA-free build; it needs a C++17 compiler as `c++` on `PATH` and fails
//! (never skips) without one.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Instant;

/// The compiler driver, as CI installs it (`.ci/run`).
const CXX: &str = "c++";

/// Flags of every compilation; `-std=c++17` (not gnu++17) keeps GCC from contracting the
/// kernels' separately rounded f32 operations into FMAs.
const CXXFLAGS: [&str; 6] = [
    "-std=c++17",
    "-O1",
    "-pthread",
    "-Wall",
    "-Wextra",
    "-Wno-unknown-pragmas",
];

/// Starts `cmd`, panicking with a clear message if the compiler cannot be run at all.
fn spawn(cmd: &mut Command) -> Child {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    match cmd.spawn() {
        Ok(child) => child,
        Err(e) => panic!(
            "cannot run the C++ compiler `{CXX}`: {e}. The CUDA emulation test compiles \
             crates/model/kernels/emulation/*.cpp with it; install a C++17 compiler providing \
             `{CXX}` (Debian/Ubuntu: `apt-get install g++`; .ci/run does this)"
        ),
    }
}

/// Waits for `child`; panics with its output (naming `what`) unless it succeeded.
fn finish(child: Child, what: &str) -> Output {
    let out = child
        .wait_with_output()
        .expect("waiting for a child process");
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

#[test]
fn cuda_kernels_match_references_under_emulation() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emulation");
    let build = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda_emulation");
    std::fs::create_dir_all(&build).expect("creating the build directory");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&src)
        .expect("reading kernels/emulation")
        .map(|e| e.expect("reading kernels/emulation").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    sources.sort();
    assert!(
        sources.len() >= 5,
        "expected the harness sources in {}",
        src.display()
    );

    // Compile the translation units in parallel, then link.
    let t0 = Instant::now();
    let mut jobs = Vec::new();
    let mut objects = Vec::new();
    for s in &sources {
        let obj = build
            .join(s.file_stem().expect("a file name"))
            .with_extension("o");
        let mut cmd = Command::new(CXX);
        cmd.args(CXXFLAGS)
            .arg("-I")
            .arg(&src)
            .arg("-c")
            .arg(s)
            .arg("-o")
            .arg(&obj);
        jobs.push((
            spawn(&mut cmd),
            format!("`{CXX}` compiling {}", s.display()),
        ));
        objects.push(obj);
    }
    let mut warnings = String::new();
    for (child, what) in jobs {
        let out = finish(child, &what);
        warnings.push_str(&String::from_utf8_lossy(&out.stderr));
    }
    let exe = build.join("kernel-emulation");
    let mut link = Command::new(CXX);
    link.arg("-pthread").args(&objects).arg("-o").arg(&exe);
    finish(spawn(&mut link), &format!("`{CXX}` linking the harness"));
    let built = t0.elapsed();

    // Run it: one line per check; a non-zero exit status means a failed check (or a crash).
    let t1 = Instant::now();
    let out = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{warnings}{stdout}{stderr}");
    println!(
        "built in {:.1} s, ran in {:.1} s",
        built.as_secs_f64(),
        t1.elapsed().as_secs_f64()
    );
    assert!(
        out.status.success(),
        "the CUDA emulation harness failed ({}); failed checks:\n{}\n{stderr}",
        out.status,
        stdout
            .lines()
            .filter(|l| !l.starts_with("ok "))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        stdout.contains(" checks, 0 failed"),
        "the harness exited successfully without its summary line:\n{stdout}"
    );
}
