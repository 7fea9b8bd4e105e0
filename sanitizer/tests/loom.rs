//! Model-checked (loom) tests of every lock-free page-state transition.
//!
//! Run with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p kvsan-sanitizer --test loom --release
//! ```
//!
//! Without `--cfg loom` this file compiles to nothing.
#![cfg(loom)]

use kvsan_sanitizer::shadow::{
    AllocOutcome, BitLayout, FLAG_OWNER_RELEASED, FLAG_SHARED, FLAG_WRITE_LOGGED, FreeOutcome,
    PageShadow, PageState, PageView, ReadCheck,
};
use kvsan_sanitizer::sync::AtomicU64;
use kvsan_sanitizer::{Generation, Owner, RequestId, ViolationKind};
use loom::sync::Arc;
use loom::thread;

const A: Owner = Owner::new(1, 1);
const B: Owner = Owner::new(2, 2);
const ALL: std::ops::Range<u32> = 0..2;

struct Page {
    rec: PageShadow,
    bits: Vec<AtomicU64>,
    layout: BitLayout,
}

impl Page {
    fn new() -> Arc<Page> {
        let layout = BitLayout::new(2, 2);
        Arc::new(Page {
            rec: PageShadow::new(),
            bits: (0..layout.stride).map(|_| AtomicU64::new(0)).collect(),
            layout,
        })
    }

    fn view(&self) -> PageView<'_> {
        PageView {
            rec: &self.rec,
            bits: &self.bits,
            layout: &self.layout,
        }
    }

    /// Allocated by `owner`, every slot written; returns the generation.
    fn owned_written(&self, owner: Owner) -> Generation {
        let AllocOutcome::Allocated { generation } = self.view().alloc(owner, false) else {
            panic!("setup alloc failed");
        };
        self.view()
            .write(owner.request, generation, 0..2, &ALL)
            .expect("setup write");
        generation
    }
}

#[test]
fn racing_allocs_give_the_page_to_exactly_one_owner() {
    loom::model(|| {
        let page = Page::new();
        let racers: Vec<_> = [A, B]
            .into_iter()
            .map(|who| {
                let page = page.clone();
                thread::spawn(move || page.view().alloc(who, false))
            })
            .collect();
        let outcomes: Vec<_> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        let won: Vec<usize> = outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| matches!(o, AllocOutcome::Allocated { .. }))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(won.len(), 1, "{outcomes:?}");
        let word = page.rec.load();
        assert_eq!(word.state(), PageState::Owned);
        assert_eq!(word.generation(), Generation(1));
        assert_eq!(page.rec.owner(), [A, B][won[0]]);
    });
}

#[test]
fn racing_frees_release_the_page_once() {
    loom::model(|| {
        let page = Page::new();
        let generation = page.owned_written(A);
        let racers: Vec<_> = (0..2)
            .map(|_| {
                let page = page.clone();
                thread::spawn(move || page.view().free_by_owner(generation, A.request))
            })
            .collect();
        let outcomes: Vec<_> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        let released = outcomes
            .iter()
            .filter(|o| **o == FreeOutcome::Released)
            .count();
        let double = outcomes
            .iter()
            .filter(|o| matches!(o, FreeOutcome::DoubleFree(_)))
            .count();
        assert_eq!((released, double), (1, 1), "{outcomes:?}");
        assert_eq!(page.rec.load().state(), PageState::Quarantined);
    });
}

/// A reader through the old tag while the page is freed and re-allocated
/// (bits cleared) must never see the old generation with the new bits: it
/// reads legally before the free, or finds the page free or re-tagged.
#[test]
fn a_reader_racing_free_and_realloc_never_mixes_generations() {
    loom::model(|| {
        let page = Page::new();
        let old = page.owned_written(A);
        let recycler = {
            let page = page.clone();
            thread::spawn(move || {
                assert_eq!(
                    page.view().free_by_owner(old, A.request),
                    FreeOutcome::Released
                );
                assert!(matches!(
                    page.view().alloc(B, false),
                    AllocOutcome::Allocated { .. }
                ));
            })
        };
        let seen = page.view().check_read(A.request, old, 0..2, &ALL);
        recycler.join().unwrap();
        match seen {
            ReadCheck::Ok => {}
            ReadCheck::Fail { kind, .. } => assert!(
                matches!(
                    kind,
                    ViolationKind::ReadFreePage | ViolationKind::GenerationMismatch
                ),
                "{kind:?}"
            ),
            other => panic!("{other:?}"),
        }
    });
}

