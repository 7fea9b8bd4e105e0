//! What the shim tests share: the library and engine binary of this build,
//! a C compiler run against `shim/include/kvsan.h`, scratch files.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `kvsan` binary of this build (built without feature `sanitize`
/// unless the test run asked for it).
pub fn kvsan_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kvsan"))
}

/// `libkvsan_shim.so`, built (or found up to date) by cargo in this test
/// build's own target directory and profile, once per test process.
pub fn shim_library() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let bin = kvsan_bin();
        let profile_dir = bin.parent().expect("the binary has a directory");
        let target_dir = profile_dir
            .parent()
            .expect("the profile directory has a parent");
        let profile = profile_dir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a UTF-8 profile directory name");
        let cargo = std::env::var_os("CARGO")
            .or_else(|| option_env!("CARGO").map(Into::into))
            .unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--quiet", "-p", "kvsan-shim", "--manifest-path"])
            .arg(repo().join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", target_dir);
        match profile {
            "debug" => {}
            "release" => {
                cmd.arg("--release");
            }
            other => {
                cmd.args(["--profile", other]);
            }
        }
        let out = cmd.output().expect("run cargo build -p kvsan-shim");
        assert!(
            out.status.success(),
            "cargo build -p kvsan-shim failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lib = profile_dir.join("libkvsan_shim.so");
        assert!(lib.is_file(), "{} was not built", lib.display());
        lib
    })
}

/// A scratch directory for this test process.
pub fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvsan-shim-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

/// Compiles `source` (C11, warnings are errors) against `kvsan.h`, linked
/// with the shim (found at run time through an rpath); returns the program.
pub fn compile_c(source: &Path, name: &str) -> PathBuf {
    let lib = shim_library();
    let lib_dir = lib.parent().expect("the library has a directory");
    let exe = scratch().join(name);
    let out = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg("-I")
        .arg(repo().join("shim/include"))
        .arg(source)
        .arg("-L")
        .arg(lib_dir)
        .arg("-lkvsan_shim")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .output()
        .expect("run cc (a C compiler is needed to test the C ABI)");
    assert!(
        out.status.success(),
        "cc {} failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// stdout and stderr of a finished process, as text.
pub fn texts(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
