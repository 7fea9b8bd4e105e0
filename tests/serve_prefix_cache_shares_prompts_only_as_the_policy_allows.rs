//! `kvsan serve --prefix-cache`, real processes on loopback with the
//! synthetic model: a repeated prompt is served from the cache
//! (`usage.prompt_tokens_details.cached_tokens`, the same tokens) only for
//! the requests the policy lets share it — one tenant and one salt under
//! `tenant` (the default), one salt under `salt`, everyone under `global`
//! (which warns at start), nobody under `off` — in one process (unified,
//! disagg) and in two (decode + prefill); the counters on `/metrics` are
//! the cache's; and under the shim the sanitizer checks the shares against
//! its own `prefix_share`, as the server's note at start says.

mod metrics_common;
mod serve_common;
mod shim_common;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use metrics_common::Scrape;
use serde_json::{Value, json};
use serve_common::client::{BOUND, Client};
use serve_common::{START_BOUND, Server};

/// Tenant 1's key.
const ALPHA: &str = "sk-alpha";
/// Tenant 1's other key, with a server-side cache salt.
const ALPHA_SALTED: &str = "sk-alpha-salted";
/// Tenant 2's key.
const BETA: &str = "sk-beta";

/// The prompt's length: two full pages of 16 slots (the default
/// `--page-slots`) and 8 tokens more, which every request computes again.
const PROMPT_TOKENS: u64 = 40;
/// What a hit serves: the prompt's full pages.
const CACHED: u64 = 32;

/// The keys file: two tenants, one key with a salt.
fn keys_file() -> PathBuf {
    static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prefix-cache-keys-{}-{n}", std::process::id()));
    std::fs::write(
        &path,
        format!("{ALPHA} 1\n{ALPHA_SALTED} 1 alpha-salt\n{BETA} 2\n"),
    )
    .expect("write the keys file");
    path
}

/// A synthetic-model server of `role` with the keys file and `extra`
/// flags (and `env`), its serving line and client address.
fn start(role: &str, extra: &[&str], env: &[(&str, &OsStr)]) -> (Server, String, String) {
    let keys = keys_file();
    let mut args = vec!["--synthetic", "--api-keys", keys.to_str().unwrap()];
    args.extend_from_slice(extra);
    let server = Server::http("serve-prefix-cache", role, &args, env);
    let line = server.wait_for("kvsan: serving", START_BOUND);
    let addr = word(&line, "listen=");
    (server, line, addr)
}

/// The value of `key=VALUE` on `line`.
fn word(line: &str, key: &str) -> String {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .unwrap_or_else(|| panic!("{key} on {line:?}"))
        .to_string()
}

/// A prompt of [`PROMPT_TOKENS`] token ids, different for each `seed`.
fn prompt(seed: u64) -> Vec<u64> {
    (0..PROMPT_TOKENS)
        .map(|i| (i * 7 + seed * 31) % 256)
        .collect()
}

/// A greedy completion of `prompt` sent with `key` (and `cache_salt`):
/// its token ids and `cached_tokens`.
fn complete(addr: &str, key: &str, prompt: &[u64], salt: Option<&str>) -> (Value, u64) {
    let mut body =
        json!({"model": "synthetic", "prompt": prompt, "max_tokens": 4, "temperature": 0});
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    let answer = Client::new(addr)
        .with_key(key)
        .post("/v1/completions", &body);
    assert_eq!(answer.status, 200, "{answer:?}");
    let usage = &answer.body["usage"];
    assert_eq!(usage["prompt_tokens"], PROMPT_TOKENS, "{usage}");
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("usage.prompt_tokens_details.cached_tokens: {usage}"));
    (answer.body["choices"][0]["token_ids"].clone(), cached)
}

/// `cached_tokens` of a greedy completion of `prompt` with `key`.
fn cached(addr: &str, key: &str, prompt: &[u64], salt: Option<&str>) -> u64 {
    complete(addr, key, prompt, salt).1
}

