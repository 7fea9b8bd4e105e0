//! `kvsan bench soak`: many requests through a real `kvsan serve` under the
//! LD_PRELOAD shim, its resident memory sampled as they go — does anything
//! grow with the requests served?
//!
//! ```text
//!  C HTTP clients, POST /v1/completions (SSE), API keys of tenants 0–7
//!     │  cancel: close the connection mid-stream      GET /stats once idle
//!     ▼
//!  kvsan serve --synthetic (LD_PRELOAD=libkvsan_shim.so, KVSAN_OPTIONS)   ◀── /proc/PID/status
//!     │                                                                       every K answers:
//!     ▼  SIGTERM at the end                                                   VmRSS, RssAnon,
//!  stderr: reports, "requests tracked at exit", "kvsan: N violations; M checks"   VmHWM, Threads
//! ```
//!
//! The load, the same on every run for a seed (each request's kind and
//! shape come from its index), exercises what the sanitizer keeps per
//! request: streamed completions of varied prompt lengths and token counts
//! (some sampled, tenants 0–7 from the API keys of `--api-keys`), clients
//! that go away — close the connection, which cancels the request — at
//! different points of a request's life (as soon as the answer's status is
//! in, or after 1, 2, 4 or 8 tokens), and rejections, both of a prompt over
//! the context window and of one over the pool the node admits it to
//! (`--pool-tokens` unified, `--prefill-pool-tokens` disaggregated, both
//! started with `--allow-pool-smaller-than-context`).
//!
//! | share | request | expected answer |
//! | --- | --- | --- |
//! | 80 % | prompt 1 … pool − 32 tokens (log-uniform), 1–32 new tokens | 200, `finish_reason` and usage |
//! | 10 % | as above, 32 new tokens, the client goes away | 200, at least as many tokens as it waited for |
//! | 5 % | prompt pool + 1 … context − 32 | 400 `rejected`, limit: the pool |
//! | 5 % | prompt context + 1 … 1.25 × context | 400 `rejected`, limit: the context |
//!
//! The soak fails (after writing its files) when a request is not
//! answered or answered otherwise than expected, when the server reports a
//! violation, when it was not really sanitized (no banner, no C hook table,
//! no checks), when the engine is not idle once every answer is in, or when
//! the sanitizer still holds a live request at exit or remembers more ended
//! ones than `ended_requests`. Resident memory is reported and plotted,
//! never judged: what is flat enough is for the reader of the curve.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use serde_json::{Value, json};

use super::overhead::parse_checks;
use super::plot;
use super::server::{Answer, HttpClient, Server};

/// How long one read of an answer may take: a bound on a hang, not a timing.
const READ_BOUND: Duration = Duration::from_secs(60);
/// How long the engine may take to be idle once every answer is in.
const IDLE_BOUND: Duration = Duration::from_secs(30);
/// New tokens at most per request.
const MAX_NEW: usize = 32;
/// Points at which a client goes away: after this many tokens (0: as soon
/// as the answer's status is in).
const CANCEL_AFTER: [usize; 5] = [0, 1, 2, 4, 8];
/// Unexpected answers kept as examples.
const EXAMPLES: usize = 5;
/// Tenants of the load, one API key each.
const TENANTS: usize = 8;

/// Arguments of `kvsan bench soak`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Requests per role.
    #[arg(long, default_value_t = 100_000)]
    pub requests: usize,
    /// HTTP clients sending requests at once, one after another each.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Roles to soak, one server each, one after the other.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Role::Unified, Role::Disagg])]
    pub roles: Vec<Role>,
    /// Points of the memory curve per role (a sample every
    /// requests ÷ samples answers).
    #[arg(long, default_value_t = 100)]
    pub samples: usize,
    /// Seed of the load.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Context window served (`serve --context`); longer prompts are rejected.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// Tokens of the pool that admits a prompt (`--pool-tokens` unified,
    /// `--prefill-pool-tokens` disaggregated); longer prompts are rejected.
    #[arg(long, default_value_t = 448)]
    pub pool_tokens: usize,
    /// `KVSAN_OPTIONS` for the server (default: none, the sanitizer's defaults).
    #[arg(long)]
    pub kvsan_options: Option<String>,
    /// Serve without the shim: the engine's and the server's own memory,
    /// for comparison (nothing is sanitized or checked for violations).
    #[arg(long)]
    pub without_shim: bool,
    /// The `kvsan` binary to serve with (default: this one);
    /// `scripts/bench-soak` passes its release build.
    #[arg(long)]
    pub server: Option<PathBuf>,
    /// The `libkvsan_shim.so` to preload (`scripts/bench-soak` builds it
    /// and passes it); needed unless `--without-shim`.
    #[arg(long)]
    pub shim: Option<PathBuf>,
    /// Where `soak.json`, `soak.csv` and `soak.svg` go (default:
    /// `target/bench/` under the current directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the JSON on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
}

