//! 64 concurrent SSE streams against `kvsan serve --role disagg`
//! with the sanitizer attached (the shim preloaded): every stream ends with
//! its finish_reason and `data: [DONE]`, every token delivered, and the
//! sanitizer's summary at SIGTERM counts zero violations. (A refusal would
//! have to be a clean 503; with the default `--max-clients` there is none.)

mod metrics_common;
mod serve_common;
mod shim_common;

use std::process::Command;
use std::time::Duration;

use metrics_common::Scrape;
use serde_json::{Value, json};
use serve_common::Server;

/// Streams at once.
const STREAMS: usize = 64;

/// One streamed completion over curl: `Ok(tokens)` for a stream that
/// ended properly, `Err(status)` for a refusal.
fn stream_once(addr: &str, seed: usize) -> Result<usize, u16> {
    let prompt: Vec<usize> = (0..8 + seed % 24).map(|i| (i * 7 + seed) % 256).collect();
    let body = json!({
        "model": "synthetic",
        "prompt": prompt,
        "max_tokens": 8 + seed % 16,
        "seed": seed,
        "stream": true,
    });
    let out = Command::new("curl")
        .args(["-sS", "-N", "--max-time", "120", "-w", "\n%{http_code}"])
        .args(["-H", "Content-Type: application/json", "--data-binary"])
        .arg(body.to_string())
        .arg(format!("http://{addr}/v1/completions"))
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "curl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let (body, status) = text.rsplit_once('\n').expect("status line");
    let status: u16 = status.parse().expect("status");
    if status != 200 {
        let v: Value = serde_json::from_str(body).expect("JSON error");
        assert_eq!(
            (status, &v["error"]["code"]),
            (503, &json!("overloaded")),
            "{v}"
        );
        return Err(status);
    }
    let data: Vec<&str> = body
        .trim_end()
        .split("\n\n")
        .map(|e| e.strip_prefix("data: ").expect("a data event"))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{body}");
    let mut tokens = 0;
    let mut reason = Value::Null;
    for d in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(d).expect("a chunk");
        assert!(chunk.get("error").is_none(), "a stream failed: {chunk}");
        tokens += chunk["choices"][0]["token_ids"].as_array().unwrap().len();
        reason = chunk["choices"][0]["finish_reason"].clone();
    }
    assert_eq!(reason, "length", "{body}");
    Ok(tokens)
}

#[test]
fn concurrent_streams_under_the_shim_end_cleanly_with_zero_violations() {
    let shim = shim_common::shim_library();
    let server = Server::http(
        "serve-http-load",
        "disagg",
        &["--synthetic", "--checker-stall-secs", "1"],
        &[("LD_PRELOAD", shim.as_os_str())],
    );
    let addr = server.listen();
    let outcomes: Vec<Result<usize, u16>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..STREAMS)
            .map(|i| {
                let addr = addr.as_str();
                s.spawn(move || stream_once(addr, i))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a stream thread"))
            .collect()
    });
    for (i, outcome) in outcomes.iter().enumerate() {
        if let Ok(tokens) = outcome {
            assert_eq!(*tokens, 8 + i % 16, "stream {i}: every token arrived");
        }
    }
    // --max-clients (256 by default) leaves room for all of them.
    let served = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(served, STREAMS, "{outcomes:?}");

    // The shim's own counters, through the C ABI, on /metrics.
    let m = Scrape::of(&addr);
    assert_eq!(
        m.value("kvsan:sanitizer_attached", &[("target", "C hook table")]),
        1.0
    );
    assert!(m.value("kvsan:checks_total", &[]) > 0.0);
    // The watchdog saw the checks move with the steps: healthy.
    assert_eq!(m.value("kvsan:checker_stalled", &[]), 0.0);
    let health = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "30",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .arg(format!("http://{addr}/health"))
        .output()
        .expect("run curl");
    assert_eq!(String::from_utf8_lossy(&health.stdout), "200");
    for kind in kvsan_sanitizer::ViolationKind::ALL {
        assert_eq!(
            m.value("kvsan:violations_total", &[("kind", kind.name())]),
            0.0
        );
    }
    assert_eq!(
        m.value(
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        STREAMS as f64
    );

    let pid = libc::pid_t::try_from(server.pid()).expect("pid");
    // SAFETY: kill takes a pid and a signal number; no memory is passed.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let summary = server.wait_for("violations", Duration::from_secs(30));
    assert!(summary.contains("kvsan: 0 violations"), "{summary}");
}
