//! Model-based property test: random operation sequences run against the
//! sanitizer and against a plain reference model of the invariant (HashMaps,
//! `Vec<bool>` written maps, no atomics); every verdict and every page's
//! state, generation, owner and sharing must agree after every step.
//!
//! The kernels' path runs against the same model: a kernel read (one page,
//! one layer, slots `0..n`) and a kernel store (one slot of one layer) go
//! through the in-place fast check ([`kvsan_sanitizer::KernelShadow`]) and,
//! when it does not pass, the cold path ([`Sanitizer::kernel_refusal`]); the
//! verdict must be the one the model gives a read or write of the same
//! slots, which shows the kernel shadow's encoding exact.
//!
//! The prefix cache takes and drops page references too (`share` and `free`
//! by [`RequestId::PREFIX_CACHE`](kvsan_sanitizer::RequestId::PREFIX_CACHE),
//! model request 0): a holder with no lifecycle, whose references keep a
//! page from quarantine like a sharer's.
//!
//! `PROPTEST_CASES` raises the number of sequences (default 3000).

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use kvsan_sanitizer::{
    AccessOp, Check, KernelAccess, Landing, Manifest, NodeRole, Options, Owner, PageId, PageRef,
    PageState, PoolGeometry, PoolId, RequestState, Sanitizer, Transition, ViolationKind as K,
};
use proptest::prelude::*;

const POOLS: usize = 2;
const PAGES: u32 = 3;
const SLOTS: u32 = 4;
const LAYERS: u32 = 3;
const REQUESTS: u64 = 2;
const QUARANTINE: usize = 2;
/// The model's id of the prefix cache (`RequestId::PREFIX_CACHE`).
const CACHE: u64 = 0;

#[derive(Clone, Debug)]
struct Ref {
    page: u32,
    /// Tag = current generation − delta (−1: a tag never issued).
    delta: i8,
}

#[derive(Clone, Debug)]
enum Op {
    Event(u64, RequestState),
    Alloc(usize, u32, u64),
    Free(usize, u64, Ref),
    Share(usize, u64, Ref),
    Write(usize, u64, Ref, Range<u32>, Range<u32>),
    Read(usize, u64, Vec<Ref>, u32, Range<u32>),
    Send(usize, u64, Vec<Ref>, u32, u32, Range<u32>),
    Recv(usize, u64, Vec<Ref>, u32, u32, Range<u32>),
    Commit(usize, u64, Vec<Ref>, u32),
    /// Attention reads slots `0..n` of one page for one layer.
    KernelRead(usize, u64, Ref, u32, u32),
    /// A store kernel writes one slot of one layer.
    KernelStore(usize, u64, Ref, u32, u32),
}

fn range(max: u32) -> impl Strategy<Value = Range<u32>> {
    (0..=max, 0..=max).prop_map(|(a, b)| a.min(b)..a.max(b))
}

fn page_ref() -> impl Strategy<Value = Ref> {
    (
        0..PAGES,
        prop_oneof![6 => Just(0i8), 2 => Just(1i8), 1 => Just(-1i8)],
    )
        .prop_map(|(page, delta)| Ref { page, delta })
}

/// A token position, 0 half the time (transfers usually start at the prompt's start).
fn token() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0), 0..=3 * SLOTS]
}

fn table() -> impl Strategy<Value = Vec<Ref>> {
    prop::collection::vec(page_ref(), 1..=3)
}

fn state() -> impl Strategy<Value = RequestState> {
    use RequestState::*;
    prop::sample::select(vec![
        Queued,
        Admitted,
        Prefilling,
        Transferring,
        Decoding,
        Finished,
        Rejected,
        Aborted,
    ])
}

/// Who takes or drops a page reference: a request, or the prefix cache.
fn holder() -> impl Strategy<Value = u64> {
    prop_oneof![3 => 1..=REQUESTS, 1 => Just(CACHE)]
}

