//! The engine's public face: start a unified or disaggregated engine,
//! `submit` requests, read their event streams, `cancel` them.
//!
//! ```text
//!  client ──submit──▶ [unified node]                          (one pool)
//!  client ──submit──▶ [decode node] ◀──link──▶ [prefill node]  (two pools)
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, unbounded};
use kvsan_sanitizer::{NodeRole, RequestId};

use crate::EngineError;
use crate::anomaly::AnomalyAction;
use crate::hooks::Hooks;
use crate::model::{AttentionCheck, Model};
use crate::node::decode::DecodeNode;
use crate::node::executor::{Executor, NodeSettings};
use crate::node::prefill::{Exit, PrefillNode};
use crate::node::scheduler::{Scheduler, SchedulerConfig};
use crate::node::{Command, NodeStats, unified};
use crate::prefix_cache::PrefixCachePolicy;
use crate::request::{Event, FinishReason, Request, RequestError};
use crate::transport::{Inbound, Link, ToDecode, ToPrefill, in_process};

/// How an engine is set up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Token slots per KV page.
    pub page_slots: usize,
    /// Context window served (at most the model's; `None`: the model's).
    pub context: Option<usize>,
    /// Tokens of the unified node's pool (`None`: one full context).
    pub pool_tokens: Option<usize>,
    /// Tokens of the prefill node's pool (`None`: one full context).
    pub prefill_pool_tokens: Option<usize>,
    /// Tokens of the decode node's pool (`None`: one full context).
    pub decode_pool_tokens: Option<usize>,
    /// Start even when a pool cannot hold one full-context request (such
    /// requests are then rejected one by one, saying why).
    pub allow_pool_smaller_than_context: bool,
    /// Step limits.
    pub scheduler: SchedulerConfig,
    /// How attention reads the pool.
    pub check: AttentionCheck,
    /// The hook target.
    pub hooks: Hooks,
    /// What the anomaly monitor does with a flagged request.
    pub anomaly: AnomalyAction,
    /// The prefix cache of the nodes that compute prompts (unified and
    /// prefill), and who may share its pages.
    pub prefix_cache: PrefixCachePolicy,
    /// Bytes of host memory per node where a preempted request's pages go
    /// and come back from, instead of being recomputed, and where evicted
    /// prefix-cache pages go when there is no disk tier (0: none, the
    /// default; preemption then recomputes).
    pub kv_offload_host_bytes: usize,
    /// The directory of each node's disk KV tier file (`None`: no disk
    /// tier, the default): evicted prefix-cache pages go there, and
    /// preempted requests' pages when the host tier is full.
    pub kv_offload_dir: Option<std::path::PathBuf>,
    /// Bytes of each node's disk tier file.
    pub kv_offload_disk_bytes: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        let hooks = default_hooks();
        EngineConfig {
            page_slots: 16,
            context: None,
            pool_tokens: None,
            prefill_pool_tokens: None,
            decode_pool_tokens: None,
            allow_pool_smaller_than_context: false,
            scheduler: SchedulerConfig::default(),
            check: default_check(&hooks),
            hooks,
            anomaly: AnomalyAction::default(),
            prefix_cache: PrefixCachePolicy::Off,
            kv_offload_host_bytes: 0,
            kv_offload_dir: None,
            kv_offload_disk_bytes: 0,
        }
    }
}

/// With a sanitizer attached (debug-build mode, or a release build under the
/// shim): the kernels that check every `PageRef`'s generation. Without one:
/// plain kernels.
fn default_check(hooks: &Hooks) -> AttentionCheck {
    if hooks.is_attached() {
        AttentionCheck::Generations
    } else {
        AttentionCheck::Unchecked
    }
}

/// The process's hook target ([`Hooks::from_environment`]). A bad
/// `KVSAN_OPTIONS` cannot fail `Default`: it is reported loudly and the
/// engine runs without hooks (callers that must refuse to start call
/// `Hooks::from_environment` themselves).
fn default_hooks() -> Hooks {
    Hooks::from_environment().unwrap_or_else(|e| {
        eprintln!("kvsan: not attached: {e}");
        tracing::error!("kvsan: not attached: {e}");
        Hooks::none()
    })
}

impl EngineConfig {
    /// A node named `name` with a pool of `pages` pages, this configuration's
    /// page size, hooks and attention check.
    fn node(
        &self,
        model: Arc<Model>,
        pages: usize,
        role: NodeRole,
        name: &str,
    ) -> Result<Executor, EngineError> {
        // Decode receives every prompt's KV from prefill: its pool caches nothing.
        let prefix_cache = match role {
            NodeRole::Decode => PrefixCachePolicy::Off,
            _ => self.prefix_cache,
        };
        let settings = NodeSettings {
            page_slots: self.page_slots,
            hooks: self.hooks.clone(),
            check: self.check,
            anomaly: self.anomaly,
            prefix_cache,
            tiers: crate::tier::TierConfig {
                host_bytes: self.kv_offload_host_bytes,
                disk_dir: self.kv_offload_dir.clone(),
                disk_bytes: self.kv_offload_disk_bytes,
            },
        };
        Executor::new(model, pages, role, name, settings)
    }

