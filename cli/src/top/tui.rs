//! The terminal UI: the frame text `view::render` makes, redrawn in place,
//! with keys to move through a replay.

use super::view::{self, RankState, Window};
use anyhow::Result;
use braid::trace::live::Line;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind};
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line as TextLine, Text};
use ratatui::widgets::Paragraph;
use ratatui::DefaultTerminal;
use std::sync::mpsc;
use std::time::Duration;

/// Draws `text` with `help` as the last line.
fn draw(term: &mut DefaultTerminal, text: &str, help: &str) -> Result<()> {
    let mut lines: Vec<TextLine> = text.lines().map(|l| TextLine::raw(l.to_string())).collect();
    if let Some(first) = lines.first_mut() {
        *first = first
            .clone()
            .style(Style::new().add_modifier(Modifier::BOLD));
    }
    lines.push(TextLine::raw(""));
    lines.push(TextLine::styled(
        help.to_string(),
        Style::new().add_modifier(Modifier::DIM),
    ));
    term.draw(|f| f.render_widget(Paragraph::new(Text::from(lines)), f.area()))?;
    Ok(())
}

/// The next key pressed within `wait`, if any.
fn key(wait: Duration) -> Result<Option<KeyCode>> {
    if event::poll(wait)? {
        if let Event::Key(k) = event::read()? {
            if k.kind == KeyEventKind::Press {
                return Ok(Some(k.code));
            }
        }
    }
    Ok(None)
}

/// Runs `body` with the terminal in the UI's mode, restoring it after.
fn with_terminal(body: impl FnOnce(&mut DefaultTerminal) -> Result<()>) -> Result<()> {
    let mut term = ratatui::init();
    let r = body(&mut term);
    ratatui::restore();
    r
}

/// Steps through a replayed trace: ←/→ move by the busy window, Home/End
/// jump, q quits.
pub fn replay(
    title: &str,
    ranks: &[RankState],
    mut w: Window,
    (start, end): (u64, u64),
) -> Result<()> {
    with_terminal(|term| loop {
        let text = view::render(title, ranks, w);
        draw(term, &text, "←/→ step · Home/End · q quit")?;
        match key(Duration::from_secs(3600))? {
            Some(KeyCode::Char('q') | KeyCode::Esc) => return Ok(()),
            Some(KeyCode::Left) => w.at_ns = w.at_ns.saturating_sub(w.busy_ns).max(start),
            Some(KeyCode::Right) => w.at_ns = (w.at_ns + w.busy_ns).min(end),
            Some(KeyCode::Home) => w.at_ns = start,
            Some(KeyCode::End) => w.at_ns = end,
            _ => {}
        }
    })
}

/// Follows a live program until q, or until it ends (its last frame stays
/// on screen).
pub fn live(
    title: &str,
    lines: impl Iterator<Item = Result<Line>> + Send + 'static,
    busy_ns: u64,
    history_ns: u64,
) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in lines {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    let mut feed = super::feed::Feed::new(history_ns);
    let mut status = String::from("q quit");
    with_terminal(|term| loop {
        loop {
            match rx.try_recv() {
                Ok(Ok(l)) => {
                    feed.apply(l);
                }
                Ok(Err(e)) => status = format!("{e:#} · q quit"),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    status = "the program ended · q quit".into();
                    break;
                }
            }
        }
        let w = Window {
            at_ns: feed.now_ns,
            busy_ns,
            history_ns,
        };
        draw(term, &view::render(title, &feed.ranks(), w), &status)?;
        if let Some(KeyCode::Char('q') | KeyCode::Esc) = key(braid::trace::live::PERIOD)? {
            return Ok(());
        }
    })
}
