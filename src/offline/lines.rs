//! Reading NDJSON with bounded memory: a line longer than the limit is not
//! buffered whole; its first `limit + 1` bytes are kept (enough to say it is
//! too large and to show its start) and the rest is skipped.

use std::io::{self, BufRead};

/// One line as read.
#[derive(Debug, Default)]
pub struct Line {
    /// The line's bytes without the newline; at most `limit + 1` bytes.
    pub bytes: Vec<u8>,
    /// The line's full length in bytes, newline excluded.
    pub len: u64,
    /// Whether the line's last byte (before the newline) is a CR, kept or
    /// not: a CRLF line end.
    pub ends_in_cr: bool,
}

impl Line {
    pub fn truncated(&self) -> bool {
        self.len > self.bytes.len() as u64
    }
}

/// Reads the next line into `line`. Returns false at end of input. A final
/// line without a newline is still a line.
pub fn read_bounded_line<R: BufRead>(r: &mut R, limit: usize, line: &mut Line) -> io::Result<bool> {
    line.bytes.clear();
    line.len = 0;
    line.ends_in_cr = false;
    let keep = limit.saturating_add(1);
    let mut saw_any = false;
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(saw_any);
        }
        saw_any = true;
        let (chunk, done) = match memchr::memchr(b'\n', buf) {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        let room = keep.saturating_sub(line.bytes.len());
        line.bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
        line.len += chunk.len() as u64;
        if let Some(&last) = chunk.last() {
            line.ends_in_cr = last == b'\r';
        }
        let consumed = done.unwrap_or(buf.len());
        r.consume(consumed);
        if done.is_some() {
            return Ok(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], limit: usize) -> Vec<(Vec<u8>, u64)> {
        let mut r = io::BufReader::with_capacity(7, input);
        let mut l = Line::default();
        let mut out = Vec::new();
        while read_bounded_line(&mut r, limit, &mut l).expect("in-memory read") {
            out.push((l.bytes.clone(), l.len));
        }
        out
    }

    #[test]
    fn splits_on_newlines_and_keeps_a_final_unterminated_line() {
        assert_eq!(
            lines(b"a\n\nbc\nd", 100),
            vec![(b"a".to_vec(), 1), (b"".to_vec(), 0), (b"bc".to_vec(), 2), (b"d".to_vec(), 1)]
        );
        assert!(lines(b"", 100).is_empty());
        assert_eq!(lines(b"x\n", 100).len(), 1);
    }

    #[test]
    fn long_lines_keep_only_limit_plus_one_bytes() {
        let mut input = vec![b'z'; 10_000];
        input.extend_from_slice(b"\nok\n");
        let got = lines(&input, 16);
        assert_eq!(got[0].0.len(), 17);
        assert_eq!(got[0].1, 10_000);
        assert_eq!(got[1], (b"ok".to_vec(), 2));
    }

    #[test]
    fn a_cr_ending_a_line_is_seen_even_past_the_bytes_kept() {
        let mut input = vec![b'z'; 100];
        input.extend_from_slice(b"\r\nok\r\n\r\nno\n");
        let mut r = io::BufReader::with_capacity(7, &input[..]);
        let mut l = Line::default();
        let mut ends = Vec::new();
        while read_bounded_line(&mut r, 16, &mut l).expect("in-memory read") {
            ends.push((l.len, l.ends_in_cr));
        }
        assert_eq!(ends, [(101, true), (3, true), (1, true), (2, false)]);
    }
}
