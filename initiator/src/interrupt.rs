//! What a Ctrl-C does to a submission, decided by how far the submission has gone (pure: the
//! commands only print the line and send the `Abandon` this says to send).
//!
//! Before the job's seal is sent, the job is not whole (chunks may still be unread, unstored or not
//! enqueued, the manifest unwritten): an interrupted submission abandons it, so that the controller
//! finishes it `abandoned` with what was billed at once instead of showing it as being submitted until
//! `--abandon-after`. Once the seal's send has begun, the job is whole: every work item is out and the
//! manifest written, and a send cut off by the interrupt may still have reached the queue. An
//! `Abandon` then would throw away a job that finishes on its own (the controller reads an `Abandon`
//! sent after a seal and ends the job `abandoned` with the chunks billed so far), so the interrupt
//! leaves it going, says so and how to follow it (`initiator wait JOB`), and exits 130 all the same.
//! The seal's send is followed by the triggers that wake a parked controller, which can wait up to
//! their confirm timeout on RabbitMQ: that wait is where a Ctrl-C after the seal is most likely.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// How far a submission has gone, as a Ctrl-C sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Reading, storing and enqueuing the chunks, then writing the manifest: the job is not whole.
    Submitting = 0,
    /// The seal's send has begun and not been answered: cut off now, it may or may not have reached
    /// the results queue. Entered before the send call starts, so no interrupt finds a seal under way
    /// in [`Phase::Submitting`].
    Sealing = 1,
    /// The results queue took the seal (the triggers that wake a parked controller may still be under
    /// way).
    Sealed = 2,
}

/// What an interrupted submission does about its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnInterrupt {
    /// Sends the job's `Abandon`: the seal's send had not begun.
    Abandon,
    /// Leaves the job to finish (no `Abandon` is sent) and prints this line on stderr: the job's id,
    /// that it was submitted whole and finishes on its own, and `initiator wait JOB` to follow it.
    GoesOn { line: String },
}

impl Phase {
    /// What a Ctrl-C in this phase does about job `job_id`.
    pub fn on_interrupt(self, job_id: &str) -> OnInterrupt {
        let follow = format!("follow it with `initiator wait {job_id}`");
        match self {
            Phase::Submitting => OnInterrupt::Abandon,
            Phase::Sealing => OnInterrupt::GoesOn {
                line: format!(
                    "interrupted: job {job_id} goes on: it was submitted whole and its seal was being sent, so it finishes on its own \
                     (Ctrl-C does not abandon a job once its seal is on its way; should the seal not have reached the queue, the controller \
                     abandons the job after --abandon-after); {follow}"
                ),
            },
            Phase::Sealed => OnInterrupt::GoesOn {
                line: format!(
                    "interrupted: job {job_id} goes on: it was submitted whole and sealed, so it finishes on its own (Ctrl-C does not abandon a sealed job); {follow}"
                ),
            },
        }
    }

    fn from_u8(v: u8) -> Phase {
        match v {
            0 => Phase::Submitting,
            1 => Phase::Sealing,
            _ => Phase::Sealed,
        }
    }
}

/// A submission's [`Phase`], shared: the submission moves it on (it holds one clone, in
/// [`crate::submit::SubmitOptions::submission`]) and the command that runs it reads it when a Ctrl-C
/// has dropped the submission's future (it holds another). Starts in [`Phase::Submitting`].
#[derive(Debug, Clone, Default)]
pub struct Submission(Arc<AtomicU8>);

