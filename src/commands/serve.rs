//! `kvsan serve`: the engine as a server, in one of four roles.
//!
//! ```text
//!  --role unified   clients ──HTTP──▶ [unified node]
//!  --role disagg    clients ──HTTP──▶ [decode node] ◀─in-process─▶ [prefill node]
//!  --role decode    clients ──HTTP──▶ [decode node] ◀──TCP──┐   (--listen, --peer-listen)
//!  --role prefill                             [prefill node] ┘   (--peer)
//! ```
//!
//! Between decode and prefill, `--transport tcp` (the default) carries KV in
//! wire frames; `--transport rdma` (a build with `--features rdma`) has the
//! decode node register its pool with the NIC for its whole life, and the
//! TCP connection on `--peer-listen` becomes the side channel of each
//! link's handshake: prefill writes KV into the reserved pages with RDMA
//! WRITEs and the manifest follows on the same queue pair.
//!
//! The decode role accepts prefill nodes on `--peer-listen` for as long as it
//! runs: each new connection replaces the previous link, so a restarted
//! prefill process is picked up. The prefill role connects to `--peer`,
//! retrying for `--peer-retry-secs`, and reconnects the same way after its
//! link drops.
//!
//! The peer link is authenticated with `--peer-key FILE`, the deployment's
//! pre-shared key ([`kvsan_engine::transport::peer_auth`]): a peer that
//! does not prove it holds the same key is refused before any page is
//! reserved for it — over RDMA, before it learns the pool's address and
//! key. Without a key a node only listens on or connects to a
//! loopback peer address, unless `--insecure-peer-link` says otherwise; it
//! says at start which mode it runs in.
//!
//! Clients speak the OpenAI-compatible HTTP API of [`http`]; their tenants
//! come from `--api-keys FILE`.

mod http;
mod text;

use std::net::{TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use kvsan_engine::chat::ChatTemplate;
use kvsan_engine::engine::{Engine, EngineConfig, PrefillControl, serve_prefill};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::{Model, SyntheticSpec};
use kvsan_engine::tokenizer::Tokenizer;
use kvsan_engine::transport::accept;
use kvsan_engine::transport::peer_auth::PeerKey;
use kvsan_engine::transport::reconnect::DecodeDialer;
use kvsan_engine::transport::tcp::{self, TcpOptions};

use super::model_arg;
use text::TextSide;

/// Which node(s) this process runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// One node computes prefill and decode over one pool.
    Unified,
    /// A prefill node that connects to a decode node (`--peer`).
    Prefill,
    /// A decode node serving clients; prefill nodes connect to `--peer-listen`.
    Decode,
    /// A prefill and a decode node in this process, linked in-process.
    Disagg,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Unified => "unified",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Disagg => "disagg",
        }
    }
}

/// How KV travels between a decode and a prefill process.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Transport {
    /// KV bytes in wire frames over the TCP connection.
    #[default]
    Tcp,
    /// RDMA WRITEs into the decode node's registered pool; the TCP
    /// connection is the side channel (needs a build with `--features rdma`).
    Rdma,
}

