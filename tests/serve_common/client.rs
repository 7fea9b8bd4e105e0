//! HTTP clients for the tests: [`Client`] (reqwest, blocking) for JSON
//! answers and whole SSE streams, [`RawStream`] (one TCP connection, bytes
//! written by hand) where a test needs the socket itself.
#![allow(dead_code)] // each test binary uses its part

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::{Value, json};

/// Generous bound on one exchange: a hang fails, nothing is timed.
pub const BOUND: Duration = Duration::from_secs(60);

/// A client of one server.
pub struct Client {
    http: reqwest::blocking::Client,
    base: String,
    /// Sent as `Authorization: Bearer KEY` when set.
    key: Option<String>,
}

/// A status and its JSON body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

/// How a streamed completion ended, as the client saw it.
#[derive(Debug)]
pub struct Completion {
    /// The answer's status.
    pub status: u16,
    /// The token ids streamed, in order.
    pub tokens: Vec<u64>,
    /// The last chunk's `finish_reason`, when the stream got that far.
    pub finish_reason: Option<String>,
    /// The usage chunk's `usage`.
    pub usage: Option<Value>,
    /// The `error` object: the body of a non-200 answer, or the stream's
    /// error event.
    pub error: Option<Value>,
}

impl Completion {
    /// The error's `code` (`rejected`, `transport`, …).
    pub fn error_code(&self) -> Option<&str> {
        self.error.as_ref()?["code"].as_str()
    }

    /// Checks the completion ran to `max_tokens` with a prompt of
    /// `prompt_tokens`, every token streamed once.
    pub fn assert_finished(&self, prompt_tokens: usize, max_tokens: usize) {
        assert_eq!(self.status, 200, "{self:?}");
        assert_eq!(self.error, None, "{self:?}");
        assert_eq!(self.finish_reason.as_deref(), Some("length"), "{self:?}");
        assert_eq!(self.tokens.len(), max_tokens, "{self:?}");
        let usage = self.usage.as_ref().expect("a usage chunk");
        assert_eq!(usage["prompt_tokens"], prompt_tokens, "{self:?}");
        assert_eq!(usage["completion_tokens"], max_tokens, "{self:?}");
    }
}

impl Client {
    /// A client of the server at `addr` (`HOST:PORT`), no proxy.
    pub fn new(addr: &str) -> Client {
        let http = reqwest::blocking::Client::builder()
            .no_proxy()
            .timeout(BOUND)
            .build()
            .expect("build the HTTP client");
        Client {
            http,
            base: format!("http://{addr}"),
            key: None,
        }
    }

    /// This client, sending `key` as `Authorization: Bearer KEY`.
    pub fn with_key(mut self, key: &str) -> Client {
        self.key = Some(key.to_string());
        self
    }

    fn authorized(
        &self,
        request: reqwest::blocking::RequestBuilder,
    ) -> reqwest::blocking::RequestBuilder {
        match &self.key {
            Some(key) => request.header("Authorization", format!("Bearer {key}")),
            None => request,
        }
    }

    /// `GET path`.
    pub fn get(&self, path: &str) -> Answer {
        let response = self
            .authorized(self.http.get(format!("{}{path}", self.base)))
            .send()
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        answer(response)
    }

    /// `POST path` with the JSON `body`.
    pub fn post(&self, path: &str, body: &Value) -> Answer {
        answer(self.send_post(path, body))
    }

    fn send_post(&self, path: &str, body: &Value) -> reqwest::blocking::Response {
        self.authorized(self.http.post(format!("{}{path}", self.base)))
            .header("Content-Type", "application/json")
            .body(body.to_string())
            .send()
            .unwrap_or_else(|e| panic!("POST {path}: {e}"))
    }

    /// The server's node counters (`GET /stats`): the front node's.
    pub fn front_stats(&self) -> Value {
        let answer = self.get("/stats");
        assert_eq!(answer.status, 200, "{answer:?}");
        answer.body["front"].clone()
    }

    /// A streamed `/v1/completions` of token ids (the synthetic model),
    /// greedy, read to its end.
    pub fn complete(&self, prompt: &[u64], max_tokens: usize) -> Completion {
        let body = json!({
            "model": "synthetic",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let response = self.send_post("/v1/completions", &body);
        let status = response.status().as_u16();
        let mut done = Completion {
            status,
            tokens: Vec::new(),
            finish_reason: None,
            usage: None,
            error: None,
        };
        if status != 200 {
            done.error = Some(answer(response).body["error"].clone());
            return done;
        }
        for line in BufReader::new(response).lines() {
            let line = line.expect("read the stream");
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                return done;
            }
            let chunk: Value =
                serde_json::from_str(data).unwrap_or_else(|e| panic!("not JSON ({e}): {data}"));
            if let Some(e) = chunk.get("error") {
                done.error = Some(e.clone());
            } else if chunk["choices"] == json!([]) {
                done.usage = Some(chunk["usage"].clone());
            } else {
                let choice = &chunk["choices"][0];
                let ids = choice["token_ids"].as_array().expect("token_ids");
                done.tokens.extend(ids.iter().map(|t| t.as_u64().unwrap()));
                if let Some(reason) = choice["finish_reason"].as_str() {
                    done.finish_reason = Some(reason.to_string());
                }
            }
        }
        panic!("the stream ended without [DONE]: {done:?}");
    }
}

fn answer(response: reqwest::blocking::Response) -> Answer {
    let status = response.status().as_u16();
    let text = response.text().expect("read the answer");
    let body = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    Answer { status, body }
}

/// A raw HTTP/1.1 streamed request on a connection of its own, read event
/// by event.
pub struct RawStream {
    reader: BufReader<TcpStream>,
}

impl RawStream {
    /// `POST /v1/completions` with `body`.
    pub fn open(addr: &str, body: &str) -> RawStream {
        Self::open_at(addr, "/v1/completions", body)
    }

    /// `POST path` with `body`.
    pub fn open_at(addr: &str, path: &str, body: &str) -> RawStream {
        Self::send(
            addr,
            &format!(
                "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
        )
    }

    /// `GET path`.
    pub fn get(addr: &str, path: &str) -> RawStream {
        Self::send(
            addr,
            &format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n"),
        )
    }

    fn send(addr: &str, request: &str) -> RawStream {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(BOUND)).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        RawStream {
            reader: BufReader::new(stream),
        }
    }

    /// The answer's JSON body, read by its `Content-Length` (the connection
    /// stays open).
    pub fn json_body(&mut self) -> Value {
        let mut length = None;
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.reader.read_line(&mut line).expect("read the headers");
            assert!(n > 0, "the answer ended in its headers");
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse::<usize>().ok();
            }
        }
        let mut body = vec![0; length.expect("a Content-Length header")];
        self.reader.read_exact(&mut body).expect("read the body");
        serde_json::from_slice(&body).expect("a JSON body")
    }

    /// This end's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.reader.get_ref().local_addr().unwrap()
    }

    /// The next line that starts with `data: ` (chunked framing lines skipped).
    pub fn next_data(&mut self) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.reader.read_line(&mut line).expect("read the stream");
            assert!(n > 0, "the stream ended early");
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                return data.to_string();
            }
        }
    }
}
