//! The distributions of vLLM's `generate_conversations` description.
//!
//! Semantics follow vLLM's `benchmarks/multi_turn/bench_dataset.py` (numpy):
//!
//! - `constant {value}`: always `value`.
//! - `uniform {min, max}`: integers in `[min, max]` when both are JSON integers,
//!   otherwise reals in `[min, max)` (rounded to a count); `0 < min <= max`.
//! - `lognormal {average, median_ratio?, max?}`: underlying normal with
//!   `sigma = sqrt(2 ln(1/median_ratio))`, `mu = ln(average · median_ratio)`
//!   (median_ratio default 0.85, in (0, 1)); the batch of samples is rescaled so
//!   its mean is exactly `average`, then capped at `max`.
//!   Or `lognormal {mean, sigma, max?}` with the normal's `mu = mean > 0`, `sigma >= 0`.
//! - `zipf {alpha, max?}`: numpy's unbounded Zipf (= zeta) over 1, 2, …,
//!   `P(k) ∝ k^-alpha`, `alpha > 1`, capped at `max`.
//! - `poisson {alpha, max?}`: Poisson with mean `alpha > 0`, capped at `max`.
//!
//! Samples are token or turn counts: rounded to the nearest integer, never negative.
//! Randomness comes from the caller's seeded [`ChaCha8Rng`], so a seed fixes the output.
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rand_distr::Distribution as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{LoadgenError, Result};

/// One distribution of counts (see the module docs for each kind's meaning).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "distribution", rename_all = "lowercase")]
pub enum Distribution {
    /// Always `value`.
    Constant {
        /// The value (>= 0).
        value: f64,
    },
    /// Uniform on `[min, max]` (integers) or `[min, max)` (reals).
    Uniform {
        /// Lower bound (> 0).
        min: f64,
        /// Upper bound (>= min).
        max: f64,
        /// Both bounds were JSON integers.
        integer: bool,
    },
    /// Lognormal; see the module docs.
    Lognormal {
        /// `mu` of the underlying normal.
        mu: f64,
        /// `sigma` of the underlying normal.
        sigma: f64,
        /// When set, each batch is rescaled to this mean.
        average: Option<f64>,
        /// Cap.
        max: Option<f64>,
    },
    /// numpy's Zipf (zeta) with exponent `alpha > 1`.
    Zipf {
        /// Exponent (> 1).
        alpha: f64,
        /// Cap.
        max: Option<f64>,
    },
    /// Poisson with mean `alpha > 0`.
    Poisson {
        /// Mean (> 0).
        alpha: f64,
        /// Cap.
        max: Option<f64>,
    },
}

fn num(o: &serde_json::Map<String, Value>, path: &str, key: &str) -> Result<Option<f64>> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| LoadgenError::field(format!("{path}.{key}"), "a number")),
    }
}

fn req(o: &serde_json::Map<String, Value>, path: &str, key: &str) -> Result<f64> {
    num(o, path, key)?
        .ok_or_else(|| LoadgenError::field(format!("{path}.{key}"), "a number (missing)"))
}

fn cap(o: &serde_json::Map<String, Value>, path: &str) -> Result<Option<f64>> {
    let m = num(o, path, "max")?;
    if let Some(m) = m
        && m < 0.0
    {
        return Err(LoadgenError::field(format!("{path}.max"), "a number >= 0"));
    }
    Ok(m)
}

