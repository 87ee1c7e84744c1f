//! Sample statistics of the generate_conversations distributions (fixed seeds).
use kvloop_loadgen::dist::Distribution;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::json;

fn sample(spec: serde_json::Value, n: usize, seed: u64) -> Vec<f64> {
    let d = Distribution::from_json(&spec, "d").unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    d.sample_n(&mut rng, n)
        .into_iter()
        .map(|x| x as f64)
        .collect()
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

fn var(x: &[f64]) -> f64 {
    let m = mean(x);
    x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (x.len() - 1) as f64
}

fn median(x: &[f64]) -> f64 {
    let mut v = x.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

const N: usize = 40_000;

#[test]
fn constant() {
    assert!(
        sample(json!({"distribution": "constant", "value": 7}), 10, 1)
            .iter()
            .all(|&x| x == 7.0)
    );
}

#[test]
fn uniform_integer_bounds_and_moments() {
    let x = sample(
        json!({"distribution": "uniform", "min": 12, "max": 18}),
        N,
        1,
    );
    assert!(x.iter().all(|&v| (12.0..=18.0).contains(&v)));
    for k in 12..=18 {
        assert!(x.contains(&(k as f64)), "{k} never drawn");
    }
    assert!((mean(&x) - 15.0).abs() < 0.05, "{}", mean(&x));
    // Discrete uniform on 7 values: variance (7² − 1) / 12 = 4.
    assert!((var(&x) - 4.0).abs() < 0.15, "{}", var(&x));
}

#[test]
fn lognormal_average_is_exact_and_median_follows_ratio() {
    let x = sample(
        json!({"distribution": "lognormal", "average": 1000, "median_ratio": 0.8}),
        N,
        2,
    );
    // The batch is rescaled to the average (then rounded).
    assert!((mean(&x) - 1000.0).abs() < 1.0, "{}", mean(&x));
    assert!((median(&x) / 800.0 - 1.0).abs() < 0.05, "{}", median(&x));
    let capped = sample(
        json!({"distribution": "lognormal", "average": 1000, "max": 1500}),
        N,
        2,
    );
    assert!(capped.iter().all(|&v| v <= 1500.0));
    let direct = sample(
        json!({"distribution": "lognormal", "mean": 3.0, "sigma": 0.5}),
        N,
        3,
    );
    // Median of a lognormal is exp(mu).
    assert!(
        (median(&direct) / 3f64.exp() - 1.0).abs() < 0.05,
        "{}",
        median(&direct)
    );
}

#[test]
fn zipf_matches_zeta_pmf() {
    let x = sample(json!({"distribution": "zipf", "alpha": 2.0}), N, 4);
    assert!(x.iter().all(|&v| v >= 1.0));
    // P(1) = 1 / zeta(2) = 6 / pi² ≈ 0.6079; P(2) = P(1) / 4.
    let p1 = x.iter().filter(|&&v| v == 1.0).count() as f64 / N as f64;
    let p2 = x.iter().filter(|&&v| v == 2.0).count() as f64 / N as f64;
    assert!((p1 - 0.6079).abs() < 0.01, "{p1}");
    assert!((p2 - 0.1520).abs() < 0.01, "{p2}");
    let capped = sample(
        json!({"distribution": "zipf", "alpha": 1.5, "max": 20}),
        N,
        4,
    );
    assert!(capped.iter().all(|&v| v <= 20.0));
}

#[test]
fn poisson_mean_and_variance() {
    let x = sample(json!({"distribution": "poisson", "alpha": 12.0}), N, 5);
    assert!((mean(&x) - 12.0).abs() < 0.1, "{}", mean(&x));
    assert!((var(&x) - 12.0).abs() < 0.5, "{}", var(&x));
    let capped = sample(
        json!({"distribution": "poisson", "alpha": 12.0, "max": 10}),
        N,
        5,
    );
    assert!(capped.iter().all(|&v| v <= 10.0));
}

#[test]
fn same_seed_same_samples() {
    let s = json!({"distribution": "lognormal", "average": 500});
    assert_eq!(sample(s.clone(), 100, 9), sample(s.clone(), 100, 9));
    assert_ne!(sample(s.clone(), 100, 9), sample(s, 100, 10));
}