    /// The context served (`context`, else the model's), checked against
    /// the model's.
    ///
    /// # Errors
    /// [`EngineError::Config`] for a context of 0 or past the model's.
    pub fn context(&self, model: &Model) -> Result<usize, EngineError> {
        let max = model.config().context_length;
        match self.context {
            Some(c) if c == 0 || c > max => Err(EngineError::Config {
                what: format!("context of {c} tokens: must be 1 to the model's {max}"),
            }),
            Some(c) => Ok(c),
            None => Ok(max),
        }
    }

    /// Pages for a pool of `tokens` (default: one context) on `node`, refusing
    /// one smaller than the context unless allowed.
    fn pages(
        &self,
        tokens: Option<usize>,
        context: usize,
        node: &str,
    ) -> Result<usize, EngineError> {
        if self.page_slots == 0 {
            return Err(EngineError::Config {
                what: "page_slots must be at least 1".into(),
            });
        }
        let tokens = tokens.unwrap_or(context);
        if tokens < context && !self.allow_pool_smaller_than_context {
            return Err(EngineError::PoolSmallerThanContext {
                node: node.to_string(),
                pool_tokens: tokens,
                context,
            });
        }
        let pages = tokens / self.page_slots;
        if pages == 0 {
            return Err(EngineError::Config {
                what: format!(
                    "the {node} pool of {tokens} tokens holds no page of {} slots",
                    self.page_slots
                ),
            });
        }
        Ok(pages)
    }
}

/// A submitted request: its id and its event stream.
#[derive(Debug)]
pub struct RequestHandle {
    /// The request's id.
    pub id: RequestId,
    /// Its events: tokens, then `Finished` or `Error`.
    pub events: Receiver<Event>,
}

/// What a request produced, once it ended normally.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Why it finished.
    pub reason: FinishReason,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

impl RequestHandle {
    /// Waits for the end of the request.
    ///
    /// # Errors
    /// The request's error; a stream that ends without a final event is an
    /// internal error.
    pub fn wait(&self) -> Result<Output, RequestError> {
        let mut tokens = Vec::new();
        for event in self.events.iter() {
            match event {
                Event::Token(t) => tokens.push(t),
                Event::Finished {
                    reason,
                    cached_tokens,
                    ..
                } => {
                    return Ok(Output {
                        tokens,
                        reason,
                        cached_tokens,
                    });
                }
                Event::Error(e) => return Err(e),
            }
        }
        Err(RequestError::new(
            crate::request::ErrorKind::Internal,
            "the engine stopped before the request ended",
        ))
    }
}

/// Counters of an engine's nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineStats {
    /// The node clients talk to (unified or decode).
    pub front: NodeStats,
    /// The in-process prefill node, if any.
    pub prefill: Option<NodeStats>,
}

/// A running engine.
pub struct Engine {
    front: Sender<Command>,
    prefill: Option<Sender<Command>>,
    next_id: AtomicU64,
    threads: Vec<JoinHandle<()>>,
}

static ENGINE_IDS: AtomicU64 = AtomicU64::new(0);

impl Engine {
    /// A unified engine: one node, one pool.
    ///
    /// # Errors
    /// [`EngineError::PoolSmallerThanContext`] or [`EngineError::Config`] for
    /// a configuration it refuses; pool allocation errors.
    pub fn unified(model: Arc<Model>, cfg: &EngineConfig) -> Result<Engine, EngineError> {
        let context = cfg.context(&model)?;
        let pages = cfg.pages(cfg.pool_tokens, context, "unified")?;
        let core = cfg.node(model, pages, NodeRole::Unified, "unified")?;
        let sched = Scheduler::new(cfg.scheduler);
        let (tx, rx) = unbounded();
        let t = spawn("kvsan-unified", move || {
            unified::run(core, sched, context, rx)
        })?;
        Ok(Engine::with(tx, None, vec![t]))
    }