/// How `kvsan serve` runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// `--role unified`: one node, one pool.
    Unified,
    /// `--role disagg`: a prefill and a decode node in one process.
    Disagg,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Unified => "unified",
            Role::Disagg => "disagg",
        }
    }

    /// The flag of the pool that admits a prompt.
    fn pool_flag(self) -> &'static str {
        match self {
            Role::Unified => "--pool-tokens",
            Role::Disagg => "--prefill-pool-tokens",
        }
    }
}

// ---------------------------------------------------------------------------
// The load.

/// SplitMix64: each request's shape comes from its index and the seed.
struct Rng(u64);

impl Rng {
    fn for_request(seed: u64, index: usize) -> Rng {
        Rng(seed ^ (index as u64).wrapping_mul(0xd1b5_4a32_d192_ed03))
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    /// Log-uniform in `1..=hi`: short prompts as often as long ones by
    /// order of magnitude.
    fn log_uniform(&mut self, hi: usize) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((hi as f64).powf(u) as usize).clamp(1, hi)
    }
}

/// What one request is, and so what its answer must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// Runs to its end: `finished` with `max_tokens` tokens.
    Complete { prompt: usize, max_tokens: usize },
    /// The client goes away after `after` tokens (0: at the status).
    Cancel { prompt: usize, after: usize },
    /// Over the pool that admits it: `rejected` with the pool's limit.
    OverPool { prompt: usize },
    /// Over the context: `rejected` with the context's limit.
    OverContext { prompt: usize },
}

/// The limits the load is shaped by.
#[derive(Clone, Copy, Debug)]
struct Limits {
    context: usize,
    pool: usize,
}

impl Limits {
    /// The longest prompt that fits the pool with its new tokens.
    fn longest_admitted(self) -> usize {
        self.pool - MAX_NEW
    }
}

