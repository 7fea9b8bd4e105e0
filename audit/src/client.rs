//! The audit's HTTP client: completions (plain and streamed, for time to
//! first token) against one base URL, every request counted against the
//! budget. Nothing is sent anywhere but the URL given.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// One completion as the server answered it.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Completion {
    /// The HTTP status.
    pub status: u16,
    /// The generated text (empty for an error).
    pub text: String,
    /// `usage.prompt_tokens`, when the server reports it.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`, when the server reports it.
    pub completion_tokens: Option<u64>,
    /// `finish_reason` of the first choice.
    pub finish_reason: Option<String>,
    /// The error message of a non-2xx answer (the server's words).
    pub error: Option<String>,
}

impl Completion {
    /// A 2xx answer with text.
    pub fn served_text(&self) -> bool {
        (200..300).contains(&self.status) && !self.text.is_empty()
    }
}

/// Why the audit stops sending and reports what it has.
#[derive(Debug, thiserror::Error)]
pub enum Stop {
    /// The budget ran out.
    #[error("the budget of {0} requests ran out; later probes did not run")]
    Budget(usize),
    /// The server stopped answering: [`UNANSWERED_IN_A_ROW`] requests in a
    /// row got no answer.
    #[error(
        "the server stopped answering: {UNANSWERED_IN_A_ROW} requests in a row got no answer \
         (the last: {0}); later probes did not run"
    )]
    Unresponsive(String),
    /// `--fail-fast`: a finding was made.
    #[error("stopped at the first finding (--fail-fast); later probes did not run")]
    FirstFinding,
}

/// Requests in a row without an answer (no status: refused connection,
/// timeout) after which the audit stops rather than wait out the rest.
pub const UNANSWERED_IN_A_ROW: usize = 3;

/// A client of one server.
pub struct Client {
    http: reqwest::Client,
    base: String,
    pub model: String,
    budget: usize,
    sent: AtomicUsize,
    /// Requests in a row that got no answer, and the last one's error.
    unanswered: std::sync::Mutex<(usize, String)>,
    progress: indicatif::ProgressBar,
}

impl Client {
    /// A client of `base` (`http://host:port`, no trailing `/v1`).
    ///
    /// # Errors
    /// A URL that is not `http://…`.
    pub fn new(
        base: &str,
        timeout: Duration,
        budget: usize,
        progress: indicatif::ProgressBar,
    ) -> anyhow::Result<Client> {
        let base = base
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_string();
        if base.starts_with("https://") {
            bail!(
                "--base-url {base}: this kvsan speaks plain HTTP only (no TLS client is built in); \
                 reach an HTTPS endpoint through a local TLS proxy"
            );
        }
        if !base.starts_with("http://") {
            bail!("--base-url {base}: expected http://HOST:PORT");
        }
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .context("building the HTTP client")?;
        Ok(Client {
            http,
            base,
            model: String::new(),
            budget,
            sent: AtomicUsize::new(0),
            unanswered: std::sync::Mutex::new((0, String::new())),
            progress,
        })
    }

    /// Requests sent so far.
    pub fn sent(&self) -> usize {
        self.sent.load(Ordering::Relaxed)
    }

    fn spend(&self) -> Result<(), Stop> {
        {
            let unanswered = self.unanswered.lock().unwrap_or_else(|e| e.into_inner());
            if unanswered.0 >= UNANSWERED_IN_A_ROW {
                return Err(Stop::Unresponsive(unanswered.1.clone()));
            }
        }
        let n = self.sent.fetch_add(1, Ordering::Relaxed);
        if n >= self.budget {
            self.sent.fetch_sub(1, Ordering::Relaxed);
            return Err(Stop::Budget(self.budget));
        }
        self.progress.inc(1);
        Ok(())
    }

    /// Counts a request that got an answer (`None`) or none (its error).
    fn answered<T>(&self, r: anyhow::Result<T>) -> anyhow::Result<T> {
        let mut unanswered = self.unanswered.lock().unwrap_or_else(|e| e.into_inner());
        match &r {
            Ok(_) => unanswered.0 = 0,
            Err(e) => *unanswered = (unanswered.0 + 1, format!("{e:#}")),
        }
        r
    }

