//! Feature `nvtx` only: compiles `src/cuda/nvtx.c` against the NVTX3
//! headers (`nvtx3/nvToolsExtMem.h`, the memory extension). Nothing is built
//! without the feature.
//!
//! The headers are looked for, in order, in: `$NVTX_INCLUDE_DIR`; a CUDA
//! toolkit (`$CUDA_HOME/include`, `/usr/local/cuda*/include`,
//! `/usr/local/cuda*/targets/*/include`); the `nvidia-nvtx` wheel unpacked by
//! `scripts/nvtx-headers` (`target/nvtx/nvidia/cu*/include`). A build that
//! finds none stops with a message saying how to get them.

#[cfg(feature = "nvtx")]
use std::env;
#[cfg(feature = "nvtx")]
use std::path::{Path, PathBuf};

#[cfg(feature = "nvtx")]
const HEADER: &str = "nvtx3/nvToolsExtMem.h";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "nvtx")]
    build_nvtx();
}

#[cfg(feature = "nvtx")]
fn build_nvtx() {
    println!("cargo:rerun-if-env-changed=NVTX_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-changed=src/cuda/nvtx.c");
    let Some(include) = find_headers() else {
        panic!(
            "feature `nvtx` needs the NVTX3 headers ({HEADER}) and none were found: set \
             NVTX_INCLUDE_DIR to a directory holding {HEADER}, install a CUDA toolkit, or run \
             `bash scripts/nvtx-headers` (unpacks the `nvidia-nvtx` wheel into target/nvtx)"
        );
    };
    println!("cargo:rerun-if-changed={}", include.join(HEADER).display());
    cc::Build::new()
        .file("src/cuda/nvtx.c")
        .include(&include)
        .std("c11")
        .warnings(true)
        .compile("kvsan_nvtx");
    // The headers' loader opens the tool's library with dlopen.
    println!("cargo:rustc-link-lib=dl");
}

#[cfg(feature = "nvtx")]
fn has_header(dir: &Path) -> bool {
    dir.join(HEADER).is_file()
}

#[cfg(feature = "nvtx")]
fn glob_dirs(parent: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(parent)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    dirs.sort();
    dirs.reverse();
    dirs
}

#[cfg(feature = "nvtx")]
fn find_headers() -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(dir) = env::var_os("NVTX_INCLUDE_DIR") {
        // Named explicitly: that or nothing.
        let dir = PathBuf::from(dir);
        return has_header(&dir).then_some(dir);
    }
    if let Some(home) = env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("include"));
    }
    for cuda in glob_dirs(Path::new("/usr/local"), "cuda") {
        candidates.push(cuda.join("include"));
        for target in glob_dirs(&cuda.join("targets"), "") {
            candidates.push(target.join("include"));
        }
    }
    // The workspace's target/nvtx (scripts/nvtx-headers): this crate's
    // manifest directory is one level under the workspace root.
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    if let Some(root) = manifest.parent() {
        for cu in glob_dirs(&root.join("target/nvtx/nvidia"), "cu") {
            candidates.push(cu.join("include"));
        }
    }
    candidates.into_iter().find(|d| has_header(d))
}
