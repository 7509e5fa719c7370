//! `dedupd verify`: read every file of a usage store and check every checksum,
//! without changing anything (a torn tail is reported, not truncated).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use super::fs::{FileSystem, RealFs};
use super::manifest::{self, Manifest};
use super::segment::{self, Segment};
use super::sidecar;
use super::wal::{self, reader};
use super::StorageError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Manifest,
    Wal,
    Segment,
    Sidecar,
}

impl FileKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FileKind::Manifest => "manifest",
            FileKind::Wal => "wal",
            FileKind::Segment => "segment",
            FileKind::Sidecar => "sidecar",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileStatus {
    /// Every checksum holds.
    Ok,
    /// The newest WAL file ends in a torn frame; open truncates it (not corruption).
    TornTail { offset: u64 },
    /// A checksum or structure check failed.
    Corrupt { error: String },
    /// Named by the current manifest but absent.
    Missing,
    /// Present but named by no readable manifest generation (a leftover that open removes).
    Unreferenced,
}

/// The verdict on one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileReport {
    pub path: PathBuf,
    pub kind: FileKind,
    pub status: FileStatus,
    /// What was checked: "1000 rows", "12 frames, 5200 events"...
    pub detail: String,
}

/// Per-file results of [`verify`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// The manifest generation open would use, if any is readable.
    pub manifest_generation: Option<u64>,
    pub files: Vec<FileReport>,
}

impl VerifyReport {
    /// True when nothing is corrupt or missing.
    pub fn is_clean(&self) -> bool {
        !self.files.iter().any(|f| matches!(f.status, FileStatus::Corrupt { .. } | FileStatus::Missing))
    }

    pub fn problems(&self) -> impl Iterator<Item = &FileReport> {
        self.files.iter().filter(|f| matches!(f.status, FileStatus::Corrupt { .. } | FileStatus::Missing))
    }
}

impl std::fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for r in &self.files {
            let status = match &r.status {
                FileStatus::Ok => "ok".to_string(),
                FileStatus::TornTail { offset } => format!("torn tail at offset {offset} (open truncates it)"),
                FileStatus::Corrupt { error } => format!("CORRUPT: {error}"),
                FileStatus::Missing => "MISSING".to_string(),
                FileStatus::Unreferenced => "unreferenced (removed on open)".to_string(),
            };
            writeln!(f, "{:<8} {} {} {}", r.kind.as_str(), r.path.display(), status, r.detail)?;
        }
        match self.manifest_generation {
            Some(g) => write!(f, "manifest generation {g}; ")?,
            None => write!(f, "no readable manifest; ")?,
        }
        let bad = self.problems().count();
        if bad == 0 {
            write!(f, "{} files, all checksums ok", self.files.len())
        } else {
            write!(f, "{} files, {bad} corrupt or missing", self.files.len())
        }
    }
}

fn file_report(path: &Path, kind: FileKind, r: Result<String, StorageError>) -> FileReport {
    match r {
        Ok(detail) => FileReport { path: path.into(), kind, status: FileStatus::Ok, detail },
        Err(e) => FileReport {
            path: path.into(),
            kind,
            status: FileStatus::Corrupt { error: e.to_string() },
            detail: String::new(),
        },
    }
}

/// Checks every file of the usage store in `dir` (`<state-dir>/usage`).
/// Errors only when a directory cannot be listed; corruption goes in the report.
pub fn verify(dir: &Path) -> Result<VerifyReport, StorageError> {
    verify_on(&RealFs, dir)
}