    fn post(&self, key: Option<&str>, path: &str, body: &Value) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        req
    }

    /// `GET /v1/models`: the model to ask for and its context length, if
    /// the server says (`max_model_len`, vLLM's and kvsan's field).
    ///
    /// # Errors
    /// The server cannot be reached, refuses the key, or answers no model.
    pub async fn discover(
        &mut self,
        key: Option<&str>,
        model: Option<&str>,
    ) -> anyhow::Result<Option<usize>> {
        let url = format!("{}/v1/models", self.base);
        let mut req = self.http.get(&url);
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("cannot reach {url}"))?;
        let status = resp.status().as_u16();
        let body: Value = serde_json::from_slice(&resp.bytes().await?).unwrap_or(Value::Null);
        if status != 200 {
            bail!("{url} answered {status}: {}", error_message(&body));
        }
        let models = body["data"].as_array().cloned().unwrap_or_default();
        let chosen = match model {
            Some(m) => models
                .iter()
                .find(|e| e["id"] == m)
                .cloned()
                .unwrap_or_else(|| json!({"id": m})),
            None => models
                .first()
                .cloned()
                .with_context(|| format!("{url} lists no model; give --model"))?,
        };
        self.model = chosen["id"].as_str().unwrap_or_default().to_string();
        Ok(["max_model_len", "context_length", "context_window"]
            .iter()
            .find_map(|f| chosen[*f].as_u64())
            .map(|n| n as usize))
    }

    /// A greedy completion of `prompt`.
    ///
    /// # Errors
    /// [`Stop`], or the request failed (no answer, timeout).
    pub async fn complete(
        &self,
        key: Option<&str>,
        prompt: &str,
        max_tokens: usize,
    ) -> anyhow::Result<Completion> {
        self.spend()?;
        let body = json!({
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "seed": 0,
        });
        let answer = async {
            let resp = self
                .post(key, "/v1/completions", &body)
                .send()
                .await
                .context("sending a completion")?;
            let status = resp.status().as_u16();
            let bytes = resp.bytes().await.context("reading a completion")?;
            let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            if !(200..300).contains(&status) {
                return Ok(Completion {
                    status,
                    error: Some(error_message(&v)),
                    ..Completion::default()
                });
            }
            let choice = &v["choices"][0];
            Ok(Completion {
                status,
                text: choice["text"].as_str().unwrap_or_default().to_string(),
                prompt_tokens: v["usage"]["prompt_tokens"].as_u64(),
                completion_tokens: v["usage"]["completion_tokens"].as_u64(),
                finish_reason: choice["finish_reason"].as_str().map(str::to_string),
                error: None,
            })
        }
        .await;
        self.answered(answer)
    }

    /// A greedy completion of `prompt`, streamed: `under_way` is told when
    /// the first chunk with text arrives (the answer is being generated),
    /// and the whole text is returned at the end. A refused request drops
    /// `under_way` untold.
    ///
    /// # Errors
    /// As [`Client::complete`].
    pub async fn complete_telling(
        &self,
        key: Option<&str>,
        prompt: &str,
        max_tokens: usize,
        under_way: tokio::sync::oneshot::Sender<()>,
    ) -> anyhow::Result<Completion> {
        self.spend()?;
        let body = json!({
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "seed": 0, "stream": true,
        });
        let answer = async {
            let mut resp = self
                .post(key, "/v1/completions", &body)
                .send()
                .await
                .context("sending a streamed completion")?;
            let status = resp.status().as_u16();
            if !(200..300).contains(&status) {
                let bytes = resp.bytes().await.context("reading a completion")?;
                let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                return Ok(Completion {
                    status,
                    error: Some(error_message(&v)),
                    ..Completion::default()
                });
            }
            let mut under_way = Some(under_way);
            let mut out = Completion {
                status,
                ..Completion::default()
            };
            let mut pending = String::new();
            while let Some(chunk) = resp.chunk().await.context("reading the stream")? {
                pending.push_str(&String::from_utf8_lossy(&chunk));
                for v in sse_events(&mut pending) {
                    let choice = &v["choices"][0];
                    if let Some(text) = choice["text"].as_str().filter(|t| !t.is_empty()) {
                        out.text.push_str(text);
                        if let Some(tell) = under_way.take() {
                            let _ = tell.send(());
                        }
                    }
                    if let Some(reason) = choice["finish_reason"].as_str() {
                        out.finish_reason = Some(reason.to_string());
                    }
                }
            }
            Ok(out)
        }
        .await;
        self.answered(answer)
    }

    /// A streamed completion of `prompt` that the client abandons after
    /// `after`: the connection is closed mid-request, as a client that
    /// times out or navigates away closes it. Nothing of the answer is kept.
    ///
    /// # Errors
    /// [`Stop`].
    pub async fn abandon(
        &self,
        key: Option<&str>,
        prompt: &str,
        max_tokens: usize,
        after: Duration,
    ) -> Result<(), Stop> {
        self.spend()?;
        let body = json!({
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": true,
        });
        let read = async {
            let mut resp = self.post(key, "/v1/completions", &body).send().await?;
            while resp.chunk().await?.is_some() {}
            Ok::<(), reqwest::Error>(())
        };
        // Dropping the unfinished request closes its connection.
        let _ = tokio::time::timeout(after, read).await;
        Ok(())
    }

    /// Time to the first streamed chunk that carries text, for `prompt`.
    /// `None` when the server refused it.
    ///
    /// # Errors
    /// As [`Client::complete`].
    pub async fn time_to_first_token(
        &self,
        key: Option<&str>,
        prompt: &str,
    ) -> anyhow::Result<Option<Duration>> {
        Ok(self
            .first_token(key, prompt, None, false)
            .await?
            .map(|t| t.after))
    }

    /// Time to the first streamed chunk that carries text, for `prompt`
    /// sent with `cache_salt` when `salt` is given, and with the stream's
    /// usage asked for when `usage` (`cached_tokens` then comes back where
    /// the server reports it). `None` when the server refused it.
    ///
    /// # Errors
    /// As [`Client::complete`].
    pub async fn first_token(
        &self,
        key: Option<&str>,
        prompt: &str,
        salt: Option<&str>,
        usage: bool,
    ) -> anyhow::Result<Option<FirstToken>> {
        self.spend()?;
        let mut body = json!({
            "model": self.model, "prompt": prompt, "max_tokens": 2,
            "temperature": 0, "stream": true,
        });
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        if usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        let answer = async {
            let start = Instant::now();
            let mut resp = self
                .post(key, "/v1/completions", &body)
                .send()
                .await
                .context("sending a streamed completion")?;
            if !resp.status().is_success() {
                return Ok(None);
            }
            let mut pending = String::new();
            let mut first = None;
            let mut cached_tokens = None;
            while let Some(chunk) = resp.chunk().await.context("reading the stream")? {
                pending.push_str(&String::from_utf8_lossy(&chunk));
                for v in sse_events(&mut pending) {
                    if first.is_none()
                        && v["choices"][0]["text"]
                            .as_str()
                            .is_some_and(|t| !t.is_empty())
                    {
                        first = Some(start.elapsed());
                        if !usage {
                            // Nothing more is read: drain the rest so the
                            // connection is reusable.
                            while resp.chunk().await.ok().flatten().is_some() {}
                            return Ok(first.map(|after| FirstToken {
                                after,
                                cached_tokens,
                            }));
                        }
                    }
                    if let Some(n) = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
                        cached_tokens = Some(n);
                    }
                }
            }
            Ok(first.map(|after| FirstToken {
                after,
                cached_tokens,
            }))
        }
        .await;
        self.answered(answer)
    }
}

/// A streamed answer's first token.
#[derive(Clone, Copy, Debug)]
pub struct FirstToken {
    /// From sending the request to the first chunk with text.
    pub after: Duration,
    /// `usage.prompt_tokens_details.cached_tokens`, where the server
    /// reported it (when asked for).
    pub cached_tokens: Option<u64>,
}

/// The server-sent events whole lines of `pending` hold, parsed (`data:`
/// lines; `[DONE]` and other lines skipped); a partial last line stays.
fn sse_events(pending: &mut String) -> Vec<Value> {
    let mut events = Vec::new();
    while let Some(at) = pending.find('\n') {
        let line: String = pending.drain(..=at).collect();
        if let Some(data) = line.trim().strip_prefix("data:").map(str::trim)
            && data != "[DONE]"
        {
            events.push(serde_json::from_str(data).unwrap_or(Value::Null));
        }
    }
    events
}

/// The message of an OpenAI-style error body (`error.message`), or the body.
fn error_message(v: &Value) -> String {
    v["error"]["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| v.to_string())
}