/// Arguments of `kvsan serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Which node(s) this process runs.
    #[arg(long, value_enum)]
    pub role: Role,
    /// GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).
    #[arg(long, conflicts_with = "synthetic")]
    pub model: Option<PathBuf>,
    /// Serve the synthetic model (random weights, no tokenizer: clients send
    /// prompts as token-id arrays). Every node of a deployment must use the
    /// same model.
    #[arg(long)]
    pub synthetic: bool,
    /// Context window of the synthetic model.
    #[arg(long, requires = "synthetic")]
    pub synthetic_context: Option<usize>,
    /// Engine settings.
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
    /// Client address, OpenAI-compatible HTTP: /v1/completions,
    /// /v1/chat/completions (SSE with `"stream": true`), /v1/models,
    /// /health, /stats, /tokenize, /detokenize (roles unified, decode,
    /// disagg); port 0 picks a free port.
    #[arg(long)]
    pub listen: Option<String>,
    /// Where prefill nodes connect (role decode); port 0 picks a free port.
    #[arg(long)]
    pub peer_listen: Option<String>,
    /// The decode node's `--peer-listen` address (role prefill).
    #[arg(long)]
    pub peer: Option<String>,
    /// How KV travels between decode and prefill (roles decode, prefill;
    /// default tcp).
    #[arg(long, value_enum)]
    pub transport: Option<Transport>,
    /// RDMA device name, e.g. `mlx5_0` (with `--transport rdma`; default the first).
    #[arg(long)]
    pub rdma_device: Option<String>,
    /// GID table index (with `--transport rdma`; default the first RoCE v2
    /// GID on Ethernet, 0 on InfiniBand).
    #[arg(long)]
    pub rdma_gid_index: Option<u8>,
    /// How long the prefill role retries connecting to `--peer` before it
    /// gives up and exits with an error (at start and after a link drop).
    #[arg(long, default_value_t = 30)]
    pub peer_retry_secs: u64,
    /// The deployment's pre-shared key for the peer link (roles decode,
    /// prefill): at least 32 bytes, raw or hex (`openssl rand -hex 32`).
    /// Both nodes prove they hold it before anything is exchanged, and
    /// every frame after that is authenticated (not encrypted).
    #[arg(long, conflicts_with = "insecure_peer_link")]
    pub peer_key: Option<PathBuf>,
    /// Run the peer link without authentication on a non-loopback address:
    /// any process that reaches it can join as a peer (roles decode,
    /// prefill). Without a key and without this flag, only loopback peer
    /// addresses are allowed.
    #[arg(long)]
    pub insecure_peer_link: bool,
    /// `KEY TENANT [SALT]` lines: the tenant of each API key clients send
    /// as `Authorization: Bearer KEY`. Without it every client is tenant 0.
    #[arg(long)]
    pub api_keys: Option<PathBuf>,
    /// Requests generating at once at most; one more is answered 503
    /// (with `Retry-After`) at once, never queued.
    #[arg(long, default_value_t = 256)]
    pub max_clients: usize,
    /// With a sanitizer attached, `/health` answers 503 (and
    /// `kvsan:checker_stalled` is 1) once forward steps ran and the
    /// sanitizer's check count has not moved for this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub checker_stall_secs: u64,
}

/// Runs the command: serves until the process is stopped (or, for the
/// prefill role, until the decode node stays unreachable).
pub fn run(args: &Args) -> anyhow::Result<()> {
    check_flags(args)?;
    // Before the model loads: a bad key, or a non-loopback link without
    // one, is a start-up error.
    let link_opts = peer_link_options(args)?;
    // Before the model loads: a missing RDMA device is a start-up error.
    let rdma = open_rdma(args)?;
    // Engine logs (link drops, refusals) go to stderr; `RUST_LOG` filters them.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    // Before the model loads: a malformed key file is a start-up error.
    let tenants = match &args.api_keys {
        Some(path) => http::api_keys::Tenants::load(path)?,
        None => http::api_keys::Tenants::single(),
    };
    let (model, text, model_id) = load_model(args)?;
    let cfg = args.engine.config()?;
    // What clients are told (`/v1/models`' max_model_len) is what the
    // engine enforces: `--context` when given.
    let context_length = cfg.context(&model)?;
    stop_on_signals(cfg.hooks.clone())?;
    let (engine, peers) = match (args.role, rdma) {
        (Role::Prefill, rdma) => return run_prefill(args, model, &cfg, rdma, &link_opts),
        (Role::Unified, _) => (Engine::unified(model, &cfg)?, PeerTransport::Tcp),
        (Role::Disagg, _) => (Engine::disaggregated(model, &cfg)?, PeerTransport::Tcp),
        (Role::Decode, None) => (Engine::decode_only(model, &cfg)?, PeerTransport::Tcp),
        #[cfg(feature = "rdma")]
        (Role::Decode, Some(device)) => {
            let (engine, region) = Engine::decode_only_rdma(model, &cfg, &device)
                .context("--transport rdma: cannot register the decode pool")?;
            (engine, PeerTransport::Rdma(region))
        }
    };
    eprintln!("kvsan: {}", tenants.describe());
    let engine = Arc::new(engine);
    let served = http::Served {
        text,
        model_id: model_id.clone(),
        context_length,
        front_node: if args.role == Role::Unified {
            "unified"
        } else {
            "decode"
        },
    };
    let front = http::Front::new(
        engine.clone(),
        served,
        cfg.hooks.clone(),
        tenants,
        args.max_clients,
        std::time::Duration::from_secs(args.checker_stall_secs),
    );
    run_front(args, front, &engine, peers, &model_id, link_opts)
}

