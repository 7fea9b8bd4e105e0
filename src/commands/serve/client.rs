//! The client interface of `kvsan serve`: JSON lines over TCP.
//!
//! Each connection is served on its own thread; its lines are handled one
//! after another (a generation streams to its end before the next line is
//! read — cancel from another connection).
//!
//! ```text
//!  client → server, one JSON object per line (at most 16 MiB):
//!    {"prompt": "text"} | {"prompt_ids": [1, 2, 3]}
//!        optional: "max_tokens" (64), "tenant" (0), "temperature" (0 = greedy),
//!                  "top_k" (0), "top_p" (1), "seed" (0), "chat" (false; text prompts only)
//!    {"stats": true}
//!    {"cancel": ID}
//!
//!  server → client, one JSON object per line:
//!    {"id": ID}                                   the request was submitted
//!    {"token": 17, "text": "piece"}               per token ("text" only with a tokenizer)
//!    {"finished": {"reason": "stop"|"length", "prompt_tokens": N, "generated": M}}
//!    {"error": {"kind": "rejected", "message": …, "reason": …, "prompt_tokens": N,
//!               "limit": L, "node": "prefill"}}    (rejection fields only when rejected,
//!                                                   "violation": {"id", "kind"} when aborted by kvsan)
//!    {"stats": {"front": {…}, "prefill": {…} | null}}
//!    {"cancelled": ID}
//! ```
//!
//! A malformed line gets `{"error": {"kind": "invalid-request", …}}` naming
//! what is wrong, and the connection goes on. Prompt text is never logged.
//!
//! Latency: every answer line is written to the socket with one `write` as
//! soon as it exists — each token as the engine hands it over, never
//! waiting for the next — and client sockets have `TCP_NODELAY`, so a small
//! line is not held back by Nagle's algorithm until the client acknowledges
//! the previous one (up to the peer's delayed-ACK timer, 40 ms on Linux).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvsan_engine::chat::ChatMessage;
use kvsan_engine::engine::{Engine, EngineStats};
use kvsan_engine::node::NodeStats;
use kvsan_engine::request::{ErrorKind, Event, FinishReason, Request, RequestError};
use kvsan_engine::sampler::SamplingParams;
use kvsan_sanitizer::{RequestId, TenantId};
use serde_json::{Map, Value, json};

use super::text::TextSide;

/// Longest request line accepted, in bytes.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// Tokens generated when a request does not say.
const DEFAULT_MAX_TOKENS: usize = 64;

/// The fields a generation request may carry.
const REQUEST_FIELDS: [&str; 9] = [
    "prompt",
    "prompt_ids",
    "max_tokens",
    "tenant",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "chat",
];

/// What every client connection shares: the engine and the text side.
pub struct Frontend {
    engine: Arc<Engine>,
    text: Option<Arc<TextSide>>,
}

impl Frontend {
    /// A frontend for `engine`; `text` is `None` for a model without a tokenizer.
    pub fn new(engine: Arc<Engine>, text: Option<Arc<TextSide>>) -> Frontend {
        Frontend { engine, text }
    }
}

/// Accepts clients for ever, each on its own thread, at most `max_clients`
/// at once (one more is told so and closed).
pub fn serve_clients(listener: &TcpListener, front: &Arc<Frontend>, max_clients: usize) {
    let active = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: wait, then go on.
                eprintln!("kvsan: accepting a client failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        if let Err(e) = stream.set_nodelay(true) {
            // Only a socket already torn down refuses this.
            eprintln!("kvsan: client connection: cannot set TCP_NODELAY: {e}");
            continue;
        }
        if active.fetch_add(1, Ordering::AcqRel) >= max_clients {
            active.fetch_sub(1, Ordering::AcqRel);
            let line = error_line(
                "busy",
                &format!("the server already serves {max_clients} clients (--max-clients)"),
            );
            let _ = send(&mut stream, &line);
            continue;
        }
        let (front, active) = (front.clone(), active.clone());
        let spawned = std::thread::Builder::new()
            .name("kvsan-client".into())
            .spawn(move || {
                let served = stream
                    .try_clone()
                    .and_then(|read_half| serve_connection(&front, read_half, stream));
                if let Err(e) = served {
                    // A client that went away is not the server's problem.
                    if !is_disconnect(&e) {
                        eprintln!("kvsan: client connection: {e}");
                    }
                }
                active.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            eprintln!("kvsan: cannot start a client thread: {e}");
        }
    }
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset | io::ErrorKind::UnexpectedEof
    )
}