#[test]
fn under_the_default_policy_a_prompt_is_shared_within_its_tenant_and_salt_only() {
    for (role, caching_node) in [("unified", "unified"), ("disagg", "prefill")] {
        let (_server, line, addr) = start(role, &[], &[]);
        assert_eq!(word(&line, "prefix-cache="), "tenant", "{line}");
        let p = prompt(1);

        let (first, none) = complete(&addr, ALPHA, &p, None);
        assert_eq!(none, 0, "{role}: nothing cached yet");
        let (again, hit) = complete(&addr, ALPHA, &p, None);
        assert_eq!(hit, CACHED, "{role}: the same key, the prompt's full pages");
        assert_eq!(again, first, "{role}: the cache changes no token");
        // Streamed: the usage chunk says it too.
        let streamed = Client::new(&addr).with_key(ALPHA).complete(&p, 4);
        streamed.assert_finished(PROMPT_TOKENS as usize, 4);
        let usage = streamed.usage.as_ref().unwrap();
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], CACHED);
        assert_eq!(json!(streamed.tokens), first, "{role}");

        // Another tenant: its own computation, the same answer.
        let (theirs, other) = complete(&addr, BETA, &p, None);
        assert_eq!(other, 0, "{role}: another tenant's key");
        assert_eq!(theirs, first, "{role}");
        // The same tenant with the key's salt, or the client's own: apart
        // from the unsalted requests, shared among themselves.
        assert_eq!(
            cached(&addr, ALPHA_SALTED, &p, None),
            0,
            "{role}: salted key"
        );
        assert_eq!(cached(&addr, ALPHA_SALTED, &p, None), CACHED, "{role}");
        assert_eq!(
            cached(&addr, ALPHA, &p, Some("mine")),
            0,
            "{role}: cache_salt"
        );
        assert_eq!(cached(&addr, ALPHA, &p, Some("mine")), CACHED, "{role}");

        // The cache's counters, in tokens: 8 requests looked up 40 tokens
        // each, 4 found 32; 4 domains keep 2 pages each.
        let m = Scrape::of(&addr);
        assert_eq!(
            m.value("vllm:prefix_cache_queries_total", &[]),
            (8 * PROMPT_TOKENS) as f64
        );
        assert_eq!(
            m.value("vllm:prefix_cache_hits_total", &[]),
            (4 * CACHED) as f64
        );
        let node = [("node", caching_node)];
        assert_eq!(m.value("kvsan:cached_pages", &node), 8.0, "{role}");
        assert!(!m.has("kvsan:cached_pages", &[("node", "decode")]));
        let stats = Client::new(&addr).get("/stats").body;
        let holder = if role == "unified" {
            "front"
        } else {
            "prefill"
        };
        assert_eq!(stats[holder]["cached_pages"], 8, "{stats}");
        assert_eq!(stats[holder]["prefix_cache_hits"], 4 * CACHED, "{stats}");
    }
}

#[test]
fn with_the_cache_off_nothing_is_served_from_it() {
    let (_server, line, addr) = start("unified", &["--prefix-cache", "off"], &[]);
    assert_eq!(word(&line, "prefix-cache="), "off", "{line}");
    let p = prompt(2);
    assert_eq!(cached(&addr, ALPHA, &p, None), 0);
    assert_eq!(cached(&addr, ALPHA, &p, None), 0);
    let m = Scrape::of(&addr);
    assert_eq!(m.value("vllm:prefix_cache_hits_total", &[]), 0.0);
    assert_eq!(m.value("kvsan:cached_pages", &[("node", "unified")]), 0.0);
}

#[test]
fn global_warns_at_start_and_shares_across_tenants_but_not_across_salts() {
    let keys = keys_file();
    let server = Server::http(
        "serve-prefix-cache",
        "unified",
        &[
            "--synthetic",
            "--api-keys",
            keys.to_str().unwrap(),
            "--prefix-cache",
            "global",
        ],
        &[],
    );
    // Said before the serving line.
    let warning = server.wait_for("WARNING: --prefix-cache global", START_BOUND);
    assert!(
        warning.contains("time to first token") && warning.contains("cached_tokens"),
        "{warning}"
    );
    let line = server.wait_for("kvsan: serving", START_BOUND);
    assert_eq!(word(&line, "prefix-cache="), "global", "{line}");
    let addr = word(&line, "listen=");
    let p = prompt(3);
    let (first, none) = complete(&addr, ALPHA, &p, None);
    assert_eq!(none, 0);
    let (theirs, hit) = complete(&addr, BETA, &p, None);
    assert_eq!(hit, CACHED, "another tenant's prompt, from the cache");
    assert_eq!(theirs, first);
    assert_eq!(
        cached(&addr, ALPHA_SALTED, &p, None),
        0,
        "a salt still keeps its requests apart"
    );
}

