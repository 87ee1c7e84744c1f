//! `kvloop top AGENT...`: a live terminal view (ratatui/crossterm) of one or
//! more agents (issue 16 item 2): per peer path bandwidth and fixed cost
//! (the agents' fits), probe READ latency percentiles (from their
//! `/metrics` probe histograms), each pair's threshold, decisions by reason
//! at `--router`s, alarms. Keys: `q` quit, `s` next sort key, `a` alarms
//! only, `/` filter by name (Enter/Esc ends). `--once --json` prints one
//! snapshot for scripts.
pub mod model;

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::widgets::{Block, Paragraph, Row, Table};

use model::{Snapshot, SortKey};

/// Flags of `kvloop top`.
#[derive(Clone, Debug, Args)]
pub struct TopArgs {
    /// Agents' HTTP addresses (`host:port`).
    #[arg(required = true)]
    pub agents: Vec<String>,
    /// Routers' base URLs (`http://host:port`) for decisions by reason.
    #[arg(long = "router")]
    pub routers: Vec<String>,
    /// Refresh period, ms.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
    /// Print one snapshot and exit.
    #[arg(long)]
    pub once: bool,
    /// With `--once`: JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Exit after this many seconds (default: until `q`).
    #[arg(long)]
    pub seconds: Option<f64>,
}

async fn text(c: &reqwest::Client, url: &str) -> Result<String, String> {
    let r = c
        .get(url)
        .send()
        .await
        .map_err(|e| crate::doctor::gather::short(&e))?;
    if !r.status().is_success() {
        return Err(format!("{url}: {}", r.status()));
    }
    r.text().await.map_err(|e| e.to_string())
}

/// Polls every agent and router once.
pub async fn snapshot(c: &reqwest::Client, a: &TopArgs) -> Snapshot {
    let mut s = Snapshot::default();
    for ag in &a.agents {
        let st = text(c, &format!("http://{ag}/v1/status")).await;
        let m = text(c, &format!("http://{ag}/metrics")).await;
        match (st, m) {
            (Ok(st), Ok(m)) => match serde_json::from_str(&st) {
                Ok(v) => model::add_agent(&mut s, &v, &m),
                Err(e) => s.errors.push((ag.clone(), format!("/v1/status: {e}"))),
            },
            (Err(e), _) | (_, Err(e)) => s.errors.push((ag.clone(), e)),
        }
    }
    for r in &a.routers {
        match text(c, &format!("{}/metrics", r.trim_end_matches('/'))).await {
            Ok(m) => model::add_router(&mut s, r, &m),
            Err(e) => s.errors.push((r.clone(), e)),
        }
    }
    s
}

fn opt(x: Option<f64>, prec: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.prec$}"))
}

/// Plain-text rendering of a snapshot (`--once` without `--json`).
pub fn render_text(s: &Snapshot) -> String {
    let mut o = format!(
        "{:<12} {:<12} {:>9} {:>9} {:>10} {:>10} {:>8} {:>6} {:>6}\n",
        "AGENT", "PEER", "BW GB/s", "FIXED ms", "p50 us", "p99 us", "probes", "VALID", "ALARM"
    );
    for p in model::view(&s.paths, SortKey::Path, false, "") {
        o.push_str(&format!(
            "{:<12} {:<12} {:>9} {:>9} {:>10} {:>10} {:>8} {:>6} {:>6}\n",
            p.agent,
            p.peer,
            opt(p.bandwidth_gbps, 3),
            opt(p.fixed_ms, 3),
            opt(p.p50_us, 0),
            opt(p.p99_us, 0),
            p.probe_reads,
            p.path_valid,
            p.alarm
        ));
    }
    for t in &s.thresholds {
        o.push_str(&format!(
            "threshold {} ({},{}) = {} tokens, confidence {}\n",
            t.agent,
            t.prefill,
            t.decode,
            t.threshold_tokens.map_or("-".into(), |v| v.to_string()),
            opt(t.confidence, 2)
        ));
    }
    for (r, reason, n) in &s.decisions {
        o.push_str(&format!("decisions {r} {reason} = {n}\n"));
    }
    for (w, e) in &s.errors {
        o.push_str(&format!("error {w}: {e}\n"));
    }
    o
}

struct Ui {
    key: SortKey,
    alarms_only: bool,
    filter: String,
    typing: bool,
}