/// One line read with a length bound.
enum LineRead {
    Line,
    TooLong,
    Eof,
}

/// Reads one line into `buf` (without its `\n` / `\r\n`), reading at most
/// `max + 1` bytes.
fn read_line(reader: &mut impl BufRead, max: usize, buf: &mut Vec<u8>) -> io::Result<LineRead> {
    buf.clear();
    let n = reader
        .by_ref()
        .take(max as u64 + 1)
        .read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(LineRead::Eof);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        return Ok(LineRead::Line);
    }
    if buf.len() > max {
        return Ok(LineRead::TooLong);
    }
    Ok(LineRead::Line)
}

/// Serves one connection: request lines from `input`, answers to `out`
/// (unbuffered: [`send`] hands each line over whole).
fn serve_connection(front: &Frontend, input: impl Read, mut out: impl Write) -> io::Result<()> {
    let mut reader = BufReader::new(input);
    let mut buf = Vec::new();
    loop {
        match read_line(&mut reader, MAX_LINE_BYTES, &mut buf)? {
            LineRead::Eof => return Ok(()),
            LineRead::TooLong => {
                // The rest of the line cannot be skipped safely: close.
                let msg =
                    format!("a request line is longer than the limit of {MAX_LINE_BYTES} bytes");
                send(&mut out, &error_line("invalid-request", &msg))?;
                return Ok(());
            }
            LineRead::Line if buf.iter().all(u8::is_ascii_whitespace) => {}
            LineRead::Line => handle_line(front, &buf, &mut out)?,
        }
    }
}

/// Writes one answer line with a single `write_all` and flushes it: on a
/// socket it leaves at once, as one segment when it fits in one.
fn send(out: &mut impl Write, value: &Value) -> io::Result<()> {
    let mut line = serde_json::to_vec(value)?;
    line.push(b'\n');
    out.write_all(&line)?;
    out.flush()
}

fn error_line(kind: &str, message: &str) -> Value {
    json!({ "error": { "kind": kind, "message": message } })
}

fn invalid(message: impl Into<String>) -> Value {
    error_line(ErrorKind::InvalidRequest.name(), &message.into())
}

/// Handles one line; only a failed write is an error.
fn handle_line(front: &Frontend, line: &[u8], out: &mut impl Write) -> io::Result<()> {
    let value: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => return send(out, &invalid(format!("the line is not valid JSON: {e}"))),
    };
    let Value::Object(obj) = value else {
        return send(out, &invalid("a request line must be a JSON object"));
    };
    if let Some(v) = obj.get("stats") {
        if obj.len() != 1 || v != &Value::Bool(true) {
            return send(out, &invalid("a stats line is exactly {\"stats\": true}"));
        }
        return send(
            out,
            &json!({ "stats": engine_stats(&front.engine.stats()) }),
        );
    }
    if let Some(v) = obj.get("cancel") {
        let Some(id) = v.as_u64().filter(|_| obj.len() == 1) else {
            return send(
                out,
                &invalid(
                    "a cancel line is exactly {\"cancel\": ID} with a request id from {\"id\": ID}",
                ),
            );
        };
        front.engine.cancel(RequestId(id));
        return send(out, &json!({ "cancelled": id }));
    }
    let parsed = match parse_request(front, &obj) {
        Ok(p) => p,
        Err(msg) => return send(out, &invalid(msg)),
    };
    generate(front, parsed, out)
}

/// Streams one request's events to the client; cancels it if the client
/// goes away.
fn generate(front: &Frontend, request: Request, out: &mut impl Write) -> io::Result<()> {
    let handle = front.engine.submit(request);
    let id = handle.id;
    let result = send(out, &json!({ "id": id.0 }))
        .and_then(|()| stream_events(front.text.as_deref(), handle.events.iter(), out));
    if result.is_err() {
        front.engine.cancel(id);
    }
    result
}

/// Writes a request's events as they arrive, one line each, to the end of
/// the stream: a token's line is on its way before the next event is
/// waited for.
fn stream_events(
    text: Option<&TextSide>,
    events: impl IntoIterator<Item = Event>,
    out: &mut impl Write,
) -> io::Result<()> {
    let mut text = text.map(|t| (t, t.tokenizer().stream_decoder()));
    for event in events {
        match event {
            Event::Token(token) => {
                let line = match &mut text {
                    Some((side, decoder)) => {
                        json!({ "token": token, "text": decoder.push(side.tokenizer(), token) })
                    }
                    None => json!({ "token": token }),
                };
                send(out, &line)?;
            }
            Event::Finished {
                reason,
                prompt_tokens,
                generated,
            } => {
                let mut fin = json!({
                    "reason": finish_reason(reason),
                    "prompt_tokens": prompt_tokens,
                    "generated": generated,
                });
                // Bytes of an incomplete UTF-8 sequence still held back.
                if let Some((_, decoder)) = text.take() {
                    let tail = decoder.finish();
                    if !tail.is_empty() {
                        fin["text"] = Value::String(tail);
                    }
                }
                return send(out, &json!({ "finished": fin }));
            }
            Event::Error(e) => return send(out, &request_error(&e)),
        }
    }
    let e = RequestError::new(
        ErrorKind::Internal,
        "the engine stopped before the request ended",
    );
    send(out, &request_error(&e))
}

fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// `{"error": {...}}` for a request's error, with its rejection or
/// violation details.
pub fn request_error(e: &RequestError) -> Value {
    let mut obj = Map::new();
    obj.insert("kind".into(), e.kind.name().into());
    obj.insert("message".into(), e.message.clone().into());
    if let Some(r) = &e.rejection {
        obj.insert("reason".into(), r.reason.clone().into());
        obj.insert("prompt_tokens".into(), r.prompt_tokens.into());
        obj.insert("limit".into(), r.limit.into());
        obj.insert("node".into(), r.node.clone().into());
    }
    if let Some(v) = &e.violation {
        obj.insert("violation".into(), json!(v));
    }
    json!({ "error": obj })
}

fn node_stats(s: &NodeStats) -> Value {
    json!({
        "total_pages": s.total_pages,
        "free_pages": s.free_pages,
        "pages_allocated": s.pages_allocated,
        "transfers": s.transfers,
        "running": s.running,
        "waiting": s.waiting,
        "preemptions": s.preemptions,
        "steps": s.steps,
    })
}

fn engine_stats(s: &EngineStats) -> Value {
    json!({
        "front": node_stats(&s.front),
        "prefill": s.prefill.as_ref().map(node_stats),
    })
}

/// A generation request from its JSON object; the error names the field.
fn parse_request(front: &Frontend, obj: &Map<String, Value>) -> Result<Request, String> {
    if let Some(unknown) = obj.keys().find(|k| !REQUEST_FIELDS.contains(&k.as_str())) {
        return Err(format!(
            "unknown field \"{unknown}\" (a request has {}; control lines are {{\"stats\": true}} and {{\"cancel\": ID}})",
            REQUEST_FIELDS.join(", ")
        ));
    }
    let chat = match obj.get("chat") {
        None => false,
        Some(v) => v.as_bool().ok_or("\"chat\" must be true or false")?,
    };
    let (prompt, stop_tokens) = match (obj.get("prompt"), obj.get("prompt_ids")) {
        (Some(_), Some(_)) => return Err("give \"prompt\" or \"prompt_ids\", not both".into()),
        (None, None) => {
            return Err("a request needs \"prompt\" (text) or \"prompt_ids\" (token ids)".into());
        }
        (None, Some(ids)) => {
            if chat {
                return Err("\"chat\" applies to a text \"prompt\", not to \"prompt_ids\"".into());
            }
            let stop = front
                .text
                .as_ref()
                .map(|t| t.stop_tokens().to_vec())
                .unwrap_or_default();
            (prompt_ids(ids)?, stop)
        }
        (Some(text), None) => {
            let text = text.as_str().ok_or("\"prompt\" must be a string")?;
            let side = front.text.as_ref().ok_or(
                "this server's model has no tokenizer (the synthetic model): send \"prompt_ids\" instead of \"prompt\"",
            )?;
            let rendered;
            let text = if chat {
                let template = side.template().ok_or(
                    "the model has no usable chat template: send the prompt without \"chat\"",
                )?;
                rendered = template.render(&[ChatMessage::user(text)], true);
                rendered.as_str()
            } else {
                text
            };
            let ids = side
                .tokenizer()
                .encode(text)
                .map_err(|e| format!("the prompt cannot be tokenized: {e}"))?;
            (ids, side.stop_tokens().to_vec())
        }
    };
    let sampling = SamplingParams {
        temperature: opt_f32(obj, "temperature")?.unwrap_or(0.0),
        top_k: opt_uint(obj, "top_k", usize::MAX as u64)?.unwrap_or(0) as usize,
        top_p: opt_f32(obj, "top_p")?.unwrap_or(1.0),
        seed: opt_uint(obj, "seed", u64::MAX)?.unwrap_or(0),
    };
    sampling.validate().map_err(|e| e.to_string())?;
    Ok(Request {
        tenant: TenantId(opt_uint(obj, "tenant", u64::from(u32::MAX))?.unwrap_or(0) as u32),
        prompt,
        max_tokens: opt_uint(obj, "max_tokens", usize::MAX as u64)?
            .map_or(DEFAULT_MAX_TOKENS, |n| n as usize),
        sampling,
        stop_tokens,
    })
}

