//! Debug-build pool behaviour: a freed page is poison-filled on request, and
//! a freed page waits in a FIFO quarantine before the free list hands it out.

use kvsan_engine::kv_pool::{KvPool, POISON_F16_BITS};
use kvsan_kernels::attention::KvGeometry;

fn pool(pages: usize) -> KvPool {
    let g = KvGeometry {
        page_slots: 4,
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 8,
    };
    KvPool::new(g, pages).expect("pool")
}

#[test]
fn a_poisoned_freed_page_reads_back_as_the_nan_pattern_and_its_neighbours_do_not() {
    let mut p = pool(3);
    let a = p.alloc().expect("a");
    let b = p.alloc().expect("b");
    p.data_mut().fill(half::f16::from_f32(1.5));
    p.free(a).expect("free");
    p.poison_page(a.page);
    assert!(
        p.page_data(a.page)
            .iter()
            .all(|v| v.to_bits() == POISON_F16_BITS && v.is_nan())
    );
    assert!(
        p.page_data(b.page)
            .iter()
            .all(|v| *v == half::f16::from_f32(1.5))
    );
}

#[test]
fn a_freed_page_is_not_handed_out_again_until_quarantine_pages_other_frees_happened() {
    // 6 pages, quarantine 2: take all, free 0 then 1 (both held back).
    let mut p = pool(6);
    p.set_quarantine(2);
    let pages: Vec<_> = (0..6).map(|_| p.alloc().expect("page")).collect();
    p.free(pages[0]).expect("free 0");
    p.free(pages[1]).expect("free 1");
    assert_eq!(p.quarantined_pages(), 2);
    // A third free pushes page 0 (two later frees) out to the free list.
    p.free(pages[2]).expect("free 2");
    assert_eq!(p.quarantined_pages(), 2);
    let again = p.alloc().expect("alloc");
    assert_eq!(again.page, pages[0].page);
    assert_eq!(again.generation.0, pages[0].generation.0 + 1);
}

#[test]
fn without_a_quarantine_the_page_freed_last_is_handed_out_first() {
    let mut p = pool(6);
    let pages: Vec<_> = (0..3).map(|_| p.alloc().expect("page")).collect();
    p.free(pages[1]).expect("free");
    assert_eq!(p.alloc().expect("again").page, pages[1].page);
}

#[test]
fn quarantined_pages_are_held_back_while_the_free_list_has_others() {
    // 4 pages, quarantine 3: take 2, free page A; the two never-used pages
    // come first, then A only when nothing else is left.
    let mut p = pool(4);
    p.set_quarantine(3);
    let a = p.alloc().expect("a");
    let _b = p.alloc().expect("b");
    p.free(a).expect("free a");
    let c = p.alloc().expect("c");
    let d = p.alloc().expect("d");
    assert_ne!(c.page, a.page);
    assert_ne!(d.page, a.page);
    // The free list is empty: the oldest quarantined page is taken rather
    // than failing the allocation.
    let e = p.alloc().expect("quarantined page under pressure");
    assert_eq!(e.page, a.page);
    assert!(p.alloc().is_none());
}

#[test]
fn free_pages_counts_quarantined_pages_and_returns_to_its_start_value() {
    let mut p = pool(8);
    p.set_quarantine(5);
    let start = p.free_pages();
    let pages: Vec<_> = (0..7).map(|_| p.alloc().expect("page")).collect();
    assert_eq!(p.free_pages(), 1);
    for page in pages {
        p.free(page).expect("free");
    }
    assert_eq!(p.quarantined_pages(), 5);
    assert_eq!(p.free_pages(), start);
    p.drain_quarantine();
    assert_eq!(p.quarantined_pages(), 0);
    assert_eq!(p.free_pages(), start);
}

#[test]
fn a_page_in_quarantine_cannot_be_freed_twice() {
    let mut p = pool(2);
    p.set_quarantine(1);
    let a = p.alloc().expect("a");
    p.free(a).expect("free");
    assert!(p.free(a).is_err());
}
