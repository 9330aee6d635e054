//! The terminal UI: the frame text `view::render` makes, redrawn in place,
//! with keys to move through a replay.

use super::view::{self, RankState, Window};
use anyhow::Result;
use braid::trace::live::Line;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line as TextLine, Text};
use ratatui::widgets::Paragraph;
use ratatui::{DefaultTerminal, Frame};
use std::sync::mpsc;
use std::time::Duration;

/// Draws `text` with `help` as the last line: its first line (the title)
/// stays at the top, and the rest scrolls, `scroll` lines down, clamped
/// to the last screenful (a job with many ranks is taller than a
/// terminal).
fn draw(term: &mut DefaultTerminal, text: &str, help: &str, scroll: &mut u16) -> Result<()> {
    term.draw(|f| *scroll = frame(f, text, help, *scroll))?;
    Ok(())
}

/// Lays one frame out on `f` (see [`draw`]) and returns the scroll used.
fn frame(f: &mut Frame, text: &str, help: &str, scroll: u16) -> u16 {
    let mut lines = text.lines();
    let title = lines.next().unwrap_or("").to_string();
    let body: Vec<TextLine> = lines.map(|l| TextLine::raw(l.to_string())).collect();
    let [top, middle, bottom] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(f.area());
    let most = (body.len() as u16).saturating_sub(middle.height);
    let scroll = scroll.min(most);
    f.render_widget(
        Paragraph::new(TextLine::styled(
            title,
            Style::new().add_modifier(Modifier::BOLD),
        )),
        top,
    );
    f.render_widget(Paragraph::new(Text::from(body)).scroll((scroll, 0)), middle);
    let more = if most > 0 {
        format!(" · ↑/↓ PgUp/PgDn: line {}/{}", scroll + 1, most + 1)
    } else {
        String::new()
    };
    f.render_widget(
        Paragraph::new(TextLine::styled(
            format!("{help}{more}"),
            Style::new().add_modifier(Modifier::DIM),
        )),
        bottom,
    );
    scroll
}

/// The scroll after key `k` (`page`: the lines a page moves), if `k`
/// scrolls.
fn scrolled(k: KeyCode, scroll: u16, page: u16) -> Option<u16> {
    match k {
        KeyCode::Up | KeyCode::Char('k') => Some(scroll.saturating_sub(1)),
        KeyCode::Down | KeyCode::Char('j') => Some(scroll.saturating_add(1)),
        KeyCode::PageUp => Some(scroll.saturating_sub(page)),
        KeyCode::PageDown | KeyCode::Char(' ') => Some(scroll.saturating_add(page)),
        _ => None,
    }
}

/// A page: the terminal's height less the title and help lines.
fn page(term: &DefaultTerminal) -> u16 {
    term.size()
        .map_or(10, |s| s.height.saturating_sub(3).max(1))
}

/// The next key pressed within `wait`, if any.
fn key(wait: Duration) -> Result<Option<KeyCode>> {
    if event::poll(wait)? {
        if let Event::Key(k) = event::read()? {
            if k.kind == KeyEventKind::Press {
                // Raw mode makes Ctrl-C a key: it quits, as Esc does.
                if k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL) {
                    return Ok(Some(KeyCode::Esc));
                }
                return Ok(Some(k.code));
            }
        }
    }
    Ok(None)
}

/// Runs `body` with the terminal in the UI's mode, restoring it after.
fn with_terminal(body: impl FnOnce(&mut DefaultTerminal) -> Result<()>) -> Result<()> {
    use std::io::IsTerminal;
    const NO_TERMINAL: &str =
        "the interactive view needs a terminal; --once prints one frame as text";
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        anyhow::bail!(NO_TERMINAL);
    }
    let mut term = ratatui::try_init().map_err(|e| anyhow::Error::new(e).context(NO_TERMINAL))?;
    let r = body(&mut term);
    ratatui::restore();
    r
}

