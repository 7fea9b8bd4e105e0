//! Over HTTP, a request the sanitizer aborts gets a 500 whose error names
//! the violation's id and kind — streamed or not, decided before any
//! stream starts — and carries nothing of the prompt.
//!
//! The incident, re-created: `kvsan serve --role disagg` with the
//! `reject-as-placeholder` fault injected and the shim preloaded; a prompt
//! over the prefill pool is rejected by prefill but admitted by decode, and
//! the sanitizer aborts it (`terminal-request-activity`).
#![cfg(feature = "faults")]

mod metrics_common;
mod serve_common;
mod shim_common;

use std::process::Command;

use metrics_common::Scrape;
use serde_json::{Value, json};
use serve_common::Server;

#[test]
fn a_sanitizer_abort_is_a_500_naming_the_violation_id_and_kind() {
    let shim = shim_common::shim_library();
    let server = Server::http(
        "serve-http-shim",
        "disagg",
        &[
            "--synthetic",
            "--prefill-pool-tokens",
            "1024",
            "--allow-pool-smaller-than-context",
            "--inject",
            "reject-as-placeholder",
        ],
        &[("LD_PRELOAD", shim.as_os_str())],
    );
    let addr = server.listen();
    // 1,100 tokens: over the 1,024-token prefill pool, within the context.
    let prompt: Vec<u32> = (1..=1100).map(|i| i % 256).collect();
    for stream in [false, true] {
        let body =
            json!({"model": "synthetic", "prompt": prompt, "max_tokens": 4, "stream": stream});
        let out = Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "60",
                "-w",
                "\n%{http_code} %{content_type}",
            ])
            .args(["-H", "Content-Type: application/json", "--data-binary"])
            .arg(body.to_string())
            .arg(format!("http://{addr}/v1/completions"))
            .output()
            .expect("run curl");
        let text = String::from_utf8(out.stdout).expect("UTF-8");
        let (answer, status) = text.rsplit_once('\n').expect("status line");
        assert_eq!(status, "500 application/json", "stream={stream}: {answer}");
        let v: Value = serde_json::from_str(answer).expect("JSON error");
        let e = &v["error"];
        assert_eq!(e["code"], "violation", "{v}");
        assert_eq!(e["violation"]["kind"], "terminal-request-activity", "{v}");
        let id = e["violation"]["id"].as_str().expect("violation id");
        assert!(id.starts_with("KV-"), "{v}");
        let message = e["message"].as_str().unwrap();
        assert!(
            message.contains(id) && message.contains("terminal-request-activity"),
            "{message}"
        );
        // The prompt's token ids are not in the answer.
        assert!(!answer.contains("1,2,3,4"), "{answer}");
    }
    // Both aborts, as the shim counted them, on /metrics.
    let m = Scrape::of(&addr);
    let kind = [("kind", "terminal-request-activity")];
    assert_eq!(m.value("kvsan:violations_total", &kind), 2.0);
    assert_eq!(
        m.value(
            "vllm:request_success_total",
            &[("finished_reason", "error")]
        ),
        2.0
    );
}
