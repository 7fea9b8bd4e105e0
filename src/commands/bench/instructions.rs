//! `kvsan bench overhead --count instructions`: each variant's workload
//! run once under Valgrind's cachegrind, counting the instructions it
//! executes — a figure that, unlike time, does not move with the machine's
//! load, so a 1 % difference is decidable on a noisy 2-core VM (the way
//! `iai-callgrind` measures Rust code).
//!
//! ```text
//!  valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=F  <variant> bench workload …
//!      KVSAN_THREADS=1 (no spinning workers), --in-flight 1 (one request at a time:
//!      the same batches every run), fixed seeds
//!  F:  fl=<source file>  fn=<function>  <line> <Ir>  …  summary: <total Ir>
//! ```
//!
//! The total is the variant's count; the per-line counts attribute part of
//! it. A line counts for a place when its source file is there, or when
//! the function it was compiled into is one of that place's crate:
//! `sanitizer` (`sanitizer/src/` or `kvsan_sanitizer::…`: the sanitizer,
//! and its kernel-shadow check where the kernels inline it), `shim`
//! (`shim/src/` or `kvsan_shim::…`: the C ABI library) and `kernel_guard`
//! (`kernels/src/guard.rs`: the kernels' own bounds and generation guard).
//! Inlined code counts where it was written, which is what the release
//! profile's line tables record — so standard-library code inlined into a
//! kernel on the sanitizer's behalf (a comparison, a slice index) is not
//! attributed, and the attributed share is a lower bound of the cost.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Serialize;

use super::child;

/// Where instructions are attributed: a name, the source path part that
/// places a file there, and the crate whose functions are there.
const PLACES: [(&str, &str, Option<&str>); 3] = [
    ("sanitizer", "/sanitizer/src/", Some("kvsan_sanitizer::")),
    ("shim", "/shim/src/", Some("kvsan_shim::")),
    ("kernel_guard", "/kernels/src/guard.rs", None),
];

/// The place of a line of `file` compiled into `function`.
fn place_of(file: &str, function: &str) -> Option<&'static str> {
    let ours = !file.contains("/.cargo/");
    PLACES
        .iter()
        .find(|(_, path, krate)| {
            (ours && file.contains(path))
                || krate.is_some_and(|k| {
                    function.starts_with(k)
                        || function.strip_prefix('<').is_some_and(|f| f.starts_with(k))
                })
        })
        .map(|(name, _, _)| *name)
}

/// One run's instruction count.
#[derive(Clone, Debug, Serialize)]
pub struct Counted {
    /// Instructions the whole process executed (cachegrind's `Ir`).
    pub instructions: u64,
    /// Of which, in code written in each of [`PLACES`].
    pub inside: BTreeMap<&'static str, u64>,
    /// The cachegrind output file, for `cg_annotate`.
    pub profile: PathBuf,
}

/// Runs `program args…` with `env` under cachegrind, its profile written to
/// `profile`; returns the child's output and the counts.
///
/// # Errors
/// Valgrind missing or failing, the program failing under it, or a profile
/// that cannot be read.
pub fn count(
    program: &Path,
    args: &[String],
    env: &[(String, OsString)],
    profile: &Path,
) -> anyhow::Result<(child::Finished, Counted)> {
    let mut a = vec![
        "--tool=cachegrind".to_string(),
        "--cache-sim=no".to_string(),
        format!("--cachegrind-out-file={}", profile.display()),
        program.display().to_string(),
    ];
    a.extend_from_slice(args);
    let mut env = env.to_vec();
    env.push(("KVSAN_THREADS".into(), "1".into()));
    let done = child::run(Path::new("valgrind"), &a, &env)
        .context("--count instructions runs the workloads under Valgrind (apt install valgrind)")?;
    let text = std::fs::read_to_string(profile)
        .with_context(|| format!("reading the cachegrind profile {}", profile.display()))?;
    let (instructions, inside) =
        parse(&text).with_context(|| format!("the cachegrind profile {}", profile.display()))?;
    Ok((
        done,
        Counted {
            instructions,
            inside,
            profile: profile.to_path_buf(),
        },
    ))
}

/// The total `Ir` of a cachegrind profile, and the part of it in each of
/// [`PLACES`].
fn parse(text: &str) -> anyhow::Result<(u64, BTreeMap<&'static str, u64>)> {
    let mut events_ok = false;
    let mut total = None;
    let mut inside: BTreeMap<&'static str, u64> = PLACES.iter().map(|(k, _, _)| (*k, 0)).collect();
    let (mut file, mut function) = (String::new(), String::new());
    let mut place: Option<&'static str> = None;
    for line in text.lines() {
        if let Some(events) = line.strip_prefix("events:") {
            // With --cache-sim=no the only event is Ir.
            events_ok = events.split_whitespace().next() == Some("Ir");
        } else if let Some(f) = line.strip_prefix("fl=") {
            f.clone_into(&mut file);
            place = place_of(&file, &function);
        } else if let Some(f) = line.strip_prefix("fn=") {
            f.clone_into(&mut function);
            place = place_of(&file, &function);
        } else if let Some(sum) = line.strip_prefix("summary:") {
            total = sum
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok());
        } else if let Some(k) = place
            && line.starts_with(|c: char| c.is_ascii_digit())
        {
            let ir = line
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok());
            *inside.get_mut(k).expect("a listed place") += ir.unwrap_or(0);
        }
    }
    if !events_ok {
        bail!("it does not count Ir first (an events: line with Ir)");
    }
    let total = total.context("it has no summary: line")?;
    Ok((total, inside))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROFILE: &str = "\
desc: I1 cache: none
cmd: kvsan bench workload
events: Ir
fl=/src/kvsan/engine/src/node/executor.rs
fn=kvsan_engine::node::executor::Executor::run
10 1000
11 500
fl=/src/kvsan/sanitizer/src/kernel_shadow.rs
fn=kvsan_kernels::attention::paged
40 70
41 30
fl=/home/u/.cargo/registry/src/index/fake-sanitizer/src/lib.rs
fn=dep
1 5
fl=/src/kvsan/shim/src/calls.rs
fn=kvsan_shim::calls::alloc
7 8
fl=/rustc/abc/library/core/src/cmp.rs
fn=<kvsan_sanitizer::shadow::Shadow>::read
3 20
fn=kvsan_kernels::attention::paged
3 400
summary: 2033
";

    #[test]
    fn the_total_and_the_sanitizers_share_come_from_the_profile() {
        let (total, inside) = parse(PROFILE).unwrap();
        assert_eq!(total, 2033);
        // 70 + 30 written in sanitizer/src, 20 of std inlined into one of
        // its functions; not a dependency's folder, not std in a kernel.
        assert_eq!(inside["sanitizer"], 120);
        assert_eq!(inside["shim"], 8);
        assert_eq!(inside["kernel_guard"], 0);
    }

    #[test]
    fn a_profile_of_other_events_or_without_a_summary_is_refused() {
        let other = PROFILE.replace("events: Ir", "events: Dr Dw");
        assert!(parse(&other).is_err());
        let cut = PROFILE.replace("summary: 2033\n", "");
        assert!(parse(&cut).is_err());
    }
}