fn op() -> impl Strategy<Value = Op> {
    let pool = 0..POOLS;
    let req = 1..=REQUESTS;
    prop_oneof![
        2 => (req.clone(), state()).prop_map(|(r, s)| Op::Event(r, s)),
        4 => (pool.clone(), 0..PAGES, req.clone()).prop_map(|(p, g, r)| Op::Alloc(p, g, r)),
        3 => (pool.clone(), holder(), page_ref()).prop_map(|(p, r, x)| Op::Free(p, r, x)),
        2 => (pool.clone(), holder(), page_ref()).prop_map(|(p, r, x)| Op::Share(p, r, x)),
        5 => (pool.clone(), req.clone(), page_ref(), range(SLOTS), range(LAYERS))
            .prop_map(|(p, r, x, s, l)| Op::Write(p, r, x, s, l)),
        5 => (pool.clone(), req.clone(), table(), 0..=3 * SLOTS, range(LAYERS))
            .prop_map(|(p, r, t, n, l)| {
                let n = n.min(t.len() as u32 * SLOTS);
                Op::Read(p, r, t, n, l)
            }),
        2 => (pool.clone(), req.clone(), table(), token(), 0..=3 * SLOTS, range(LAYERS))
            .prop_map(|(p, r, t, a, b, l)| {
                let cap = t.len() as u32 * SLOTS;
                let first = a.min(cap);
                Op::Send(p, r, t, first, b.min(cap - first), l)
            }),
        3 => (pool.clone(), req.clone(), table(), token(), 0..=3 * SLOTS, range(LAYERS))
            .prop_map(|(p, r, t, a, b, l)| {
                let cap = t.len() as u32 * SLOTS;
                let first = a.min(cap);
                Op::Recv(p, r, t, first, b.min(cap - first), l)
            }),
        2 => (pool.clone(), req.clone(), table(), 0..=3 * SLOTS).prop_map(|(p, r, t, n)| {
            let n = n.min(t.len() as u32 * SLOTS);
            Op::Commit(p, r, t, n)
        }),
        5 => (pool.clone(), req.clone(), page_ref(), 0..LAYERS, 1..=SLOTS)
            .prop_map(|(p, r, x, l, n)| Op::KernelRead(p, r, x, l, n)),
        5 => (pool, req, page_ref(), 0..LAYERS, 0..SLOTS)
            .prop_map(|(p, r, x, l, s)| Op::KernelStore(p, r, x, l, s)),
    ]
}

// ------------------------------------------------------------------ model

#[derive(Clone, Debug, PartialEq)]
enum St {
    Free,
    Owned,
    Receiving,
    Quarantined,
}

#[derive(Clone, Debug)]
struct MPage {
    st: St,
    generation: u32,
    owner: u64,
    released: bool,
    terminal: bool,
    sharers: Vec<(u64, u32)>,
    written: Vec<bool>,
}

impl MPage {
    fn new() -> MPage {
        MPage {
            st: St::Free,
            generation: 0,
            owner: 0,
            released: false,
            terminal: false,
            sharers: Vec::new(),
            written: vec![false; (SLOTS * LAYERS) as usize],
        }
    }
    fn free(&self) -> bool {
        matches!(self.st, St::Free | St::Quarantined)
    }
    fn holds(&self, r: u64) -> bool {
        self.owner == r && !self.released
    }
    fn shares(&self, r: u64) -> bool {
        self.sharers.iter().any(|(s, _)| *s == r)
    }
    fn written(&self, slot: u32, layer: u32) -> bool {
        self.written[(slot * LAYERS + layer) as usize]
    }
    fn unwritten(&self, slots: Range<u32>, layers: &Range<u32>) -> bool {
        !layers.is_empty()
            && slots
                .into_iter()
                .any(|s| layers.clone().any(|l| !self.written(s, l)))
    }
    fn set(&mut self, slots: Range<u32>, layers: &Range<u32>) {
        for s in slots {
            for l in layers.clone() {
                self.written[(s * LAYERS + l) as usize] = true;
            }
        }
    }
}

#[derive(Default)]
struct Model {
    pages: Vec<Vec<MPage>>,
    fifo: Vec<VecDeque<(u32, u32)>>,
    requests: HashMap<u64, (RequestState, u64)>,
}

impl Model {
    fn new() -> Model {
        Model {
            pages: vec![vec![MPage::new(); PAGES as usize]; POOLS],
            fifo: vec![VecDeque::new(); POOLS],
            requests: HashMap::new(),
        }
    }

