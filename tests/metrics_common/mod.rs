//! A `/metrics` scrape, parsed by the Prometheus project's own parser (the
//! `prometheus_client` Python package's OpenMetrics parser, which refuses
//! text that is not OpenMetrics).

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};

/// Parses stdin as OpenMetrics text; prints `[[name, labels, value], …]`.
const PARSE: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
samples = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        samples.append([s.name, s.labels, s.value])
print(json.dumps(samples))
"#;

/// One scrape's samples.
pub struct Scrape {
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
}

#[allow(dead_code)] // each test binary uses its part
impl Scrape {
    /// `GET http://{addr}/metrics`, checked to be OpenMetrics text.
    pub fn of(addr: &str) -> Scrape {
        let out = Command::new("curl")
            .args(["-sS", "--fail", "--max-time", "60", "-D", "/dev/stderr"])
            .arg(format!("http://{addr}/metrics"))
            .output()
            .expect("run curl");
        let headers = String::from_utf8_lossy(&out.stderr).to_lowercase();
        assert!(out.status.success(), "GET /metrics: {headers}");
        assert!(
            headers.contains("content-type: application/openmetrics-text"),
            "{headers}"
        );
        Scrape::parse(&String::from_utf8(out.stdout).expect("UTF-8 metrics"))
    }

    /// Parses `text` with the reference parser.
    pub fn parse(text: &str) -> Scrape {
        let mut python = Command::new("python3")
            .args(["-c", PARSE])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run python3");
        python
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write the metrics");
        let out = python.wait_with_output().expect("python3");
        assert!(
            out.status.success(),
            "prometheus_client refused the metrics (python3 -m pip install prometheus_client \
             if it is missing; scripts/test does): {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
        let samples: Vec<(String, BTreeMap<String, String>, f64)> =
            serde_json::from_slice(&out.stdout).expect("parser output");
        Scrape { samples }
    }

    /// The value of the sample `name` whose labels include `labels`; panics
    /// when none or several match.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<f64> = self
            .samples
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(v))
            })
            .map(|(_, _, v)| *v)
            .collect();
        match found.as_slice() {
            [v] => *v,
            _ => panic!(
                "{} samples {name}{labels:?} (want 1); the scrape has: {:?}",
                found.len(),
                self.names()
            ),
        }
    }

    /// The value of `name` with `labels`, 0 when no sample matches (a
    /// labelled counter no request has touched yet).
    pub fn count(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        if self.has(name, labels) {
            self.value(name, labels)
        } else {
            0.0
        }
    }

    /// Whether a sample `name` with `labels` is there.
    pub fn has(&self, name: &str, labels: &[(&str, &str)]) -> bool {
        self.samples.iter().any(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(v))
        })
    }

    fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.samples.iter().map(|(n, _, _)| n.as_str()).collect();
        names.dedup();
        names
    }
}