/// [`verify`] on any [`FileSystem`] (the simulator's disk, in tests).
pub fn verify_on(fs: &dyn FileSystem, dir: &Path) -> Result<VerifyReport, StorageError> {
    let (wal_dir, seg_dir, man_dir) = (dir.join("wal"), dir.join("segments"), dir.join("manifest"));
    let mut report = VerifyReport::default();

    let mut readable: Vec<Manifest> = Vec::new();
    for (_, path) in manifest::list(fs, &man_dir)? {
        let r =
            fs.read(&path).map_err(|e| StorageError::io(&path, e)).and_then(|bytes| Manifest::decode(&path, &bytes));
        let r = r.map(|m| {
            let detail =
                format!("generation {}, {} segments, wal_start {}", m.generation, m.segments.len(), m.wal_start);
            readable.push(m);
            detail
        });
        report.files.push(file_report(&path, FileKind::Manifest, r));
    }
    let current = readable.first();
    report.manifest_generation = current.map(|m| m.generation);
    let referenced: HashSet<u64> = readable.iter().take(2).flat_map(|m| m.segments.iter().map(|s| s.id)).collect();

    let wal_files = wal::list(fs, &wal_dir)?;
    // As open replays them: every file from the manifest's `wal_start` to
    // the newest, none missing (a missing one held accepted events that
    // nothing else of the usage store has).
    if let Some(m) = current {
        let newest = wal_files.last().map_or(m.wal_start, |(seq, _)| (*seq).max(m.wal_start));
        let present: HashSet<u64> = wal_files.iter().map(|(seq, _)| *seq).collect();
        // Beside a running worker a flush may have moved `wal_start` and
        // removed the files below it since the manifest was read: the
        // manifest as it is now says where live files start.
        let wal_start_now = || -> u64 {
            manifest::load(fs, &man_dir)
                .ok()
                .flatten()
                .map_or(m.wal_start, |now| now.current.wal_start.max(m.wal_start))
        };
        let mut missing: Vec<u64> = (m.wal_start..=newest).filter(|seq| !present.contains(seq)).collect();
        if !missing.is_empty() {
            let start = wal_start_now();
            missing.retain(|seq| *seq >= start);
        }
        for seq in missing {
            report.files.push(FileReport {
                path: wal::wal_path(&wal_dir, seq),
                kind: FileKind::Wal,
                status: FileStatus::Missing,
                detail: format!("live WAL files run from {} (manifest generation {})", m.wal_start, m.generation),
            });
        }
    }
    let mut before: Option<(u64, &Path, u64)> = None;
    for (i, (seq, path)) in wal_files.iter().enumerate() {
        let is_last = i + 1 == wal_files.len();
        let mut events = 0usize;
        match reader::scan_file(fs, path, is_last, |e| {
            events += e.len();
            Ok(())
        }) {
            Ok(scan) => {
                // The file before lost frames if it no longer ends where
                // this one's link recorded.
                if let Some((previous_seq, previous_path, scanned_len)) = before {
                    // The file before may have been the active one, written
                    // on by a running worker after it was read and before
                    // it was sealed: read it again before calling it short.
                    let checked =
                        reader::check_link((previous_seq, previous_path, scanned_len), scan.link).or_else(|e| {
                            match reader::scan_file(fs, previous_path, false, |_| Ok(())) {
                                Ok(again) => {
                                    reader::check_link((previous_seq, previous_path, again.valid_len), scan.link)
                                }
                                Err(_) => Err(e),
                            }
                        });
                    if let Err(e) = checked {
                        if let Some(r) = report.files.iter_mut().rev().find(|r| r.path == previous_path) {
                            r.status = FileStatus::Corrupt { error: e.to_string() };
                        }
                    }
                }
                before = Some((*seq, path.as_path(), scan.valid_len));
                let detail = format!("{} frames, {events} events", scan.frames);
                let status = match (reader::check_own_link(*seq, path, scan.link), scan.torn) {
                    (Err(e), _) => FileStatus::Corrupt { error: e.to_string() },
                    (Ok(()), Some(_)) => FileStatus::TornTail { offset: scan.valid_len },
                    (Ok(()), None) => FileStatus::Ok,
                };
                report.files.push(FileReport { path: path.clone(), kind: FileKind::Wal, status, detail });
            }
            Err(e) => {
                before = None;
                report.files.push(file_report(path, FileKind::Wal, Err(e)));
            }
        }
    }

    let mut seen_segments: HashSet<u64> = HashSet::new();
    let mut entries: Vec<PathBuf> = Vec::new();
    if fs.is_dir(&seg_dir) {
        entries = fs.list_dir(&seg_dir).map_err(|e| StorageError::io(&seg_dir, e))?;
    }
    entries.sort();
    for path in entries {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if let Some(id) = name.strip_suffix(".seg").and_then(|s| s.parse::<u64>().ok()) {
            seen_segments.insert(id);
            let named = current.and_then(|m| m.segments.iter().find(|s| s.id == id));
            let r = Segment::open(fs, &path).and_then(|s| {
                let rows = s.read_all()?;
                // A file whose checksums hold can still be another segment
                // (copied in from another state directory under this name):
                // its rows must be what the manifest recorded of it.
                if let Some(meta) = named {
                    let min = rows.iter().map(|e| e.key.first_seen_ms).min();
                    let max = rows.iter().map(|e| e.key.first_seen_ms).max();
                    let recorded = (meta.rows, Some(meta.min_first_seen_ms), Some(meta.max_first_seen_ms));
                    if (rows.len() as u64, min, max) != recorded && meta.rows > 0 {
                        return Err(StorageError::Corrupt {
                            file: path.clone(),
                            offset: 0,
                            detail: format!(
                                "{} rows first seen {min:?}..{max:?}, the manifest recorded {} rows first seen {}..{}: \
                                 not the segment the manifest names",
                                rows.len(),
                                meta.rows,
                                meta.min_first_seen_ms,
                                meta.max_first_seen_ms
                            ),
                        });
                    }
                }
                Ok(format!("{} rows, {} bytes", rows.len(), s.len_bytes()))
            });
            let mut fr = file_report(&path, FileKind::Segment, r);
            if fr.status == FileStatus::Ok && !referenced.contains(&id) {
                fr.status = FileStatus::Unreferenced;
            }
            report.files.push(fr);
        } else if let Some(id) = name.strip_suffix(".idx").and_then(|s| s.parse::<u64>().ok()) {
            let r = sidecar::read(fs, &path, id).map(|e| format!("{} entries", e.len()));
            let mut fr = file_report(&path, FileKind::Sidecar, r);
            if fr.status == FileStatus::Ok && !referenced.contains(&id) {
                fr.status = FileStatus::Unreferenced;
            }
            report.files.push(fr);
        }
    }
    // Data with no manifest to name it: open refuses the store.
    if current.is_none() && (!seen_segments.is_empty() || wal_files.iter().any(|(_, p)| reader::holds_events(fs, p))) {
        report.files.push(FileReport {
            path: man_dir.clone(),
            kind: FileKind::Manifest,
            status: FileStatus::Missing,
            detail: format!(
                "no readable manifest, but {} segment(s) and WAL data are here: open refuses the usage store",
                seen_segments.len()
            ),
        });
    }
    if let Some(m) = current {
        for s in &m.segments {
            if !seen_segments.contains(&s.id) {
                report.files.push(FileReport {
                    path: segment::segment_path(&seg_dir, s.id),
                    kind: FileKind::Segment,
                    status: FileStatus::Missing,
                    detail: format!("named by manifest generation {}", m.generation),
                });
            }
        }
    }
    Ok(report)
}