/// Request `index`'s plan, its tenant and its body.
fn request(seed: u64, index: usize, limits: Limits) -> (Plan, usize, Value) {
    let mut rng = Rng::for_request(seed, index);
    let admitted = limits.longest_admitted();
    let plan = match rng.next() % 100 {
        0..5 => Plan::OverContext {
            prompt: rng.range(limits.context + 1, limits.context + limits.context / 4),
        },
        5..10 => Plan::OverPool {
            prompt: rng.range(limits.pool + 1, limits.context - MAX_NEW),
        },
        10..20 => Plan::Cancel {
            prompt: rng.log_uniform(admitted),
            after: CANCEL_AFTER[rng.range(0, CANCEL_AFTER.len() - 1)],
        },
        _ => Plan::Complete {
            prompt: rng.log_uniform(admitted),
            max_tokens: rng.range(1, MAX_NEW),
        },
    };
    let (prompt, max_tokens) = match plan {
        Plan::Complete { prompt, max_tokens } => (prompt, max_tokens),
        Plan::Cancel { prompt, .. } => (prompt, MAX_NEW),
        Plan::OverPool { prompt } | Plan::OverContext { prompt } => (prompt, rng.range(1, MAX_NEW)),
    };
    // Ordinary ids of the synthetic vocabulary (256).
    let ids: Vec<u32> = (0..prompt).map(|_| rng.range(1, 250) as u32).collect();
    let tenant = rng.range(0, TENANTS - 1);
    let mut body = json!({
        "model": "synthetic",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if rng.next().is_multiple_of(4) {
        body["temperature"] = json!(0.8);
        body["top_k"] = json!(40);
        body["seed"] = json!(index);
    }
    (plan, tenant, body)
}

/// The API key of `tenant` (`--api-keys` of the server).
fn api_key(tenant: usize) -> String {
    format!("soak-tenant-{tenant}")
}

/// The `--api-keys` file: one key per tenant.
fn api_keys_file() -> String {
    (0..TENANTS)
        .map(|t| format!("{} {t}\n", api_key(t)))
        .collect()
}

// ---------------------------------------------------------------------------
// Answers.

/// How the requests were answered.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Outcomes {
    /// Completions that finished.
    pub finished: u64,
    /// Requests whose client went away mid-stream, as planned.
    pub cancelled: u64,
    /// Prompts over the pool, rejected with the pool's limit.
    pub rejected_over_pool: u64,
    /// Prompts over the context, rejected with the context's limit.
    pub rejected_over_context: u64,
    /// Answers other than expected (a violation, a wrong limit, …).
    pub unexpected: u64,
    /// Tokens received.
    pub tokens: u64,
    /// The first unexpected answers.
    pub examples: Vec<String>,
}

impl Outcomes {
    fn answered(&self) -> u64 {
        self.finished
            + self.cancelled
            + self.rejected_over_pool
            + self.rejected_over_context
            + self.unexpected
    }
}

/// How one request ended, as the client saw it.
#[derive(Debug)]
enum End {
    /// The stream's last chunk said why it ended; the usage chunk followed.
    Finished {
        reason: String,
        prompt_tokens: u64,
        completion_tokens: u64,
    },
    /// The client went away after the tokens it waited for.
    WentAway,
    /// An error status, or an error event in the stream.
    Error { status: u16, error: Value },
}

/// Sends request `body` as `tenant`'s, going away where the plan says,
/// and reads its answer to the end; counts it in `outcomes`.
fn run_request(
    client: &HttpClient,
    plan: Plan,
    tenant: usize,
    body: &Value,
    limits: Limits,
    outcomes: &Mutex<Outcomes>,
) -> anyhow::Result<()> {
    let go_away_at = match plan {
        Plan::Cancel { after, .. } => Some(after as u64),
        _ => None,
    };
    let mut tokens = 0u64;
    let end = match client.complete(body, Some(&api_key(tenant)))? {
        Answer::Error { status, error } => End::Error { status, error },
        Answer::Whole(v) => bail!("a whole answer to a streamed request: {v}"),
        Answer::Stream(mut events) => {
            let (mut reason, mut usage) = (None, None);
            loop {
                if go_away_at == Some(tokens) {
                    // Dropping the stream closes the connection.
                    break End::WentAway;
                }
                let Some(data) = events.next_data()? else {
                    bail!("the event stream ended before data: [DONE]");
                };
                if data == "[DONE]" {
                    let usage: Value = usage.context("no usage chunk before [DONE]")?;
                    let count = |k: &str| usage[k].as_u64().unwrap_or(u64::MAX);
                    break End::Finished {
                        reason: reason.unwrap_or_default(),
                        prompt_tokens: count("prompt_tokens"),
                        completion_tokens: count("completion_tokens"),
                    };
                }
                let chunk: Value = serde_json::from_str(&data)
                    .with_context(|| format!("an event that is not JSON: {data}"))?;
                if let Some(e) = chunk.get("error") {
                    break End::Error {
                        status: 200,
                        error: e.clone(),
                    };
                }
                match chunk["choices"].as_array().map(Vec::as_slice) {
                    Some([]) => usage = Some(chunk["usage"].clone()),
                    Some([choice]) => {
                        tokens += choice["token_ids"].as_array().map_or(0, Vec::len) as u64;
                        if let Some(r) = choice["finish_reason"].as_str() {
                            reason = Some(r.to_string());
                        }
                    }
                    _ => bail!("an event that is none of chunk, usage, error: {data}"),
                }
            }
        }
    };
    let mut o = outcomes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    o.tokens += tokens;
    let rejected_at = |status: u16, e: &Value, limit: usize| {
        status == 400
            && e["code"] == "rejected"
            && e["rejection"]["limit"].as_u64() == Some(limit as u64)
    };
    match (&plan, &end) {
        (
            Plan::Complete { prompt, max_tokens },
            End::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
            },
        ) if reason == "length"
            && *prompt_tokens == *prompt as u64
            && *completion_tokens == tokens
            && (1..=*max_tokens as u64).contains(completion_tokens) =>
        {
            o.finished += 1;
        }
        (Plan::Cancel { .. }, End::WentAway) => o.cancelled += 1,
        (Plan::OverPool { .. }, End::Error { status, error })
            if rejected_at(*status, error, limits.pool) =>
        {
            o.rejected_over_pool += 1;
        }
        (Plan::OverContext { .. }, End::Error { status, error })
            if rejected_at(*status, error, limits.context) =>
        {
            o.rejected_over_context += 1;
        }
        _ => {
            o.unexpected += 1;
            if o.examples.len() < EXAMPLES {
                o.examples
                    .push(format!("{plan:?} → {end:?} after {tokens} tokens"));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Memory samples.

/// The server's memory after `requests` answers.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Requests answered so far.
    pub requests: usize,
    /// Seconds since the first request was sent.
    pub seconds: f64,
    /// Resident set (`VmRSS`), KiB.
    pub rss_kib: u64,
    /// Its anonymous part (`RssAnon`: heap and stacks), KiB.
    pub rss_anon_kib: u64,
    /// Peak resident set so far (`VmHWM`), KiB.
    pub hwm_kib: u64,
    /// Threads of the process.
    pub threads: u64,
}

/// Reads `/proc/PID/status`.
fn sample(pid: u32, requests: usize, start: Instant) -> anyhow::Result<Sample> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("no {name} in {path}"))
    };
    Ok(Sample {
        requests,
        seconds: start.elapsed().as_secs_f64(),
        rss_kib: field("VmRSS")?,
        rss_anon_kib: field("RssAnon")?,
        hwm_kib: field("VmHWM")?,
        threads: field("Threads")?,
    })
}