/// The owner letting go and the last sharer letting go at once: exactly one
/// of them moves the page to quarantine.
#[test]
fn owner_release_and_last_sharer_release_quarantine_exactly_once() {
    loom::model(|| {
        let page = Page::new();
        let generation = page.owned_written(A);
        page.view().mark_shared(generation).unwrap();
        let owner = {
            let page = page.clone();
            thread::spawn(move || page.view().free_by_owner(generation, A.request))
        };
        let sharer_quarantined = page.view().last_sharer_gone(generation);
        let owner = owner.join().unwrap();
        let owner_quarantined = match owner {
            FreeOutcome::Released => true,
            FreeOutcome::OwnerReleased => false,
            other => panic!("{other:?}"),
        };
        assert!(owner_quarantined ^ sharer_quarantined);
        let word = page.rec.load();
        assert_eq!(word.state(), PageState::Quarantined);
        assert!(!word.has(FLAG_SHARED) && !word.has(FLAG_OWNER_RELEASED));
    });
}

/// Sharing and the owner's free at once: either the share lands first (the
/// page stays, owner released) or the free does (the share is refused).
#[test]
fn share_racing_the_owners_free_never_shares_a_freed_page() {
    loom::model(|| {
        let page = Page::new();
        let generation = page.owned_written(A);
        let sharer = {
            let page = page.clone();
            thread::spawn(move || page.view().mark_shared(generation).is_ok())
        };
        let freed = page.view().free_by_owner(generation, A.request);
        let shared = sharer.join().unwrap();
        let word = page.rec.load();
        match freed {
            FreeOutcome::OwnerReleased => {
                assert!(shared);
                assert_eq!(word.state(), PageState::Owned);
                assert!(word.has(FLAG_SHARED) && word.has(FLAG_OWNER_RELEASED));
            }
            FreeOutcome::Released => {
                assert!(!shared);
                assert_eq!(word.state(), PageState::Quarantined);
            }
            other => panic!("{other:?}"),
        }
    });
}

/// A late transfer landing while the owner frees: it lands before the free
/// (then the free quarantines a Receiving page) or is `write-after-free`.
#[test]
fn receive_racing_free_either_lands_first_or_is_write_after_free() {
    loom::model(|| {
        let page = Page::new();
        let AllocOutcome::Allocated { generation } = page.view().alloc(A, false) else {
            panic!("setup alloc failed");
        };
        let transfer = {
            let page = page.clone();
            thread::spawn(move || page.view().receive(A.request, generation, 0..2, &ALL))
        };
        let freed = page.view().free_by_owner(generation, A.request);
        let landed = transfer.join().unwrap();
        assert_eq!(freed, FreeOutcome::Released);
        if let Err((kind, _)) = landed {
            assert_eq!(kind, ViolationKind::WriteAfterFree);
        }
        assert_eq!(page.rec.load().state(), PageState::Quarantined);
    });
}

/// The first write's log flag and a commit's state change on the same word
/// at once: neither update is lost.
#[test]
fn first_write_flag_and_commit_do_not_lose_each_other() {
    loom::model(|| {
        let page = Page::new();
        let AllocOutcome::Allocated { generation } = page.view().alloc(A, false) else {
            panic!("setup alloc failed");
        };
        page.view()
            .receive(A.request, generation, 0..1, &ALL)
            .unwrap();
        let writer = {
            let page = page.clone();
            thread::spawn(move || page.view().write(RequestId(1), generation, 1..2, &ALL))
        };
        assert!(page.view().commit(generation));
        assert_eq!(writer.join().unwrap(), Ok(true));
        let word = page.rec.load();
        assert_eq!(word.state(), PageState::Owned);
        assert!(word.has(FLAG_WRITE_LOGGED));
        assert_eq!(page.view().first_unwritten(0..2, &ALL), None);
    });
}
