//! Helper threads for a batch's key-store lookups.
//!
//! A key found in the store (a retry older than the hot cache's TTL) costs
//! a data block read of its own, about 4 µs, mostly the kernel copying the
//! block out of the page cache: a batch of 1,000 old retries is 4 ms of one
//! thread's time, spent waiting on nothing but the copies. RocksDB's
//! MultiGet reads one key after another on the calling thread. So a large
//! lookup is cut into parts: the caller reads the first, helper threads the
//! others, and the answers are put back together in the caller's order.
//!
//! A part a helper has not started yet when the caller finishes its own is
//! taken back and read by the caller: a caller never waits on a helper
//! busy with another partition's lookup, so with every core already busy
//! (many partitions at once) a lookup costs what it cost on one thread,
//! plus a queue push.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use crate::classify::SeenKey;
use crate::event::IdHash;

use super::error::KeystoreError;

/// Fewest ids worth a helper: below it, waking a thread (tens of
/// microseconds) costs about what the part would take to read.
const MIN_PART: usize = 128;

/// Parts a large lookup is cut into per thread (caller and helpers).
const PARTS_PER_THREAD: usize = 2;

/// Reads one part of a lookup into `out` (cleared first): the key store's
/// batched MultiGet, shared by the caller and the helpers.
pub(crate) type ReadPart = dyn Fn(i32, &[IdHash], &mut Vec<Option<SeenKey>>) -> Result<(), KeystoreError> + Send + Sync;

/// The helper threads of one key store, stopped and joined on drop.
pub(crate) struct Lookups {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

struct Shared {
    read: Box<ReadPart>,
    queue: Mutex<Queue>,
    queued: Condvar,
}

#[derive(Default)]
struct Queue {
    parts: VecDeque<Arc<Part>>,
    closing: bool,
}

/// One part of a caller's lookup, handed to whichever thread gets to it
/// first.
struct Part {
    partition: i32,
    ids: Vec<IdHash>,
    state: Mutex<PartState>,
    done: Condvar,
}

enum PartState {
    Queued,
    /// A helper is reading it; the caller waits for it.
    Reading,
    Read(Result<Vec<Option<SeenKey>>, KeystoreError>),
    /// The caller took it back (or collected its answer).
    Taken,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing under these locks is left half done by a panic: a part's
    // state is replaced whole, and the queue is only pushed and popped.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Lookups {
    /// `helpers` threads (none: every lookup stays on its caller), each
    /// reading parts with `read`.
    pub(crate) fn start(helpers: usize, read: Box<ReadPart>) -> Result<Lookups, std::io::Error> {
        let shared = Arc::new(Shared { read, queue: Mutex::new(Queue::default()), queued: Condvar::new() });
        let mut threads = Vec::with_capacity(helpers);
        for i in 0..helpers {
            let helper = Arc::clone(&shared);
            let thread = std::thread::Builder::new().name(format!("keystore-lookup-{i}")).spawn(move || help(&helper));
            match thread {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // Stop the ones already started before reporting.
                    drop(Lookups { shared, threads });
                    return Err(e);
                }
            }
        }
        Ok(Lookups { shared, threads })
    }

