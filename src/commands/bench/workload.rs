//! `kvsan bench workload` (hidden): one serving workload in this process,
//! measured from the client's side, printed as one JSON object on stdout.
//!
//! `kvsan bench overhead` runs it as a child of each built variant. A fixed
//! number of clients (`--in-flight`) each submit a request, read its event
//! stream and submit the next, so exactly that many requests are in flight
//! until the queue drains:
//!
//! ```text
//!  submit ──▶ first token ──▶ … ──▶ last token ──▶ Finished
//!  |── TTFT ──|                                      TPOT = (last − first) / (tokens − 1)
//! ```
//!
//! Every request generates exactly its `max_tokens` (no stop tokens), so all
//! variants compute the same tokens. At the end the hook target's summary
//! line (`kvsan: N violations; M checks`) goes to stderr, where the parent
//! reads the checks performed.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvsan_engine::engine::{Engine, EngineConfig};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::synthetic::SyntheticSpec;
use kvsan_engine::model::{AttentionCheck, Model};
use kvsan_engine::request::{Event, Request};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::scheduler::SchedulerConfig;
use kvsan_kernels::DType;
use kvsan_sanitizer::TenantId;
use serde::{Deserialize, Serialize};

use super::super::generate::Topology;
use super::super::model_arg;

/// The model a workload serves.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// The default model, SmolLM2-135M (or `--model PATH`).
    Smollm2,
    /// The synthetic model at a tiny geometry: compute is smallest relative
    /// to the sanitizer's checks (the worst case).
    Synthetic,
}

/// Which hook target the workload's engine uses.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach {
    /// What the build and the process provide (`Hooks::from_environment`):
    /// the in-process sanitizer with feature `sanitize`, else a preloaded
    /// shim's table, else none.
    Environment,
    /// No hooks and the plain kernel, whatever the build.
    None,
    /// The in-process sanitizer (configured by `KVSAN_OPTIONS`), whose
    /// kernel shadow the KV kernels then check, attached at run time: what
    /// feature `sanitize` selects at compile time.
    InProcess,
}

/// Arguments of `kvsan bench workload`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// The model served.
    #[arg(long, value_enum, default_value_t = ModelKind::Synthetic)]
    pub model_kind: ModelKind,
    /// GGUF file for `--model-kind smollm2` (default: SmolLM2-135M, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// One node or a prefill and a decode node.
    #[arg(long, value_enum, default_value_t = Topology::Unified)]
    pub topology: Topology,
    /// The hook target.
    #[arg(long, value_enum, default_value_t = Attach::Environment)]
    pub attach: Attach,
    /// Requests served.
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    pub in_flight: usize,
    /// Shortest prompt, in tokens.
    #[arg(long, default_value_t = 16)]
    pub prompt_min: usize,
    /// Longest prompt, in tokens (lengths are log-uniform between the two).
    #[arg(long, default_value_t = 1024)]
    pub prompt_max: usize,
    /// Fewest tokens generated per request.
    #[arg(long, default_value_t = 64)]
    pub new_min: usize,
    /// Most tokens generated per request (uniform between the two).
    #[arg(long, default_value_t = 128)]
    pub new_max: usize,
    /// Seed of the request shapes and prompt tokens.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Serve the workload with each of these hook targets, all in this
    /// process, one engine per target over the one loaded model, wave by
    /// wave, and report the CPU time of each serving (`--attach` is then
    /// unused).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub alternate: Vec<Attach>,
    /// Segments of `--alternate`: each serves the next `--in-flight`
    /// requests of the workload (a wave) once per hook target, their order
    /// rotated by one from segment to segment.
    #[arg(long, default_value_t = 1)]
    pub segments: usize,
}

/// What an `--alternate` run measured (the child's stdout).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Alternated {
    /// The hook target each `--alternate` entry got, in that order.
    pub hooks: Vec<String>,
    /// CPU seconds (user + system, the whole process) of each serving of a
    /// wave: `[segment][entry]`, entries in `--alternate` order whatever
    /// order they ran in.
    pub cpu_seconds: Vec<Vec<f64>>,
    /// Checks each entry's hook target performed, over all its segments.
    pub checks: Vec<u64>,
    /// Tokens each entry generated over all its segments (the same for
    /// every entry: each wave must generate the same tokens every time).
    pub output_tokens: usize,
}

