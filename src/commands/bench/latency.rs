//! `kvsan bench latency`: the latency floor of `kvsan serve` — one client,
//! one connection, trivial requests one after another, on loopback.
//!
//! For each deployment it starts real `kvsan serve` processes (this binary,
//! or `--server`) on the synthetic model:
//!
//! | deployment | processes |
//! | --- | --- |
//! | `unified` | `serve --role unified` |
//! | `disagg` | `serve --role disagg` (prefill and decode nodes in one process) |
//! | `decode-prefill` | `serve --role decode` + `serve --role prefill`, linked over TCP |
//!
//! and times, from one HTTP client (one keep-alive connection,
//! `TCP_NODELAY`), `POST /v1/completions` requests alternating between two
//! ways of reading the answer:
//!
//! ```text
//!  streamed:      send ──▶ 200, data: {token} ──▶ … ──▶ data: {finish_reason} ──▶ data: [DONE]
//!                 |──────── TTFT ─────────|
//!                 |──────────────────────── completion ──────────────────────────────────|
//!  non-streamed:  send ──▶ 200, the whole JSON answer: completion only
//! ```
//!
//! Beside it, for scale:
//!
//! - **the steps**: the request's forward steps timed alone in this process
//!   on the same model — the prompt step (8 tokens → the first token) and
//!   each decode step — with no thread, channel or socket;
//! - **the engine**: the same request submitted to an engine of the same
//!   topology in this process (for `decode-prefill`, a decode and a prefill
//!   node linked by the same TCP transport over loopback), timed from
//!   `submit` to its events: the steps plus the hand-offs between threads,
//!   without the client socket, HTTP or JSON. Its steps per request come
//!   from the nodes' counters.
//!
//! The goal: every client-side median within 1 ms of the steps' time for
//! the same figure (the prompt step for TTFT, all the request's steps for
//! completion).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvsan_engine::engine::{Engine, EngineConfig, PrefillControl, serve_prefill};
use kvsan_engine::kv_pool::KvPool;
use kvsan_engine::model::{Logits, Model, SeqChunk, SyntheticSpec};
use kvsan_engine::node::NodeStats;
use kvsan_engine::request::{Event, Request};
use kvsan_engine::sampler::{SamplingParams, argmax};
use kvsan_engine::transport::tcp::{self, TcpOptions};
use kvsan_engine::transport::{Link, ToDecode};
use kvsan_sanitizer::TenantId;
use serde::Serialize;
use serde_json::{Value, json};

use super::server::{Answer, HttpClient, Server};
use super::workload::percentile;

/// How long one read of an answer may take.
const READ_BOUND: Duration = Duration::from_secs(30);
/// The goal: a client-side median at most this far above the steps' time.
const GOAL_MS: f64 = 1.0;
/// Token slots per page, as `kvsan serve` by default.
const PAGE_SLOTS: usize = 16;

/// Arguments of `kvsan bench latency`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Measured requests per deployment and way of reading (after the warm-up).
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Requests sent first and not measured, per deployment.
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Prompt length, in tokens.
    #[arg(long, default_value_t = 8)]
    pub prompt_tokens: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 2)]
    pub max_tokens: usize,
    /// Deployments to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Deployment::Unified, Deployment::Disagg, Deployment::DecodePrefill])]
    pub deployments: Vec<Deployment>,
    /// The `kvsan` binary to serve with (default: this one). Measure a
    /// release build.
    #[arg(long)]
    pub server: Option<PathBuf>,
    /// Print the JSON on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
}

/// How `kvsan serve` is deployed.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Deployment {
    /// One process, `--role unified`.
    Unified,
    /// One process, `--role disagg`: prefill and decode nodes linked in-process.
    Disagg,
    /// Two processes, `--role decode` and `--role prefill`, linked over TCP.
    DecodePrefill,
}

impl Deployment {
    fn name(self) -> &'static str {
        match self {
            Deployment::Unified => "unified",
            Deployment::Disagg => "disagg",
            Deployment::DecodePrefill => "decode-prefill",
        }
    }
}

/// Median and 99th percentile of one figure, in milliseconds.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile (nearest rank).
    pub p99_ms: f64,
    /// Fastest.
    pub min_ms: f64,
}

impl Quantiles {
    fn of(mut ms: Vec<f64>) -> Quantiles {
        ms.sort_by(f64::total_cmp);
        Quantiles {
            p50_ms: percentile(&ms, 50.0),
            p99_ms: percentile(&ms, 99.0),
            min_ms: ms.first().copied().unwrap_or(0.0),
        }
    }
}