    /// A disaggregated engine in one process: a prefill node and a decode
    /// node with separate pools, linked in-process.
    ///
    /// # Errors
    /// As [`Engine::unified`], for either pool.
    pub fn disaggregated(model: Arc<Model>, cfg: &EngineConfig) -> Result<Engine, EngineError> {
        let context = cfg.context(&model)?;
        let ppages = cfg.pages(cfg.prefill_pool_tokens, context, "prefill")?;
        let dpages = cfg.pages(cfg.decode_pool_tokens, context, "decode")?;
        let pcore = cfg.node(model.clone(), ppages, NodeRole::Prefill, "prefill")?;
        let dcore = cfg.node(model, dpages, NodeRole::Decode, "decode")?;
        let pair = in_process::pair();
        let (ptx, prx) = unbounded();
        let mut prefill = PrefillNode::new(pcore, Scheduler::new(cfg.scheduler), context);
        let (to_decode, prefill_inbox) = (pair.to_decode, pair.prefill_inbox);
        let pt = spawn("kvsan-prefill", move || {
            prefill.serve(&to_decode, &prefill_inbox, &prx);
        })?;
        let (dtx, dt) = spawn_decode(dcore, cfg, context, |node| node)?;
        let engine = Engine::with(dtx, Some(ptx), vec![pt, dt]);
        engine.attach_prefill(Box::new(pair.to_prefill), pair.decode_inbox);
        Ok(engine)
    }

    /// A decode node alone, waiting for a prefill node to be attached with
    /// [`Engine::attach_prefill`] (the TCP and RDMA deployments).
    ///
    /// # Errors
    /// As [`Engine::unified`].
    pub fn decode_only(model: Arc<Model>, cfg: &EngineConfig) -> Result<Engine, EngineError> {
        let context = cfg.context(&model)?;
        let dpages = cfg.pages(cfg.decode_pool_tokens, context, "decode")?;
        let dcore = cfg.node(model, dpages, NodeRole::Decode, "decode")?;
        let (dtx, dt) = spawn_decode(dcore, cfg, context, |node| node)?;
        Ok(Engine::with(dtx, None, vec![dt]))
    }

    /// A decode node alone whose pool is registered on `device` for RDMA
    /// WRITEs for as long as the node runs, waiting for prefill nodes
    /// attached with [`Engine::attach_rdma_prefill`]. Returns the engine
    /// and the registered region each link's handshake offers.
    ///
    /// # Errors
    /// As [`Engine::unified`]; [`RdmaError::Verbs`](crate::transport::rdma::RdmaError::Verbs) when the pool cannot
    /// be registered (memory lock limit).
    #[cfg(feature = "rdma")]
    pub fn decode_only_rdma(
        model: Arc<Model>,
        cfg: &EngineConfig,
        device: &Arc<crate::transport::rdma::RdmaDevice>,
    ) -> Result<(Engine, crate::transport::rdma::PoolRegion), EngineError> {
        use crate::transport::rdma::PoolRegistration;
        let context = cfg.context(&model)?;
        let dpages = cfg.pages(cfg.decode_pool_tokens, context, "decode")?;
        let mut dcore = cfg.node(model, dpages, NodeRole::Decode, "decode")?;
        // SAFETY: the registration goes to the decode node that owns this
        // core, in its field declared before the core, so it is dropped
        // before the pool (also when the node's thread unwinds). A node
        // never replaces its core's pool, and moving the core (into the
        // node, onto its thread) moves the pool's handle, not the storage
        // it allocated once. Prefill writes only into pages this node
        // reserved for the transfer, read after its completion message.
        let registration = unsafe { PoolRegistration::new(device, &mut dcore.pool) }?;
        let region = registration.region();
        let (dtx, dt) = spawn_decode(dcore, cfg, context, |node| {
            node.with_registration(registration)
        })?;
        Ok((Engine::with(dtx, None, vec![dt]), region))
    }

    /// Runs the decode side of the RDMA handshake over `stream` (a prefill
    /// node that connected to the side channel), offering `pool` — the
    /// region [`Engine::decode_only_rdma`] returned — and attaches the link
    /// as [`Engine::attach_prefill`] does. The decode node refuses a link
    /// set up with another pool's region. With `auth`, the prefill node must
    /// prove it holds the deployment's key before it learns anything about
    /// the pool.
    ///
    /// # Errors
    /// As [`RdmaDecodeEndpoint::handshake`](crate::transport::rdma::RdmaDecodeEndpoint::handshake).
    #[cfg(feature = "rdma")]
    pub fn attach_rdma_prefill(
        &self,
        stream: std::net::TcpStream,
        pool: &crate::transport::rdma::PoolRegion,
        auth: Option<&crate::transport::peer_auth::PeerKey>,
    ) -> Result<(), EngineError> {
        let (tx, inbox) = unbounded();
        let link = crate::transport::rdma::RdmaDecodeEndpoint::handshake(stream, pool, tx, auth)?;
        let landing = Some(link.landing_zone());
        let _ = self.front.send(Command::AttachPrefill {
            link: Box::new(link),
            inbox,
            landing,
        });
        Ok(())
    }

    fn with(
        front: Sender<Command>,
        prefill: Option<Sender<Command>>,
        threads: Vec<JoinHandle<()>>,
    ) -> Engine {
        // Request ids differ across engines of one process (tests run several
        // engines against one sanitizer).
        let base = ENGINE_IDS.fetch_add(1, Ordering::Relaxed) << 40;
        Engine {
            front,
            prefill,
            next_id: AtomicU64::new(base + 1),
            threads,
        }
    }

