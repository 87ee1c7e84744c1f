//! PNG chart of TTFT versus prompt length, one colour per mode: every
//! request as a dot, each bucket's TTFT median joined by a line.
//!
//! Text is drawn with DejaVu Sans embedded by the `dejavu` crate and rendered
//! through plotters' `ab_glyph` feature, so no system font is needed.
use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::report::Report;
use crate::{LoadgenError, Result};

/// Chart size, pixels.
pub const CHART_SIZE_PX: (u32, u32) = (1100, 680);

/// Registers the embedded font as plotters' `sans-serif` (once per process);
/// false when the font could not be loaded.
pub fn ensure_font() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .is_ok()
            && plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold())
                .is_ok()
    })
}

fn chart_err(e: impl std::fmt::Display) -> LoadgenError {
    LoadgenError::Chart(e.to_string())
}

/// Draws the chart of `report` onto any plotters backend.
pub fn draw_ttft_chart<DB: DrawingBackend>(
    report: &Report,
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let text = ensure_font();
    root.fill(&WHITE).map_err(chart_err)?;
    let points: Vec<(String, Vec<(f64, f64)>)> = report
        .runs
        .iter()
        .map(|r| {
            let pts = r
                .records
                .iter()
                .filter(|x| x.error.is_none())
                .filter_map(|x| x.ttft_ms.map(|t| (report.prompt_tokens_of(x) as f64, t)))
                .collect();
            (r.mode.clone(), pts)
        })
        .collect();
    let max_x = points
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .fold(1.0, f64::max)
        * 1.05;
    let max_y = points
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(1.0, f64::max)
        * 1.1;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder
            .caption(title, ("sans-serif", 26).into_font())
            .x_label_area_size(50)
            .y_label_area_size(70);
    }
    let mut chart = builder
        .build_cartesian_2d(0.0..max_x, 0.0..max_y)
        .map_err(chart_err)?;
    let mut mesh = chart.configure_mesh();
    if text {
        let by = if report.uses_server_counts() {
            "server"
        } else {
            report.tokenizer.as_str()
        };
        mesh.x_desc(format!("prompt tokens (counted by {by})"))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(WHITE.mix(0.0))
            .y_desc("TTFT (ms)")
            .label_style(("sans-serif", 16))
            .axis_desc_style(("sans-serif", 18));
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(chart_err)?;
    let summaries = report.summaries();
    for (i, (mode, pts)) in points.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), 3, color.mix(0.45).filled())),
            )
            .map_err(chart_err)?;
        let mut med: Vec<(f64, f64)> = summaries
            .iter()
            .filter(|s| &s.mode == mode)
            .filter_map(|s| s.ttft_ms_p50.map(|t| (s.prompt_tokens as f64, t)))
            .collect();
        med.sort_by(|a, b| a.0.total_cmp(&b.0));
        let series = chart
            .draw_series(LineSeries::new(med.clone(), color.stroke_width(3)))
            .map_err(chart_err)?;
        if text {
            series.label(format!("{mode} (p50)")).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        }
        chart
            .draw_series(
                med.iter()
                    .map(|&(x, y)| Circle::new((x, y), 5, color.filled())),
            )
            .map_err(chart_err)?;
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 18))
            .draw()
            .map_err(chart_err)?;
    }
    root.present().map_err(chart_err)?;
    Ok(())
}

/// Writes the chart of `report` as a PNG ([`CHART_SIZE_PX`]) at `path`,
/// creating parent directories.
pub fn write_ttft_chart(report: &Report, path: &Path, title: &str) -> Result<()> {
    if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d).map_err(|e| LoadgenError::io(d, e))?;
    }
    let root = BitMapBackend::new(path, CHART_SIZE_PX).into_drawing_area();
    draw_ttft_chart(report, root, title)
}
