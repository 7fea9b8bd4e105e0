//! `kvsan serve` answers OpenAI clients: real server processes
//! on loopback, driven by `curl` (SSE framing, statuses and error bodies,
//! as bytes on the wire) and by the official `openai` Python package.
//!
//! The synthetic model (no tokenizer: prompts are token-id arrays, answers
//! carry `token_ids`) covers the wire format; the default model covers
//! text, the chat template and the Python client.

use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

mod metrics_common;
mod serve_common;
use metrics_common::Scrape;
use serve_common::Server;
use serve_common::client::{BOUND, RawStream};

/// A unified synthetic-model server with `extra` flags, and its address.
fn synthetic_server(extra: &[&str]) -> (Server, String) {
    let server = start_synthetic(extra);
    let addr = server.listen();
    (server, addr)
}

/// A unified synthetic-model server with `extra` flags, before its serving line.
fn start_synthetic(extra: &[&str]) -> Server {
    Server::synthetic("serve-http", "unified", extra)
}

/// A `curl` answer: the status and the body.
struct Answer {
    status: u16,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// Checks the OpenAI error shape and returns the `error` object.
    fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.body);
        let v = self.json();
        let e = v["error"].clone();
        for field in ["message", "type", "code"] {
            assert!(e[field].is_string(), "error.{field} missing: {v}");
        }
        e
    }
}

/// `curl` with `args`, to `http://{addr}{path}`.
fn curl(addr: &str, path: &str, args: &[&str]) -> Answer {
    let out = Command::new("curl")
        .args(["-sS", "-N", "--max-time", "60", "-w", "\n%{http_code}"])
        .args(args)
        .arg(format!("http://{addr}{path}"))
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8 answer");
    let (body, status) = text.rsplit_once('\n').expect("status line");
    Answer {
        status: status.parse().expect("status code"),
        body: body.to_string(),
    }
}

/// POSTs `body` (JSON text) with extra `headers`.
fn post(addr: &str, path: &str, body: &str, headers: &[&str]) -> Answer {
    let mut args = vec![
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        body,
    ];
    for h in headers {
        args.extend(["-H", h]);
    }
    curl(addr, path, &args)
}

/// The `data:` payloads of an SSE body, checking the framing: every event
/// is exactly one `data: ` line followed by a blank line.
fn sse_data(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("\n\n"),
        "events end with a blank line: {body:?}"
    );
    body.trim_end_matches('\n')
        .split("\n\n")
        .map(|event| {
            assert!(!event.contains('\n'), "one line per event: {event:?}");
            event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"))
                .to_string()
        })
        .collect()
}

#[test]
fn a_streamed_completion_is_sse_chunks_then_usage_then_done() {
    let (_server, addr) = synthetic_server(&[]);
    let body = json!({
        "model": "synthetic",
        "prompt": [1, 2, 3, 4],
        "max_tokens": 5,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let answer = post(&addr, "/v1/completions", &body, &[]);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let data = sse_data(&answer.body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]), "{usage}");
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    let chunks: Vec<Value> = data[..data.len() - 2]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let mut ids = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        assert_eq!(chunk["object"], "text_completion", "{chunk}");
        assert!(chunk["id"].as_str().unwrap().starts_with("cmpl-"));
        assert_eq!(chunk["usage"], Value::Null, "usage null until the end");
        let choice = &chunk["choices"][0];
        let last = i == chunks.len() - 1;
        let reason = if last { json!("length") } else { Value::Null };
        assert_eq!(choice["finish_reason"], reason, "{chunk}");
        ids.extend(choice["token_ids"].as_array().unwrap().iter().cloned());
    }
    assert_eq!(ids.len(), 5, "every token streamed once");
}

#[test]
fn a_completion_not_streamed_has_its_usage_and_finish_reason() {
    let (_server, addr) = synthetic_server(&[]);
    let body = json!({"model": "synthetic", "prompt": [[5, 6, 7]], "max_tokens": 3, "seed": 7});
    let answer = post(&addr, "/v1/completions", &body.to_string(), &[]);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let v = answer.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 3);
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    let models = curl(&addr, "/v1/models", &[]).json();
    assert_eq!(models["data"][0]["id"], "synthetic");
    assert_eq!(curl(&addr, "/health", &[]).status, 200);
}