fn draw(f: &mut ratatui::Frame, s: &Snapshot, ui: &Ui, when: &str) {
    let [top, mid, bottom, foot] = Layout::vertical([
        Constraint::Min(5),
        Constraint::Length(6),
        Constraint::Length(6),
        Constraint::Length(1),
    ])
    .areas(f.area());
    let rows: Vec<Row> = model::view(&s.paths, ui.key, ui.alarms_only, &ui.filter)
        .into_iter()
        .map(|p| {
            let style = if p.alarm || !p.path_valid {
                Style::default().add_modifier(Modifier::REVERSED)
            } else {
                Style::default()
            };
            Row::new(vec![
                p.agent,
                p.peer,
                opt(p.bandwidth_gbps, 3),
                opt(p.fixed_ms, 3),
                opt(p.p50_us, 0),
                opt(p.p99_us, 0),
                p.probe_reads.to_string(),
                if !p.path_valid {
                    "PATH DOWN".into()
                } else if p.alarm {
                    "BW ALARM".into()
                } else {
                    "ok".into()
                },
            ])
            .style(style)
        })
        .collect();
    let w = [12, 12, 9, 9, 9, 9, 8, 10].map(Constraint::Length);
    let header = Row::new([
        "AGENT", "PEER", "BW GB/s", "FIXED ms", "p50 us", "p99 us", "probes", "STATE",
    ])
    .style(Style::default().add_modifier(Modifier::BOLD));
    f.render_widget(
        Table::new(rows, w)
            .header(header)
            .block(Block::bordered().title(format!(" kvloop top: paths ({when}) "))),
        top,
    );
    let trows: Vec<Row> = s
        .thresholds
        .iter()
        .map(|t| {
            Row::new(vec![
                t.agent.clone(),
                t.prefill.clone(),
                t.decode.clone(),
                t.threshold_tokens.map_or("-".into(), |v| v.to_string()),
                opt(t.confidence, 2),
            ])
        })
        .collect();
    f.render_widget(
        Table::new(trows, [12, 16, 16, 10, 6].map(Constraint::Length))
            .header(Row::new(["AGENT", "PREFILL", "DECODE", "TOKENS", "CONF"]))
            .block(Block::bordered().title(" thresholds ")),
        mid,
    );
    let mut lines: Vec<String> = s
        .decisions
        .iter()
        .map(|(r, reason, n)| format!("{r} {reason}: {n}"))
        .collect();
    lines.extend(s.errors.iter().map(|(w, e)| format!("ERROR {w}: {e}")));
    f.render_widget(
        Paragraph::new(lines.join("\n"))
            .block(Block::bordered().title(" router decisions / errors ")),
        bottom,
    );
    let foot_text = if ui.typing {
        format!("filter: {}_  (Enter/Esc to end)", ui.filter)
    } else {
        format!(
            "q quit  s sort: {}  a alarms only: {}  / filter: {}",
            ui.key.label(),
            if ui.alarms_only { "on" } else { "off" },
            if ui.filter.is_empty() {
                "-"
            } else {
                &ui.filter
            }
        )
    };
    f.render_widget(Paragraph::new(foot_text), foot);
}

/// Runs the view (or one snapshot with `--once`).
///
/// # Errors
/// Terminal errors; with `--once`, none (unreachable agents are listed).
pub async fn run(a: TopArgs) -> Result<i32> {
    // A live view waits at most one refresh period per request; one
    // snapshot (`--once`) waits up to 5 s: an agent on a loaded node can be
    // slower than the refresh period and must not vanish from a script's
    // answer.
    let timeout_ms = if a.once {
        5000
    } else {
        a.interval_ms.clamp(200, 5000)
    };
    let c = reqwest::Client::builder()
        .timeout(Duration::from_millis(timeout_ms))
        .build()?;
    if a.once {
        let s = snapshot(&c, &a).await;
        if a.json {
            println!("{}", serde_json::to_string(&s)?);
        } else {
            print!("{}", render_text(&s));
        }
        return Ok(i32::from(!s.errors.is_empty()));
    }
    // The live view needs a terminal; `ratatui::init` panics without one.
    use std::io::IsTerminal;
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        anyhow::bail!(
            "kvloop top: the live view needs a terminal (stdin and stdout); use `--once` (or `--once --json`) for one snapshot"
        );
    }
    let mut term = ratatui::try_init().context("kvloop top: starting the terminal")?;
    let r = ui_loop(&mut term, &c, &a).await;
    ratatui::restore();
    r.map(|()| 0)
}

async fn ui_loop(
    term: &mut ratatui::DefaultTerminal,
    c: &reqwest::Client,
    a: &TopArgs,
) -> Result<()> {
    let start = Instant::now();
    let mut ui = Ui {
        key: SortKey::Path,
        alarms_only: false,
        filter: String::new(),
        typing: false,
    };
    let period = Duration::from_millis(a.interval_ms.max(100));
    let mut snap = snapshot(c, a).await;
    let mut fetched = Instant::now();
    loop {
        if a.seconds
            .is_some_and(|s| start.elapsed().as_secs_f64() >= s)
        {
            return Ok(());
        }
        if fetched.elapsed() >= period {
            snap = snapshot(c, a).await;
            fetched = Instant::now();
        }
        let when = format!("{:.0} s", start.elapsed().as_secs_f64());
        term.draw(|f| draw(f, &snap, &ui, &when))?;
        let wait = period
            .saturating_sub(fetched.elapsed())
            .min(Duration::from_millis(200));
        let ev = tokio::task::block_in_place(|| -> std::io::Result<Option<Event>> {
            if event::poll(wait)? {
                Ok(Some(event::read()?))
            } else {
                Ok(None)
            }
        })?;
        let Some(Event::Key(k)) = ev else { continue };
        if k.kind != KeyEventKind::Press {
            continue;
        }
        if ui.typing {
            match k.code {
                KeyCode::Enter | KeyCode::Esc => ui.typing = false,
                KeyCode::Backspace => {
                    ui.filter.pop();
                }
                KeyCode::Char(ch) => ui.filter.push(ch),
                _ => {}
            }
            continue;
        }
        match k.code {
            KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
            KeyCode::Char('s') => ui.key = ui.key.next(),
            KeyCode::Char('a') => ui.alarms_only = !ui.alarms_only,
            KeyCode::Char('/') => {
                ui.typing = true;
                ui.filter.clear();
            }
            _ => {}
        }
    }
}