/// Steps through a replayed trace: ←/→ move by the busy window, Home/End
/// jump, ↑/↓ and PgUp/PgDn scroll, q quits.
pub fn replay(
    title: &str,
    ranks: &[RankState],
    mut w: Window,
    (start, end): (u64, u64),
) -> Result<()> {
    let mut scroll = 0;
    let status = format!("←/→ {:.0} ms · Home/End · q quit", w.busy_ns as f64 / 1e6);
    with_terminal(|term| loop {
        let text = view::render(title, ranks, w);
        draw(term, &text, &status, &mut scroll)?;
        match key(Duration::from_secs(3600))? {
            Some(KeyCode::Char('q') | KeyCode::Esc) => return Ok(()),
            Some(k) if scrolled(k, scroll, page(term)).is_some() => {
                scroll = scrolled(k, scroll, page(term)).unwrap_or(scroll)
            }
            Some(KeyCode::Left) => w.at_ns = w.at_ns.saturating_sub(w.busy_ns).max(start),
            Some(KeyCode::Right) => w.at_ns = (w.at_ns + w.busy_ns).min(end),
            Some(KeyCode::Home) => w.at_ns = start,
            Some(KeyCode::End) => w.at_ns = end,
            _ => {}
        }
    })
}

/// Follows a live program until q, or until it ends (its last frame stays
/// on screen); ↑/↓ and PgUp/PgDn scroll.
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
    // An error that ended the lines (a line too long): it stays shown.
    let mut fatal = false;
    let mut scroll = 0;
    with_terminal(|term| loop {
        loop {
            match rx.try_recv() {
                Ok(Ok(l)) => {
                    feed.apply(l);
                    // Lines again after an error (a silence that ended).
                    status = "q quit".into();
                }
                Ok(Err(e)) => {
                    fatal = e.is::<super::feed::TooLong>();
                    status = format!("{e:#} · q quit");
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    if !fatal {
                        status = "the program ended · q quit".into();
                    }
                    break;
                }
            }
        }
        let w = Window {
            at_ns: feed.now_ns,
            busy_ns,
            history_ns,
            start_ns: feed.start_ns,
        };
        draw(
            term,
            &view::render(title, &feed.ranks(), w),
            &status,
            &mut scroll,
        )?;
        match key(braid::trace::live::PERIOD)? {
            Some(KeyCode::Char('q') | KeyCode::Esc) => return Ok(()),
            Some(k) => scroll = scrolled(k, scroll, page(term)).unwrap_or(scroll),
            None => {}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    /// The rows of a 40 × 6 screen showing `text` scrolled by `scroll`, and
    /// the scroll used.
    fn screen(text: &str, scroll: u16) -> (Vec<String>, u16) {
        let mut term = Terminal::new(TestBackend::new(40, 6)).unwrap();
        let mut used = 0;
        term.draw(|f| used = frame(f, text, "q quit", scroll))
            .unwrap();
        let buf = term.backend().buffer();
        let rows = (0..6)
            .map(|y| {
                (0..40)
                    .map(|x| buf[(x, y)].symbol())
                    .collect::<String>()
                    .trim_end()
                    .to_string()
            })
            .collect();
        (rows, used)
    }

    /// The title stays on top and the help at the bottom; the body between
    /// them scrolls, and a scroll past its end shows its last screenful.
    #[test]
    fn the_body_scrolls_between_the_title_and_the_help() {
        let text: String = std::iter::once("title".to_string())
            .chain((0..10).map(|i| format!("line {i}")))
            .map(|l| l + "\n")
            .collect();
        let (rows, used) = screen(&text, 0);
        assert_eq!(used, 0);
        assert_eq!(rows[0], "title");
        assert_eq!(&rows[1..5], ["line 0", "line 1", "line 2", "line 3"]);
        assert!(rows[5].starts_with("q quit · ↑/↓"), "{rows:?}");
        let (rows, used) = screen(&text, 3);
        assert_eq!(used, 3);
        assert_eq!((rows[0].as_str(), rows[1].as_str()), ("title", "line 3"));
        // 10 body lines, 4 shown: the last screenful starts at line 6.
        let (rows, used) = screen(&text, 100);
        assert_eq!(used, 6);
        assert_eq!(&rows[1..5], ["line 6", "line 7", "line 8", "line 9"]);
        assert!(rows[5].ends_with("line 7/7"), "{rows:?}");
        // A frame that fits says nothing of scrolling.
        let (rows, used) = screen("title\nonly\n", 5);
        assert_eq!((used, rows[5].as_str()), (0, "q quit"));
    }

    #[test]
    fn keys_scroll_by_a_line_or_a_page() {
        assert_eq!(scrolled(KeyCode::Down, 0, 10), Some(1));
        assert_eq!(scrolled(KeyCode::Up, 0, 10), Some(0));
        assert_eq!(scrolled(KeyCode::PageDown, 3, 10), Some(13));
        assert_eq!(scrolled(KeyCode::PageUp, 3, 10), Some(0));
        assert_eq!(scrolled(KeyCode::Left, 3, 10), None);
    }
}