    fn tag(&self, pool: usize, r: &Ref) -> PageRef {
        let g = i64::from(self.pages[pool][r.page as usize].generation) - i64::from(r.delta);
        PageRef::new(r.page, g.max(0) as u32)
    }

    fn terminal(&self, r: u64) -> bool {
        self.requests.get(&r).is_some_and(|(s, _)| s.is_terminal())
    }

    fn held(&mut self, r: u64, delta: i64) {
        if r == CACHE {
            // The cache has no lifecycle.
            return;
        }
        let e = self
            .requests
            .entry(r)
            .or_insert((RequestState::Admitted, 0));
        e.1 = e.1.saturating_add_signed(delta);
    }

    fn quarantine(&mut self, pool: usize, page: u32) {
        let p = &mut self.pages[pool][page as usize];
        p.st = St::Quarantined;
        p.released = false;
        p.terminal = false;
        let generation = p.generation;
        self.fifo[pool].push_back((page, generation));
        while self.fifo[pool].len() > QUARANTINE {
            let (old, g) = self.fifo[pool].pop_front().unwrap();
            let p = &mut self.pages[pool][old as usize];
            if p.st == St::Quarantined && p.generation == g {
                p.st = St::Free;
            }
        }
    }

    /// The checks `read` and `send` share for one page; `stale` is the kind
    /// of an unwritten slot.
    fn read_page(
        &self,
        pool: usize,
        r: u64,
        tag: PageRef,
        slots: Range<u32>,
        layers: &Range<u32>,
        stale: K,
    ) -> Option<K> {
        let p = &self.pages[pool][tag.page.0 as usize];
        if tag.generation.0 != p.generation {
            Some(K::GenerationMismatch)
        } else if p.free() {
            Some(K::ReadFreePage)
        } else if p.st == St::Receiving {
            Some(K::ReadDuringTransfer)
        } else if !p.holds(r) && !p.shares(r) {
            Some(K::ForeignRead)
        } else if p.unwritten(slots, layers) {
            Some(stale)
        } else {
            None
        }
    }

