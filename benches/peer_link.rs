//! KV transfer over a TCP link on loopback, plain and authenticated
//! (`--peer-key`: HMAC-SHA256 records), in one run.
//!
//! ```text
//! cargo bench --bench peer_link
//! ```
//!
//! - `plain/T tokens`: a prefill side sends one KV transfer of T tokens of
//!   SmolLM2's geometry (30 layers, kv_dim 192, f16 K and V: 23,040 bytes a
//!   token) and the decode side's inbox receives it, checksum checked.
//! - `authenticated/T tokens`: the same over a link whose handshake ran and
//!   whose bytes travel in HMAC-tagged records.
//! - `ttft/plain|authenticated/P`: time to first token of a greedy request
//!   with a P-token prompt through a decode engine and a prefill node of
//!   the synthetic model (`kvsan serve --synthetic`'s), linked over TCP on
//!   loopback: the prefill order, the prefill steps, the KV transfer, the
//!   first token.
//!
//! - `landing/copy/T` and `landing/copy+digests/T`: what the receiving
//!   side does with a transfer of T tokens once it is in: the copy into a
//!   decode pool's pages, page by page, and the same with the landing
//!   digests — the sender's digest of each page's piece and the receiver's
//!   digest of what the page then holds (XXH3-64, computed in place). The
//!   ratio is the cost of verifying where received KV landed
//!   (`cargo bench --bench peer_link -- landing`).
//!
//! The message is built outside the timed region; criterion prints the
//! time per transfer and the throughput in bytes of KV. The ratio of the
//! two variants is the cost of authentication on this machine.

use std::time::{Duration, Instant};

use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use crossbeam_channel::Receiver;
use kvsan_engine::engine::{Engine, EngineConfig, PrefillControl, serve_prefill};
use kvsan_engine::kv_pool::KvPool;
use kvsan_engine::model::SyntheticSpec;
use kvsan_engine::request::{Event, Request};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::transport::peer_auth::PeerKey;
use kvsan_engine::transport::tcp::{self, TcpLink, TcpOptions};
use kvsan_engine::transport::{
    Inbound, KvPayload, KvTransfer, Link, NodeInfo, ToDecode, kv_checksum, kv_payload_len,
    kv_slices, landing_digests, landing_seed,
};
use kvsan_kernels::attention::KvGeometry;
use kvsan_sanitizer::{Manifest, Owner, PageRef, PoolId, TenantId};

const LAYERS: u32 = 30;
const KV_DIM: usize = 192;
const TOKENS: [u32; 2] = [64, 512];
const PROMPTS: [usize; 2] = [64, 512];
const BOUND: Duration = Duration::from_secs(10);

/// A KV transfer of `tokens` tokens from token 0.
fn transfer(tokens: u32) -> ToDecode {
    let pages = tokens.div_ceil(16);
    let mut manifest = Manifest {
        request: Owner::new(1, 0),
        src_pool: PoolId(1),
        src_pages: (0..pages).map(|p| PageRef::new(p, 1)).collect(),
        dst_pool: PoolId(2),
        dst_pages: (0..pages).map(|p| PageRef::new(p, 1)).collect(),
        first_token: 0,
        tokens,
        layers: 0..LAYERS,
        checksum: 0,
    };
    let bytes: Vec<u8> = (0..kv_payload_len(&manifest, KV_DIM))
        .map(|i| (i as u64).wrapping_mul(2_654_435_761) as u8)
        .collect();
    manifest.checksum = kv_checksum(&bytes);
    let digests = landing_digests(&manifest, 16, KV_DIM, &bytes);
    ToDecode::Kv(KvTransfer {
        manifest,
        payload: KvPayload::Bytes(bytes),
        digests,
    })
}

/// Copies a transfer's bytes into `pool`, page by page; with `digests`,
/// computes the sender's landing digests first and each page's landing
/// digest after, and checks they match.
fn land(pool: &mut KvPool, manifest: &Manifest, bytes: &[u8], digests: bool) {
    let layers = manifest.layers.start as usize..manifest.layers.end as usize;
    let sent = digests.then(|| landing_digests(manifest, 16, KV_DIM, bytes));
    let mut at = 0;
    for (idx, slots) in kv_slices(manifest, 16) {
        let page = manifest.dst_pages[idx].page;
        at += pool
            .unpack_slots(page, slots.clone(), layers.clone(), &bytes[at..])
            .expect("the transfer fits the pool");
        if let Some(sent) = &sent {
            let seed = landing_seed(idx * 16 + slots.start, slots.len(), &layers);
            let landed = pool.landing_digest(page, slots, layers.clone(), seed);
            assert_eq!(landed, sent[idx], "the copy lands what was sent");
        }
    }
}

fn landing(c: &mut Criterion) {
    let mut group = c.benchmark_group("landing");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(3));
    let geometry = KvGeometry {
        page_slots: 16,
        n_layers: LAYERS as usize,
        n_kv_heads: 3,
        head_dim: KV_DIM / 3,
    };
    for tokens in TOKENS {
        let ToDecode::Kv(KvTransfer {
            manifest,
            payload: KvPayload::Bytes(bytes),
            ..
        }) = transfer(tokens)
        else {
            unreachable!("transfer() builds a KV message with bytes")
        };
        let mut pool = KvPool::new(geometry, manifest.dst_pages.len()).expect("a small pool");
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        for (name, digests) in [("copy", false), ("copy+digests", true)] {
            group.bench_function(BenchmarkId::new(name, tokens), |b| {
                b.iter(|| land(&mut pool, &manifest, &bytes, digests));
            });
        }
    }
    group.finish();
}

