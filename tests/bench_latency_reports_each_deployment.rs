//! `kvsan bench latency` runs end to end: real `kvsan serve` processes (this
//! dev-profile binary) in each deployment, a client timing streamed and
//! non-streamed requests, and the engine alone beside them. The figures
//! themselves are machine-dependent and not asserted; their shape and the
//! step counts (which are deterministic for a request run alone) are.

use std::process::Command;

use serde_json::Value;

#[test]
fn bench_latency_reports_each_deployment_with_its_engine_floor() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvsan"))
        .args([
            "bench",
            "latency",
            "--requests",
            "5",
            "--warmup",
            "1",
            "--json",
        ])
        .output()
        .expect("run kvsan bench latency");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stderr}", out.status);
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(report["request"]["prompt_tokens"], 8);
    assert_eq!(report["request"]["max_tokens"], 2);
    assert!(report["machine"]["cores"].as_u64().unwrap() >= 1);
    let deployments = report["deployments"].as_array().expect("deployments");
    let names: Vec<&str> = deployments
        .iter()
        .map(|d| d["deployment"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["unified", "disagg", "decode-prefill"]);
    for d in deployments {
        let name = d["deployment"].as_str().unwrap();
        // A prompt step and a decode step, on one node or split over two.
        assert_eq!(d["engine"]["steps_per_request"], 2.0, "{name}: {d}");
        // The server counts the nodes it reports: decode only when the
        // prefill node is another process.
        let server_steps = if name == "decode-prefill" { 1.0 } else { 2.0 };
        assert_eq!(d["server_steps_per_request"], server_steps, "{name}: {d}");
        for figure in [
            &d["steps"]["prompt_step"],
            &d["steps"]["decode_step"],
            &d["engine"]["ttft"],
            &d["engine"]["completion"],
            &d["streamed_ttft"],
            &d["streamed_completion"],
            &d["non_streamed_completion"],
        ] {
            let (min, p50, p99) = (
                figure["min_ms"].as_f64().unwrap(),
                figure["p50_ms"].as_f64().unwrap(),
                figure["p99_ms"].as_f64().unwrap(),
            );
            assert!(0.0 < min && min <= p50 && p50 <= p99, "{name}: {figure}");
        }
        for gaps in [&d["gap_to_steps"], &d["gap_to_engine"]] {
            for key in ["ttft_ms", "completion_ms", "non_streamed_completion_ms"] {
                assert!(gaps[key].is_f64(), "{name}: {key} in {gaps}");
            }
        }
        assert!(d["goal_met"].is_boolean(), "{name}: {d}");
    }
    assert!(stderr.contains("client median minus steps"), "{stderr}");
}