    fn apply(&mut self, op: &Op, tags: &[PageRef]) -> Option<K> {
        match op {
            Op::Event(r, to) => {
                let e = self.requests.entry(*r).or_insert((RequestState::Queued, 0));
                match e.0.transition(*to) {
                    Transition::Legal => {
                        e.0 = *to;
                        if to.is_terminal() && e.1 > 0 {
                            for pool in &mut self.pages {
                                for p in pool.iter_mut() {
                                    if !p.free() && p.holds(*r) {
                                        p.terminal = true;
                                    }
                                }
                            }
                            Some(K::PageLeak)
                        } else {
                            None
                        }
                    }
                    Transition::TerminalActivity => Some(K::TerminalRequestActivity),
                    _ => Some(K::IllegalTransition),
                }
            }
            Op::Alloc(pool, page, r) => {
                let e = self
                    .requests
                    .entry(*r)
                    .or_insert((RequestState::Admitted, 0));
                let terminal = e.0.is_terminal();
                let p = &mut self.pages[*pool][*page as usize];
                if !p.free() {
                    return Some(K::DoubleAlloc);
                }
                e.1 += 1;
                *p = MPage {
                    st: St::Owned,
                    generation: p.generation + 1,
                    owner: *r,
                    terminal,
                    ..MPage::new()
                };
                terminal.then_some(K::TerminalRequestActivity)
            }
            Op::Free(pool, r, _) => {
                let tag = tags[0];
                let p = &mut self.pages[*pool][tag.page.0 as usize];
                if tag.generation.0 != p.generation || p.free() {
                    return Some(K::DoubleFree);
                }
                if p.holds(*r) {
                    if p.sharers.is_empty() {
                        self.quarantine(*pool, tag.page.0);
                    } else {
                        p.released = true;
                    }
                } else if let Some(at) = p.sharers.iter().position(|(s, _)| s == r) {
                    p.sharers[at].1 -= 1;
                    if p.sharers[at].1 == 0 {
                        p.sharers.swap_remove(at);
                    }
                    if p.sharers.is_empty() && p.released {
                        self.quarantine(*pool, tag.page.0);
                    }
                } else {
                    return Some(K::ForeignFree);
                }
                self.held(*r, -1);
                None
            }
            Op::Share(pool, r, _) => {
                let tag = tags[0];
                if self.terminal(*r) {
                    return Some(K::TerminalRequestActivity);
                }
                let p = &mut self.pages[*pool][tag.page.0 as usize];
                if tag.generation.0 != p.generation {
                    return Some(K::GenerationMismatch);
                }
                if p.free() {
                    return Some(K::ReadFreePage);
                }
                if p.st == St::Receiving {
                    return Some(K::ReadDuringTransfer);
                }
                if p.unwritten(0..SLOTS, &(0..LAYERS)) {
                    return Some(K::UnwrittenShare);
                }
                match p.sharers.iter_mut().find(|(s, _)| s == r) {
                    Some((_, n)) => *n += 1,
                    None => p.sharers.push((*r, 1)),
                }
                self.held(*r, 1);
                None
            }
            Op::KernelStore(pool, r, x, layer, slot) => self.apply(
                &Op::Write(*pool, *r, x.clone(), *slot..slot + 1, *layer..layer + 1),
                tags,
            ),
            Op::KernelRead(pool, r, _, layer, n) => {
                if self.terminal(*r) {
                    return Some(K::TerminalRequestActivity);
                }
                self.read_page(
                    *pool,
                    *r,
                    tags[0],
                    0..*n,
                    &(*layer..layer + 1),
                    K::StaleRead,
                )
            }
            Op::Write(pool, r, _, slots, layers) => {
                let tag = tags[0];
                let p = &mut self.pages[*pool][tag.page.0 as usize];
                if tag.generation.0 != p.generation {
                    Some(K::GenerationMismatch)
                } else if p.free() {
                    Some(K::WriteAfterFree)
                } else if !p.holds(*r) || !p.sharers.is_empty() {
                    // A shared page is read-only to its owner too.
                    Some(K::ForeignWrite)
                } else if p.terminal {
                    Some(K::TerminalRequestActivity)
                } else {
                    p.set(slots.clone(), layers);
                    None
                }
            }
            Op::Read(pool, r, _, tokens, layers) => {
                if self.terminal(*r) {
                    return Some(K::TerminalRequestActivity);
                }
                for (i, tag) in tags
                    .iter()
                    .enumerate()
                    .take(tokens.div_ceil(SLOTS) as usize)
                {
                    let needed = (tokens - i as u32 * SLOTS).min(SLOTS);
                    if let Some(k) =
                        self.read_page(*pool, *r, *tag, 0..needed, layers, K::StaleRead)
                    {
                        return Some(k);
                    }
                }
                None
            }
            Op::Send(pool, r, _, first, n, layers) => {
                if self.terminal(*r) {
                    return Some(K::TerminalRequestActivity);
                }
                for (i, slots) in split(*first, *n) {
                    if let Some(k) =
                        self.read_page(*pool, *r, tags[i], slots, layers, K::UnwrittenTransfer)
                    {
                        return Some(k);
                    }
                }
                None
            }
            Op::Recv(pool, r, _, first, n, layers) => {
                if self.terminal(*r) {
                    return Some(K::TerminalRequestActivity);
                }
                for (i, slots) in split(*first, *n) {
                    let tag = tags[i];
                    let p = &mut self.pages[*pool][tag.page.0 as usize];
                    if tag.generation.0 != p.generation || p.free() {
                        return Some(K::WriteAfterFree);
                    }
                    if !p.holds(*r) || !p.sharers.is_empty() {
                        return Some(K::ForeignWrite);
                    }
                    p.st = St::Receiving;
                    p.set(slots, layers);
                }
                None
            }
            Op::Commit(pool, r, _, tokens) => {
                if self.terminal(*r) {
                    return Some(K::TerminalRequestActivity);
                }
                let mut short = false;
                for (i, tag) in tags.iter().enumerate() {
                    let p = &self.pages[*pool][tag.page.0 as usize];
                    if tag.generation.0 != p.generation {
                        return Some(K::GenerationMismatch);
                    }
                    if p.free() {
                        return Some(K::ReadFreePage);
                    }
                    if !p.holds(*r) && !p.shares(*r) {
                        return Some(K::ForeignRead);
                    }
                    let needed = tokens.saturating_sub(i as u32 * SLOTS).min(SLOTS);
                    short |= p.unwritten(0..needed, &(0..LAYERS));
                }
                for tag in tags {
                    let p = &mut self.pages[*pool][tag.page.0 as usize];
                    if p.st == St::Receiving {
                        p.st = St::Owned;
                    }
                }
                short.then_some(K::ShortTransfer)
            }
        }
    }
}