/// A connected prefill → decode link with `opts`, the decode side's inbox
/// past the hello.
fn link(opts: &TcpOptions) -> (TcpLink<ToDecode>, Receiver<Inbound<ToDecode>>, impl Sized) {
    let listener = tcp::listen("127.0.0.1:0").expect("listen on loopback");
    let addr = listener.local_addr();
    let prefill_opts = opts.clone();
    let prefill = std::thread::spawn(move || tcp::connect_prefill(addr, BOUND, &prefill_opts));
    let (to_prefill, inbox) = listener
        .accept_decode(Some(BOUND), opts)
        .expect("accept the prefill side");
    let (to_decode, prefill_inbox) = prefill.join().expect("prefill thread").expect("connect");
    to_decode
        .send(ToDecode::Hello(NodeInfo {
            pool_tokens: 1 << 20,
            page_slots: 16,
            n_layers: LAYERS as usize,
            kv_dim: KV_DIM,
            context_length: 1 << 20,
        }))
        .expect("send the hello");
    match inbox.recv_timeout(BOUND) {
        Ok(Inbound::Message(ToDecode::Hello(_))) => {}
        other => panic!("expected the hello, got {other:?}"),
    }
    (to_decode, inbox, (to_prefill, prefill_inbox))
}

/// The link options measured: plain and authenticated.
fn variants() -> [(&'static str, TcpOptions); 2] {
    let key = PeerKey::from_bytes(&[0x5a; 32]).expect("a 32-byte key");
    [
        ("plain", TcpOptions::default()),
        (
            "authenticated",
            TcpOptions {
                auth: Some(key),
                ..TcpOptions::default()
            },
        ),
    ]
}

fn kv_transfer(c: &mut Criterion) {
    let variants = variants();
    let mut group = c.benchmark_group("kv_transfer");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    for tokens in TOKENS {
        let msg = transfer(tokens);
        let ToDecode::Kv(KvTransfer {
            payload: KvPayload::Bytes(bytes),
            ..
        }) = &msg
        else {
            unreachable!("transfer() builds a KV message with bytes")
        };
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        for (name, opts) in &variants {
            let (to_decode, inbox, _keep) = link(opts);
            group.bench_with_input(BenchmarkId::new(*name, tokens), &msg, |b, msg| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let m = msg.clone();
                        let start = Instant::now();
                        to_decode.send(m).expect("send");
                        match inbox.recv_timeout(BOUND) {
                            Ok(Inbound::Message(ToDecode::Kv(_))) => {}
                            other => panic!("expected the transfer, got {other:?}"),
                        }
                        spent += start.elapsed();
                    }
                    spent
                });
            });
        }
    }
    group.finish();
}

/// A decode engine and a prefill node of the synthetic model linked over
/// TCP with `opts`; the prefill node stops when the control drops.
fn disaggregated(opts: &TcpOptions) -> (Engine, PrefillControl, std::thread::JoinHandle<()>) {
    let model = Arc::new(
        SyntheticSpec::default()
            .build()
            .expect("the synthetic model"),
    );
    let cfg = EngineConfig::default();
    let listener = tcp::listen("127.0.0.1:0").expect("listen on loopback");
    let addr = listener.local_addr();
    let (control, inbox) = PrefillControl::new();
    let prefill = {
        let (model, cfg, opts) = (model.clone(), cfg.clone(), opts.clone());
        std::thread::spawn(move || {
            let mut connected = false;
            let _ = serve_prefill(model, &cfg, inbox, || {
                if std::mem::replace(&mut connected, true) {
                    return None;
                }
                let (link, rx) = tcp::connect_prefill(addr, BOUND, &opts).ok()?;
                let link: Box<dyn Link<ToDecode>> = Box::new(link);
                Some((link, rx))
            });
        })
    };
    let engine = Engine::decode_only(model, &cfg).expect("the decode engine");
    let (link, rx) = listener
        .accept_decode(Some(BOUND), opts)
        .expect("accept the prefill node");
    engine.attach_prefill(Box::new(link), rx);
    (engine, control, prefill)
}

/// Time from submitting `prompt` to its first token.
fn first_token(engine: &Engine, prompt: &[u32]) -> Duration {
    let start = Instant::now();
    let handle = engine.submit(Request {
        tenant: TenantId(0),
        prompt: prompt.to_vec(),
        max_tokens: 1,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: Default::default(),
    });
    let mut first = None;
    for event in handle.events.iter() {
        match event {
            Event::Token(_) => {
                first.get_or_insert_with(|| start.elapsed());
            }
            Event::Finished { .. } => return first.expect("a token before the end"),
            Event::Error(e) => panic!("the request failed: {e}"),
        }
    }
    panic!("the engine stopped before the request ended")
}

fn ttft(c: &mut Criterion) {
    let mut group = c.benchmark_group("ttft");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    for (name, opts) in &variants() {
        let (engine, control, prefill) = disaggregated(opts);
        for len in PROMPTS {
            let prompt: Vec<u32> = (0..len as u32).map(|i| (i * 31 + 3) % 251).collect();
            group.bench_with_input(BenchmarkId::new(*name, len), &prompt, |b, prompt| {
                b.iter_custom(|iters| (0..iters).map(|_| first_token(&engine, prompt)).sum());
            });
        }
        engine.shutdown();
        control.shutdown();
        let _ = prefill.join();
    }
    group.finish();
}

criterion_group!(benches, kv_transfer, ttft, landing);
criterion_main!(benches);