    /// Connects a (new) prefill node to the decode node; requests that were
    /// waiting on a previous link are aborted.
    pub fn attach_prefill(
        &self,
        link: Box<dyn Link<ToPrefill>>,
        inbox: Receiver<Inbound<ToDecode>>,
    ) {
        let _ = self.front.send(Command::AttachPrefill {
            link,
            inbox,
            landing: None,
        });
    }

    /// Submits a request; its events arrive on the handle.
    pub fn submit(&self, request: Request) -> RequestHandle {
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = unbounded();
        let owner = crate::request::owner(id, request.tenant);
        if self
            .front
            .send(Command::Submit {
                owner,
                request,
                events: tx.clone(),
            })
            .is_err()
        {
            let _ = tx.send(Event::Error(RequestError::new(
                crate::request::ErrorKind::Internal,
                "the engine has stopped",
            )));
        }
        RequestHandle { id, events: rx }
    }

    /// Cancels a request: its pages are freed, its stream ends with a
    /// `cancelled` error (a request that already ended is left alone).
    pub fn cancel(&self, id: RequestId) {
        let _ = self.front.send(Command::Cancel(id));
    }

    /// The nodes' counters (after the commands sent before this call).
    pub fn stats(&self) -> EngineStats {
        let ask = |tx: &Sender<Command>| {
            let (stx, srx) = unbounded();
            tx.send(Command::Stats(stx)).ok()?;
            srx.recv().ok()
        };
        EngineStats {
            front: ask(&self.front).unwrap_or_default(),
            prefill: self.prefill.as_ref().and_then(ask),
        }
    }

    /// Fails what is still running and stops the nodes.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.front.send(Command::Shutdown);
        if let Some(p) = &self.prefill {
            let _ = p.send(Command::Shutdown);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts a decode node's thread, the node made by `finish` from the plain
/// one; returns its command channel and thread.
fn spawn_decode(
    core: Executor,
    cfg: &EngineConfig,
    context: usize,
    finish: impl FnOnce(DecodeNode) -> DecodeNode,
) -> Result<(Sender<Command>, JoinHandle<()>), EngineError> {
    let (tx, rx) = unbounded();
    let decode = finish(DecodeNode::new(
        core,
        Scheduler::new(cfg.scheduler),
        context,
        tx.clone(),
    ));
    let thread = spawn("kvsan-decode", move || decode.run(rx))?;
    Ok((tx, thread))
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, EngineError> {
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(f)
        .map_err(|e| EngineError::io(name, "spawn thread", e))
}

/// The control side of a prefill node run by [`serve_prefill`]: counters
/// and shutdown, from another thread.
#[derive(Clone, Debug)]
pub struct PrefillControl {
    tx: Sender<Command>,
}

/// What [`serve_prefill`] listens on for [`PrefillControl`]'s commands.
pub struct PrefillControlInbox {
    rx: Receiver<Command>,
}

impl PrefillControl {
    /// A control and the inbox to hand to [`serve_prefill`].
    #[must_use]
    pub fn new() -> (PrefillControl, PrefillControlInbox) {
        let (tx, rx) = unbounded();
        (PrefillControl { tx }, PrefillControlInbox { rx })
    }

    /// The prefill node's counters (`None` when it has stopped).
    #[must_use]
    pub fn stats(&self) -> Option<NodeStats> {
        let (stx, srx) = unbounded();
        self.tx.send(Command::Stats(stx)).ok()?;
        srx.recv().ok()
    }

    /// Frees every request and stops serving.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

/// A prefill node serving decode nodes over links that `connect` brings up,
/// one after another: when a link breaks, its requests are freed and the
/// next link is asked for. Returns when `connect` gives up (returns `None`)
/// or shutdown is sent on `control`.
///
/// # Errors
/// As [`Engine::unified`], for the prefill pool.
pub fn serve_prefill(
    model: Arc<Model>,
    cfg: &EngineConfig,
    control: PrefillControlInbox,
    mut connect: impl FnMut() -> Option<(Box<dyn Link<ToDecode>>, Receiver<Inbound<ToPrefill>>)>,
) -> Result<(), EngineError> {
    let context = cfg.context(&model)?;
    let pages = cfg.pages(cfg.prefill_pool_tokens, context, "prefill")?;
    let core = cfg.node(model, pages, NodeRole::Prefill, "prefill")?;
    let mut node = PrefillNode::new(core, Scheduler::new(cfg.scheduler), context);
    while let Some((link, inbox)) = connect() {
        if let Exit::Shutdown = node.serve(link.as_ref(), &inbox, &control.rx) {
            break;
        }
    }
    Ok(())
}