#[test]
fn under_the_salt_policy_one_salt_shares_across_tenants() {
    let (_server, _, addr) = start("disagg", &["--prefix-cache", "salt"], &[]);
    let p = prompt(4);
    assert_eq!(cached(&addr, ALPHA, &p, Some("team")), 0);
    assert_eq!(cached(&addr, BETA, &p, Some("team")), CACHED, "one salt");
    assert_eq!(cached(&addr, BETA, &p, Some("other")), 0, "another salt");
    // Unsalted requests share among themselves, as in vLLM.
    assert_eq!(cached(&addr, ALPHA, &p, None), 0);
    assert_eq!(cached(&addr, BETA, &p, None), CACHED);
}

#[test]
fn in_two_processes_the_prefill_node_caches_and_decode_passes_cached_tokens_on() {
    // The decode node caches nothing: the flag is refused there.
    let keys = keys_file();
    let keys = keys.to_str().unwrap();
    let mut refused = Server::http(
        "serve-prefix-cache-decode",
        "decode",
        &["--synthetic", "--prefix-cache", "tenant"],
        &[],
    );
    refused.wait_for("--prefix-cache is not used by --role decode", START_BOUND);
    let deadline = Instant::now() + BOUND;
    while refused.try_wait().is_none() {
        assert!(Instant::now() < deadline, "still running");
        std::thread::sleep(Duration::from_millis(50));
    }

    let decode = Server::http(
        "serve-prefix-cache-decode",
        "decode",
        &["--synthetic", "--api-keys", keys],
        &[],
    );
    let addrs = decode.serving();
    let peer = addrs.peer_listen.expect("peer-listen= on the serving line");
    let prefill = Server::start(
        "serve-prefix-cache-prefill",
        &["--role", "prefill", "--synthetic", "--peer", &peer],
    );
    let line = prefill.wait_for("kvsan: serving role=prefill", START_BOUND);
    assert_eq!(word(&line, "prefix-cache="), "tenant", "{line}");
    decode.wait_for("prefill node connected", START_BOUND);
    let addr = addrs.listen.expect("listen= on the serving line");
    let p = prompt(5);
    let (first, none) = complete(&addr, ALPHA, &p, None);
    assert_eq!(none, 0);
    let (again, hit) = complete(&addr, ALPHA, &p, None);
    assert_eq!((hit, &again), (CACHED, &first), "over the TCP link");
    assert_eq!(cached(&addr, BETA, &p, None), 0);
    // The cache is the prefill process's: the decode process shows none.
    let m = Scrape::of(&addr);
    assert!(!m.has("vllm:prefix_cache_hits_total", &[]));
    assert!(!m.has("kvsan:cached_pages", &[]));
}

#[test]
fn an_empty_cache_salt_is_a_400_naming_the_field() {
    let (_server, _, addr) = start("unified", &[], &[]);
    let body =
        json!({"model": "synthetic", "prompt": prompt(6), "max_tokens": 1, "cache_salt": ""});
    let answer = Client::new(&addr)
        .with_key(ALPHA)
        .post("/v1/completions", &body);
    assert_eq!(answer.status, 400, "{answer:?}");
    assert_eq!(answer.body["error"]["param"], "cache_salt", "{answer:?}");
}