// ---------------------------------------------------------------------------
// What the server says on stderr.

/// `kvsan: requests tracked at exit: L live, R ended and remembered (ended_requests=N)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Tracked {
    /// Requests the sanitizer still tracked as live.
    pub live: u64,
    /// Ended requests it remembered.
    pub remembered: u64,
    /// Its bound on those.
    pub ended_requests: u64,
}

/// The shim's line of the requests it tracked at exit, the last one.
pub fn parse_tracked(lines: &[String]) -> Option<Tracked> {
    lines.iter().rev().find_map(|line| {
        let rest = line
            .trim()
            .strip_prefix("kvsan: requests tracked at exit: ")?;
        let (live, rest) = rest.split_once(" live, ")?;
        let (remembered, rest) = rest.split_once(" ended and remembered (ended_requests=")?;
        let bound = rest.strip_suffix(')')?;
        Some(Tracked {
            live: live.parse().ok()?,
            remembered: remembered.parse().ok()?,
            ended_requests: bound.parse().ok()?,
        })
    })
}

/// The violations count of the last summary line (`kvsan: N violations…; M checks`).
pub fn parse_violations(lines: &[String]) -> Option<u64> {
    lines.iter().rev().find_map(|line| {
        let rest = line.trim().strip_prefix("kvsan: ")?;
        rest.ends_with(" checks").then_some(())?;
        let (n, rest) = rest.split_once(' ')?;
        rest.starts_with("violation").then_some(())?;
        n.replace(',', "").parse().ok()
    })
}

// ---------------------------------------------------------------------------
// One role.

/// A check the soak passes or fails.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// What is checked.
    pub name: &'static str,
    /// Whether it held.
    pub passed: bool,
    /// What was seen.
    pub detail: String,
}

/// Resident memory at points of the run, KiB.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct RssPoints {
    /// Before the first request (the server started, idle).
    pub start_kib: u64,
    /// After half the requests.
    pub middle_kib: u64,
    /// Answers after which the sanitizer's memory of ended requests is
    /// full (`ended_requests` of them, from its exit line; none when the
    /// run is shorter or unsanitized): from there on, what it remembers
    /// stays the same size.
    pub warm_requests: Option<usize>,
    /// At the first sample from `warm_requests` answers on.
    pub warm_kib: Option<u64>,
    /// After the last request.
    pub end_kib: u64,
    /// The peak over the run (`VmHWM` at the end).
    pub peak_kib: u64,
}

/// One role's soak.
#[derive(Clone, Debug, Serialize)]
pub struct RoleReport {
    /// `unified` or `disagg`.
    pub role: Role,
    /// Sanitized by the preloaded shim.
    pub sanitized: bool,
    /// `kvsan serve` arguments.
    pub serve_args: Vec<String>,
    /// Requests sent.
    pub requests: usize,
    /// Seconds from the first request sent to the last answer.
    pub seconds: f64,
    /// Requests answered per second.
    pub requests_per_s: f64,
    /// How they were answered.
    pub outcomes: Outcomes,
    /// Resident memory at the start, middle and end.
    pub rss: RssPoints,
    /// The curve.
    pub samples: Vec<Sample>,
    /// Violations in the sanitizer's summary line.
    pub violations: Option<u64>,
    /// Report blocks on stderr (`kvsan: ERROR`).
    pub reports: usize,
    /// Checks the sanitizer performed.
    pub checks: Option<u64>,
    /// Requests the sanitizer tracked at exit.
    pub tracked_at_exit: Option<Tracked>,
    /// The nodes' counters once idle (`GET /stats`).
    pub final_stats: Value,
    /// The pass/fail checks.
    pub verdict: Vec<Check>,
}

impl RoleReport {
    fn passed(&self) -> bool {
        self.verdict.iter().all(|c| c.passed)
    }
}

/// The server binary and the shim to preload (`None`: none).
struct Binaries {
    server: PathBuf,
    shim: Option<PathBuf>,
}