impl Distribution {
    /// Parses one distribution object; `path` (e.g. `prompt_input.num_turns`)
    /// prefixes the field named in errors.
    pub fn from_json(v: &Value, path: &str) -> Result<Self> {
        let o = v
            .as_object()
            .ok_or_else(|| LoadgenError::field(path, "an object with a \"distribution\" field"))?;
        let kind = o
            .get("distribution")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                LoadgenError::field(
                    format!("{path}.distribution"),
                    "one of constant, uniform, lognormal, zipf, poisson",
                )
            })?;
        match kind {
            "constant" => {
                let value = req(o, path, "value")?;
                if value < 0.0 {
                    return Err(LoadgenError::field(
                        format!("{path}.value"),
                        "a number >= 0",
                    ));
                }
                Ok(Self::Constant { value })
            }
            "uniform" => {
                let min = req(o, path, "min")?;
                let max = req(o, path, "max")?;
                if min <= 0.0 {
                    return Err(LoadgenError::field(format!("{path}.min"), "a number > 0"));
                }
                if max < min {
                    return Err(LoadgenError::field(
                        format!("{path}.max"),
                        "a number >= min",
                    ));
                }
                let integer = o["min"].is_i64() || o["min"].is_u64();
                let integer = integer && (o["max"].is_i64() || o["max"].is_u64());
                Ok(Self::Uniform { min, max, integer })
            }
            "lognormal" => {
                let max = cap(o, path)?;
                if let Some(average) = num(o, path, "average")? {
                    if average < 1.0 {
                        return Err(LoadgenError::field(
                            format!("{path}.average"),
                            "a number >= 1",
                        ));
                    }
                    if o.contains_key("mean") || o.contains_key("sigma") {
                        return Err(LoadgenError::field(
                            format!("{path}.mean"),
                            "absent when \"average\" is given (use average or mean+sigma)",
                        ));
                    }
                    let ratio = num(o, path, "median_ratio")?.unwrap_or(0.85);
                    if !(ratio > 0.0 && ratio < 1.0) {
                        return Err(LoadgenError::field(
                            format!("{path}.median_ratio"),
                            "a number in (0, 1)",
                        ));
                    }
                    let sigma = (2.0 * (1.0 / ratio).ln()).sqrt();
                    let mu = (average * ratio).ln();
                    Ok(Self::Lognormal {
                        mu,
                        sigma,
                        average: Some(average),
                        max,
                    })
                } else {
                    let mu = req(o, path, "mean")?;
                    let sigma = req(o, path, "sigma")?;
                    if mu <= 0.0 {
                        return Err(LoadgenError::field(format!("{path}.mean"), "a number > 0"));
                    }
                    if sigma < 0.0 {
                        return Err(LoadgenError::field(
                            format!("{path}.sigma"),
                            "a number >= 0",
                        ));
                    }
                    Ok(Self::Lognormal {
                        mu,
                        sigma,
                        average: None,
                        max,
                    })
                }
            }
            "zipf" => {
                let alpha = req(o, path, "alpha")?;
                if alpha <= 1.0 {
                    return Err(LoadgenError::field(format!("{path}.alpha"), "a number > 1"));
                }
                Ok(Self::Zipf {
                    alpha,
                    max: cap(o, path)?,
                })
            }
            "poisson" => {
                let alpha = req(o, path, "alpha")?;
                if alpha <= 0.0 {
                    return Err(LoadgenError::field(format!("{path}.alpha"), "a number > 0"));
                }
                Ok(Self::Poisson {
                    alpha,
                    max: cap(o, path)?,
                })
            }
            other => Err(LoadgenError::field(
                format!("{path}.distribution"),
                format!("one of constant, uniform, lognormal, zipf, poisson (got \"{other}\")"),
            )),
        }
    }

    /// Draws `n` counts (see the module docs; lognormal with `average`
    /// rescales the batch, so `sample_n(rng, 1)` returns `average`).
    pub fn sample_n(&self, rng: &mut ChaCha8Rng, n: usize) -> Vec<u64> {
        let capped = |x: f64, max: Option<f64>| max.map_or(x, |m| x.min(m));
        let raw: Vec<f64> = match *self {
            Self::Constant { value } => vec![value; n],
            Self::Uniform { min, max, integer } => (0..n)
                .map(|_| {
                    if integer {
                        rng.random_range(min as u64..=max as u64) as f64
                    } else if max > min {
                        rng.random_range(min..max)
                    } else {
                        min
                    }
                })
                .collect(),
            Self::Lognormal {
                mu,
                sigma,
                average,
                max,
            } => {
                let d = rand_distr::LogNormal::new(mu, sigma).expect("validated lognormal");
                let mut xs: Vec<f64> = (0..n).map(|_| d.sample(rng)).collect();
                if let Some(avg) = average {
                    let mean = xs.iter().sum::<f64>() / n.max(1) as f64;
                    if mean > 0.0 {
                        xs.iter_mut().for_each(|x| *x *= avg / mean);
                    }
                }
                xs.into_iter().map(|x| capped(x, max)).collect()
            }
            Self::Zipf { alpha, max } => {
                let d = rand_distr::Zeta::new(alpha).expect("validated zipf");
                (0..n).map(|_| capped(d.sample(rng), max)).collect()
            }
            Self::Poisson { alpha, max } => {
                let d = rand_distr::Poisson::new(alpha).expect("validated poisson");
                (0..n).map(|_| capped(d.sample(rng), max)).collect()
            }
        };
        raw.into_iter().map(|x| x.max(0.0).round() as u64).collect()
    }

    /// Largest value a sample can take, when bounded (used to size text offsets).
    pub fn max_value(&self) -> Option<f64> {
        match *self {
            Self::Constant { value } => Some(value),
            Self::Uniform { max, .. } => Some(max),
            Self::Lognormal { max, .. } | Self::Zipf { max, .. } | Self::Poisson { max, .. } => max,
        }
    }
}