    /// Looks up `ids` of `partition` into `out` (cleared first), one answer
    /// per id in their order: in parts over the caller and the helpers when
    /// there are enough ids, on the caller alone otherwise.
    pub(crate) fn read(
        &self,
        partition: i32,
        ids: &[IdHash],
        out: &mut Vec<Option<SeenKey>>,
    ) -> Result<(), KeystoreError> {
        let threads = self.threads.len() + 1;
        // Two parts per thread: a helper that wakes late, or a caller whose
        // part ran slow, leaves the other fewer ids to wait for.
        let parts_wanted = (ids.len() / MIN_PART).min(PARTS_PER_THREAD * threads);
        if self.threads.is_empty() || parts_wanted < 2 {
            return (self.shared.read)(partition, ids, out);
        }
        let per_part = ids.len().div_ceil(parts_wanted);
        let (mine, rest) = ids.split_at(per_part);
        let handed: Vec<Arc<Part>> = rest
            .chunks(per_part)
            .map(|ids| {
                Arc::new(Part {
                    partition,
                    ids: ids.to_vec(),
                    state: Mutex::new(PartState::Queued),
                    done: Condvar::new(),
                })
            })
            .collect();
        lock(&self.shared.queue).parts.extend(handed.iter().cloned());
        for _ in 0..handed.len().min(self.threads.len()) {
            self.shared.queued.notify_one();
        }
        // The caller's own part first; then, from the last part back (the
        // helpers take from the front), every part no helper has started;
        // then the helpers' answers. A part a helper is still reading when
        // this lookup fails is left to it: the part owns its ids and its
        // answers, and nobody reads them.
        let mut answers: Vec<Option<Vec<Option<SeenKey>>>> = vec![None; handed.len()];
        let settled = (self.shared.read)(partition, mine, out).and_then(|()| {
            for (part, answer) in handed.iter().zip(answers.iter_mut()).rev() {
                if take_back(part) {
                    let mut read = Vec::with_capacity(part.ids.len());
                    (self.shared.read)(partition, &part.ids, &mut read)?;
                    *answer = Some(read);
                }
            }
            for (part, answer) in handed.iter().zip(answers.iter_mut()) {
                if answer.is_none() {
                    *answer = Some(wait_for(part)?);
                }
            }
            Ok(())
        });
        if let Err(e) = settled {
            for part in &handed {
                take_back(part);
            }
            return Err(e);
        }
        for read in answers.into_iter().flatten() {
            out.extend(read);
        }
        Ok(())
    }
}

/// Takes `part` back from the helpers if none has started it. It stays in
/// the queue (taking it out would search the queue under the helpers'
/// lock); the helper that pops it skips it.
fn take_back(part: &Part) -> bool {
    let mut state = lock(&part.state);
    if matches!(*state, PartState::Queued) {
        *state = PartState::Taken;
        true
    } else {
        false
    }
}

/// The answers of a `part` a helper started, once it has read them.
fn wait_for(part: &Part) -> Result<Vec<Option<SeenKey>>, KeystoreError> {
    let mut state = lock(&part.state);
    loop {
        match std::mem::replace(&mut *state, PartState::Taken) {
            PartState::Read(answers) => return answers,
            PartState::Reading => {
                *state = PartState::Reading;
                state = part.done.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
            PartState::Queued | PartState::Taken => {
                unreachable!("a part is waited for only once a helper has started it, and only once")
            }
        }
    }
}

/// A helper's loop: read queued parts until the store closes.
fn help(shared: &Shared) {
    loop {
        let part = {
            let mut queue = lock(&shared.queue);
            loop {
                if let Some(p) = queue.parts.pop_front() {
                    break p;
                }
                if queue.closing {
                    return;
                }
                queue = shared.queued.wait(queue).unwrap_or_else(PoisonError::into_inner);
            }
        };
        {
            let mut state = lock(&part.state);
            if !matches!(*state, PartState::Queued) {
                // Taken back by its caller.
                continue;
            }
            *state = PartState::Reading;
        }
        // A panic in the read is this part's error: the caller is answered
        // and the helper lives on for the next part.
        let answers = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut answers = Vec::with_capacity(part.ids.len());
            (shared.read)(part.partition, &part.ids, &mut answers).map(|()| answers)
        }))
        .unwrap_or_else(|_| {
            Err(KeystoreError::LookupHelper { detail: "the helper thread panicked while reading".to_string() })
        });
        *lock(&part.state) = PartState::Read(answers);
        part.done.notify_all();
    }
}