/// The TCP options of the peer link: authenticated with `--peer-key`, or
/// plain on a loopback address, or plain anywhere with
/// `--insecure-peer-link`. Says which at start.
fn peer_link_options(args: &Args) -> anyhow::Result<TcpOptions> {
    let (flag, addr) = match (&args.peer_listen, &args.peer) {
        (Some(a), _) => ("--peer-listen", a),
        (None, Some(a)) => ("--peer", a),
        (None, None) => return Ok(TcpOptions::default()),
    };
    if let Some(path) = &args.peer_key {
        let key = PeerKey::from_file(path)?;
        let covers = if args.transport == Some(Transport::Rdma) {
            "the side channel's handshake and orders; the queue pair connects only to the authenticated peer's"
        } else {
            "authenticity and integrity, not confidentiality"
        };
        eprintln!(
            "kvsan: peer link authenticated with the key in {} ({covers})",
            path.display()
        );
        return Ok(TcpOptions {
            auth: Some(key),
            ..TcpOptions::default()
        });
    }
    let loopback = addr
        .to_socket_addrs()
        .with_context(|| format!("{flag} {addr}: cannot resolve the address"))?
        .all(|a| a.ip().is_loopback());
    if loopback {
        eprintln!(
            "kvsan: peer link NOT authenticated (no --peer-key), loopback only: {flag} {addr}"
        );
    } else if args.insecure_peer_link {
        eprintln!(
            "kvsan: peer link NOT authenticated (--insecure-peer-link): any process that reaches {flag} {addr} can join as a peer"
        );
    } else {
        bail!(
            "{flag} {addr} is not a loopback address: a peer link off this host needs --peer-key FILE (the deployment's shared key), or --insecure-peer-link to accept any peer without authentication"
        );
    }
    Ok(TcpOptions::default())
}

/// The RDMA device `--transport rdma` uses (`None` for TCP).
#[cfg(feature = "rdma")]
type RdmaDevice = Arc<kvsan_engine::transport::rdma::RdmaDevice>;
/// A build without RDMA support opens no device: `open_rdma` refuses
/// `--transport rdma` first.
#[cfg(not(feature = "rdma"))]
type RdmaDevice = std::convert::Infallible;

/// Opens the RDMA device for `--transport rdma`; `None` for TCP.
fn open_rdma(args: &Args) -> anyhow::Result<Option<RdmaDevice>> {
    if args.transport == Some(Transport::Rdma) {
        open_device(args).map(Some)
    } else {
        Ok(None)
    }
}

#[cfg(not(feature = "rdma"))]
fn open_device(_: &Args) -> anyhow::Result<RdmaDevice> {
    bail!(
        "--transport rdma: this kvsan was built without RDMA support; rebuild with --features rdma"
    )
}

#[cfg(feature = "rdma")]
fn open_device(args: &Args) -> anyhow::Result<RdmaDevice> {
    use kvsan_engine::transport::rdma::{RdmaConfig, RdmaDevice};
    let config = RdmaConfig {
        device: args.rdma_device.clone(),
        gid_index: args.rdma_gid_index,
        ..RdmaConfig::default()
    };
    let device = RdmaDevice::open(&config).with_context(|| {
        format!(
            "--transport rdma: cannot open the RDMA device {}",
            config.device.as_deref().unwrap_or("(the first one)")
        )
    })?;
    eprintln!("kvsan: RDMA device {device:?}");
    Ok(device)
}

/// How the decode role takes prefill nodes on `--peer-listen`.
enum PeerTransport {
    Tcp,
    /// The RDMA handshake, offering this registered pool.
    #[cfg(feature = "rdma")]
    Rdma(kvsan_engine::transport::rdma::PoolRegion),
}

/// SIGTERM or SIGINT stops the process cleanly: the sanitizer's summary
/// line is printed (in-process sanitizer) and the process exits through
/// `exit`, so a preloaded shim prints its own at exit too. Requests in
/// flight are dropped; their clients see the connection close.
fn stop_on_signals(hooks: Hooks) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
        .context("cannot install the SIGTERM/SIGINT handler")?;
    std::thread::Builder::new()
        .name("kvsan-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let name = if signal == SIGINT {
                    "SIGINT"
                } else {
                    "SIGTERM"
                };
                eprintln!("kvsan: stopping ({name})");
                hooks.print_summary();
                std::process::exit(0);
            }
        })
        .context("cannot start the signal thread")?;
    Ok(())
}

