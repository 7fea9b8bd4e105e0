//! Hooks called from many threads at once (scheduler, compute and transfer
//! threads): outcomes are checked exactly, not just "did not crash".

mod common;

use std::sync::Barrier;
use std::thread;

use common::*;
use kvsan_sanitizer::{Owner, PageId, PageRef, PageState, ViolationKind};

const THREADS: usize = 4;

#[test]
fn racing_allocs_of_one_page_give_it_to_exactly_one_request() {
    let f = fixture_with("on_violation=abort:print_limit=1");
    let rounds = 200;
    let barrier = Barrier::new(THREADS);
    let winners: Vec<Vec<PageRef>> = thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (f, barrier) = (&f, &barrier);
                s.spawn(move || {
                    let me = Owner::new(100 + t as u64, 1);
                    let mut won = Vec::new();
                    for round in 0..rounds {
                        barrier.wait();
                        let (v, generation) = f.san.alloc(f.decode, PageId(0), me, round).unwrap();
                        if v.is_continue() {
                            won.push(PageRef {
                                page: PageId(0),
                                generation,
                            });
                        }
                        barrier.wait();
                        if let Some(page) = won
                            .last()
                            .filter(|p| p.generation == generation && v.is_continue())
                        {
                            assert!(
                                f.san
                                    .free(f.decode, me, *page, round)
                                    .unwrap()
                                    .is_continue()
                            );
                        }
                    }
                    won
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut generations: Vec<u32> = winners.iter().flatten().map(|p| p.generation.0).collect();
    generations.sort_unstable();
    assert_eq!(
        generations,
        (1..=rounds as u32).collect::<Vec<_>>(),
        "one winner per round"
    );
    assert_eq!(
        f.san.count(ViolationKind::DoubleAlloc),
        rounds * (THREADS as u64 - 1)
    );
    assert_eq!(
        f.san.violation_count(),
        f.san.count(ViolationKind::DoubleAlloc)
    );
}

#[test]
fn racing_frees_of_one_page_release_it_once() {
    let f = fixture_with("print_limit=1");
    let owner = Owner::new(1, 1);
    let rounds = 200;
    for round in 0..rounds {
        let page = f.alloc(f.decode, 1, owner, round);
        let barrier = Barrier::new(THREADS);
        let ok = thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (f, barrier) = (&f, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        f.san
                            .free(f.decode, owner, page, round)
                            .unwrap()
                            .is_continue()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|ok| *ok)
                .count()
        });
        assert_eq!(ok, 1, "round {round}");
    }
    assert_eq!(
        f.san.count(ViolationKind::DoubleFree),
        rounds * (THREADS as u64 - 1)
    );
}

#[test]
fn owner_and_sharers_letting_go_at_once_release_the_page_exactly_at_the_last() {
    let f = fixture_with("print_limit=1");
    let owner = Owner::new(1, 1);
    let sharers: Vec<Owner> = (0..THREADS as u64 - 1)
        .map(|i| Owner::new(10 + i, 1))
        .collect();
    for round in 0..200 {
        let page = f.alloc(f.decode, 2, owner, round);
        f.write_all(f.decode, owner, page, 0..SLOTS, round);
        for s in &sharers {
            assert!(f.san.share(f.decode, page, *s).unwrap().is_continue());
        }
        let barrier = Barrier::new(THREADS);
        thread::scope(|s| {
            for who in std::iter::once(owner).chain(sharers.iter().copied()) {
                let (f, barrier) = (&f, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    // A holder reads, then lets go; others may have let go already.
                    assert!(
                        f.san
                            .read(f.decode, who, &[page], 16, ALL, round)
                            .unwrap()
                            .is_continue()
                    );
                    assert!(
                        f.san
                            .free(f.decode, who, page, round)
                            .unwrap()
                            .is_continue()
                    );
                });
            }
        });
        let info = f.san.page_info(f.decode, PageId(2)).unwrap();
        assert_eq!(info.state, PageState::Quarantined, "round {round}");
        assert_eq!(info.generation, page.generation);
    }
    assert_eq!(f.san.violation_count(), 0, "{}", f.out.text());
}

/// Each thread plays one request through many lifetimes on its own pages of
/// a shared pool, reading what it wrote (legal) and, every tenth step, one
/// token past what it wrote (a stale read): the count must be exact.
#[test]
fn concurrent_requests_on_one_pool_find_exactly_the_planted_stale_reads() {
    let f = fixture_with("on_violation=report:print_limit=1");
    let per_thread = 2u32;
    let lifetimes = 150u64;
    thread::scope(|s| {
        for t in 0..THREADS as u32 {
            let f = &f;
            s.spawn(move || {
                for life in 0..lifetimes {
                    let me = Owner::new(u64::from(t) * 1_000 + life, t);
                    let table: Vec<PageRef> = (0..per_thread)
                        .map(|i| f.alloc(f.decode, t * per_thread + i, me, life))
                        .collect();
                    for token in 0..(per_thread * SLOTS) {
                        let page = table[(token / SLOTS) as usize];
                        let slot = token % SLOTS;
                        f.write_all(f.decode, me, page, slot..slot + 1, life);
                        let len = token as usize + 1;
                        assert!(
                            f.san
                                .read(f.decode, me, &table, len, ALL, life)
                                .unwrap()
                                .is_continue()
                        );
                        if token % 10 == 3 {
                            let _ = f
                                .san
                                .read(f.decode, me, &table, len + 1, ALL, life)
                                .unwrap();
                        }
                    }
                    for page in &table {
                        f.free(f.decode, me, *page, life);
                    }
                }
            });
        }
    });
    let per_life = (0..per_thread * SLOTS).filter(|t| t % 10 == 3).count() as u64;
    assert_eq!(
        f.san.count(ViolationKind::StaleRead),
        per_life * lifetimes * THREADS as u64
    );
    assert_eq!(
        f.san.violation_count(),
        f.san.count(ViolationKind::StaleRead)
    );
}