/// The request's forward steps, timed alone.
#[derive(Clone, Debug, Serialize)]
pub struct Steps {
    /// The prompt step: the whole prompt in one chunk, logits of the last
    /// position (it yields the first token).
    pub prompt_step: Quantiles,
    /// One decode step (one token).
    pub decode_step: Quantiles,
    /// Median prompt step: what TTFT is compared with.
    pub ttft_ms: f64,
    /// Median prompt step plus `max_tokens - 1` median decode steps: what
    /// completion is compared with.
    pub completion_ms: f64,
}

/// The engine alone, in this process.
#[derive(Clone, Debug, Serialize)]
pub struct EngineFloor {
    /// Submit to first token event.
    pub ttft: Quantiles,
    /// Submit to the finished event.
    pub completion: Quantiles,
    /// Forward steps per request, over all nodes.
    pub steps_per_request: f64,
}

/// Client median minus a reference median, in milliseconds.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Gaps {
    /// Streamed TTFT.
    pub ttft_ms: f64,
    /// Streamed completion.
    pub completion_ms: f64,
    /// Non-streamed completion.
    pub non_streamed_completion_ms: f64,
}

impl Gaps {
    fn all_within(&self, limit: f64) -> bool {
        [
            self.ttft_ms,
            self.completion_ms,
            self.non_streamed_completion_ms,
        ]
        .iter()
        .all(|&g| g <= limit)
    }
}

/// One deployment's figures.
#[derive(Clone, Debug, Serialize)]
pub struct DeploymentReport {
    /// `unified`, `disagg` or `decode-prefill`.
    pub deployment: Deployment,
    /// The request's steps alone.
    pub steps: Steps,
    /// The engine alone.
    pub engine: EngineFloor,
    /// Streamed: time to the first token line.
    pub streamed_ttft: Quantiles,
    /// Streamed: time to the finished line.
    pub streamed_completion: Quantiles,
    /// Non-streamed: time to the finished line.
    pub non_streamed_completion: Quantiles,
    /// Forward steps per request on the server, from its `/stats` (the
    /// nodes it reports: for `decode-prefill`, the decode process's only).
    pub server_steps_per_request: f64,
    /// Client medians minus the steps' time.
    pub gap_to_steps: Gaps,
    /// Client medians minus the engine's medians.
    pub gap_to_engine: Gaps,
    /// Every gap to the steps at most 1 ms.
    pub goal_met: bool,
}

/// What the command prints.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The machine and its load.
    pub machine: Value,
    /// The request and counts.
    pub request: Value,
    /// Per deployment.
    pub deployments: Vec<DeploymentReport>,
}

/// Runs the command.
///
/// # Errors
/// Bad arguments, a server that does not start, a request that fails.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let report = measure(args)?;
    let table = table(&report);
    if args.json {
        eprint!("{table}");
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{table}");
    }
    Ok(())
}

/// Measures every deployment asked for.
///
/// # Errors
/// As [`run`].
pub fn measure(args: &Args) -> anyhow::Result<Report> {
    if args.requests == 0 || args.prompt_tokens == 0 || args.max_tokens == 0 {
        bail!("--requests, --prompt-tokens and --max-tokens must be at least 1");
    }
    let server = match &args.server {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("locating this binary")?,
    };
    let machine = super::machine();
    let mut deployments = Vec::new();
    for &d in &args.deployments {
        eprintln!("kvsan bench latency: {} …", d.name());
        deployments.push(measure_deployment(args, &server, d)?);
    }
    Ok(Report {
        machine,
        request: json!({
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "requests": args.requests,
            "warmup": args.warmup,
            "server": server.display().to_string(),
        }),
        deployments,
    })
}

fn prompt(args: &Args) -> Vec<u32> {
    // Ordinary ids of the synthetic vocabulary (256).
    (0..args.prompt_tokens)
        .map(|i| 1 + (i % 250) as u32)
        .collect()
}