/// The server binary and the shim given, each refused by name when it is
/// not there: the CLI builds nothing (`scripts/bench-soak` does).
fn binaries(args: &Args) -> anyhow::Result<Binaries> {
    const BUILD: &str =
        "scripts/bench-soak builds the release kvsan binary and the shim and passes them";
    let server = match &args.server {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("locating this binary")?,
    };
    if !server.is_file() {
        bail!(
            "the server binary {} (--server) does not exist ({BUILD})",
            server.display()
        );
    }
    let shim = match (args.without_shim, &args.shim) {
        (true, _) => None,
        (false, None) => bail!(
            "the soak needs --shim PATH, a built libkvsan_shim.so ({BUILD}); \
             or --without-shim to serve unsanitized"
        ),
        (false, Some(p)) => {
            if !p.is_file() {
                bail!(
                    "the shim library {} (--shim) does not exist ({BUILD})",
                    p.display()
                );
            }
            // LD_PRELOAD of a relative path is looked up, not opened.
            Some(
                std::fs::canonicalize(p)
                    .with_context(|| format!("the shim library {}", p.display()))?,
            )
        }
    };
    Ok(Binaries { server, shim })
}

/// `kvsan serve` arguments; `api_keys`: the `--api-keys` file.
fn serve_args(args: &Args, role: Role, api_keys: &Path) -> Vec<String> {
    let mut argv: Vec<String> = [
        "--role",
        role.name(),
        "--synthetic",
        "--context",
        &args.context.to_string(),
        role.pool_flag(),
        &args.pool_tokens.to_string(),
        "--allow-pool-smaller-than-context",
        "--listen",
        "127.0.0.1:0",
        "--api-keys",
    ]
    .map(str::to_string)
    .to_vec();
    argv.push(api_keys.display().to_string());
    argv
}

