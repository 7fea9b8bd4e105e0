//! A checker that proves it runs: with a sanitizer attached, `/health`
//! answers 503 (and `kvsan:checker_stalled` is 1) when forward steps run but
//! the sanitizer's check count has not moved for `--checker-stall-secs`. A
//! sanitizer that stopped checking would otherwise look like a clean run.
//!
//! ```text
//!  checks moved            -> the clock restarts (healthy)
//!  no step since then      -> idle: the clock restarts (healthy)
//!  steps ran, checks still -> stalled once the clock passes the interval
//! ```

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The watchdog over one engine's steps and its sanitizer's checks.
#[derive(Debug)]
pub struct Watchdog {
    stall_after: Duration,
    last: Mutex<Option<Seen>>,
}

#[derive(Clone, Copy, Debug)]
struct Seen {
    checks: u64,
    steps: u64,
    since: Instant,
}

impl Watchdog {
    /// A watchdog that calls the checker stalled after `stall_after`.
    #[must_use]
    pub fn new(stall_after: Duration) -> Watchdog {
        Watchdog {
            stall_after,
            last: Mutex::new(None),
        }
    }

    /// Looks at the counters now: `steps` run so far, and `checks` the
    /// sanitizer made (None: no sanitizer, nothing to watch). Some(why)
    /// when the checker is stalled.
    pub fn observe(&self, now: Instant, steps: u64, checks: Option<u64>) -> Option<String> {
        let checks = checks?;
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let seen = match *last {
            Some(seen) if seen.checks == checks && seen.steps != steps => seen,
            // Checks moved, or no step ran since they last did (idle), or
            // the first look: the clock starts now.
            _ => {
                *last = Some(Seen {
                    checks,
                    steps,
                    since: now,
                });
                return None;
            }
        };
        let stalled = now.saturating_duration_since(seen.since);
        (stalled >= self.stall_after).then(|| {
            format!(
                "{} forward steps ran in the last {} s and the sanitizer's check count stayed at {checks}: \
                 the sanitizer is not checking",
                steps.saturating_sub(seen.steps),
                stalled.as_secs()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_without_checks_past_the_interval_are_a_stall_and_checks_clear_it() {
        let w = Watchdog::new(Duration::from_secs(10));
        let t = Instant::now();
        assert_eq!(w.observe(t, 5, Some(100)), None, "first look");
        assert_eq!(
            w.observe(t + Duration::from_secs(5), 9, Some(100)),
            None,
            "within the interval"
        );
        let why = w
            .observe(t + Duration::from_secs(11), 12, Some(100))
            .expect("stalled");
        assert!(
            why.contains("7 forward steps") && why.contains("not checking"),
            "{why}"
        );
        assert_eq!(
            w.observe(t + Duration::from_secs(12), 13, Some(101)),
            None,
            "checks moved"
        );
    }

    #[test]
    fn an_idle_engine_or_no_sanitizer_is_never_a_stall() {
        let w = Watchdog::new(Duration::from_secs(10));
        let t = Instant::now();
        assert_eq!(w.observe(t, 5, Some(100)), None);
        assert_eq!(
            w.observe(t + Duration::from_secs(60), 5, Some(100)),
            None,
            "idle"
        );
        assert_eq!(
            w.observe(t + Duration::from_secs(65), 6, Some(100)),
            None,
            "the clock restarted at the idle look"
        );
        assert!(
            w.observe(t + Duration::from_secs(71), 7, Some(100))
                .is_some()
        );
        let none = Watchdog::new(Duration::from_secs(1));
        assert_eq!(none.observe(t, 1, None), None);
        assert_eq!(none.observe(t + Duration::from_secs(99), 50, None), None);
    }
}
