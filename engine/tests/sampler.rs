//! The sampler: greedy, top-k, top-p, seeding, and the distribution it draws
//! from.

use kvsan_engine::EngineError;
use kvsan_engine::sampler::{Sampler, SamplingParams, argmax};

fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed,
    }
}

fn draw(p: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
    let mut s = Sampler::new(p).unwrap();
    (0..n).map(|_| s.sample(logits)).collect()
}

fn counts(ids: &[u32], vocab: usize) -> Vec<usize> {
    let mut c = vec![0; vocab];
    for &i in ids {
        c[i as usize] += 1;
    }
    c
}

fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits
        .iter()
        .map(|&l| ((l as f64 - m) / t as f64).exp())
        .collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

#[test]
fn greedy_picks_the_argmax_with_ties_to_the_lowest_id() {
    let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    assert_eq!(s.sample(&[1.0, 5.0, 5.0, 5.0]), 1);
    assert_eq!(s.sample(&[f32::NAN, -2.0, f32::NAN]), 1);
    assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), 0);
    assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
}

#[test]
fn top_k_of_one_equals_greedy_at_any_temperature() {
    let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
    let want = argmax(&logits);
    assert!(
        draw(params(1.5, 1, 1.0, 9), &logits, 200)
            .iter()
            .all(|&t| t == want)
    );
}

#[test]
fn same_seed_gives_the_same_sequence_and_another_seed_a_different_one() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let a = draw(params(1.0, 0, 1.0, 42), &logits, 64);
    let b = draw(params(1.0, 0, 1.0, 42), &logits, 64);
    let c = draw(params(1.0, 0, 1.0, 43), &logits, 64);
    assert_eq!(a, b);
    // 64 draws from a near-uniform 50-way distribution: equal sequences
    // under two seeds would be a broken generator.
    assert_ne!(a, c);
}

/// Recorded once from this implementation (ChaCha8, seed 7).
const PINNED: [u32; 12] = [1, 1, 3, 3, 3, 2, 0, 3, 2, 3, 1, 2];

#[test]
fn the_seeded_stream_is_fixed_across_platforms() {
    // ChaCha8 is a fixed algorithm: these ids are what every platform draws.
    let logits = [0.0f32, 0.5, 1.0, 1.5];
    let got = draw(params(1.0, 0, 1.0, 7), &logits, 12);
    assert_eq!(got, PINNED);
}

#[test]
fn top_k_never_draws_outside_the_k_largest() {
    let logits = [1.0f32, 4.0, 2.0, 3.5, 0.0, 3.9];
    let ids = draw(params(2.0, 3, 1.0, 1), &logits, 5000);
    let c = counts(&ids, logits.len());
    assert_eq!((c[0], c[2], c[4]), (0, 0, 0), "{c:?}");
    assert!(c[1] > 0 && c[3] > 0 && c[5] > 0, "{c:?}");
}

#[test]
fn top_p_keeps_the_smallest_set_whose_mass_reaches_p() {
    // Probabilities 0.5, 0.3, 0.15, 0.05.
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let c = counts(&draw(params(1.0, 0, 0.75, 3), &logits, 4000), 4);
    assert_eq!(
        (c[2], c[3]),
        (0, 0),
        "mass 0.8 of {{0, 1}} reaches 0.75: {c:?}"
    );
    assert!(c[0] > 0 && c[1] > 0);
    // Within the kept set, the draw is renormalised: 0.5 / 0.8 = 0.625.
    let share = c[0] as f64 / 4000.0;
    assert!((share - 0.625).abs() < 0.03, "share of id 0: {share}");
    let c = counts(&draw(params(1.0, 0, 0.85, 3), &logits, 4000), 4);
    assert_eq!(c[3], 0, "{c:?}");
    assert!(c[2] > 0, "0.8 < 0.85 needs the third token: {c:?}");
    let c = counts(&draw(params(1.0, 0, 0.4, 3), &logits, 1000), 4);
    assert_eq!(c[0], 1000, "the top token alone reaches 0.4: {c:?}");
}

#[test]
fn frequencies_match_the_tempered_softmax_by_chi_square() {
    let logits = [0.3f32, -1.2, 2.0, 0.0, 1.1, -0.5, 0.9, 1.6];
    for &t in &[0.5f32, 1.0, 1.7] {
        let n = 200_000;
        let c = counts(&draw(params(t, 0, 1.0, 2024), &logits, n), logits.len());
        let chi2: f64 = softmax(&logits, t)
            .iter()
            .zip(&c)
            .map(|(p, &o)| {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum();
        // 7 degrees of freedom: P(chi2 > 24.32) = 0.001.
        assert!(chi2 < 24.32, "T = {t}: chi2 = {chi2:.2}, counts {c:?}");
    }
}

#[test]
fn infinite_and_nan_logits_are_never_drawn() {
    let logits = [f32::NEG_INFINITY, 1.0, f32::NAN, 1.0];
    let c = counts(&draw(params(1.0, 0, 1.0, 5), &logits, 2000), 4);
    assert_eq!((c[0], c[2]), (0, 0), "{c:?}");
}

#[test]
fn out_of_range_parameters_name_the_parameter_and_the_range() {
    for (p, name) in [
        (params(-0.1, 0, 1.0, 0), "temperature"),
        (params(f32::NAN, 0, 1.0, 0), "temperature"),
        (params(1.0, 0, 0.0, 0), "top_p"),
        (params(1.0, 0, 1.5, 0), "top_p"),
    ] {
        let e = Sampler::new(p).unwrap_err();
        assert!(matches!(e, EngineError::InvalidSamplingParam { name: n, .. } if n == name));
        let msg = e.to_string();
        assert!(msg.contains(name) && msg.contains("allowed"), "{msg}");
    }
}