impl Submission {
    /// Where the submission stands now.
    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.0.load(Ordering::SeqCst))
    }

    /// Moves the submission on to `phase` (never back: the phases only go forward).
    pub(crate) fn enter(&self, phase: Phase) {
        self.0.fetch_max(phase as u8, Ordering::SeqCst);
    }

    /// What a Ctrl-C now does about job `job_id`: [`Phase::on_interrupt`] of where it stands.
    pub fn on_interrupt(&self, job_id: &str) -> OnInterrupt {
        self.phase().on_interrupt(job_id)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use fleet_io::blob::BlobStore;
    use fleet_io::call::CallCounter;
    use fleet_io::memory::{MemoryQueue, MemoryStore};
    use fleet_io::queue::{Delivery, Outgoing, Queue, QueueDepth, QueueInfo, Receipt};

    use super::*;
    use crate::submit::{open_inputs, submit_inputs, Clients, Stdin, SubmitOptions};

    const JOB: &str = "0190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b";

    #[test]
    fn an_interrupt_before_the_seal_abandons_the_job_and_one_after_its_send_began_does_not() {
        assert_eq!(Phase::Submitting.on_interrupt(JOB), OnInterrupt::Abandon);
        for phase in [Phase::Sealing, Phase::Sealed] {
            let OnInterrupt::GoesOn { line } = phase.on_interrupt(JOB) else { panic!("{phase:?} abandons the job") };
            // The job's id, that it goes on whole, and how to follow it; never that it was abandoned
            // (what the Ctrl-C of a submission before its seal says).
            assert!(line.starts_with(&format!("interrupted: job {JOB} goes on: it was submitted whole")), "{line}");
            assert!(line.contains("finishes on its own"), "{line}");
            assert!(line.ends_with(&format!("follow it with `initiator wait {JOB}`")), "{line}");
            assert!(!line.contains(" abandoned"), "{line}");
        }
    }

    #[test]
    fn a_submissions_phase_only_goes_forward() {
        let s = Submission::default();
        let seen_by_the_command = s.clone();
        assert_eq!(seen_by_the_command.phase(), Phase::Submitting);
        s.enter(Phase::Sealing);
        assert_eq!(seen_by_the_command.phase(), Phase::Sealing);
        s.enter(Phase::Sealed);
        s.enter(Phase::Sealing);
        assert_eq!(seen_by_the_command.phase(), Phase::Sealed);
    }

    /// A queue whose sends never answer: each tells the test it was reached, then waits forever (a
    /// send under way when the Ctrl-C comes). Everything else is the in-memory queue's.
    struct Stuck {
        inner: Arc<MemoryQueue>,
        reached: Arc<tokio::sync::Notify>,
    }

    /// A boxed future, as `async_trait` declares the queue's methods (written out here: the initiator
    /// does not depend on `async_trait` for one test queue).
    type Boxed<'f, T> = std::pin::Pin<Box<dyn std::future::Future<Output = fleet_io::Result<T>> + Send + 'f>>;

    impl Queue for Stuck {
        fn name(&self) -> &str {
            self.inner.name()
        }
        fn send_messages<'s, 'm, 'f>(&'s self, _: &'m [Outgoing]) -> Boxed<'f, u64>
        where
            's: 'f,
            'm: 'f,
            Self: 'f,
        {
            Box::pin(async move {
                self.reached.notify_one();
                std::future::pending().await
            })
        }
        fn receive<'s, 'f>(&'s self, max: u32, wait: Duration) -> Boxed<'f, Vec<Delivery>>
        where
            's: 'f,
            Self: 'f,
        {
            self.inner.receive(max, wait)
        }
        fn delete_receipts<'s, 'r, 'a, 'f>(&'s self, receipts: &'r [&'a Receipt]) -> Boxed<'f, Vec<usize>>
        where
            's: 'f,
            'r: 'f,
            'a: 'f,
            Self: 'f,
        {
            self.inner.delete_receipts(receipts)
        }
        fn change_visibility<'s, 'e, 'a, 'f>(&'s self, entries: &'e [(&'a str, Duration)]) -> Boxed<'f, Vec<usize>>
        where
            's: 'f,
            'e: 'f,
            'a: 'f,
            Self: 'f,
        {
            self.inner.change_visibility(entries)
        }
        fn depth<'s, 'f>(&'s self) -> Boxed<'f, QueueDepth>
        where
            's: 'f,
            Self: 'f,
        {
            self.inner.depth()
        }
        fn info<'s, 'f>(&'s self) -> Boxed<'f, QueueInfo>
        where
            's: 'f,
            Self: 'f,
        {
            self.inner.info()
        }
        fn calls(&self) -> &CallCounter {
            self.inner.calls()
        }
    }

    /// A job of 30 rows in 3 chunks, submitted to in-memory queues of which `stuck` ("work" or
    /// "results") never answers a send; the submission is dropped (as a Ctrl-C drops it) once that
    /// send is under way. Returns where the submission stood then, and the store.
    async fn interrupted_while_sending_to(stuck: &str) -> (Phase, Arc<MemoryStore>) {
        let dir = tempfile::tempdir().unwrap();
        let path: PathBuf = dir.path().join("day.csv");
        let mut body = String::from("txn_id,account_id,amount,currency,timestamp\n");
        for i in 0..30 {
            body.push_str(&format!("t{i:04},A{:03},{}.25,EUR,2026-01-01T00:00:00Z\n", i % 7, i + 1));
        }
        std::fs::write(&path, body).unwrap();
        let reached = Arc::new(tokio::sync::Notify::new());
        let queue = |name: &str| -> Arc<dyn Queue> {
            let inner = MemoryQueue::new(name, Duration::from_secs(30));
            match name == stuck {
                true => Arc::new(Stuck { inner, reached: reached.clone() }),
                false => inner,
            }
        };
        let store = MemoryStore::new();
        let clients = Clients { work: queue("work"), results: queue("results"), store: store.clone(), triggers: None, signing_key: None };
        let submission = Submission::default();
        let opts = SubmitOptions { job_id: Some(JOB.into()), chunk_size: 10, submission: submission.clone(), ..SubmitOptions::new(vec![path.clone()]) };
        let files = open_inputs(&[path], &Stdin::default()).unwrap();
        tokio::select! {
            r = submit_inputs(opts, files, &clients) => panic!("a send to {stuck} never answers, yet the submission ended: {r:?}"),
            () = reached.notified() => {}
        }
        // The submission's future is dropped here, its send cut off, as `until_interrupted` drops it.
        (submission.phase(), store)
    }

    #[tokio::test]
    async fn a_ctrl_c_while_work_items_are_being_sent_abandons_the_job() {
        let (phase, store) = interrupted_while_sending_to("work").await;
        assert_eq!(phase, Phase::Submitting);
        assert_eq!(phase.on_interrupt(JOB), OnInterrupt::Abandon);
        // Not whole: no manifest.
        assert!(store.get(&fleet_domain::layout::manifest_key(JOB)).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_ctrl_c_once_the_seals_send_began_leaves_the_job_to_finish() {
        // The seal's send is cut off before it is answered: the phase says it had begun (it may have
        // reached the queue), so no `Abandon` follows it.
        let (phase, store) = interrupted_while_sending_to("results").await;
        assert_eq!(phase, Phase::Sealing);
        assert!(matches!(phase.on_interrupt(JOB), OnInterrupt::GoesOn { .. }));
        // Whole: the manifest was written before the seal.
        assert!(store.get(&fleet_domain::layout::manifest_key(JOB)).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn a_finished_submission_is_sealed_and_a_ctrl_c_then_leaves_the_job_to_finish() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("day.csv");
        std::fs::write(&path, "txn_id,account_id,amount,currency,timestamp\nt1,A1,1.25,EUR,2026-01-01T00:00:00Z\n").unwrap();
        let results = MemoryQueue::new("results", Duration::from_secs(30));
        let clients = Clients {
            work: MemoryQueue::new("work", Duration::from_secs(30)),
            results: results.clone(),
            store: MemoryStore::new(),
            triggers: None,
            signing_key: None,
        };
        let submission = Submission::default();
        let opts = SubmitOptions { job_id: Some(JOB.into()), submission: submission.clone(), ..SubmitOptions::new(vec![path.clone()]) };
        submit_inputs(opts, open_inputs(&[path], &Stdin::default()).unwrap(), &clients).await.unwrap();
        assert_eq!(submission.phase(), Phase::Sealed);
        assert!(matches!(submission.on_interrupt(JOB), OnInterrupt::GoesOn { .. }));
        assert!(results.bodies().iter().any(|b| b.contains(r#""kind":"sealed""#)), "the seal is on the results queue: {:?}", results.bodies());
    }
}