/// What one workload run measured (the child's stdout).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Measured {
    /// The hook target the engine used (`none`, `in-process sanitizer`, `C hook table`).
    pub hooks: String,
    /// Requests served.
    pub requests: usize,
    /// Prompt tokens over all requests.
    pub prompt_tokens: usize,
    /// Tokens generated over all requests.
    pub output_tokens: usize,
    /// Wall time from the first submit to the last request's end.
    pub seconds: f64,
    /// `output_tokens / seconds`.
    pub tokens_per_s: f64,
    /// Time to first token, median, in milliseconds.
    pub ttft_p50_ms: f64,
    /// Time to first token, 99th percentile, in milliseconds.
    pub ttft_p99_ms: f64,
    /// Time per output token after the first, median over requests, in milliseconds.
    pub tpot_p50_ms: f64,
}

/// Timing of one request as its client saw it.
struct Timing {
    ttft: Duration,
    tpot: Option<Duration>,
    tokens: usize,
}

/// Deterministic pseudo-random numbers (a fixed LCG) for request shapes.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next() & ((1 << 30) - 1)) as f64 / f64::from(1u32 << 30)
    }
}

/// The synthetic model's tiny geometry: 2 layers, width 32, 2 heads over 1
/// KV head, FFN 64, 256 tokens.
pub fn tiny_spec() -> SyntheticSpec {
    SyntheticSpec {
        n_layers: 2,
        d_model: 32,
        n_heads: 2,
        n_kv_heads: 1,
        ffn_dim: 64,
        vocab_size: 256,
        context_length: 4096,
        dtype: DType::Q8_0,
        ..SyntheticSpec::default()
    }
}

/// The requests of a workload: prompt lengths log-uniform in
/// `prompt_min..=prompt_max`, generated lengths uniform in `new_min..=new_max`,
/// prompt ids drawn from `ids`.
fn requests(args: &Args, ids: std::ops::Range<u32>) -> Vec<Request> {
    let mut rng = Lcg(args.seed);
    let (lo, hi) = (args.prompt_min as f64, args.prompt_max as f64);
    (0..args.requests)
        .map(|_| {
            let len = (lo * (hi / lo).powf(rng.unit())).round() as usize;
            let len = len.clamp(args.prompt_min, args.prompt_max);
            let span = u64::from(ids.end - ids.start);
            Request {
                tenant: TenantId(1 + (rng.next() % 4) as u32),
                prompt: (0..len)
                    .map(|_| ids.start + (rng.next() % span) as u32)
                    .collect(),
                max_tokens: rng.between(args.new_min, args.new_max),
                sampling: SamplingParams::greedy(),
                stop_tokens: Vec::new(),
                cache_salt: Default::default(),
            }
        })
        .collect()
}

fn check_args(args: &Args) -> anyhow::Result<()> {
    if args.requests == 0 || args.in_flight == 0 {
        bail!("--requests and --in-flight must be at least 1");
    }
    if args.prompt_min == 0 || args.prompt_min > args.prompt_max {
        bail!(
            "prompt lengths {}..={}: need 1 <= --prompt-min <= --prompt-max",
            args.prompt_min,
            args.prompt_max
        );
    }
    if args.new_min == 0 || args.new_min > args.new_max {
        bail!(
            "generated lengths {}..={}: need 1 <= --new-min <= --new-max",
            args.new_min,
            args.new_max
        );
    }
    Ok(())
}

/// The hooks and attention check for `attach`.
fn hooks_for(attach: Attach) -> anyhow::Result<(Hooks, AttentionCheck)> {
    Ok(match attach {
        Attach::Environment => {
            let hooks = Hooks::from_environment().context("choosing the hook target")?;
            (hooks, EngineConfig::default().check)
        }
        Attach::None => (Hooks::none(), AttentionCheck::Unchecked),
        Attach::InProcess => {
            let sanitizer = kvsan_sanitizer::options::Options::from_env()
                .and_then(kvsan_sanitizer::self_test::start)
                .context("KVSAN_OPTIONS")?;
            (
                Hooks::sanitizer(Arc::new(sanitizer)),
                AttentionCheck::Generations,
            )
        }
    })
}

