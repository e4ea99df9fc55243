//! What a job knows of its own writes to the store: the ETag its checkpoints are fenced on, the
//! writes of unknown outcome since the last confirmed one (any of them may be the one in place), the
//! calls counted since that one, and whether its open marker exists. The job adds the calls it counts
//! and clears what a written checkpoint confirms ([`super::Job::saved`]); a write whose answer was
//! lost and the open marker written are reported here (by the driver, or the core's finish).

use fleet_domain::requests::RequestCounts;

use crate::resident::Carry;

/// How many checkpoint writes of unknown outcome a job remembers (each failed one may have landed,
/// and at most one did: they are all fenced on the job's last confirmed ETag, so it may be the
/// first). Digests, 32 bytes each: enough for minutes of failed tries at a finish's pace. (It was
/// the last 4 bodies until seed 168173223: a finish whose first ending write landed unanswered,
/// then four more tries without an answer, took its own first write for another controller's.)
const MAX_UNCONFIRMED: usize = 1024;

#[derive(Debug, Default)]
pub struct Writes {
    /// ETag of the checkpoint as last read or written (`None`: there is none yet where this release
    /// writes it, a new job's or one read where an earlier release kept it): checkpoints are written
    /// only if it still matches (fencing), or only where none is.
    etag: Option<String>,
    /// The digests of its checkpoint writes since the last confirmed one whose outcome is unknown (no
    /// answer, or an answer lost and not read back): one may have landed, and a later write fenced
    /// by `etag` then finds it in place (see `fleet_io::blob::put_if_owned_after`).
    unconfirmed: Vec<[u8; 32]>,
    /// The calls counted for the job since its last checkpoint (in its checkpoint's requests too):
    /// lost with the job when it is dropped from memory unless the driver carries them to its next
    /// load.
    uncommitted: RequestCounts,
    /// Beside each of `unconfirmed`, the calls since the last checkpoint its document held, and the
    /// calls it attributed to what it covered.
    unconfirmed_calls: Vec<(RequestCounts, RequestCounts)>,
    /// Its `open/{job}` marker is known to exist.
    marked_open: bool,
}

impl Writes {
    /// A job's writes when its checkpoint was last read with `etag` (none: a new job's, whose open
    /// marker is not written yet).
    pub(super) fn new(etag: Option<String>, marked_open: bool) -> Writes {
        Writes { etag, marked_open, ..Writes::default() }
    }

    /// The ETag its next checkpoint is fenced on.
    pub(super) fn etag(&self) -> Option<String> {
        self.etag.clone()
    }

    /// Calls made for the job since its last checkpoint.
    pub(super) fn counted(&mut self, calls: &RequestCounts) {
        self.uncommitted.merge(calls);
    }

    /// A checkpoint was written, its ETag `etag`: nothing is unconfirmed or uncommitted any more.
    pub(super) fn confirmed(&mut self, etag: String) {
        self.unconfirmed.clear();
        self.unconfirmed_calls.clear();
        self.uncommitted = RequestCounts::default();
        self.etag = Some(etag);
    }

    /// The calls counted since its last checkpoint.
    pub fn uncommitted(&self) -> &RequestCounts {
        &self.uncommitted
    }

    /// What the job carries when it is dropped from memory: its calls since its last checkpoint, and
    /// those each write of unknown outcome since held (see `crate::resident::Carry`).
    pub fn carry(&self) -> Carry {
        let in_writes = self.unconfirmed.iter().zip(&self.unconfirmed_calls).map(|(d, (held, attributed))| (*d, held.clone(), attributed.clone())).collect();
        Carry { calls: self.uncommitted.clone(), in_writes }
    }

    /// The digests of its checkpoint writes since the last one confirmed whose outcome is unknown
    /// (up to `MAX_UNCONFIRMED`, the latest).
    pub fn unconfirmed(&self) -> &[[u8; 32]] {
        &self.unconfirmed
    }

    /// A checkpoint write failed without saying whether it landed (any such write since the last
    /// confirmed one may be the one in place): `digest`, its body's SHA-256; `attributed`, what its
    /// plan attributed to what it covered.
    pub fn write_unconfirmed(&mut self, digest: [u8; 32], attributed: &RequestCounts) {
        if self.unconfirmed.len() >= MAX_UNCONFIRMED {
            self.unconfirmed.remove(0);
            self.unconfirmed_calls.remove(0);
        }
        self.unconfirmed.push(digest);
        // Nothing is counted between a plan and its write: the document held these.
        self.unconfirmed_calls.push((self.uncommitted.clone(), attributed.clone()));
    }

    /// Whether its open marker must be written before its checkpoint.
    pub fn needs_marker(&self) -> bool {
        !self.marked_open
    }

    /// Its open marker was written.
    pub fn marked(&mut self) {
        self.marked_open = true;
    }
}