/// Under the shim the preloaded sanitizer checks each share against its
/// own `KVSAN_OPTIONS`: with `--prefix-cache global` and no `prefix_share`,
/// the server says so at start and the cross-tenant hit is reported (and
/// aborted, `on_violation=abort`); with `prefix_share=global` it is legal.
/// (A build with `sanitize` attaches its own sanitizer, not the shim's.)
#[cfg(not(feature = "sanitize"))]
#[test]
fn under_the_shim_the_sanitizer_checks_shares_against_its_own_prefix_share() {
    let shim = shim_common::shim_library();
    for options in [None, Some("prefix_share=global")] {
        let mut env = vec![("LD_PRELOAD", shim.as_os_str())];
        if let Some(o) = options {
            env.push(("KVSAN_OPTIONS", OsStr::new(o)));
        }
        let keys = keys_file();
        let server = Server::http(
            "serve-prefix-cache-shim",
            "unified",
            &[
                "--synthetic",
                "--api-keys",
                keys.to_str().unwrap(),
                "--prefix-cache",
                "global",
            ],
            &env,
        );
        let note = server.wait_for("the preloaded sanitizer checks shares", START_BOUND);
        let addr = word(&server.wait_for("kvsan: serving", START_BOUND), "listen=");
        let p = prompt(7);
        assert_eq!(cached(&addr, ALPHA, &p, None), 0);
        let body = json!({"model": "synthetic", "prompt": p, "max_tokens": 4, "temperature": 0});
        let answer = Client::new(&addr)
            .with_key(BETA)
            .post("/v1/completions", &body);
        let m = Scrape::of(&addr);
        let shares = m.value("kvsan:violations_total", &[("kind", "cross-domain-share")]);
        if options.is_none() {
            assert!(note.contains("not set (tenant)"), "{note}");
            assert_eq!(answer.status, 500, "{answer:?}");
            let e = &answer.body["error"];
            assert_eq!(e["violation"]["kind"], "cross-domain-share", "{e}");
            assert_eq!(shares, 1.0);
        } else {
            assert!(note.contains("prefix_share=global, as"), "{note}");
            assert_eq!(answer.status, 200, "{answer:?}");
            let usage = &answer.body["usage"];
            assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], CACHED);
            assert_eq!(shares, 0.0);
        }
    }
}

/// In the debug-build mode the in-process sanitizer checks each share
/// against the engine's `--prefix-cache` when `KVSAN_OPTIONS` sets no
/// `prefix_share` (so `salt`'s legal cross-tenant shares are not reported),
/// and against `KVSAN_OPTIONS`' when it sets one — the server says which.
#[cfg(feature = "sanitize")]
#[test]
fn in_process_the_sanitizer_checks_shares_against_the_engines_policy_unless_told_otherwise() {
    for options in [None, Some("prefix_share=tenant")] {
        let env: Vec<(&str, &OsStr)> = options
            .map(|o| ("KVSAN_OPTIONS", OsStr::new(o)))
            .into_iter()
            .collect();
        let keys = keys_file();
        let server = Server::http(
            "serve-prefix-cache-sanitize",
            "unified",
            &[
                "--synthetic",
                "--api-keys",
                keys.to_str().unwrap(),
                "--prefix-cache",
                "salt",
            ],
            &env,
        );
        // Said before the serving line.
        let note = server.wait_for("the in-process sanitizer checks shares", START_BOUND);
        let addr = word(&server.wait_for("kvsan: serving", START_BOUND), "listen=");
        let p = prompt(8);
        assert_eq!(cached(&addr, ALPHA, &p, Some("team")), 0);
        let body = json!({"model": "synthetic", "prompt": p, "max_tokens": 4, "temperature": 0,
                          "cache_salt": "team"});
        let answer = Client::new(&addr)
            .with_key(BETA)
            .post("/v1/completions", &body);
        let m = Scrape::of(&addr);
        let shares = m.value("kvsan:violations_total", &[("kind", "cross-domain-share")]);
        if options.is_none() {
            assert!(note.contains("against --prefix-cache salt"), "{note}");
            assert_eq!(answer.status, 200, "{answer:?}");
            let usage = &answer.body["usage"];
            assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], CACHED);
            assert_eq!(shares, 0.0);
        } else {
            assert!(
                note.contains("prefix_share=tenant, not --prefix-cache salt"),
                "{note}"
            );
            assert_eq!(answer.status, 500, "{answer:?}");
            assert_eq!(shares, 1.0);
        }
    }
}