/// Runs the clients against the server at `addr` (process `pid`) until
/// every request is answered.
fn drive(
    args: &Args,
    role: Role,
    addr: &str,
    pid: u32,
) -> anyhow::Result<(Outcomes, Vec<Sample>, f64)> {
    let limits = Limits {
        context: args.context,
        pool: args.pool_tokens,
    };
    let every = (args.requests / args.samples.max(1)).max(1);
    let next = AtomicUsize::new(0);
    let answered = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let outcomes = Mutex::new(Outcomes::default());
    let start = Instant::now();
    let samples = Mutex::new(vec![sample(pid, 0, start)?]);
    let client = |_: usize| -> anyhow::Result<()> {
        let http = HttpClient::new(addr, READ_BOUND)?;
        loop {
            let index = next.fetch_add(1, Ordering::Relaxed);
            if index >= args.requests || failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            let (plan, tenant, body) = request(args.seed, index, limits);
            run_request(&http, plan, tenant, &body, limits, &outcomes)
                .with_context(|| format!("request {index} ({plan:?})"))?;
            let n = answered.fetch_add(1, Ordering::AcqRel) + 1;
            if n.is_multiple_of(every) || n == args.requests {
                let s = sample(pid, n, start)?;
                eprintln!(
                    "kvsan bench soak: {} {n}/{} requests, {:.1} s, RSS {:.1} MiB",
                    role.name(),
                    args.requests,
                    s.seconds,
                    s.rss_kib as f64 / 1024.0
                );
                samples
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(s);
            }
        }
    };
    let results: Vec<anyhow::Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..args.clients)
            .map(|c| {
                let client = &client;
                let failed = &failed;
                scope.spawn(move || {
                    let r = client(c);
                    if r.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client thread panicked")))
            })
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    for r in results {
        r.with_context(|| format!("soak of --role {}", role.name()))?;
    }
    let outcomes = outcomes
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut samples = samples
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    samples.sort_by_key(|s| s.requests);
    Ok((outcomes, samples, seconds))
}

/// The nodes' counters once nothing runs or waits (or after [`IDLE_BOUND`]).
fn idle_stats(addr: &str) -> anyhow::Result<(Value, bool)> {
    let http = HttpClient::new(addr, READ_BOUND)?;
    let deadline = Instant::now() + IDLE_BOUND;
    loop {
        let stats = http.get_json("/stats")?;
        let busy = |node: &Value| {
            node["running"].as_u64().unwrap_or(0) + node["waiting"].as_u64().unwrap_or(0)
        };
        let idle = busy(&stats["front"]) == 0 && busy(&stats["prefill"]) == 0;
        if idle || Instant::now() >= deadline {
            return Ok((stats, idle));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn soak_role(
    args: &Args,
    bins: &Binaries,
    role: Role,
    api_keys: &Path,
) -> anyhow::Result<RoleReport> {
    let serve_args = serve_args(args, role, api_keys);
    let mut env: Vec<(&str, OsString)> = vec![("RUST_LOG", "info".into())];
    let options = if bins.shim.is_some() {
        args.kvsan_options.clone().unwrap_or_default()
    } else {
        String::new()
    };
    env.push(("KVSAN_OPTIONS", options.into()));
    env.push((
        "LD_PRELOAD",
        bins.shim
            .clone()
            .map(PathBuf::into_os_string)
            .unwrap_or_default(),
    ));
    let argv: Vec<&str> = serve_args.iter().map(String::as_str).collect();
    let mut server = Server::start(&bins.server, role.name(), &argv, &env)?;
    let line = server.wait_for("kvsan: serving")?;
    let addr = server.address(&line, "listen=")?;
    let pid = server.pid();
    eprintln!(
        "kvsan bench soak: {} (pid {pid}) at {addr}: {} requests from {} clients",
        role.name(),
        args.requests,
        args.clients
    );
    let (outcomes, samples, seconds) = drive(args, role, &addr, pid)?;
    let (final_stats, idle) = idle_stats(&addr)?;
    let peak_kib = sample(pid, args.requests, Instant::now())?.hwm_kib;
    let stopped = server.stop()?;
    let lines = &stopped.lines;
    let text = lines.join("\n");

    let at = |n: usize| {
        samples
            .iter()
            .min_by_key(|s| s.requests.abs_diff(n))
            .map_or(0, |s| s.rss_kib)
    };
    let violations = parse_violations(lines);
    let reports = lines.iter().filter(|l| l.contains("kvsan: ERROR")).count();
    let checks = parse_checks(&text);
    let tracked_at_exit = parse_tracked(lines);
    let warm = tracked_at_exit
        .and_then(|t| usize::try_from(t.ended_requests).ok())
        .and_then(|n| {
            samples
                .iter()
                .find(|s| s.requests >= n && s.requests < args.requests)
        });
    let rss = RssPoints {
        start_kib: at(0),
        middle_kib: at(args.requests / 2),
        warm_requests: warm.map(|s| s.requests),
        warm_kib: warm.map(|s| s.rss_kib),
        end_kib: at(args.requests),
        peak_kib,
    };

    let mut verdict = Vec::new();
    let mut check = |name, passed, detail: String| {
        verdict.push(Check {
            name,
            passed,
            detail,
        })
    };
    check(
        "every request answered as expected",
        outcomes.answered() == args.requests as u64 && outcomes.unexpected == 0,
        format!(
            "{} of {} answered, {} unexpected{}",
            outcomes.answered(),
            args.requests,
            outcomes.unexpected,
            outcomes
                .examples
                .iter()
                .map(|e| format!("; {e}"))
                .collect::<String>()
        ),
    );
    check(
        "the engine idle once every answer is in",
        idle,
        format!("{final_stats}"),
    );
    let anomalies: u64 = ["front", "prefill"]
        .iter()
        .filter_map(|node| final_stats[node]["anomalies"].as_object())
        .flat_map(|kinds| kinds.values().filter_map(Value::as_u64))
        .sum();
    check(
        "the anomaly monitor flags nothing",
        anomalies == 0,
        format!("{anomalies} requests flagged"),
    );
    check(
        "the server exited cleanly on SIGTERM",
        stopped.status.success(),
        format!("{}", stopped.status),
    );
    if bins.shim.is_some() {
        let attached = text.contains("kvsan: attached (pid ");
        let table = lines
            .iter()
            .any(|l| l.contains("kvsan hooks chosen") && l.contains("C hook table"));
        check(
            "sanitized by the shim",
            attached && table && checks.is_some_and(|c| c > 0),
            format!(
                "banner {attached}, C hook table chosen {table}, checks {}",
                checks.map_or("none".into(), |c| c.to_string())
            ),
        );
        check(
            "zero violations",
            violations == Some(0) && reports == 0,
            format!(
                "summary: {}, report blocks: {reports}",
                violations.map_or("no summary line".into(), |v| format!("{v} violations"))
            ),
        );
        check(
            "the sanitizer's request memory bounded",
            tracked_at_exit.is_some_and(|t| t.live == 0 && t.remembered <= t.ended_requests),
            tracked_at_exit.map_or("no tracked-requests line at exit".into(), |t| {
                format!(
                    "{} live, {} ended and remembered, ended_requests={}",
                    t.live, t.remembered, t.ended_requests
                )
            }),
        );
    }
    Ok(RoleReport {
        role,
        sanitized: bins.shim.is_some(),
        serve_args,
        requests: args.requests,
        seconds,
        requests_per_s: args.requests as f64 / seconds.max(f64::MIN_POSITIVE),
        outcomes,
        rss,
        samples,
        violations,
        reports,
        checks,
        tracked_at_exit,
        final_stats,
        verdict,
    })
}

// ---------------------------------------------------------------------------
// Output.

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn table(reports: &[RoleReport], machine: &Value) -> String {
    let mut t = String::new();
    for r in reports {
        let o = &r.outcomes;
        let _ = writeln!(
            t,
            "{} ({}): {} requests in {:.1} s ({:.0}/s): {} finished, {} cancelled (client gone), {} rejected over the pool, {} over the context, {} unexpected; {} tokens",
            r.role.name(),
            if r.sanitized { "shim" } else { "no sanitizer" },
            r.requests,
            r.seconds,
            r.requests_per_s,
            o.finished,
            o.cancelled,
            o.rejected_over_pool,
            o.rejected_over_context,
            o.unexpected,
            o.tokens
        );
        let _ = writeln!(
            t,
            "  RSS start {:.1} MiB, middle {:.1} MiB, end {:.1} MiB (second half {:+.1} MiB), peak {:.1} MiB",
            mib(r.rss.start_kib),
            mib(r.rss.middle_kib),
            mib(r.rss.end_kib),
            mib(r.rss.end_kib) - mib(r.rss.middle_kib),
            mib(r.rss.peak_kib)
        );
        if let (Some(n), Some(kib)) = (r.rss.warm_requests, r.rss.warm_kib) {
            let _ = writeln!(
                t,
                "  RSS once the sanitizer's ended requests are full ({n} answered) {:.1} MiB; to the end {:+.1} MiB",
                mib(kib),
                mib(r.rss.end_kib) - mib(kib)
            );
        }
        for c in &r.verdict {
            let _ = writeln!(
                t,
                "  {} {}: {}",
                if c.passed { "ok  " } else { "FAIL" },
                c.name,
                c.detail
            );
        }
    }
    let _ = writeln!(
        t,
        "machine: {}, {} cores, load average {}",
        machine["cpu"].as_str().unwrap_or("?"),
        machine["cores"],
        machine["load_average_at_start"].as_str().unwrap_or("?")
    );
    t
}

fn csv(reports: &[RoleReport]) -> String {
    let mut s = String::from("role,requests,seconds,rss_kib,rss_anon_kib,hwm_kib,threads\n");
    for r in reports {
        for p in &r.samples {
            let _ = writeln!(
                s,
                "{},{},{:.3},{},{},{},{}",
                r.role.name(),
                p.requests,
                p.seconds,
                p.rss_kib,
                p.rss_anon_kib,
                p.hwm_kib,
                p.threads
            );
        }
    }
    s
}

fn svg(args: &Args, reports: &[RoleReport]) -> String {
    let names: Vec<String> = reports
        .iter()
        .map(|r| {
            format!(
                "{}{}",
                r.role.name(),
                if r.sanitized { "" } else { " (no sanitizer)" }
            )
        })
        .collect();
    let points: Vec<Vec<(f64, f64)>> = reports
        .iter()
        .map(|r| {
            r.samples
                .iter()
                .map(|s| (s.requests as f64, mib(s.rss_kib)))
                .collect()
        })
        .collect();
    let series: Vec<plot::Series<'_>> = names
        .iter()
        .zip(&points)
        .map(|(name, points)| plot::Series { name, points })
        .collect();
    let under = if args.without_shim {
        "without the sanitizer".to_string()
    } else {
        format!(
            "under the shim ({})",
            args.kvsan_options.as_deref().unwrap_or("default options")
        )
    };
    plot::curve(
        &format!(
            "kvsan serve {under}: resident memory over {} requests",
            plot::thousands(args.requests as f64)
        ),
        "requests answered",
        "VmRSS (MiB)",
        &format!(
            "synthetic model, {} clients, cancels and rejections mixed in; a point every {} requests",
            args.clients,
            (args.requests / args.samples.max(1)).max(1)
        ),
        &series,
    )
}

/// Runs the command.
///
/// # Errors
/// Bad arguments, a binary not given or not there, a server that fails, a client that cannot talk
/// to the server, output that cannot be written, or a failed check (after
/// the output is written).
pub fn run(args: &Args) -> anyhow::Result<()> {
    if args.requests == 0 || args.clients == 0 || args.samples == 0 {
        bail!("--requests, --clients and --samples must be at least 1");
    }
    if args.clients > 100 {
        bail!(
            "--clients {} is over 100 (the server generates for 256 requests at most, and a \
             cancelled request keeps its place until the server sees its client gone)",
            args.clients
        );
    }
    if args.pool_tokens <= MAX_NEW || args.pool_tokens + MAX_NEW >= args.context {
        bail!(
            "--pool-tokens {} must be over {MAX_NEW} and at least {} below --context {} (prompts over the pool but within the context are part of the load)",
            args.pool_tokens,
            MAX_NEW + 1,
            args.context
        );
    }
    let bins = binaries(args)?;
    let machine = super::machine();
    let out_dir = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("target").join("bench"));
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let api_keys = out_dir.join("soak-api-keys");
    write(&api_keys, &api_keys_file())?;
    let mut reports = Vec::new();
    for &role in &args.roles {
        reports.push(soak_role(args, &bins, role, &api_keys)?);
    }

    let (json_path, csv_path, svg_path) = (
        out_dir.join("soak.json"),
        out_dir.join("soak.csv"),
        out_dir.join("soak.svg"),
    );
    let doc = json!({
        "machine": machine,
        "server": bins.server,
        "shim": bins.shim,
        "kvsan_options": if bins.shim.is_some() { args.kvsan_options.clone() } else { None },
        "requests": args.requests,
        "clients": args.clients,
        "seed": args.seed,
        "context": args.context,
        "pool_tokens": args.pool_tokens,
        "roles": reports,
        "passed": reports.iter().all(RoleReport::passed),
        "csv": csv_path,
        "plot": svg_path,
    });
    write(
        &json_path,
        &format!("{}\n", serde_json::to_string_pretty(&doc)?),
    )?;
    write(&csv_path, &csv(&reports))?;
    write(&svg_path, &svg(args, &reports))?;

    let t = table(&reports, &machine);
    if args.json {
        eprint!("{t}");
        println!("{}", serde_json::to_string(&doc)?);
    } else {
        print!("{t}");
        println!(
            "wrote {}, {} and {}",
            json_path.display(),
            csv_path.display(),
            svg_path.display()
        );
    }
    let failed: Vec<String> = reports
        .iter()
        .flat_map(|r| {
            r.verdict
                .iter()
                .filter(|c| !c.passed)
                .map(move |c| format!("{}: {}", r.role.name(), c.name))
        })
        .collect();
    if !failed.is_empty() {
        bail!("the soak failed: {}", failed.join("; "));
    }
    Ok(())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_string).collect()
    }

    #[test]
    fn the_exit_lines_give_violations_and_tracked_requests() {
        let err = lines(
            "kvsan: attached (pid 1, options: defaults)\n\
             kvsan: requests tracked at exit: 0 live, 200 ended and remembered (ended_requests=200)\n\
             kvsan: 0 violations; 123 checks\n",
        );
        assert_eq!(parse_violations(&err), Some(0));
        assert_eq!(
            parse_tracked(&err),
            Some(Tracked {
                live: 0,
                remembered: 200,
                ended_requests: 200
            })
        );
        let bad = lines("kvsan: 2 violations (stale-read: 2); 77 checks\n");
        assert_eq!(parse_violations(&bad), Some(2));
        assert_eq!(parse_tracked(&bad), None);
        assert_eq!(
            parse_violations(&lines("kvsan: serving role=unified")),
            None
        );
    }

    #[test]
    fn the_load_is_the_same_for_a_seed_and_mixes_every_kind() {
        let limits = Limits {
            context: 512,
            pool: 448,
        };
        let load: Vec<(Plan, usize)> = (0..2_000)
            .map(|i| {
                let (plan, tenant, _) = request(7, i, limits);
                (plan, tenant)
            })
            .collect();
        let again = (0..2_000).map(|i| request(7, i, limits));
        assert!(
            load.iter()
                .zip(again)
                .all(|(&(p, t), (q, u, _))| p == q && t == u)
        );
        let plans: Vec<Plan> = load.iter().map(|&(p, _)| p).collect();
        let tenants: std::collections::BTreeSet<usize> = load.iter().map(|&(_, t)| t).collect();
        assert_eq!(tenants.len(), TENANTS, "every tenant's key is used");
        let count = |f: fn(&Plan) -> bool| plans.iter().filter(|p| f(p)).count();
        assert!(count(|p| matches!(p, Plan::Cancel { after: 0, .. })) > 0);
        assert!(count(|p| matches!(p, Plan::Cancel { after: 8, .. })) > 0);
        assert!(count(|p| matches!(p, Plan::OverPool { .. })) > 50);
        assert!(count(|p| matches!(p, Plan::OverContext { .. })) > 50);
        assert!(count(|p| matches!(p, Plan::Complete { .. })) > 1_400);
        for p in &plans {
            match *p {
                Plan::Complete { prompt, max_tokens } => {
                    assert!((1..=416).contains(&prompt) && (1..=MAX_NEW).contains(&max_tokens));
                }
                Plan::Cancel { prompt, .. } => assert!((1..=416).contains(&prompt)),
                Plan::OverPool { prompt } => assert!((449..=480).contains(&prompt)),
                Plan::OverContext { prompt } => assert!((513..=640).contains(&prompt)),
            }
        }
        let short = count(|p| matches!(p, Plan::Complete { prompt, .. } if *prompt <= 16));
        let long = count(|p| matches!(p, Plan::Complete { prompt, .. } if *prompt > 256));
        assert!(short > 200 && long > 50, "short {short}, long {long}");
    }
}
