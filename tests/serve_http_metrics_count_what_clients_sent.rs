//! `GET /metrics` of `kvsan serve`: OpenMetrics text that the
//! Prometheus project's parser accepts, whose counters match what the test
//! sent, under vLLM's names and kvsan's (a repeated prompt raising the
//! prefix cache's: `serve_prefix_cache_*`); a client that leaves mid-stream
//! is counted as an abort and its pages are seen coming back; and the
//! anomaly monitor, with no sanitizer, flags the incident's fault (and
//! aborts it when asked).

mod metrics_common;
mod serve_common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use metrics_common::Scrape;
use serde_json::json;
use serve_common::Server;
use serve_common::client::{BOUND, Client};

/// A disaggregated synthetic-model server with `extra` flags, and a client
/// of it.
fn server(extra: &[&str]) -> (Server, String, Client) {
    let server = Server::synthetic("serve-http-metrics", "disagg", extra);
    let addr = server
        .serving()
        .listen
        .expect("listen= on the serving line");
    let client = Client::new(&addr);
    (server, addr, client)
}

/// A prompt of `n` token ids.
fn prompt(n: u64) -> Vec<u64> {
    (1..=n).map(|i| i % 256).collect()
}

#[test]
fn the_counters_match_what_the_clients_sent() {
    let (_server, addr, client) = server(&[]);
    let idle = Scrape::of(&addr);
    assert_eq!(
        idle.value("vllm:prompt_tokens_total", &[("model_name", "synthetic")]),
        0.0
    );
    // (prompt tokens, max_tokens): the synthetic model has no stop token,
    // so each generates exactly max_tokens; the second is streamed.
    let sent = [(5, 4), (7, 3), (9, 2)];
    for (i, (n, max_tokens)) in sent.into_iter().enumerate() {
        if i == 1 {
            client
                .complete(&prompt(n), max_tokens)
                .assert_finished(n as usize, max_tokens);
        } else {
            let body = json!({
                "model": "synthetic", "prompt": prompt(n), "max_tokens": max_tokens, "temperature": 0,
            });
            let answer = client.post("/v1/completions", &body);
            assert_eq!(answer.status, 200, "{answer:?}");
        }
    }
    let over = json!({"model": "synthetic", "prompt": prompt(5), "max_tokens": 100_000});
    assert_eq!(client.post("/v1/completions", &over).status, 400);

    let m = Scrape::of(&addr);
    let prompts: u64 = sent.iter().map(|s| s.0).sum();
    let generated: usize = sent.iter().map(|s| s.1).sum();
    assert_eq!(m.value("vllm:prompt_tokens_total", &[]), prompts as f64);
    assert_eq!(
        m.value("vllm:generation_tokens_total", &[]),
        generated as f64
    );
    let requests = sent.len() as f64;
    let success = [("finished_reason", "length")];
    assert_eq!(m.value("vllm:request_success_total", &success), requests);
    assert_eq!(
        m.value("vllm:time_to_first_token_seconds_count", &[]),
        requests
    );
    assert_eq!(
        m.value("vllm:e2e_request_latency_seconds_count", &[]),
        requests
    );
    // Every token after a request's first is one inter-token interval.
    assert_eq!(
        m.value("vllm:inter_token_latency_seconds_count", &[]),
        generated as f64 - requests
    );
    let rejected = [("limit", "context"), ("node", "decode")];
    assert_eq!(m.value("kvsan:rejections_total", &rejected), 1.0);
    // Each prompt is one transfer piece, sent by prefill, received by decode.
    for node in ["prefill", "decode"] {
        assert_eq!(
            m.value("kvsan:kv_transfers_total", &[("node", node)]),
            requests
        );
        assert_eq!(
            m.value("kvsan:free_pages", &[("node", node)]),
            m.value("kvsan:total_pages", &[("node", node)]),
            "{node}: every page back"
        );
        assert!(m.value("kvsan:steps_total", &[("node", node)]) >= requests);
        assert!(m.value("kvsan:pages_allocated_total", &[("node", node)]) >= requests);
    }
    assert_eq!(m.value("vllm:num_requests_running", &[]), 0.0);
    assert_eq!(m.value("vllm:num_requests_waiting", &[]), 0.0);
    assert_eq!(m.value("vllm:kv_cache_usage_perc", &[]), 0.0);
    assert_eq!(m.value("vllm:num_preemptions_total", &[]), 0.0);
    // The prefill node's cache looked up every admitted prompt; none of
    // them fills a page, so none is kept or found.
    assert_eq!(
        m.value("vllm:prefix_cache_queries_total", &[]),
        prompts as f64
    );
    assert_eq!(m.value("vllm:prefix_cache_hits_total", &[]), 0.0);
    assert_eq!(m.value("kvsan:cached_pages", &[("node", "prefill")]), 0.0);
    for kind in ["short-kv", "fast-first-token"] {
        assert_eq!(
            m.value("kvsan:anomalies_total", &[("kind", kind)]),
            0.0,
            "{kind}"
        );
    }
    assert!(m.has("kvsan:sanitizer_attached", &[]));
}