/// The last output offset the usage store in `dir` (`<state-dir>/usage`)
/// holds for each partition, as its next open would find it: the
/// manifest's checkpoints, raised by the events of the live WAL files (a
/// torn tail read up to where it tears). Read-only and without the lock,
/// like [`verify`]: beside a running process the answer is a moment's.
/// An empty map when there is no store; a WAL file that does not read is
/// its error.
pub fn stored_checkpoints(dir: &Path) -> Result<std::collections::BTreeMap<i32, i64>, StorageError> {
    let fs = &RealFs;
    let Some(loaded) = manifest::load(fs, &dir.join("manifest"))? else {
        return Ok(Default::default());
    };
    let mut checkpoints = loaded.current.checkpoints;
    let live: Vec<(u64, std::path::PathBuf)> =
        wal::list(fs, &dir.join("wal"))?.into_iter().filter(|(seq, _)| *seq >= loaded.current.wal_start).collect();
    for (i, (_, path)) in live.iter().enumerate() {
        reader::scan_file(fs, path, i + 1 == live.len(), |events| {
            for e in events {
                let cp = checkpoints.entry(e.key.output.partition).or_insert(e.key.output.offset);
                *cp = (*cp).max(e.key.output.offset);
            }
            Ok(())
        })?;
    }
    Ok(checkpoints)
}