fn split(first: u32, n: u32) -> Vec<(usize, Range<u32>)> {
    let end = first + n;
    (first / SLOTS..end.div_ceil(SLOTS))
        .filter_map(|p| {
            let lo = first.max(p * SLOTS) - p * SLOTS;
            let hi = end.min((p + 1) * SLOTS) - p * SLOTS;
            (hi > lo).then_some((p as usize, lo..hi))
        })
        .collect()
}

fn owner(r: u64) -> Owner {
    let request = if r == CACHE {
        kvsan_sanitizer::RequestId::PREFIX_CACHE.0
    } else {
        r
    };
    Owner::new(request, r as u32 + 100)
}

fn run(san: &Sanitizer, pools: &[PoolId], op: &Op, tags: &[PageRef]) -> Option<K> {
    let manifest = |r: u64, first: u32, n: u32, layers: &Range<u32>| Manifest {
        request: owner(r),
        src_pool: pools[0],
        src_pages: tags.to_vec(),
        dst_pool: pools[1],
        dst_pages: tags.to_vec(),
        first_token: first,
        tokens: n,
        layers: layers.clone(),
        checksum: 0,
    };
    let verdict = match op {
        Op::Event(r, s) => san.request_event(owner(*r), *s),
        Op::Alloc(p, page, r) => san.alloc(pools[*p], PageId(*page), owner(*r), 0).unwrap().0,
        Op::Free(p, r, _) => san.free(pools[*p], owner(*r), tags[0], 0).unwrap(),
        Op::Share(p, r, _) => san.share(pools[*p], tags[0], owner(*r)).unwrap(),
        Op::Write(p, r, _, s, l) => san
            .write(pools[*p], owner(*r), tags[0], s.clone(), l.clone(), 0)
            .unwrap(),
        Op::Read(p, r, _, n, l) => san
            .read(pools[*p], owner(*r), tags, *n as usize, l.clone(), 0)
            .unwrap(),
        Op::Send(p, r, _, first, n, l) => san
            .transfer_send(pools[*p], &manifest(*r, *first, *n, l))
            .unwrap(),
        Op::Recv(p, r, _, first, n, l) => san
            .transfer_recv(pools[*p], &manifest(*r, *first, *n, l))
            .unwrap(),
        Op::Commit(p, r, _, n) => san
            .transfer_commit(pools[*p], owner(*r), tags, *n as usize)
            .unwrap(),
        Op::KernelRead(p, r, _, layer, n) => {
            let shadow = san.kernel_shadow(pools[*p]).unwrap();
            match shadow.check_read(owner(*r).request, tags[0], *layer, *n) {
                Check::Ok => kvsan_sanitizer::Verdict::Continue,
                _ => kernel_cold(san, pools[*p], *r, AccessOp::Read, tags[0], *layer, 0..*n),
            }
        }
        Op::KernelStore(p, r, _, layer, slot) => {
            let shadow = san.kernel_shadow(pools[*p]).unwrap();
            match shadow.store(owner(*r).request, tags[0], *layer, *slot, 0) {
                Check::Ok => kvsan_sanitizer::Verdict::Continue,
                Check::Arbitrate => panic!("a store is never arbitrated"),
                Check::Refused(_) => kernel_cold(
                    san,
                    pools[*p],
                    *r,
                    AccessOp::Store,
                    tags[0],
                    *layer,
                    *slot..slot + 1,
                ),
            }
        }
    };
    verdict.kind()
}

fn kernel_cold(
    san: &Sanitizer,
    pool: PoolId,
    r: u64,
    op: AccessOp,
    page: PageRef,
    layer: u32,
    slots: Range<u32>,
) -> kvsan_sanitizer::Verdict {
    let access = KernelAccess {
        op,
        page,
        entry: 0,
        layer,
        slots,
    };
    san.kernel_refusal(pool, owner(r), &access, 0).unwrap()
}