fn measure_deployment(
    args: &Args,
    server: &Path,
    deployment: Deployment,
) -> anyhow::Result<DeploymentReport> {
    let steps = time_steps(args).context("timing the request's steps alone")?;
    let engine = engine_floor(args, deployment).context("the engine alone, in-process")?;
    let servers = start(server, deployment)?;
    let client = Client::connect(&servers.listen)?;
    let body = |stream: bool| {
        json!({
            "model": "synthetic",
            "prompt": prompt(args),
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": stream,
        })
    };
    let (streamed, whole) = (body(true), body(false));
    for _ in 0..args.warmup {
        client.request(&streamed, true)?;
    }
    let steps_before = client.steps()?;
    let (mut ttft, mut done, mut done_ns) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.requests {
        let timed = client.request(&streamed, true)?;
        ttft.push(timed.ttft.map_or(0.0, ms));
        done.push(ms(timed.completion));
        done_ns.push(ms(client.request(&whole, false)?.completion));
    }
    let server_steps = (client.steps()? - steps_before) as f64 / (2 * args.requests) as f64;
    drop(client);
    drop(servers);
    let (ttft, done, done_ns) = (
        Quantiles::of(ttft),
        Quantiles::of(done),
        Quantiles::of(done_ns),
    );
    let gaps = |ttft_ms: f64, completion_ms: f64| Gaps {
        ttft_ms: ttft.p50_ms - ttft_ms,
        completion_ms: done.p50_ms - completion_ms,
        non_streamed_completion_ms: done_ns.p50_ms - completion_ms,
    };
    let gap_to_steps = gaps(steps.ttft_ms, steps.completion_ms);
    let gap_to_engine = gaps(engine.ttft.p50_ms, engine.completion.p50_ms);
    Ok(DeploymentReport {
        deployment,
        goal_met: gap_to_steps.all_within(GOAL_MS),
        steps,
        engine,
        streamed_ttft: ttft,
        streamed_completion: done,
        non_streamed_completion: done_ns,
        server_steps_per_request: server_steps,
        gap_to_steps,
        gap_to_engine,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---------------------------------------------------------------------------
// The steps alone, and the engine alone.

/// Times the request's forward steps on the model `serve --synthetic`
/// serves: the prompt in one chunk, then one decode step per further token,
/// `requests` times (after `warmup`), over one pool.
fn time_steps(args: &Args) -> anyhow::Result<Steps> {
    let (model, cfg) = model_and_config()?;
    let prompt = prompt(args);
    let len = prompt.len() + args.max_tokens;
    let mut pool = KvPool::new(model.kv_geometry(PAGE_SLOTS), len.div_ceil(PAGE_SLOTS))?;
    let table = (0..len.div_ceil(PAGE_SLOTS))
        .map(|_| pool.alloc().context("the pool holds the request"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let vocab = model.config().vocab_size;
    let (mut prompt_ms, mut decode_ms) = (Vec::new(), Vec::new());
    for i in 0..args.warmup + args.requests {
        let chunk = [SeqChunk {
            tokens: &prompt,
            start_pos: 0,
            block_table: &table,
            logits: Logits::Last,
        }];
        let start = Instant::now();
        let mut logits = model.forward_chunks(&mut pool, &chunk, cfg.check)?;
        let mut token = argmax(&logits[..vocab]);
        let prompt_time = start.elapsed();
        let mut decodes = Vec::new();
        for pos in prompt.len()..len - 1 {
            let chunk = [SeqChunk {
                tokens: std::slice::from_ref(&token),
                start_pos: pos,
                block_table: &table,
                logits: Logits::Last,
            }];
            let start = Instant::now();
            logits = model.forward_chunks(&mut pool, &chunk, cfg.check)?;
            token = argmax(&logits[..vocab]);
            decodes.push(ms(start.elapsed()));
        }
        if i >= args.warmup {
            prompt_ms.push(ms(prompt_time));
            decode_ms.extend(decodes);
        }
    }
    let (prompt_step, decode_step) = (Quantiles::of(prompt_ms), Quantiles::of(decode_ms));
    Ok(Steps {
        ttft_ms: prompt_step.p50_ms,
        completion_ms: prompt_step.p50_ms + (args.max_tokens - 1) as f64 * decode_step.p50_ms,
        prompt_step,
        decode_step,
    })
}

/// The same model as `kvsan serve --synthetic`, and the engine settings
/// `serve` uses by default.
fn model_and_config() -> anyhow::Result<(Arc<Model>, EngineConfig)> {
    let model = Arc::new(SyntheticSpec::default().build()?);
    Ok((model, EngineConfig::default()))
}

fn engine_floor(args: &Args, deployment: Deployment) -> anyhow::Result<EngineFloor> {
    let (model, cfg) = model_and_config()?;
    let request = Request {
        tenant: TenantId(0),
        prompt: prompt(args),
        max_tokens: args.max_tokens,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: Default::default(),
    };
    let measure = |engine: &Engine, prefill_steps: &dyn Fn() -> u64| {
        let time = || one_in_process(engine, request.clone());
        for _ in 0..args.warmup {
            time()?;
        }
        let steps_of = || engine.stats().front.steps + prefill_steps();
        let before = steps_of();
        let (mut ttft, mut done) = (Vec::new(), Vec::new());
        for _ in 0..args.requests {
            let (t, d) = time()?;
            ttft.push(ms(t));
            done.push(ms(d));
        }
        anyhow::Ok(EngineFloor {
            ttft: Quantiles::of(ttft),
            completion: Quantiles::of(done),
            steps_per_request: (steps_of() - before) as f64 / args.requests as f64,
        })
    };
    match deployment {
        Deployment::Unified => {
            let engine = Engine::unified(model, &cfg)?;
            let floor = measure(&engine, &|| 0);
            engine.shutdown();
            floor
        }
        Deployment::Disagg => {
            let engine = Engine::disaggregated(model, &cfg)?;
            let floor = measure(&engine, &|| {
                engine.stats().prefill.map_or(0, |s: NodeStats| s.steps)
            });
            engine.shutdown();
            floor
        }
        Deployment::DecodePrefill => {
            let opts = TcpOptions::default();
            let listener = tcp::listen("127.0.0.1:0")?;
            let addr = listener.local_addr();
            let (control, inbox) = PrefillControl::new();
            let prefill = {
                let (model, cfg, opts) = (model.clone(), cfg.clone(), opts.clone());
                std::thread::Builder::new()
                    .name("bench-prefill".into())
                    .spawn(move || {
                        let mut connected = false;
                        serve_prefill(model, &cfg, inbox, || {
                            if connected {
                                return None;
                            }
                            connected = true;
                            let (link, rx) =
                                tcp::connect_prefill(addr, Duration::from_secs(10), &opts).ok()?;
                            let link: Box<dyn Link<ToDecode>> = Box::new(link);
                            Some((link, rx))
                        })
                    })?
            };
            let engine = Engine::decode_only(model, &cfg)?;
            let (link, rx) = listener.accept_decode(Some(Duration::from_secs(10)), &opts)?;
            engine.attach_prefill(Box::new(link), rx);
            let floor = measure(&engine, &|| control.stats().map_or(0, |s| s.steps));
            engine.shutdown();
            control.shutdown();
            let _ = prefill.join();
            floor
        }
    }
}

/// One request through the engine: (time to first token, to the end).
fn one_in_process(engine: &Engine, request: Request) -> anyhow::Result<(Duration, Duration)> {
    let start = Instant::now();
    let handle = engine.submit(request);
    let mut first = None;
    for event in handle.events.iter() {
        match event {
            Event::Token(_) => {
                first.get_or_insert_with(|| start.elapsed());
            }
            Event::Finished { .. } => {
                let first = first.context("the request finished without a token")?;
                return Ok((first, start.elapsed()));
            }
            Event::Error(e) => return Err(e.into()),
        }
    }
    bail!("the engine stopped before the request ended")
}

// ---------------------------------------------------------------------------
// The server processes and the client.

/// The processes of one deployment and its client address.
struct Servers {
    listen: String,
    // Dropped (killed) in this order: prefill first.
    _procs: Vec<Server>,
}

fn start(bin: &Path, deployment: Deployment) -> anyhow::Result<Servers> {
    let common = ["--synthetic", "--listen", "127.0.0.1:0"];
    match deployment {
        Deployment::Unified | Deployment::Disagg => {
            let role = deployment.name();
            let mut args = vec!["--role", role];
            args.extend(common);
            let mut s = Server::start(bin, role, &args, &[])?;
            let line = s.wait_for("kvsan: serving")?;
            Ok(Servers {
                listen: s.address(&line, "listen=")?,
                _procs: vec![s],
            })
        }
        Deployment::DecodePrefill => {
            let mut args = vec!["--role", "decode", "--peer-listen", "127.0.0.1:0"];
            args.extend(common);
            let mut decode = Server::start(bin, "decode", &args, &[])?;
            let line = decode.wait_for("kvsan: serving")?;
            let peer = decode.address(&line, "peer-listen=")?;
            let prefill = Server::start(
                bin,
                "prefill",
                &["--role", "prefill", "--synthetic", "--peer", &peer],
                &[],
            )?;
            decode.wait_for("prefill node connected")?;
            Ok(Servers {
                listen: decode.address(&line, "listen=")?,
                _procs: vec![prefill, decode],
            })
        }
    }
}

/// How long one request took, as the client saw it.
struct Timed {
    ttft: Option<Duration>,
    completion: Duration,
}

/// One HTTP client, timing requests.
struct Client(HttpClient);

impl Client {
    fn connect(addr: &str) -> anyhow::Result<Client> {
        Ok(Client(HttpClient::new(addr, READ_BOUND)?))
    }

    /// Sends one completion request and reads its answer to the end; with
    /// `streamed`, notes when the first event with a token arrived (events
    /// are only parsed after the clock is read).
    fn request(&self, body: &Value, streamed: bool) -> anyhow::Result<Timed> {
        let start = Instant::now();
        match self.0.complete(body, None)? {
            Answer::Stream(mut events) if streamed => {
                let mut ttft = None;
                while let Some(data) = events.next_data()? {
                    let now = start.elapsed();
                    if data == "[DONE]" {
                        if ttft.is_none() {
                            bail!("the stream ended without a token");
                        }
                        return Ok(Timed {
                            ttft,
                            completion: now,
                        });
                    }
                    let chunk: Value = serde_json::from_str(&data)
                        .with_context(|| format!("an event that is not JSON: {data}"))?;
                    if chunk.get("error").is_some() {
                        bail!("the stream ended with an error: {data}");
                    }
                    let has_token = chunk["choices"][0]["token_ids"]
                        .as_array()
                        .is_some_and(|ids| !ids.is_empty());
                    if has_token && ttft.is_none() {
                        ttft = Some(now);
                    }
                }
                bail!("the event stream ended before data: [DONE]")
            }
            Answer::Whole(_) if !streamed => Ok(Timed {
                ttft: None,
                completion: start.elapsed(),
            }),
            Answer::Error { status, error } => bail!("the server answered {status}: {error}"),
            Answer::Stream(_) | Answer::Whole(_) => {
                bail!("the server did not answer as asked (streamed: {streamed})")
            }
        }
    }

    /// Forward steps the server's nodes have run (`GET /stats`).
    fn steps(&self) -> anyhow::Result<u64> {
        let v = self.0.get_json("/stats")?;
        let steps = |node: &Value| node["steps"].as_u64().unwrap_or(0);
        Ok(steps(&v["front"]) + steps(&v["prefill"]))
    }
}

// ---------------------------------------------------------------------------
// Output.

fn table(report: &Report) -> String {
    let mut t = String::new();
    let r = &report.request;
    let _ = writeln!(
        t,
        "one client, {} sequential requests of {} prompt tokens and {} new tokens per row ({} warm-up); ms, p50 / p99",
        r["requests"], r["prompt_tokens"], r["max_tokens"], r["warmup"]
    );
    let _ = writeln!(
        t,
        "{:<15} {:<22} {:>17} {:>17} {:>6}",
        "deployment", "measured", "TTFT", "completion", "steps"
    );
    let q = |q: &Quantiles| format!("{:.3} / {:.3}", q.p50_ms, q.p99_ms);
    for d in &report.deployments {
        let name = d.deployment.name();
        let row = |t: &mut String, what: &str, ttft: &str, done: &str, steps: &str| {
            let _ = writeln!(t, "{name:<15} {what:<22} {ttft:>17} {done:>17} {steps:>6}");
        };
        let s = &d.steps;
        row(
            &mut t,
            "steps alone",
            &format!("{:.3}", s.ttft_ms),
            &format!("{:.3}", s.completion_ms),
            "",
        );
        let e = &d.engine;
        row(
            &mut t,
            "engine (in-process)",
            &q(&e.ttft),
            &q(&e.completion),
            &format!("{:.2}", e.steps_per_request),
        );
        row(
            &mut t,
            "client, streamed",
            &q(&d.streamed_ttft),
            &q(&d.streamed_completion),
            &format!("{:.2}", d.server_steps_per_request),
        );
        row(
            &mut t,
            "client, non-streamed",
            "—",
            &q(&d.non_streamed_completion),
            "",
        );
        let (g, h) = (&d.gap_to_steps, &d.gap_to_engine);
        let _ = writeln!(
            t,
            "{name:<15} prompt step {:.3} ms, decode step {:.3} ms; client median minus steps: \
             TTFT {:+.3}, completion {:+.3} / {:+.3} (non-streamed); minus engine: {:+.3}, {:+.3} / {:+.3}; \
             goal (≤ {GOAL_MS} ms over the steps) {}",
            s.prompt_step.p50_ms,
            s.decode_step.p50_ms,
            g.ttft_ms,
            g.completion_ms,
            g.non_streamed_completion_ms,
            h.ttft_ms,
            h.completion_ms,
            h.non_streamed_completion_ms,
            if d.goal_met { "met" } else { "MISSED" }
        );
    }
    let _ = writeln!(
        t,
        "machine: {}, {} cores, load average {}",
        report.machine["cpu"].as_str().unwrap_or("?"),
        report.machine["cores"],
        report.machine["load_average_at_start"]
            .as_str()
            .unwrap_or("?")
    );
    t
}
