//! Job leases and fencing (seed 003's partition leases, one per job): several controllers may read one
//! results queue, and each job has one owner at a time. The lease (`leases/{job}.json`: owner, expiry,
//! epoch) is taken and renewed with conditional S3 writes (If-None-Match / If-Match on its ETag), so
//! two controllers never both believe they hold it; a dead owner's lease expires and the next
//! controller that receives a message of the job takes it over. Checkpoints are fenced the same way
//! (`aggregate`): written If-Match the ETag the owner last read or wrote, so an owner that lost its
//! lease (paused, partitioned) cannot overwrite what the new owner wrote.
//!
//! Expiry is judged on the reader's clock alone (`sighting`): another controller's lease is free once
//! this controller has seen it unchanged (the same ETag) for a whole lease. The expiry time in the
//! document is the writer's wall clock; it only paces hand-backs, never decides a take.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fleet_domain::layout::lease_key;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::error::Result;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::clock::Clock;
use crate::sighting::Sightings;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct LeaseDoc {
    owner: String,
    /// Unix time, ms, on the writer's clock, when the lease runs out; 0: given back. Read by
    /// another controller as a hint only (see the module header).
    expires_ms: u64,
    /// Grows with every change of owner.
    epoch: u64,
    /// The writer's lease, ms: a reader judges the lease by it when it is longer than its own
    /// (`sighting::lease_to_judge`). Absent in what older releases wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lease_ms: Option<u64>,
}

/// A lease this controller holds: one shared handle per job, renewed by the controller's timer
/// whether or not the job is busy (a finish longer than the lease keeps its lease), and by the job's
/// own steps; renewals of one lease never overlap (its lock is held across the conditional write).
#[derive(Debug, Clone)]
pub struct Lease(Arc<tokio::sync::Mutex<LeaseState>>);

#[derive(Debug)]
struct LeaseState {
    etag: String,
    epoch: u64,
    /// When it was last written (taken or renewed).
    written: Instant,
    /// Another controller wrote it since, or this one gave it back: the job is no longer this
    /// controller's.
    lost: bool,
    /// Given back by this controller (`release`).
    released: bool,
}

/// A handle that does not keep a lease alive (the timer's list of leases to renew): a job dropped
/// from memory takes its lease with it.
#[derive(Debug, Clone)]
pub struct WeakLease(std::sync::Weak<tokio::sync::Mutex<LeaseState>>);

impl WeakLease {
    pub fn upgrade(&self) -> Option<Lease> {
        self.0.upgrade().map(Lease)
    }

    /// Whether it is a handle of `lease` (not of an older or newer lease of the same job).
    pub fn is(&self, lease: &Lease) -> bool {
        std::ptr::eq(self.0.as_ptr(), Arc::as_ptr(&lease.0))
    }
}

impl Lease {
    fn new(etag: String, epoch: u64, written: Instant) -> Lease {
        Lease(Arc::new(tokio::sync::Mutex::new(LeaseState { etag, epoch, written, lost: false, released: false })))
    }

    pub fn downgrade(&self) -> WeakLease {
        WeakLease(Arc::downgrade(&self.0))
    }

    /// Its epoch (grows with every change of owner).
    pub async fn epoch(&self) -> u64 {
        self.0.lock().await.epoch
    }
}

/// The answer to a request for a job's lease.
#[derive(Debug)]
pub enum Acquired {
    Ours(Lease),
    /// Another controller holds it.
    Busy {
        owner: String,
        /// How long, on this controller's clock, until it may take the lease if nothing changes.
        expires_in: Duration,
        /// Its owner looks alive: it renewed within half a lease as far as this controller saw (on a
        /// first sight, the document's own expiry says so).
        live: bool,
    },
}

/// Takes, renews and gives back job leases for one controller.
pub struct Leases {
    store: Arc<dyn BlobStore>,
    owner: String,
    ttl: Duration,
    clock: Clock,
    /// Other controllers' leases as this controller saw them (by ETag), to age them on its own clock.
    seen: std::sync::Mutex<Sightings<String, String>>,
}

impl Leases {
    pub fn new(store: Arc<dyn BlobStore>, owner: String, ttl: Duration, clock: Clock) -> Leases {
        // Kept as long as the longest lease a peer may declare, so that a value looked at once per
        // such lease keeps its age.
        Leases { store, owner, ttl, clock, seen: std::sync::Mutex::new(Sightings::new((ttl * 3).max(crate::sighting::MAX_DECLARED_LEASE * 2))) }
    }

