//! The chart's text really renders with the embedded font (no system fonts).
use kvloop_loadgen::chart::{CHART_SIZE_PX, draw_ttft_chart, ensure_font};
use kvloop_loadgen::client::{ModeRun, RequestRecord};
use kvloop_loadgen::report::{Report, default_bucket_edges_tokens};
use plotters::prelude::*;

fn report() -> Report {
    let mut r = Report::new(default_bucket_edges_tokens(), "cl100k_base");
    let records = (1..=8u64)
        .map(|i| RequestRecord {
            conversation_id: format!("c{i}"),
            turn: 0,
            input_tokens: i * 3000,
            server_prompt_tokens: None,
            output_tokens: 10,
            max_tokens: 10,
            ttft_ms: Some(30.0 * i as f64),
            tpot_ms: Some(5.0),
            latency_ms: 100.0 * i as f64,
            start_ms: 0.0,
            error: None,
            server_info: Default::default(),
        })
        .collect();
    r.push(ModeRun {
        mode: "OFF".into(),
        wall_ms: 1.0,
        records,
        meta: Default::default(),
    });
    r
}

fn render(title: &str) -> Vec<u8> {
    let (w, h) = CHART_SIZE_PX;
    let mut buf = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        draw_ttft_chart(&report(), root, title).unwrap();
    }
    buf
}

#[test]
fn caption_pixels_change_with_the_title() {
    assert!(ensure_font(), "embedded DejaVu font failed to load");
    let (w, _) = CHART_SIZE_PX;
    let a = render("TTFT vs prompt length");
    let b = render("");
    // The caption sits in the top 60 rows: a title adds many dark pixels there.
    let dark = |buf: &[u8]| {
        buf[..(w * 60 * 3) as usize]
            .chunks(3)
            .filter(|p| p.iter().all(|&c| c < 100))
            .count()
    };
    assert!(
        dark(&a) > dark(&b) + 200,
        "caption not drawn: {} vs {} dark pixels",
        dark(&a),
        dark(&b)
    );
    // Axis labels exist too (the left margin holds tick labels).
    let left_dark = a
        .chunks((w * 3) as usize)
        .map(|row| {
            row[..60 * 3]
                .chunks(3)
                .filter(|p| p.iter().all(|&c| c < 100))
                .count()
        })
        .sum::<usize>();
    assert!(left_dark > 100, "no tick labels: {left_dark}");
}
