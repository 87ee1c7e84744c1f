//! PNG grouped bar chart: one group per category (e.g. a policy), one bar
//! per series (e.g. TTFT p50 / p90 / p99) in each, values labelled. Text as
//! in [`crate::chart`] (embedded DejaVu Sans).
use std::path::Path;

use plotters::prelude::*;

use crate::chart::{CHART_SIZE_PX, ensure_font};
use crate::{LoadgenError, Result};

fn err(e: impl std::fmt::Display) -> LoadgenError {
    LoadgenError::Chart(e.to_string())
}

/// Writes the chart at `path` ([`CHART_SIZE_PX`]), creating parent
/// directories. `groups[i]` labels `values[i]`; `series[j]` labels
/// `values[i][j]` (a missing or non-finite value draws no bar).
///
/// # Errors
/// [`LoadgenError::Chart`] when drawing or encoding fails, or the shapes
/// disagree; [`LoadgenError::Io`] when the directory cannot be created.
pub fn write_grouped_bars(
    path: &Path,
    title: &str,
    y_label: &str,
    groups: &[String],
    series: &[&str],
    values: &[Vec<f64>],
) -> Result<()> {
    if values.len() != groups.len() || values.iter().any(|v| v.len() != series.len()) {
        return Err(err(
            "values: expected one row per group, one value per series",
        ));
    }
    if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d).map_err(|e| LoadgenError::io(d, e))?;
    }
    let text = ensure_font();
    let root = BitMapBackend::new(path, CHART_SIZE_PX).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let max_y = values
        .iter()
        .flatten()
        .copied()
        .filter(|v| v.is_finite())
        .fold(1.0f64, f64::max)
        * 1.15;
    let n_s = series.len().max(1);
    let x_max = (groups.len() * (n_s + 1)) as f64;
    let mut chart = ChartBuilder::on(&root)
        .margin(20)
        .x_label_area_size(if text { 40 } else { 0 })
        .y_label_area_size(if text { 70 } else { 0 })
        .caption(if text { title } else { "" }, ("sans-serif", 22))
        .build_cartesian_2d(0.0..x_max, 0.0..max_y)
        .map_err(err)?;
    if text {
        let labels: Vec<(f64, String)> = groups
            .iter()
            .enumerate()
            .map(|(i, g)| ((i * (n_s + 1)) as f64 + n_s as f64 / 2.0, g.clone()))
            .collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc(y_label)
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(err)?;
        for (x, g) in &labels {
            chart
                .draw_series(std::iter::once(Text::new(
                    g.clone(),
                    (*x - 0.4 * g.len() as f64 / 12.0, -max_y * 0.04),
                    ("sans-serif", 16),
                )))
                .map_err(err)?;
        }
    }
    for (j, s) in series.iter().enumerate() {
        let color = Palette99::pick(j).mix(0.85);
        let bars: Vec<Rectangle<(f64, f64)>> = values
            .iter()
            .enumerate()
            .filter(|(_, v)| v[j].is_finite())
            .map(|(i, v)| {
                let x0 = (i * (n_s + 1) + j) as f64 + 0.5;
                Rectangle::new([(x0, 0.0), (x0 + 0.9, v[j])], color.filled())
            })
            .collect();
        let drawn = chart.draw_series(bars).map_err(err)?;
        if text {
            drawn.label(*s).legend(move |(x, y)| {
                Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())
            });
            let labels: Vec<Text<'_, (f64, f64), String>> = values
                .iter()
                .enumerate()
                .filter(|(_, v)| v[j].is_finite())
                .map(|(i, v)| {
                    let x0 = (i * (n_s + 1) + j) as f64 + 0.5;
                    Text::new(
                        format!("{:.0}", v[j]),
                        (x0, v[j] + max_y * 0.01),
                        ("sans-serif", 13),
                    )
                })
                .collect();
            chart.draw_series(labels).map_err(err)?;
        }
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_png_and_refuses_ragged_values() {
        let dir = std::env::temp_dir().join(format!("kvloop-bars-{}", std::process::id()));
        let p = dir.join("bars.png");
        let groups = vec!["rr + fixed 64".to_string(), "kvloop".to_string()];
        write_grouped_bars(
            &p,
            "TTFT",
            "ms",
            &groups,
            &["p50", "p90"],
            &[vec![100.0, 200.0], vec![80.0, f64::NAN]],
        )
        .unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(write_grouped_bars(&p, "t", "ms", &groups, &["p50"], &[vec![1.0]]).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }
}
