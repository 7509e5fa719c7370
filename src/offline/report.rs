//! The `--rejected` and `--conflicts` report files: one JSON object per line.
//!
//! ```text
//! rejected:  {"line":N,"reason":"<code>","detail":"...","raw":"<original line>"}
//! conflicts: {"line":N,"reason":"conflict","tenant_id":..,"event_id":..,"id_hash":..,
//!             "payload_hash":..,"first_payload_hash":..,"first_seen_ms":..,
//!             "first_line":N,"first_output_offset":N|null,"tier":"batch|hot_cache|keystore",
//!             "differs":["quantity",..]|null,"raw":"<original line>"}
//! ```
//!
//! `raw` is the line as sent when it is UTF-8; otherwise `raw_base64` holds
//! its bytes. A line over the record limit was read only in part (memory stays
//! bounded): `raw_truncated` is then true and `raw_bytes` gives its full length.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use base64::Engine as _;

use super::lines::Line;
use super::OfflineError;
use crate::classify::{FirstSeen, Tier};
use crate::event::{push_json_str, IdHash, PayloadHash, Rejection, UsageEvent};

pub(super) struct ReportWriter {
    path: PathBuf,
    out: BufWriter<File>,
    /// Whether the report is a regular file, synced at the end of the run;
    /// a pipe or a device (`/dev/null`) cannot be, and fsync of one fails.
    durable: bool,
    buf: String,
}

pub(super) fn open(path: Option<&Path>) -> Result<Option<ReportWriter>, OfflineError> {
    let Some(path) = path else { return Ok(None) };
    let f = File::create(path).map_err(|source| OfflineError::Io {
        what: "cannot create report",
        path: path.display().to_string(),
        source,
    })?;
    let durable = super::is_regular_file(&f).map_err(|source| OfflineError::Io {
        what: "cannot create report",
        path: path.display().to_string(),
        source,
    })?;
    Ok(Some(ReportWriter { path: path.to_owned(), out: BufWriter::new(f), durable, buf: String::with_capacity(1024) }))
}

pub(super) fn end_batch(w: Option<&mut ReportWriter>) -> Result<(), OfflineError> {
    match w {
        Some(w) => w.out.flush().map_err(|e| w.err(e)),
        None => Ok(()),
    }
}

pub(super) fn finish(w: Option<&mut ReportWriter>) -> Result<(), OfflineError> {
    match w {
        Some(w) => {
            w.out.flush().map_err(|e| w.err(e))?;
            if w.durable {
                w.out.get_ref().sync_all().map_err(|e| w.err(e))?;
            }
            Ok(())
        }
        None => Ok(()),
    }
}

fn push_raw(buf: &mut String, line: &Line) {
    match std::str::from_utf8(&line.bytes) {
        Ok(s) if !line.truncated() => {
            buf.push_str(",\"raw\":");
            push_json_str(buf, s);
        }
        _ => {
            // Not UTF-8, or cut short (possibly mid-character): bytes, exactly.
            buf.push_str(",\"raw_base64\":\"");
            buf.push_str(&base64::engine::general_purpose::STANDARD.encode(&line.bytes));
            buf.push('"');
        }
    }
    if line.truncated() {
        buf.push_str(&format!(",\"raw_truncated\":true,\"raw_bytes\":{}", line.len));
    }
}

impl ReportWriter {
    fn err(&self, source: io::Error) -> OfflineError {
        OfflineError::Io { what: "cannot write report", path: self.path.display().to_string(), source }
    }

    fn emit(&mut self) -> Result<(), OfflineError> {
        self.buf.push_str("}\n");
        let r = self.out.write_all(self.buf.as_bytes());
        r.map_err(|e| self.err(e))
    }

    pub(super) fn rejected(&mut self, line_no: u64, r: &Rejection, line: &Line) -> Result<(), OfflineError> {
        self.buf.clear();
        self.buf.push_str(&format!("{{\"line\":{line_no},\"reason\":\"{}\",\"detail\":", r.reason.as_str()));
        push_json_str(&mut self.buf, &r.detail);
        push_raw(&mut self.buf, line);
        self.emit()
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn conflict(
        &mut self,
        line_no: u64,
        event: &UsageEvent,
        id: &IdHash,
        payload: &PayloadHash,
        tier: Tier,
        first: &FirstSeen,
        differs: Option<&[&str]>,
        line: &Line,
    ) -> Result<(), OfflineError> {
        let b = &mut self.buf;
        b.clear();
        b.push_str(&format!("{{\"line\":{line_no},\"reason\":\"conflict\",\"tenant_id\":"));
        push_json_str(b, &event.tenant_id);
        b.push_str(",\"event_id\":");
        push_json_str(b, &event.event_id);
        b.push_str(&format!(
            ",\"id_hash\":\"{id}\",\"payload_hash\":\"{payload}\",\"first_payload_hash\":\"{}\",\"first_seen_ms\":{},\"first_line\":{},\"first_output_offset\":{},\"tier\":\"{}\",\"differs\":",
            first.payload_hash,
            first.first_seen_ms,
            first.source.offset + 1,
            first.output.map_or("null".to_owned(), |p| p.offset.to_string()),
            tier.as_str(),
        ));
        match differs {
            None => b.push_str("null"),
            Some(fields) => {
                b.push('[');
                for (i, f) in fields.iter().enumerate() {
                    if i > 0 {
                        b.push(',');
                    }
                    push_json_str(b, f);
                }
                b.push(']');
            }
        }
        push_raw(b, line);
        self.emit()
    }
}