/// Refuses flags that mean nothing for the role (a misplaced pool size or
/// address is a mistake worth saying, not ignoring).
fn check_flags(args: &Args) -> anyhow::Result<()> {
    let role = args.role;
    let front_roles: &[Role] = &[Role::Unified, Role::Decode, Role::Disagg];
    let flags: [(&str, bool, &[Role]); 13] = [
        ("--listen", args.listen.is_some(), front_roles),
        ("--api-keys", args.api_keys.is_some(), front_roles),
        // The decode node receives every prompt's KV: the prefill node caches.
        (
            "--prefix-cache",
            args.engine.prefix_cache.is_some(),
            &[Role::Unified, Role::Prefill, Role::Disagg],
        ),
        ("--peer-listen", args.peer_listen.is_some(), &[Role::Decode]),
        ("--peer", args.peer.is_some(), &[Role::Prefill]),
        (
            "--pool-tokens",
            args.engine.pool_tokens.is_some(),
            &[Role::Unified],
        ),
        (
            "--prefill-pool-tokens",
            args.engine.prefill_pool_tokens.is_some(),
            &[Role::Prefill, Role::Disagg],
        ),
        (
            "--decode-pool-tokens",
            args.engine.decode_pool_tokens.is_some(),
            &[Role::Decode, Role::Disagg],
        ),
        (
            "--transport",
            args.transport.is_some(),
            &[Role::Decode, Role::Prefill],
        ),
        (
            "--rdma-device",
            args.rdma_device.is_some(),
            &[Role::Decode, Role::Prefill],
        ),
        (
            "--rdma-gid-index",
            args.rdma_gid_index.is_some(),
            &[Role::Decode, Role::Prefill],
        ),
        (
            "--peer-key",
            args.peer_key.is_some(),
            &[Role::Decode, Role::Prefill],
        ),
        (
            "--insecure-peer-link",
            args.insecure_peer_link,
            &[Role::Decode, Role::Prefill],
        ),
    ];
    for (flag, given, roles) in flags {
        if given && !roles.contains(&role) {
            let names: Vec<&str> = roles.iter().map(|r| r.name()).collect();
            bail!(
                "{flag} is not used by --role {}: it is for --role {}",
                role.name(),
                names.join("|")
            );
        }
    }
    let rdma_flag = [
        ("--rdma-device", args.rdma_device.is_some()),
        ("--rdma-gid-index", args.rdma_gid_index.is_some()),
    ]
    .into_iter()
    .find(|(_, given)| *given);
    if let Some((flag, _)) = rdma_flag
        && args.transport != Some(Transport::Rdma)
    {
        bail!("{flag} is used only with --transport rdma");
    }
    let missing = match role {
        Role::Unified | Role::Disagg if args.listen.is_none() => Some("--listen"),
        Role::Decode if args.listen.is_none() => Some("--listen"),
        Role::Decode if args.peer_listen.is_none() => Some("--peer-listen"),
        Role::Prefill if args.peer.is_none() => Some("--peer"),
        _ => None,
    };
    if let Some(flag) = missing {
        bail!("--role {} needs {flag} ADDR", role.name());
    }
    Ok(())
}

/// The model, its tokenizer and chat template when it has them, and the
/// name clients call it by (the file's name without `.gguf`, or `synthetic`).
fn load_model(args: &Args) -> anyhow::Result<(Arc<Model>, Option<Arc<TextSide>>, String)> {
    if args.synthetic {
        let spec = SyntheticSpec {
            context_length: args
                .synthetic_context
                .unwrap_or(SyntheticSpec::default().context_length),
            ..SyntheticSpec::default()
        };
        return Ok((Arc::new(spec.build()?), None, "synthetic".into()));
    }
    let path = model_arg::resolve(args.model.as_deref())?;
    let model = Model::load(&path)?;
    let model_id = path
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let text = match model.weights().file() {
        Some(gguf) => {
            let tokenizer = Tokenizer::from_gguf(gguf)?;
            // A model without a usable template still serves plain prompts.
            let template = ChatTemplate::from_gguf(gguf).ok();
            Some(Arc::new(TextSide::new(tokenizer, template)))
        }
        None => None,
    };
    Ok((Arc::new(model), text, model_id))
}

