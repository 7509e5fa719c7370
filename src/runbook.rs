//! The on-call runbook, built into the binary and served at `GET /runbook`
//! on the metrics address.
//!
//! Every alert in `deploy/prometheus/alerts.yml` links to a section of
//! `docs/runbook.md`. A link into a source tree is useless in a page at 3 a.m.
//! (there is no published copy to resolve it against), so the worker serves
//! the runbook it was built with: the link always leads to the instructions of
//! the version that raised the alert. The alerts build the absolute URL from
//! the external label `dedupd_runbook_url` when the operator publishes the
//! runbook elsewhere, and otherwise point at `http://localhost:9464/runbook`,
//! which is the worker itself under compose and under
//! `kubectl port-forward svc/dedupd 9464`.

use pulldown_cmark::{html, CowStr, Event, Options, Parser, Tag, TagEnd};

/// `docs/runbook.md` as it was when this binary was built.
pub const MARKDOWN: &str = include_str!("../docs/runbook.md");

/// The anchor GitHub gives a heading, which is what the alerts' links and the
/// runbook's own `(#…)` links use: lower case, punctuation other than `-` and
/// `_` dropped, spaces turned into `-`.
pub fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The runbook as a standalone HTML page whose headings carry their GitHub
/// anchors as ids, so `/runbook#dedupdconflictdetected` scrolls to the alert.
pub fn html_page() -> String {
    let mut events: Vec<Event> = Parser::new_ext(MARKDOWN, Options::ENABLE_TABLES).collect();
    let mut i = 0;
    while i < events.len() {
        if let Event::Start(Tag::Heading { id: None, .. }) = &events[i] {
            let mut text = String::new();
            for e in &events[i + 1..] {
                match e {
                    Event::End(TagEnd::Heading(_)) => break,
                    Event::Text(t) | Event::Code(t) => text.push_str(t),
                    _ => {}
                }
            }
            if let Event::Start(Tag::Heading { id, .. }) = &mut events[i] {
                *id = Some(CowStr::from(slug(&text)));
            }
        }
        i += 1;
    }
    // Links into the source tree (`../deploy/...`) lead nowhere from the
    // worker's address: their text stays, the link goes.
    let mut in_tree_link = false;
    events.retain(|e| match e {
        Event::Start(Tag::Link { dest_url, .. }) if dest_url.starts_with("../") => {
            in_tree_link = true;
            false
        }
        Event::End(TagEnd::Link) if in_tree_link => {
            in_tree_link = false;
            false
        }
        _ => true,
    });
    let mut body = String::with_capacity(MARKDOWN.len() * 3 / 2);
    html::push_html(&mut body, events.into_iter());
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>dedupd {} runbook</title>\
         <style>body{{max-width:60rem;margin:auto;padding:1rem;font-family:sans-serif;line-height:1.4}}\
         pre{{background:#f4f4f4;padding:.5rem;overflow-x:auto}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:.2rem .4rem}}</style></head><body>\n{body}</body></html>\n",
        env!("CARGO_PKG_VERSION"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_are_githubs() {
        assert_eq!(slug("DedupdConflictDetected"), "dedupdconflictdetected");
        assert_eq!(slug("`dedupd verify` and `dedupd inspect`"), "dedupd-verify-and-dedupd-inspect");
        assert_eq!(slug("Two processes with one `--instance-id`"), "two-processes-with-one---instance-id");
    }

    /// Every anchor an alert links to is an id in the served page: a renamed
    /// heading would otherwise leave the page's link landing at the top.
    #[test]
    fn every_alert_anchor_is_an_id_of_the_served_page() {
        let page = html_page();
        let alerts = include_str!("../deploy/prometheus/alerts.yml");
        let anchors: Vec<&str> = alerts
            .split("/runbook\" }}#")
            .skip(1)
            .filter_map(|rest| rest.split(|c: char| !(c.is_alphanumeric() || c == '-' || c == '_')).next())
            .collect();
        assert!(anchors.len() >= 16, "only {} runbook links found in alerts.yml", anchors.len());
        for anchor in anchors {
            assert!(page.contains(&format!("id=\"{anchor}\"")), "/runbook has no id {anchor}");
        }
        assert!(page.contains("<table>"), "the alert table is rendered as a table");
        assert!(!page.contains("href=\"../"), "a link into the source tree, dead on the worker's address");
        assert!(page.contains("deploy/prometheus/alerts.yml"), "its text is kept");
    }
}
