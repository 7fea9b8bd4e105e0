//! The two-sample Kolmogorov–Smirnov test: does one sample of times come
//! from another distribution than the other? The statistic is the largest
//! distance between the two empirical distribution functions; its p-value
//! is the asymptotic Kolmogorov distribution with the small-sample
//! correction of Stephens (1970), as Numerical Recipes gives it.

/// The test's outcome.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Ks {
    /// The statistic `D` (0..=1).
    pub d: f64,
    /// The p-value of `D` under "the same distribution".
    pub p: f64,
}

/// The test of samples `a` and `b` (neither empty).
#[must_use]
pub fn two_sample(a: &[f64], b: &[f64]) -> Ks {
    let mut a = a.to_vec();
    let mut b = b.to_vec();
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    let (n, m) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut d) = (0usize, 0usize, 0f64);
    while i < a.len() && j < b.len() {
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / n - j as f64 / m).abs());
    }
    let ne = (n * m / (n + m)).sqrt();
    let lambda = (ne + 0.12 + 0.11 / ne) * d;
    Ks {
        d,
        p: kolmogorov_q(lambda),
    }
}

/// `Q(λ) = 2 Σ_{k≥1} (−1)^{k−1} e^{−2k²λ²}`: the probability that the
/// scaled statistic exceeds `λ`.
fn kolmogorov_q(lambda: f64) -> f64 {
    if lambda < 1e-3 {
        return 1.0;
    }
    let mut sum = 0.0;
    let mut sign = 1.0;
    for k in 1..=100 {
        let k = f64::from(k);
        let term = sign * (-2.0 * k * k * lambda * lambda).exp();
        sum += term;
        if term.abs() < 1e-12 {
            break;
        }
        sign = -sign;
    }
    (2.0 * sum).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_samples_do_not_differ() {
        let a = [1.0, 2.0, 3.0, 4.0, 5.0];
        let ks = two_sample(&a, &a);
        assert!(ks.d.abs() < 1e-12 && ks.p > 0.99, "{ks:?}");
    }

    #[test]
    fn disjoint_samples_differ_with_a_small_p() {
        let a: Vec<f64> = (0..12).map(f64::from).collect();
        let b: Vec<f64> = (100..112).map(f64::from).collect();
        let ks = two_sample(&a, &b);
        assert!((ks.d - 1.0).abs() < 1e-12, "{ks:?}");
        assert!(ks.p < 1e-4, "{ks:?}");
    }

    /// The value SciPy's `ks_2samp(..., method="asymp")` family gives for
    /// D = 0.5 with 10 and 10 samples is about 0.13 (asymptotic).
    #[test]
    fn a_half_shift_of_ten_samples_is_not_significant() {
        let a: Vec<f64> = (0..10).map(f64::from).collect();
        let b: Vec<f64> = (5..15).map(f64::from).collect();
        let ks = two_sample(&a, &b);
        assert!((ks.d - 0.5).abs() < 1e-12, "{ks:?}");
        assert!(ks.p > 0.05 && ks.p < 0.3, "{ks:?}");
    }
}