/// Roles with a client interface (unified, decode, disagg): serve clients
/// on `--listen`, and for decode accept prefill nodes on `--peer-listen`.
/// The serving line names the model clients ask for, `model_id`.
fn run_front(
    args: &Args,
    front: http::Front,
    engine: &Arc<Engine>,
    transport: PeerTransport,
    model_id: &str,
    link_opts: TcpOptions,
) -> anyhow::Result<()> {
    let listen = args.listen.as_deref().expect("checked by check_flags");
    let clients = TcpListener::bind(listen)
        .with_context(|| format!("cannot listen for clients at {listen}"))?;
    let client_addr = clients.local_addr()?;
    let mut line = format!(
        "kvsan: serving role={} listen={client_addr}",
        args.role.name()
    );
    if args.role != Role::Decode {
        line.push_str(&format!(" prefix-cache={}", args.engine.prefix_cache()));
    }
    if let Some(peer_listen) = &args.peer_listen {
        let peers = tcp::listen(peer_listen.as_str())?;
        line.push_str(&format!(" peer-listen={}", peers.local_addr()));
        let engine = engine.clone();
        let accepting = match transport {
            PeerTransport::Tcp => accept::spawn_accept_thread(peers, move |stream, _| {
                attach_tcp_prefill(stream, &engine, &link_opts)
            }),
            #[cfg(feature = "rdma")]
            PeerTransport::Rdma(region) => {
                accept::spawn_accept_thread(peers, move |stream, peer| {
                    attach_rdma_prefill(stream, peer, &engine, &region, &link_opts)
                })
            }
        };
        accepting.context("cannot start the prefill accept thread")?;
    }
    eprintln!("{line} model={model_id}");
    http::serve(clients, front)
}

/// Attaches a prefill node over TCP.
fn attach_tcp_prefill(
    stream: std::net::TcpStream,
    engine: &Engine,
    opts: &TcpOptions,
) -> Result<String, kvsan_engine::EngineError> {
    let (link, inbox) = tcp::decode_end(stream, opts)?;
    let peer = link.peer().to_string();
    engine.attach_prefill(Box::new(link), inbox);
    Ok(peer)
}

/// Attaches a prefill node whose connection (from `peer`) is the side
/// channel of an RDMA link: the handshake offers the decode node's
/// registered pool, to a node that proved it holds `opts.auth` when one is
/// set.
#[cfg(feature = "rdma")]
fn attach_rdma_prefill(
    stream: std::net::TcpStream,
    peer: &str,
    engine: &Engine,
    region: &kvsan_engine::transport::rdma::PoolRegion,
    opts: &TcpOptions,
) -> Result<String, kvsan_engine::EngineError> {
    engine.attach_rdma_prefill(stream, region, opts.auth.as_ref())?;
    Ok(format!("{peer}, over RDMA"))
}

/// The prefill role: serve the decode node at `--peer`, reconnecting after
/// each link drop, until it stays unreachable for `--peer-retry-secs`.
fn run_prefill(
    args: &Args,
    model: Arc<Model>,
    cfg: &EngineConfig,
    rdma: Option<RdmaDevice>,
    opts: &TcpOptions,
) -> anyhow::Result<()> {
    let peer = args.peer.as_deref().expect("checked by check_flags");
    let retry = Duration::from_secs(args.peer_retry_secs);
    let mut dialer = match rdma {
        #[cfg(feature = "rdma")]
        Some(device) => DecodeDialer::rdma(peer, retry, device, opts.auth.clone()),
        None => DecodeDialer::tcp(peer, retry, opts.clone()),
    };
    let transport = dialer.transport();
    eprintln!(
        "kvsan: serving role=prefill peer={peer} transport={} prefix-cache={}",
        transport.to_ascii_lowercase(),
        args.engine.prefix_cache()
    );
    // Dropping the control would stop the node: keep it for the whole run.
    let (control, inbox) = PrefillControl::new();
    serve_prefill(model, cfg, inbox, || dialer.connect())?;
    drop(control);
    match dialer.into_failure() {
        Some(e @ kvsan_engine::EngineError::PeerAuth(_)) => Err(anyhow::Error::new(e).context(
            format!("the decode node at {peer} and this node did not authenticate each other"),
        )),
        Some(e) => Err(anyhow::Error::new(e).context(format!(
            "the decode node at {peer} could not be reached over {transport} within {}s",
            args.peer_retry_secs
        ))),
        None => Ok(()),
    }
}