#[test]
fn a_client_that_leaves_mid_stream_is_an_abort_and_its_pages_come_back() {
    let (_server, addr, _client) = server(&[]);
    let body = json!({
        "model": "synthetic", "prompt": prompt(100), "max_tokens": 3900, "stream": true,
    });
    let mut curl = Command::new("curl")
        .args(["-sS", "-N", "--max-time", "60"])
        .args(["-H", "Content-Type: application/json", "--data-binary"])
        .arg(body.to_string())
        .arg(format!("http://{addr}/v1/completions"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("run curl");
    let mut events = BufReader::new(curl.stdout.take().expect("stdout")).lines();
    for _ in 0..2 {
        let line = loop {
            let line = events
                .next()
                .expect("the stream ended early")
                .expect("read");
            if line.starts_with("data: ") {
                break line;
            }
        };
        assert!(!line.contains("[DONE]"), "{line}");
    }
    let streaming = Scrape::of(&addr);
    assert_eq!(streaming.value("vllm:num_requests_running", &[]), 1.0);
    assert!(streaming.value("vllm:kv_cache_usage_perc", &[]) > 0.0);

    // The client goes away.
    curl.kill().expect("kill curl");
    let _ = curl.wait();
    let deadline = Instant::now() + BOUND;
    loop {
        let m = Scrape::of(&addr);
        let aborted = m.count(
            "vllm:request_success_total",
            &[("finished_reason", "abort")],
        );
        let free = m.value("kvsan:free_pages", &[("node", "decode")]);
        if aborted == 1.0 && free == m.value("kvsan:total_pages", &[("node", "decode")]) {
            assert_eq!(m.value("vllm:kv_cache_usage_perc", &[]), 0.0);
            assert_eq!(m.value("vllm:num_requests_running", &[]), 0.0);
            assert_eq!(
                m.count(
                    "vllm:request_success_total",
                    &[("finished_reason", "length")]
                ),
                0.0
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the abort and the freed pages never showed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The incident's fault, injected into a server with no sanitizer: a
/// prompt over the prefill pool is rejected by prefill, admitted by decode
/// as a one-token placeholder, and its first token comes with KV for one
/// position of 1,100.
#[cfg(feature = "faults")]
#[test]
fn without_a_sanitizer_the_anomaly_monitor_flags_the_incident_and_aborts_it_when_asked() {
    let incident = [
        "--prefill-pool-tokens",
        "1024",
        "--allow-pool-smaller-than-context",
        "--inject",
        "reject-as-placeholder",
    ];
    for (mode, status) in [("log", 200), ("abort", 500)] {
        let mut flags = incident.to_vec();
        flags.extend(["--anomaly", mode]);
        let (server, addr, client) = server(&flags);
        let body = json!({"model": "synthetic", "prompt": prompt(1100), "max_tokens": 4});
        let answer = client.post("/v1/completions", &body);
        assert_eq!(answer.status, status, "--anomaly {mode}: {answer:?}");
        if mode == "abort" {
            let e = &answer.body["error"];
            assert_eq!(e["code"], "anomaly", "{e}");
            let message = e["message"].as_str().unwrap();
            assert!(
                message.contains("short-kv") && message.contains("1 of the prompt's 1100"),
                "{message}"
            );
        }
        server.wait_for("anomaly short-kv", BOUND);
        // An honest request beside it is served and not flagged.
        let honest = json!({"model": "synthetic", "prompt": prompt(10), "max_tokens": 2});
        assert_eq!(client.post("/v1/completions", &honest).status, 200);
        let m = Scrape::of(&addr);
        assert_eq!(
            m.value("kvsan:anomalies_total", &[("kind", "short-kv")]),
            1.0,
            "--anomaly {mode}"
        );
        assert_eq!(
            m.value("kvsan:anomalies_total", &[("kind", "fast-first-token")]),
            0.0
        );
    }
}
