//! Checks that the pool's threads really run tasks side by side: times 16
//! tasks of ~100 µs of arithmetic each on 1 and on 2 threads.
//! Run: `cargo run --release -p kvsan-kernels --example pool_check`.

use std::sync::Mutex;
use std::time::Instant;

use kvsan_kernels::ThreadPool;

fn busy(n: u64) -> u64 {
    let mut s = n;
    for i in 0..200_000u64 {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(i);
    }
    s
}

fn main() {
    let mut best = f64::MAX;
    for _ in 0..50 {
        let t = Instant::now();
        std::thread::scope(|sc| {
            let h = sc.spawn(|| (0..8).map(busy).sum::<u64>());
            std::hint::black_box((8..16).map(busy).sum::<u64>());
            std::hint::black_box(h.join().unwrap());
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("plain scoped threads, 2 threads: best {:.0} us", best * 1e6);
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        let names = Mutex::new(std::collections::BTreeSet::new());
        let mut best = f64::MAX;
        for _ in 0..50 {
            let t = Instant::now();
            pool.run(16, |i| {
                std::hint::black_box(busy(i as u64));
                names
                    .lock()
                    .unwrap()
                    .insert(format!("{:?}", std::thread::current().id()));
            });
            best = best.min(t.elapsed().as_secs_f64());
        }
        let main_id = std::thread::current().id();
        let mut hist = Vec::new();
        for _ in 0..20 {
            let other = std::sync::atomic::AtomicUsize::new(0);
            let t = Instant::now();
            pool.run(16, |i| {
                std::hint::black_box(busy(i as u64));
                if std::thread::current().id() != main_id {
                    other.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
            hist.push((other.into_inner(), (t.elapsed().as_secs_f64() * 1e6) as u64));
        }
        println!("  (tasks on workers, us) per job: {hist:?}");
        println!(
            "{threads} threads: best {:.0} us, tasks ran on {} threads",
            best * 1e6,
            names.lock().unwrap().len()
        );
    }
}