    /// This controller's name in leases.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// How long a lease runs from its last renewal.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    async fn write(&self, job: &str, doc: &LeaseDoc, cond: Cond) -> Result<Option<String>> {
        let body = Bytes::from(serde_json::to_vec(doc)?);
        if crate::undo::is(crate::undo::Fix::LostAnswerReadBack) {
            return self.store.put_if(&lease_key(job), body, "application/json", &BTreeMap::new(), &cond).await;
        }
        fleet_io::blob::put_if_owned(self.store.as_ref(), &lease_key(job), body, "application/json", &BTreeMap::new(), &cond).await
    }

    /// This controller's lease, as it declares it in what it writes.
    fn declared(&self) -> Option<u64> {
        Some(self.ttl.as_millis() as u64)
    }

    /// Takes the job's lease if it is free, expired or already ours.
    pub async fn acquire(&self, job: &str) -> Result<Acquired> {
        let (cond, epoch) = match self.store.get_tagged(&lease_key(job)).await? {
            None => (Cond::Absent, 1),
            Some((body, etag)) => match serde_json::from_slice::<LeaseDoc>(&body) {
                Ok(doc) if doc.owner != self.owner && doc.expires_ms > 0 => {
                    let hint = Duration::from_millis(doc.expires_ms.saturating_sub(self.clock.now_ms()));
                    // Its writer's lease when that is longer than ours.
                    let ttl = crate::sighting::lease_to_judge(self.ttl, doc.lease_ms);
                    if crate::undo::is(crate::undo::Fix::OneClock) {
                        if !hint.is_zero() {
                            return Ok(Acquired::Busy { owner: doc.owner, expires_in: hint, live: hint >= ttl / 2 });
                        }
                    } else {
                        let age = self.seen.lock().expect("sightings").age(&job.to_string(), etag.clone(), Instant::now().into_std());
                        if age < ttl {
                            let live = if age.is_zero() { hint >= ttl / 2 } else { age < ttl / 2 };
                            return Ok(Acquired::Busy { owner: doc.owner, expires_in: ttl - age, live });
                        }
                    }
                    (Cond::Matches(etag), doc.epoch + 1)
                }
                Ok(doc) => (Cond::Matches(etag), doc.epoch + u64::from(doc.owner != self.owner)),
                // Unreadable: nobody can hold it.
                Err(_) => (Cond::Matches(etag), 1),
            },
        };
        let doc = LeaseDoc { owner: self.owner.clone(), expires_ms: self.clock.now_ms() + self.ttl.as_millis() as u64, epoch, lease_ms: self.declared() };
        let written = Instant::now();
        self.seen.lock().expect("sightings").forget(&job.to_string());
        Ok(match self.write(job, &doc, cond).await? {
            Some(etag) => {
                tracing::debug!(job, epoch, owner = %self.owner, "lease taken");
                Acquired::Ours(Lease::new(etag, epoch, written))
            }
            // Another controller wrote it between our read and write.
            None => Acquired::Busy { owner: "(another controller, just now)".into(), expires_in: self.ttl, live: true },
        })
    }

    /// How long to hand a message of a job another controller holds back to the queue. A live
    /// owner renews its lease every third of its time, so more than half of it is always left: the
    /// message comes back at once (`soon`) for the owner to receive. Less left means the owner
    /// missed renewals (stopped, cut off): the message comes back when the lease has run out and
    /// the job can be taken over, not every `soon` meanwhile (each receive spends one of its
    /// maxReceiveCount, and an owner stopped for a few leases would push its job's results into
    /// the dead-letter queue).
    pub fn hand_back_after(&self, live: bool, expires_in: Duration, soon: Duration) -> Duration {
        if live {
            soon
        } else {
            (expires_in + Duration::from_millis(250)).max(soon)
        }
    }

    /// Whether a lease of ours is young enough to act on (a third of its life is kept as margin for
    /// clock skew and slow calls), and not lost.
    pub async fn fresh(&self, lease: &Lease) -> bool {
        let s = lease.0.lock().await;
        !s.lost && s.written.elapsed() < self.ttl * 2 / 3
    }

    /// Whether this controller gave it back (a renewal then fails with nobody else involved).
    pub async fn given_back(&self, lease: &Lease) -> bool {
        lease.0.lock().await.released
    }

    /// Whether it is time to renew (a third of its life has passed).
    pub async fn due(&self, lease: &Lease) -> bool {
        let s = lease.0.lock().await;
        !s.lost && s.written.elapsed() >= self.ttl / 3
    }

    /// Extends a lease of ours; `false` when it was lost (someone else wrote it), now or before.
    pub async fn renew(&self, job: &str, lease: &Lease) -> Result<bool> {
        let mut s = lease.0.lock().await;
        if s.lost {
            return Ok(false);
        }
        let doc =
            LeaseDoc { owner: self.owner.clone(), expires_ms: self.clock.now_ms() + self.ttl.as_millis() as u64, epoch: s.epoch, lease_ms: self.declared() };
        let written = Instant::now();
        if let Some(etag) = self.write(job, &doc, Cond::Matches(s.etag.clone())).await? {
            (s.etag, s.written) = (etag, written);
            return Ok(true);
        }
        // The ETag moved. A renewal of ours whose outcome was never learned (its answer lost, and
        // the read-back failed too) moves it as well: the lease still names this controller at its
        // epoch, and is renewed from what it holds now (found by the simulation: such a lease was
        // taken for lost to another controller, and the job dropped).
        if !crate::undo::is(crate::undo::Fix::LostAnswerReadBack) {
            if let Some((body, etag)) = self.store.get_tagged(&lease_key(job)).await? {
                let ours = serde_json::from_slice::<LeaseDoc>(&body).is_ok_and(|d| d.owner == self.owner && d.epoch == s.epoch);
                if ours {
                    if let Some(etag) = self.write(job, &doc, Cond::Matches(etag)).await? {
                        (s.etag, s.written) = (etag, written);
                        return Ok(true);
                    }
                }
            }
        }
        s.lost = true;
        Ok(false)
    }

    /// Gives a lease back (expired at once), so another controller can take the job without waiting.
    pub async fn release(&self, job: &str, lease: &Lease) -> Result<()> {
        let mut s = lease.0.lock().await;
        if s.lost {
            return Ok(());
        }
        let doc = LeaseDoc { owner: self.owner.clone(), expires_ms: 0, epoch: s.epoch, lease_ms: self.declared() };
        let out = self.write(job, &doc, Cond::Matches(s.etag.clone())).await.map(drop);
        s.lost = true;
        s.released = true;
        out
    }
}