/// Nearest-rank percentile `p` (0–100) of sorted `values` (0 when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Serves the workload and measures it.
///
/// # Errors
/// Bad arguments, a model that does not load, an engine that does not start,
/// or a request that fails.
pub fn measure(args: &Args) -> anyhow::Result<Measured> {
    let (model, ids, context) = load(args)?;
    let (hooks, check) = hooks_for(args.attach)?;
    let target = hooks.target();
    let engine = start(args, model, context, &hooks, check)?;
    let requests = requests(args, ids);
    let (timings, seconds) = serve(&engine, &requests, args.in_flight)?;
    engine.shutdown();
    hooks.print_summary();

    let output_tokens: usize = timings.iter().map(|t| t.tokens).sum();
    let mut ttft: Vec<f64> = timings.iter().map(|t| ms(t.ttft)).collect();
    ttft.sort_by(f64::total_cmp);
    let mut tpot: Vec<f64> = timings.iter().filter_map(|t| t.tpot.map(ms)).collect();
    tpot.sort_by(f64::total_cmp);
    Ok(Measured {
        hooks: target.name().to_string(),
        requests: requests.len(),
        prompt_tokens: requests.iter().map(|r| r.prompt.len()).sum(),
        output_tokens,
        seconds,
        tokens_per_s: output_tokens as f64 / seconds,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        tpot_p50_ms: percentile(&tpot, 50.0),
    })
}

/// The workload's model, loaded after its arguments are checked: the model,
/// the prompt ids to draw from, the workload's context.
fn load(args: &Args) -> anyhow::Result<(Arc<Model>, std::ops::Range<u32>, usize)> {
    check_args(args)?;
    let (model, ids, context) = match args.model_kind {
        ModelKind::Synthetic => {
            let spec = tiny_spec();
            (
                spec.build()?,
                3..spec.vocab_size as u32,
                spec.context_length,
            )
        }
        // Ordinary vocabulary ids, away from the special tokens.
        ModelKind::Smollm2 => (
            Model::load(model_arg::resolve(args.model.as_deref())?)?,
            100..40_100,
            2048,
        ),
    };
    let longest = args.prompt_max + args.new_max;
    if longest > context {
        bail!(
            "a request of {} prompt + {} new tokens exceeds the workload's context of {context}",
            args.prompt_max,
            args.new_max
        );
    }
    Ok((Arc::new(model), ids, context))
}

/// An engine of the workload's topology over `model` with `hooks`.
fn start(
    args: &Args,
    model: Arc<Model>,
    context: usize,
    hooks: &Hooks,
    check: AttentionCheck,
) -> anyhow::Result<Engine> {
    // Pools hold every in-flight request at its longest: no preemption, so
    // every variant computes the same steps.
    let pool = (args.in_flight * (args.prompt_max + args.new_max)).max(context);
    let cfg = EngineConfig {
        context: Some(context),
        pool_tokens: Some(pool),
        prefill_pool_tokens: Some(pool),
        decode_pool_tokens: Some(pool),
        scheduler: SchedulerConfig::default(),
        check,
        hooks: hooks.clone(),
        ..EngineConfig::default()
    };
    Ok(match args.topology {
        Topology::Unified => Engine::unified(model, &cfg)?,
        Topology::Disagg => Engine::disaggregated(model, &cfg)?,
    })
}

/// CPU seconds this process has used, user and system, all its threads
/// (ended ones included).
fn process_cpu_seconds() -> anyhow::Result<f64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the pointer it is given,
    // which points at one.
    let r = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).context("getrusage");
    }
    // SAFETY: getrusage succeeded, so it wrote the struct.
    let usage = unsafe { usage.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Ok(secs(usage.ru_utime) + secs(usage.ru_stime))
}