fn prompt_ids(v: &Value) -> Result<Vec<u32>, String> {
    let arr = v
        .as_array()
        .ok_or("\"prompt_ids\" must be an array of token ids")?;
    arr.iter()
        .enumerate()
        .map(|(i, id)| {
            id.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    format!(
                        "\"prompt_ids\"[{i}] is {id}: token ids are integers from 0 to {}",
                        u32::MAX
                    )
                })
        })
        .collect()
}

fn opt_uint(obj: &Map<String, Value>, name: &str, max: u64) -> Result<Option<u64>, String> {
    match obj.get(name) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&n| n <= max)
            .map(Some)
            .ok_or_else(|| format!("\"{name}\" is {v}: it must be an integer from 0 to {max}")),
    }
}

fn opt_f32(obj: &Map<String, Value>, name: &str) -> Result<Option<f32>, String> {
    match obj.get(name) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| format!("\"{name}\" is {v}: it must be a number")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_over_the_limit_is_reported_without_reading_past_it() {
        let data = b"0123456789\nabc\n";
        let mut r = io::Cursor::new(&data[..]);
        let mut buf = Vec::new();
        assert!(matches!(
            read_line(&mut r, 5, &mut buf).unwrap(),
            LineRead::TooLong
        ));
        assert_eq!(buf.len(), 6, "reads at most the limit plus one byte");
        let mut r = io::Cursor::new(&b"12345\n"[..]);
        assert!(matches!(
            read_line(&mut r, 5, &mut buf).unwrap(),
            LineRead::Line
        ));
        assert_eq!(buf, b"12345");
        assert!(matches!(
            read_line(&mut r, 5, &mut buf).unwrap(),
            LineRead::Eof
        ));
    }

    /// Records what reaches it: each `write` call, grouped by `flush`, and
    /// sends each flushed group to the test.
    struct Flushes {
        writes: Vec<Vec<u8>>,
        flushed: std::sync::mpsc::Sender<Vec<Vec<u8>>>,
    }

    impl Write for Flushes {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.writes.push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            let group = std::mem::take(&mut self.writes);
            let _ = self.flushed.send(group);
            Ok(())
        }
    }

    #[test]
    fn a_token_line_is_flushed_before_the_next_event_arrives() {
        use std::sync::mpsc::channel;
        use std::time::Duration;
        // Generous: a bound on a hang, not a timing.
        const BOUND: Duration = Duration::from_secs(30);
        let (events, events_rx) = channel::<Event>();
        let (flushed_tx, flushed) = channel();
        let handler = std::thread::spawn(move || {
            let mut out = Flushes {
                writes: Vec::new(),
                flushed: flushed_tx,
            };
            stream_events(None, events_rx.iter(), &mut out)
        });
        let expect = |line: &str| {
            let group = flushed
                .recv_timeout(BOUND)
                .unwrap_or_else(|_| panic!("{line:?} was not flushed on its own"));
            assert_eq!(
                group,
                vec![format!("{line}\n").into_bytes()],
                "one write of one whole line per flush"
            );
        };
        // The next event is sent only once the previous line is out: a
        // handler that waited for more before writing would hang here.
        events.send(Event::Token(17)).unwrap();
        expect(r#"{"token":17}"#);
        events.send(Event::Token(4)).unwrap();
        expect(r#"{"token":4}"#);
        events
            .send(Event::Finished {
                reason: FinishReason::Length,
                prompt_tokens: 3,
                generated: 2,
            })
            .unwrap();
        expect(r#"{"finished":{"generated":2,"prompt_tokens":3,"reason":"length"}}"#);
        handler.join().unwrap().unwrap();
    }

    #[test]
    fn a_rejection_carries_its_limit_and_node_on_the_wire() {
        let e = RequestError::rejected(kvsan_engine::request::Rejection {
            reason: "prompt exceeds the prefill pool".into(),
            prompt_tokens: 1100,
            limit: 1024,
            node: "prefill".into(),
        });
        let v = request_error(&e);
        assert_eq!(v["error"]["kind"], "rejected");
        assert_eq!(v["error"]["limit"], 1024);
        assert_eq!(v["error"]["prompt_tokens"], 1100);
        assert_eq!(v["error"]["node"], "prefill");
    }
}