#[cfg(test)]
mod tests {
    use fleet_io::memory::MemoryStore;

    use super::*;

    /// A live owner (more than half its lease left) gets its job's messages back at once; one that
    /// missed renewals gets them when its lease has run out, so a stopped owner does not make the
    /// others spend a receive of each message every second.
    #[test]
    fn messages_of_a_late_owner_come_back_when_its_lease_runs_out() {
        let l = Leases::new(MemoryStore::new(), "b".into(), Duration::from_secs(30), Clock::System);
        let soon = Duration::from_secs(1);
        assert_eq!(l.hand_back_after(true, Duration::from_secs(25), soon), soon);
        assert_eq!(l.hand_back_after(true, Duration::from_secs(15), soon), soon);
        assert_eq!(l.hand_back_after(false, Duration::from_secs(9), soon), Duration::from_millis(9_250));
        assert_eq!(l.hand_back_after(false, Duration::from_millis(100), soon), soon, "never sooner than at once");
    }

    /// Expiry on one clock: however far the owner's wall clock is from the reader's (ten leases
    /// either way), the reader takes the lease only once it has seen it unchanged for a whole lease
    /// of its own time; while the owner renews it is never taken, and after its last renewal it is
    /// taken one lease after the reader's first sight of that renewal.
    #[tokio::test(start_paused = true)]
    async fn a_skewed_owner_keeps_its_lease_while_it_renews_and_loses_it_a_lease_after_it_stops() {
        let ttl = Duration::from_secs(30);
        for skew in [-300_000i64, -10_000, 10_000, 300_000] {
            let store = MemoryStore::new();
            let wall = 1_800_000_000_000u64;
            let a = Leases::new(store.clone(), "a".into(), ttl, Clock::driven(wall.saturating_add_signed(skew)));
            let b = Leases::new(store.clone(), "b".into(), ttl, Clock::driven(wall));
            let Acquired::Ours(ha) = a.acquire("j").await.unwrap() else { panic!("free lease") };
            for _ in 0..9 {
                tokio::time::sleep(Duration::from_secs(5)).await;
                assert!(matches!(b.acquire("j").await.unwrap(), Acquired::Busy { .. }), "skew {skew}: taken while a renews");
                if a.due(&ha).await {
                    assert!(a.renew("j", &ha).await.unwrap());
                }
                assert!(a.fresh(&ha).await);
            }
            // a stops renewing; b saw its last renewal at most 5 s after it was written.
            let stopped = Instant::now();
            let taken = loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if let Acquired::Ours(_) = b.acquire("j").await.unwrap() {
                    assert!(!a.fresh(&ha).await, "skew {skew}: taken while a may still act on it");
                    break stopped.elapsed();
                }
            };
            assert!(taken <= ttl + Duration::from_secs(2), "skew {skew}: taken {taken:?} after a stopped");
            assert!(!a.renew("j", &ha).await.unwrap(), "skew {skew}: a lost it");
        }
    }

    /// A misconfigured peer: b runs with a 10 s lease, a with 30 s (renewed every 10 s). b judges a's
    /// lease by the 30 s a declares, so it never takes it while a renews, and takes it one of a's
    /// leases after a stops.
    #[tokio::test(start_paused = true)]
    async fn a_peer_with_a_shorter_lease_judges_by_the_owners_declared_lease() {
        let store = MemoryStore::new();
        let a = Leases::new(store.clone(), "a".into(), Duration::from_secs(30), Clock::driven(1_800_000_000_000));
        let b = Leases::new(store.clone(), "b".into(), Duration::from_secs(10), Clock::driven(1_800_000_000_000));
        let Acquired::Ours(ha) = a.acquire("j").await.unwrap() else { panic!("free lease") };
        for _ in 0..18 {
            tokio::time::sleep(Duration::from_secs(5)).await;
            assert!(matches!(b.acquire("j").await.unwrap(), Acquired::Busy { .. }), "taken by the peer with the shorter lease while a renews");
            if a.due(&ha).await {
                assert!(a.renew("j", &ha).await.unwrap());
            }
        }
        let stopped = Instant::now();
        let taken = loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if let Acquired::Ours(_) = b.acquire("j").await.unwrap() {
                assert!(!a.fresh(&ha).await, "taken while a may still act on it");
                break stopped.elapsed();
            }
        };
        assert!(taken >= Duration::from_secs(20) && taken <= Duration::from_secs(32), "taken {taken:?} after a stopped");
    }

    #[tokio::test]
    async fn one_owner_at_a_time_and_takeover_after_expiry() {
        let store = MemoryStore::new();
        let a = Leases::new(store.clone(), "a".into(), Duration::from_millis(200), Clock::System);
        let b = Leases::new(store.clone(), "b".into(), Duration::from_millis(200), Clock::System);
        let Acquired::Ours(ha) = a.acquire("j").await.unwrap() else { panic!("free lease") };
        assert!(matches!(b.acquire("j").await.unwrap(), Acquired::Busy { owner, .. } if owner == "a"));
        assert!(a.renew("j", &ha).await.unwrap());
        assert!(matches!(a.acquire("j").await.unwrap(), Acquired::Ours(_)), "ours: taken again");
        tokio::time::sleep(Duration::from_millis(250)).await;
        // b judges on its own clock: the renewed lease is new to it, so it waits a lease from now.
        assert!(matches!(b.acquire("j").await.unwrap(), Acquired::Busy { owner, .. } if owner == "a"), "first sight of the renewal");
        tokio::time::sleep(Duration::from_millis(250)).await;
        let Acquired::Ours(hb) = b.acquire("j").await.unwrap() else { panic!("expired: b takes it") };
        assert_eq!(hb.epoch().await, 2);
        assert!(!a.renew("j", &ha).await.unwrap(), "a lost it");
        assert!(!a.fresh(&ha).await, "lost: not to be acted on");
        b.release("j", &hb).await.unwrap();
        let Acquired::Ours(h) = a.acquire("j").await.unwrap() else { panic!("released: free at once") };
        assert_eq!(h.epoch().await, 3);
    }

    /// A write of ours whose outcome was never learned (its answer lost, the read-back failed) moves
    /// the ETag under a lease handle: the lease still names this controller at its epoch, so the
    /// next renewal keeps it instead of concluding another controller took it.
    #[tokio::test]
    async fn a_lease_moved_by_our_own_unseen_write_is_still_ours() {
        let store = MemoryStore::new();
        let a = Leases::new(store.clone(), "a".into(), Duration::from_secs(30), Clock::System);
        let Acquired::Ours(seen) = a.acquire("j").await.unwrap() else { panic!("free lease") };
        // Our own write the handle never heard of (same owner, same epoch, a new ETag).
        let Acquired::Ours(_unseen) = a.acquire("j").await.unwrap() else { panic!("ours") };
        assert!(a.renew("j", &seen).await.unwrap(), "still ours");
        assert!(a.fresh(&seen).await);
        // Another controller's write is still a loss.
        let b = Leases::new(store.clone(), "b".into(), Duration::from_secs(30), Clock::System);
        a.release("j", &seen).await.unwrap();
        let Acquired::Ours(_) = b.acquire("j").await.unwrap() else { panic!("released: b takes it") };
        let Acquired::Ours(mine) = Leases::new(store.clone(), "a".into(), Duration::from_secs(30), Clock::System).acquire("k").await.unwrap() else {
            panic!("free")
        };
        assert!(a.renew("k", &mine).await.unwrap());
        assert!(!a.renew("j", &seen).await.unwrap(), "given back, then b's");
    }
}