/// Serves the workload in `--segments` waves of `--in-flight` requests
/// (cycling through the requests) with each `--alternate` hook target in
/// this one process, one running engine per target, and measures each
/// serving's CPU time: the variants then share the process's memory
/// placement and the machine's moment, which differ far more between
/// processes, and between servings seconds apart, than between
/// neighbouring servings milliseconds apart.
///
/// # Errors
/// As [`measure`]; also no `--segments`, or an entry listed twice.
pub fn alternate(args: &Args) -> anyhow::Result<Alternated> {
    let entries = &args.alternate;
    if args.segments == 0 {
        bail!("--segments must be at least 1");
    }
    if let Some(twice) = (1..entries.len()).find(|&i| entries[..i].contains(&entries[i])) {
        let name = clap::ValueEnum::to_possible_value(&entries[twice])
            .map_or_else(String::new, |v| v.get_name().to_string());
        bail!("--alternate lists the hook target `{name}` twice");
    }
    let (model, ids, context) = load(args)?;
    let requests = requests(args, ids);
    let mut hooks = Vec::with_capacity(entries.len());
    let mut checks_before = Vec::with_capacity(entries.len());
    for &a in entries {
        let (h, check) = hooks_for(a)?;
        checks_before.push(h.counters().map_or(0, |c| c.checks));
        hooks.push((h, check));
    }
    // Each target's engine serves every segment: what a serving costs is
    // then the steady state of a running server, not the start of one.
    let engines = hooks
        .iter()
        .map(|(h, check)| start(args, model.clone(), context, h, *check))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The workload in waves of `--in-flight` requests served together; a
    // segment serves the next wave with every target.
    let waves: Vec<&[Request]> = requests.chunks(args.in_flight).collect();
    let mut wave_tokens: Vec<Option<usize>> = vec![None; waves.len()];
    let mut cpu_seconds = Vec::with_capacity(args.segments);
    let mut output_tokens = 0;
    for segment in 0..args.segments {
        let wave = segment % waves.len();
        let mut row = vec![0.0; entries.len()];
        for k in 0..entries.len() {
            let i = (segment + k) % entries.len();
            let (h, _) = &hooks[i];
            let before = process_cpu_seconds()?;
            let (timings, _) = serve(&engines[i], waves[wave], args.in_flight)?;
            row[i] = process_cpu_seconds()? - before;
            let tokens: usize = timings.iter().map(|t| t.tokens).sum();
            let expected = *wave_tokens[wave].get_or_insert(tokens);
            if tokens != expected {
                bail!(
                    "wave {wave} generated {tokens} tokens with hook target {}, {expected} before",
                    h.target().name()
                );
            }
            if k == 0 {
                output_tokens += tokens;
            }
        }
        cpu_seconds.push(row);
    }
    for engine in engines {
        engine.shutdown();
    }
    let checks = hooks
        .iter()
        .zip(checks_before)
        .map(|((h, _), before)| h.counters().map_or(0, |c| c.checks - before))
        .collect();
    Ok(Alternated {
        hooks: hooks
            .iter()
            .map(|(h, _)| h.target().name().to_string())
            .collect(),
        cpu_seconds,
        checks,
        output_tokens,
    })
}

/// Serves `requests` with `in_flight` clients; returns each request's
/// timing and the wall time.
fn serve(
    engine: &Engine,
    requests: &[Request],
    in_flight: usize,
) -> anyhow::Result<(Vec<Timing>, f64)> {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let per_client: Vec<anyhow::Result<Vec<Timing>>> = std::thread::scope(|s| {
        let clients: Vec<_> = (0..in_flight.min(requests.len()))
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(request) = requests.get(i) else {
                            return Ok(done);
                        };
                        done.push(one(engine, request.clone()).with_context(|| {
                            format!("request {i} ({} prompt tokens)", requests[i].prompt.len())
                        })?);
                    }
                })
            })
            .collect();
        clients
            .into_iter()
            .map(|c| {
                c.join()
                    .unwrap_or_else(|_| bail!("a client thread panicked"))
            })
            .collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let mut timings = Vec::with_capacity(requests.len());
    for client in per_client {
        timings.extend(client?);
    }
    Ok((timings, seconds))
}

/// Submits one request and times its stream.
fn one(engine: &Engine, request: Request) -> anyhow::Result<Timing> {
    let submitted = Instant::now();
    let handle = engine.submit(request);
    let mut first: Option<Instant> = None;
    let mut last = submitted;
    let mut tokens = 0usize;
    for event in handle.events.iter() {
        match event {
            Event::Token(_) => {
                let now = Instant::now();
                first.get_or_insert(now);
                last = now;
                tokens += 1;
            }
            Event::Finished { .. } => {
                let first = first.context("the request finished without a token")?;
                return Ok(Timing {
                    ttft: first - submitted,
                    tpot: (tokens > 1).then(|| (last - first) / (tokens as u32 - 1)),
                    tokens,
                });
            }
            Event::Error(e) => return Err(e.into()),
        }
    }
    bail!("the engine stopped before the request ended")
}

/// Runs the command: the measurement as one JSON line on stdout.
///
/// # Errors
/// As [`measure`].
pub fn run(args: &Args) -> anyhow::Result<()> {
    if args.alternate.is_empty() {
        println!("{}", serde_json::to_string(&measure(args)?)?);
    } else {
        println!("{}", serde_json::to_string(&alternate(args)?)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