fn refs(op: &Op) -> Vec<Ref> {
    match op {
        Op::Free(_, _, x)
        | Op::Share(_, _, x)
        | Op::Write(_, _, x, _, _)
        | Op::KernelRead(_, _, x, _, _)
        | Op::KernelStore(_, _, x, _, _) => vec![x.clone()],
        Op::Read(_, _, t, _, _)
        | Op::Send(_, _, t, _, _, _)
        | Op::Recv(_, _, t, _, _, _)
        | Op::Commit(_, _, t, _) => t.clone(),
        Op::Event(..) | Op::Alloc(..) => Vec::new(),
    }
}

fn pool_of(op: &Op) -> usize {
    match op {
        Op::Event(..) => 0,
        Op::Alloc(p, ..)
        | Op::Free(p, ..)
        | Op::Share(p, ..)
        | Op::Write(p, ..)
        | Op::Read(p, ..)
        | Op::Send(p, ..)
        | Op::Recv(p, ..)
        | Op::Commit(p, ..)
        | Op::KernelRead(p, ..)
        | Op::KernelStore(p, ..) => *p,
    }
}

fn check_pages(
    san: &Sanitizer,
    pools: &[PoolId],
    model: &Model,
    step: usize,
) -> Result<(), TestCaseError> {
    for (pi, pool) in model.pages.iter().enumerate() {
        for (i, m) in pool.iter().enumerate() {
            let info = san.page_info(pools[pi], PageId(i as u32)).unwrap();
            let st = match info.state {
                PageState::Free => St::Free,
                PageState::Owned => St::Owned,
                PageState::Receiving => St::Receiving,
                PageState::Quarantined => St::Quarantined,
                PageState::Allocating => panic!("transient state seen single-threaded"),
            };
            let at = format!("step {step}, pool {pi} page {i}");
            prop_assert_eq!(&st, &m.st, "state at {}", at);
            prop_assert_eq!(info.generation.0, m.generation, "generation at {}", at);
            if m.generation > 0 {
                prop_assert_eq!(info.owner, owner(m.owner), "owner at {}", at);
            }
            prop_assert_eq!(info.shared, !m.sharers.is_empty(), "shared at {}", at);
            prop_assert_eq!(info.owner_released, m.released, "released at {}", at);
        }
    }
    for (r, (state, _)) in &model.requests {
        prop_assert_eq!(
            san.request_state(kvsan_sanitizer::RequestId(*r)),
            Some(*state)
        );
    }
    prop_assert_eq!(
        san.request_state(kvsan_sanitizer::RequestId::PREFIX_CACHE),
        None,
        "the prefix cache is no request"
    );
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn sanitizer_and_reference_model_agree_on_every_verdict(ops in prop::collection::vec(op(), 1..60)) {
        // Every request is its own tenant: the model leaves the isolation
        // policy to the unit tests and shares under `global`.
        let options = Options::parse(&format!("quarantine_pages={QUARANTINE}:print_limit=0:history_depth=2:prefix_share=global")).unwrap();
        let san = Sanitizer::with_writer(options, std::io::sink());
        let geometry = |role, node: &str| PoolGeometry {
            pages: PAGES,
            page_slots: SLOTS,
            layers: LAYERS,
            bytes_per_slot: 1,
            role,
            node: node.into(),
        };
        let pools = [
            // The model's `Recv` marks the manifest's slots written: the
            // pools of an engine that reports no landing (the landing hooks
            // have their own tests).
            san.pool_register_with(geometry(NodeRole::Prefill, "prefill-0"), Landing::Manifest)
                .unwrap(),
            san.pool_register_with(geometry(NodeRole::Decode, "decode-0"), Landing::Manifest)
                .unwrap(),
        ];
        let mut model = Model::new();
        for (step, op) in ops.iter().enumerate() {
            let pool = pool_of(op);
            let tags: Vec<PageRef> = refs(op).iter().map(|r| model.tag(pool, r)).collect();
            let got = run(&san, &pools, op, &tags);
            let want = model.apply(op, &tags);
            prop_assert_eq!(got, want, "step {}: {:?} with tags {:?}", step, op, tags);
            check_pages(&san, &pools, &model, step)?;
        }
    }
}