impl Drop for Lookups {
    fn drop(&mut self) {
        lock(&self.shared.queue).closing = true;
        self.shared.queued.notify_all();
        for t in self.threads.drain(..) {
            // A helper catches its reads' panics, so this returns Ok.
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{PayloadHash, Position};
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn id(i: u64) -> IdHash {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&i.to_be_bytes());
        IdHash(b)
    }

    /// A model store: ids with an even first byte of their counter are
    /// known, and an answer names its id, so order is checked too. Records
    /// which threads read.
    fn model(readers: Arc<Mutex<Vec<String>>>, fail_on: Option<IdHash>) -> Box<ReadPart> {
        Box::new(move |partition, ids, out| {
            out.clear();
            take_a_while(ids);
            lock(&readers).push(std::thread::current().name().unwrap_or("caller").to_string());
            for i in ids {
                if Some(*i) == fail_on {
                    return Err(KeystoreError::LookupHelper { detail: "model failure".to_string() });
                }
                let n = u64::from_be_bytes(i.0[..8].try_into().unwrap());
                out.push((n % 2 == 0).then(|| SeenKey {
                    id_hash: *i,
                    payload_hash: PayloadHash([7; 16]),
                    first_seen_ms: n as i64,
                    source: Position::new(partition, n as i64),
                    output: Position::new(partition, n as i64),
                }));
            }
            Ok(())
        })
    }

    /// A part takes as long as a real one might, so a helper woken for
    /// it gets to it before its caller is done with its own part.
    fn take_a_while(ids: &[IdHash]) {
        if ids.len() >= MIN_PART {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    fn expected(partition: i32, ids: &[IdHash]) -> Vec<Option<SeenKey>> {
        let mut out = Vec::new();
        model(Arc::default(), None)(partition, ids, &mut out).unwrap();
        out
    }

    #[test]
    fn answers_come_back_in_the_callers_order_whatever_the_parts() {
        for helpers in [0, 1, 3] {
            let lookups = Lookups::start(helpers, model(Arc::default(), None)).unwrap();
            for n in [0, 1, MIN_PART - 1, MIN_PART * 2, MIN_PART * 2 + 1, 1000, 4097] {
                let ids: Vec<IdHash> = (0..n as u64).map(|i| id(i * 7919 % 10_007)).collect();
                let mut out = vec![None; 3];
                lookups.read(5, &ids, &mut out).unwrap();
                assert_eq!(out, expected(5, &ids), "{helpers} helpers, {n} ids");
            }
        }
    }

    #[test]
    fn a_large_lookup_is_shared_with_a_helper() {
        let readers = Arc::new(Mutex::new(Vec::new()));
        let lookups = Lookups::start(1, model(readers.clone(), None)).unwrap();
        let ids: Vec<IdHash> = (0..1000).map(id).collect();
        let mut out = Vec::new();
        // The helper may lose the race for a part to the caller now and
        // then; over many lookups it reads some.
        for _ in 0..50 {
            lookups.read(0, &ids, &mut out).unwrap();
            assert_eq!(out, expected(0, &ids));
        }
        let readers = lock(&readers);
        assert!(readers.iter().any(|r| r == "keystore-lookup-0"), "the helper never read a part");
        assert!(readers.iter().any(|r| r != "keystore-lookup-0"), "the caller never read its own part");
    }

    #[test]
    fn an_error_in_any_part_is_the_lookups_error_and_the_next_lookup_works() {
        let ids: Vec<IdHash> = (0..1000).map(id).collect();
        for failing in [ids[3], ids[999]] {
            let lookups = Lookups::start(1, model(Arc::default(), Some(failing))).unwrap();
            let mut out = Vec::new();
            for _ in 0..20 {
                let e = lookups.read(0, &ids, &mut out).unwrap_err();
                assert!(e.to_string().contains("model failure"), "{e}");
            }
            let fine: Vec<IdHash> = (2000..3000).map(id).collect();
            lookups.read(0, &fine, &mut out).unwrap();
            assert_eq!(out, expected(0, &fine));
        }
    }

    #[test]
    fn a_helper_that_panics_answers_its_caller_with_an_error() {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let read: Box<ReadPart> = Box::new(move |_, ids, out| {
            counted.fetch_add(1, Ordering::SeqCst);
            take_a_while(ids);
            if std::thread::current().name() == Some("keystore-lookup-0") {
                panic!("read failed on the helper");
            }
            out.clear();
            out.resize(ids.len(), None);
            Ok(())
        });
        let lookups = Lookups::start(1, read).unwrap();
        let ids: Vec<IdHash> = (0..1000).map(id).collect();
        let mut out = Vec::new();
        // Until the helper picks a part up, the caller takes its parts back
        // and succeeds; once it does, its panic is this lookup's error.
        let mut failed = false;
        for _ in 0..500 {
            match lookups.read(0, &ids, &mut out) {
                Ok(()) => assert_eq!(out.len(), ids.len()),
                Err(e) => {
                    assert!(e.to_string().contains("panicked"), "{e}");
                    failed = true;
                    break;
                }
            }
        }
        assert!(failed, "the helper never picked a part up");
        assert!(calls.load(Ordering::SeqCst) >= 2);
    }

    #[test]
    fn dropping_the_store_stops_its_helpers() {
        let lookups = Lookups::start(3, model(Arc::default(), None)).unwrap();
        let shared = Arc::downgrade(&lookups.shared);
        drop(lookups);
        assert!(shared.upgrade().is_none(), "a helper still holds the store's reader");
    }
}