#[test]
fn bad_requests_get_openai_errors_with_the_right_status() {
    let (_server, addr) = synthetic_server(&["--synthetic-context", "256"]);
    let completions = |body: &str| post(&addr, "/v1/completions", body, &[]);

    let e = completions(r#"{"model": "synthetic", "prompt": [1, 2"#).error(400);
    assert_eq!(e["code"], "invalid_json", "{e}");

    let e = completions(r#"{"model": "synthetic", "prompt": [1], "logprobs": 1}"#).error(400);
    assert_eq!(e["param"], "logprobs", "{e}");
    assert!(e["message"].as_str().unwrap().contains("logprobs"), "{e}");

    let e = completions(r#"{"model": "synthetic", "prompt": [1], "n": 2}"#).error(400);
    assert_eq!(e["param"], "n", "{e}");

    let e = completions(r#"{"model": "synthetic", "prompt": [1], "top_k": "x"}"#).error(400);
    assert_eq!(e["param"], "top_k", "{e}");

    let e = completions(r#"{"model": "synthetic", "prompt": [1, -2]}"#).error(400);
    assert_eq!(e["param"], "prompt[1]", "{e}");

    let e = completions(r#"{"model": "synthetic", "prompt": [1], "temperature": -1}"#).error(400);
    assert!(
        e["message"].as_str().unwrap().contains("temperature"),
        "{e}"
    );

    // Over the context: refused with its limit, before any stream starts.
    let long: Vec<u32> = (0..300).map(|i| i % 50).collect();
    for stream in [false, true] {
        let body = json!({"model": "synthetic", "prompt": long, "max_tokens": 4, "stream": stream});
        let e = completions(&body.to_string()).error(400);
        assert_eq!(e["code"], "rejected", "{e}");
        let message = e["message"].as_str().unwrap();
        assert!(message.contains("limit 256 tokens"), "{message}");
    }

    let e = completions(r#"{"model": "gpt-4", "prompt": [1]}"#).error(404);
    assert_eq!(e["code"], "model_not_found", "{e}");

    let chat = json!({"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]});
    let e = post(&addr, "/v1/chat/completions", &chat.to_string(), &[]).error(400);
    assert_eq!(e["code"], "no_tokenizer", "{e}");

    curl(&addr, "/v1/nothing", &[]).error(404);
    curl(&addr, "/v1/completions", &[]).error(405);
}

#[test]
fn tenants_come_from_api_keys_and_an_unknown_key_is_refused() {
    let dir = tempfile_dir();
    let keys = dir.join("keys");
    std::fs::write(&keys, "# test keys\nsk-alpha 1\nsk-beta 2 salt-b\n").unwrap();
    let server = start_synthetic(&["--api-keys", keys.to_str().unwrap()]);
    // Said before the serving line.
    server.wait_for("--api-keys: 2 keys for 2 tenants", BOUND);
    let addr = server.listen();
    let body = r#"{"model": "synthetic", "prompt": [1, 2], "max_tokens": 1}"#;

    let e = post(&addr, "/v1/completions", body, &[]).error(401);
    assert_eq!(e["code"], "invalid_api_key", "{e}");
    let answer = post(
        &addr,
        "/v1/completions",
        body,
        &["Authorization: Bearer sk-guess"],
    );
    answer.error(401);
    assert!(!answer.body.contains("sk-guess"), "the key is not echoed");
    curl(&addr, "/v1/models", &[]).error(401);

    let ok = post(
        &addr,
        "/v1/completions",
        body,
        &["Authorization: Bearer sk-beta"],
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    // /health asks no key.
    assert_eq!(curl(&addr, "/health", &[]).status, 200);
}

#[test]
fn a_malformed_key_file_refuses_to_start_naming_the_line() {
    let dir = tempfile_dir();
    let keys = dir.join("keys");
    std::fs::write(&keys, "sk-alpha 1\nsk-beta two\n").unwrap();
    let mut server = start_synthetic(&["--api-keys", keys.to_str().unwrap()]);
    server.wait_for("line 2", BOUND);
    let deadline = std::time::Instant::now() + BOUND;
    let status = loop {
        if let Some(status) = server.try_wait() {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "still running");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
}

#[test]
fn without_a_key_file_the_server_says_it_has_one_tenant() {
    let server = start_synthetic(&[]);
    // Said before the serving line.
    server.wait_for("no --api-keys: every client is tenant 0", BOUND);
    server.listen();
}

#[test]
fn a_client_that_disconnects_mid_stream_cancels_its_request() {
    // One generation at a time: the next request is refused while this
    // one runs and served once its client has gone.
    let (server, addr) = synthetic_server(&["--max-clients", "1"]);
    let long = json!({
        "model": "synthetic",
        "prompt": [1, 2, 3],
        "max_tokens": 4000,
        "stream": true,
    })
    .to_string();
    let mut stream = RawStream::open(&addr, &long);
    let first: Value = serde_json::from_str(&stream.next_data()).unwrap();
    let id = first["id"]
        .as_str()
        .unwrap()
        .strip_prefix("cmpl-")
        .unwrap()
        .to_string();
    stream.next_data();

    let small = r#"{"model": "synthetic", "prompt": [1], "max_tokens": 1}"#;
    let e = post(&addr, "/v1/completions", small, &[]).error(503);
    assert_eq!(e["code"], "overloaded", "{e}");

    drop(stream);
    server.wait_for(
        &format!("request {id} cancelled: its client went away"),
        BOUND,
    );
    let deadline = std::time::Instant::now() + BOUND;
    loop {
        let answer = post(&addr, "/v1/completions", small, &[]);
        if answer.status == 200 {
            break;
        }
        answer.error(503);
        assert!(std::time::Instant::now() < deadline, "capacity never freed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_client_that_disconnects_before_a_whole_answer_cancels_its_request() {
    let (server, addr) = synthetic_server(&["--max-clients", "1", "--synthetic-context", "65536"]);
    let long = json!({"model": "synthetic", "prompt": [1, 2, 3], "max_tokens": 65000}).to_string();
    let waiting = RawStream::open(&addr, &long);
    // Running before any small request is sent: a small one that took the
    // only place first would have the long one refused instead.
    let deadline = std::time::Instant::now() + BOUND;
    while Scrape::of(&addr).value("vllm:num_requests_running", &[]) < 1.0 {
        assert!(std::time::Instant::now() < deadline, "never running");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Refused while the long request holds the only place: it is in flight.
    let small = r#"{"model": "synthetic", "prompt": [1], "max_tokens": 1}"#;
    while post(&addr, "/v1/completions", small, &[]).status != 503 {
        assert!(std::time::Instant::now() < deadline, "never in flight");
    }
    drop(waiting);
    server.wait_for("cancelled: its client went away", BOUND);
}

/// A fresh directory under the target's temporary directory.
fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "serve-http-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A server of the default model (text, tokenizer, chat template).
fn text_server(extra: &[&str]) -> (Server, String, String) {
    let server = Server::http("serve-http", "unified", extra, &[]);
    let line = server.wait_for("kvsan: serving", serve_common::START_BOUND);
    let get = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .unwrap_or_else(|| panic!("{key} on {line:?}"))
            .to_string()
    };
    (server, get("listen="), get("model="))
}

#[test]
fn a_chat_streams_text_and_tokenize_round_trips_over_curl() {
    let (_server, addr, model) = text_server(&[]);
    let chat = json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": true,
    });
    let answer = post(&addr, "/v1/chat/completions", &chat.to_string(), &[]);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let data = sse_data(&answer.body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str() {
            text.push_str(piece);
        }
    }
    let reason = &chunks.last().unwrap()["choices"][0]["finish_reason"];
    assert!(reason == "stop" || reason == "length", "{reason}");
    assert!(!text.is_empty(), "the chat answered some text");

    let tokens = post(&addr, "/tokenize", r#"{"prompt": "Hello world"}"#, &[]).json();
    let ids = tokens["tokens"].clone();
    assert_eq!(tokens["count"], ids.as_array().unwrap().len());
    let back = post(
        &addr,
        "/detokenize",
        &json!({ "tokens": ids }).to_string(),
        &[],
    )
    .json();
    assert_eq!(back["prompt"], "Hello world");
}

/// The `openai` package's exchange with the server (`python3` prints one
/// JSON object with what it saw).
const PYTHON_CLIENT: &str = r#"
import json, sys
import openai
addr, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="sk-alpha", max_retries=0)
seen = {"models": [m.id for m in client.models.list().data]}
msgs = [{"role": "user", "content": "What is 2 + 2?"}]
chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
seen["chat"] = {"text": chat.choices[0].message.content, "finish": chat.choices[0].finish_reason,
                "usage": chat.usage.model_dump()}
pieces, usage = [], None
for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}):
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage.model_dump()
seen["chat_stream"] = {"text": "".join(pieces), "usage": usage}
# The same chat with another tenant's key: nothing of tenant 1's prompt is cached for it.
other = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="sk-beta", max_retries=0)
theirs = other.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
seen["other_tenant_chat"] = {"text": theirs.choices[0].message.content,
                             "cached": theirs.usage.prompt_tokens_details.cached_tokens}
done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
seen["completion"] = {"text": done.choices[0].text, "usage": done.usage.model_dump()}
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
seen["completion_stream"] = streamed
try:
    client.completions.create(model=model, prompt="x", n=2)
    seen["n2"] = None
except openai.BadRequestError as e:
    seen["n2"] = e.status_code
try:
    openai.OpenAI(base_url=f"http://{addr}/v1", api_key="sk-wrong", max_retries=0).models.list()
    seen["wrong_key"] = None
except openai.AuthenticationError as e:
    seen["wrong_key"] = e.status_code
print(json.dumps(seen))
"#;

/// Runs a client `script` against the server at `addr` serving `model`;
/// the JSON object it printed.
fn python_client(script: &str, addr: &str, model: &str) -> Value {
    let out = Command::new("python3")
        .args(["-c", script, addr, model])
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "the Python client failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the client's JSON")
}

#[test]
fn the_openai_python_client_chats_and_completes_streamed_and_not() {
    let has_openai = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_openai,
        "the `openai` Python package is missing: python3 -m pip install openai (scripts/test does)"
    );
    let dir = tempfile_dir();
    let keys = dir.join("keys");
    std::fs::write(&keys, "sk-alpha 1\nsk-beta 2\n").unwrap();
    let (_server, addr, model) = text_server(&["--api-keys", keys.to_str().unwrap()]);
    let seen = python_client(PYTHON_CLIENT, &addr, &model);
    assert_eq!(seen["models"], json!([model]));
    assert!(!seen["chat"]["text"].as_str().unwrap().is_empty(), "{seen}");
    let usage = &seen["chat"]["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
    // Greedy: the streamed answer is the same text, and its usage chunk
    // came, with the same counts — and the repeated prompt's full pages
    // from the prefix cache (the default policy, one tenant).
    assert_eq!(seen["chat_stream"]["text"], seen["chat"]["text"], "{seen}");
    let streamed = &seen["chat_stream"]["usage"];
    for count in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(streamed[count], usage[count], "{count}: {seen}");
    }
    let cached = |u: &Value| u["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached(usage), Some(0), "the first chat: {seen}");
    let hit = cached(streamed).expect("cached_tokens parsed by the client");
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert!(hit > 0 && hit < prompt && hit % 16 == 0, "{seen}");
    // Another tenant: the same answer, computed afresh.
    assert_eq!(seen["other_tenant_chat"]["cached"], 0, "{seen}");
    assert_eq!(
        seen["other_tenant_chat"]["text"], seen["chat"]["text"],
        "{seen}"
    );
    assert_eq!(
        seen["completion_stream"], seen["completion"]["text"],
        "{seen}"
    );
    let generated = seen["completion"]["usage"]["completion_tokens"]
        .as_u64()
        .unwrap();
    assert!((1..=6).contains(&generated), "{seen}");
    assert_eq!(seen["n2"], 400);
    assert_eq!(seen["wrong_key"], 401);
}

/// The `openai` package asks one system prompt, then prompts of other
/// tenants that take the pool, then the first again (`python3` prints what
/// it saw).
const PYTHON_TIER_CLIENT: &str = r#"
import json, sys
import openai
addr, model = sys.argv[1], sys.argv[2]
def client(key):
    return openai.OpenAI(base_url=f"http://{addr}/v1", api_key=key, max_retries=0)
def ask(key, system, user):
    r = client(key).chat.completions.create(
        model=model, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    return {"text": r.choices[0].message.content, "prompt": r.usage.prompt_tokens,
            "cached": r.usage.prompt_tokens_details.cached_tokens}
system = "You answer in one word. Colours are red, green, blue, yellow and violet. " * 4
seen = {"first": ask("sk-alpha", system, "Name a colour.")}
seen["fillers"] = [ask("sk-beta", f"Note {i}: " + "the quick brown fox jumps over the lazy dog. " * 20, "Hi.")
                   for i in range(3)]
seen["again"] = ask("sk-alpha", system, "Name a colour.")
print(json.dumps(seen))
"#;

/// With a small pool and a disk KV tier, a system prompt's cached pages
/// are evicted by other tenants' prompts and go to disk; the `openai`
/// client's repeat of the first chat is served them from there
/// (`cached_tokens`), with the same answer, and `/metrics` counts the
/// disk tier's stores and hits.
#[test]
fn the_openai_client_is_served_a_cached_prompt_back_from_the_disk_tier() {
    let dir = tempfile_dir();
    let keys = dir.join("tier-keys");
    std::fs::write(&keys, "sk-alpha 1\nsk-beta 2\n").unwrap();
    let tier_dir = dir.join("kv-tier");
    std::fs::create_dir_all(&tier_dir).unwrap();
    let (_server, addr, model) = text_server(&[
        "--api-keys",
        keys.to_str().unwrap(),
        "--pool-tokens",
        "512",
        "--allow-pool-smaller-than-context",
        "--kv-offload-dir",
        tier_dir.to_str().unwrap(),
        "--kv-offload-disk-bytes",
        "67108864",
    ]);
    assert_eq!(
        std::fs::read_dir(&tier_dir).unwrap().count(),
        1,
        "the node's tier file"
    );
    let seen = python_client(PYTHON_TIER_CLIENT, &addr, &model);
    assert_eq!(seen["first"]["cached"], 0, "{seen}");
    let prompt = seen["first"]["prompt"].as_u64().unwrap();
    let again = seen["again"]["cached"].as_u64().unwrap();
    assert!(
        again > 0 && again < prompt && again.is_multiple_of(16),
        "the repeat is served its full pages: {seen}"
    );
    assert_eq!(seen["again"]["text"], seen["first"]["text"], "{seen}");
    let scrape = Scrape::of(&addr);
    let disk = [("tier", "disk")];
    assert!(scrape.value("kvsan:kv_offload_stores_total", &disk) > 0.0);
    assert!(
        scrape.value("kvsan:kv_offload_hits_total", &disk) >= (again / 16) as f64,
        "every page served came from disk"
    );
    assert_eq!(scrape.value("kvsan:kv_offload_io_errors_total", &disk), 0.0);
}

/// A greedy completion's token ids from the server at `addr`.
fn greedy_ids(addr: &str) -> Value {
    let body =
        json!({"model": "synthetic", "prompt": [3, 1, 4, 1, 5], "max_tokens": 6, "temperature": 0});
    let answer = post(addr, "/v1/completions", &body.to_string(), &[]);
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.json()["choices"][0]["token_ids"].clone()
}

#[test]
fn disaggregated_roles_answer_over_http_as_the_unified_one_does() {
    let (_unified, unified_addr) = synthetic_server(&[]);
    let expected = greedy_ids(&unified_addr);

    let disagg = Server::synthetic("serve-http-disagg", "disagg", &[]);
    let disagg_addr = disagg.listen();
    assert_eq!(greedy_ids(&disagg_addr), expected, "--role disagg");

    let decode = Server::synthetic("serve-http-decode", "decode", &[]);
    let addrs = decode.serving();
    let peer = addrs.peer_listen.expect("peer-listen= on the serving line");
    let _prefill = Server::start(
        "serve-http-prefill",
        &["--role", "prefill", "--synthetic", "--peer", &peer],
    );
    decode.wait_for("prefill node connected", serve_common::START_BOUND);
    let decode_addr = addrs.listen.expect("listen= on the serving line");
    assert_eq!(
        greedy_ids(&decode_addr),
        expected,
        "--role decode + prefill"
    );
}

#[test]
fn a_stop_string_ends_the_text_before_it_with_finish_reason_stop() {
    let (_server, addr, model) = text_server(&[]);
    let complete = |stop: Option<&str>, stream: bool| {
        let mut body = json!({
            "model": model,
            "prompt": "One, two, three,",
            "max_tokens": 12,
            "temperature": 0,
            "stream": stream,
        });
        if let Some(stop) = stop {
            body["stop"] = json!([stop]);
        }
        let answer = post(&addr, "/v1/completions", &body.to_string(), &[]);
        assert_eq!(answer.status, 200, "{}", answer.body);
        if !stream {
            let v = answer.json();
            let choice = &v["choices"][0];
            return (
                choice["text"].as_str().unwrap().to_string(),
                choice["finish_reason"].clone(),
            );
        }
        let data = sse_data(&answer.body);
        let mut text = String::new();
        let mut reason = Value::Null;
        for d in &data[..data.len() - 1] {
            let chunk: Value = serde_json::from_str(d).unwrap();
            text.push_str(chunk["choices"][0]["text"].as_str().unwrap());
            reason = chunk["choices"][0]["finish_reason"].clone();
        }
        (text, reason)
    };
    // The stop string is taken from the model's own greedy answer, so the
    // test does not depend on what the model says.
    let (full, _) = complete(None, false);
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 6, "a long enough answer: {full:?}");
    let stop: String = chars[3..6].iter().collect();
    let before = &full[..full.find(&stop).unwrap()];
    for stream in [false, true] {
        let (text, reason) = complete(Some(&stop), stream);
        assert_eq!(text, before, "stream={stream}, stop {stop:?} in {full:?}");
        assert_eq!(reason, "stop", "stream={stream}");
    }
}
