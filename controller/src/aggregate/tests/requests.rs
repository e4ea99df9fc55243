//! A report's requests are the calls made for its job, each where it was made (issue 59, item 3):
//! compared with what the store itself saw of the job's objects, read-backs and a reload included,
//! and with what the results queue itself counted of the receives and deletes of its messages.

use super::*;
use fleet_io::call::{Billed, Op};
use fleet_io::error::Service as S;
use fleet_io::queue::Outgoing;

/// Counts the calls on one job's objects as the store sees them (each call passed to the inner store
/// is one billed attempt), and the counts at the moment the job's report starts to be written. Loses the answer
/// of the job's first checkpoint write (it lands; the write is made again and finds the object there,
/// then reads it back: a lost answer's retry) and of its second (it lands; the controller hears only
/// an error: the job is dropped, its messages held, and it is loaded again).
struct JobCalls {
    job: &'static str,
    counts: Mutex<RequestCounts>,
    at_report: Mutex<Option<RequestCounts>>,
    reported: std::sync::atomic::AtomicBool,
    checkpoint_writes: AtomicUsize,
}

impl JobCalls {
    fn count(&self, key: &str, op: Op) {
        // The report's writing starts by asking whether it is there (as the claims' step did before
        // it): the counts at the last such look before the report is written.
        if key == report_key(self.job) && op == Op::S3HeadObject && !self.reported.load(std::sync::atomic::Ordering::SeqCst) {
            *lock(&self.at_report) = Some(lock(&self.counts).clone());
        }
        if key == report_key(self.job) && op == Op::S3PutObject {
            self.reported.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        // The job's objects, and the claims of its transactions (this test's store holds no other job's).
        if key.contains(self.job) || key.starts_with(fleet_domain::layout::CLAIMS_PREFIX) {
            lock(&self.counts).add(Billed::call(op), 1);
        }
    }
}

#[async_trait::async_trait]
impl Hook for JobCalls {
    async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> Result<Option<String>> {
        self.count(put.key, Op::S3PutObject);
        if put.key != checkpoint_key(self.job) {
            return put.to(inner).await;
        }
        let retry = put.clone();
        let written = put.to(inner).await;
        match self.checkpoint_writes.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => {
                // The answer is lost; the call is made again, and its condition fails on our own write.
                self.count(retry.key, Op::S3PutObject);
                retry.to(inner).await
            }
            1 => Err(Error::Timeout { service: S::S3, operation: "PutObject", after: Duration::from_secs(5), attempts: 1 }),
            _ => written,
        }
    }
    async fn get_tagged(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<(Bytes, String)>> {
        self.count(key, Op::S3GetObject);
        inner.get_tagged(key).await
    }
    async fn head(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<std::collections::BTreeMap<String, String>>> {
        self.count(key, Op::S3HeadObject);
        inner.head(key).await
    }
    async fn list(&self, inner: &dyn BlobStore, prefix: &str, limit: usize) -> Result<Vec<String>> {
        self.count(prefix, Op::S3ListObjectsV2);
        inner.list(prefix, limit).await
    }
    async fn delete(&self, inner: &dyn BlobStore, key: &str) -> Result<()> {
        self.count(key, Op::S3DeleteObject);
        inner.delete(key).await
    }
}

/// The results queue the test's messages travel through, and the completions that delete them: its
/// own counter is the queue's count of the job's calls (it carries nothing else).
struct Results {
    queue: Arc<MemoryQueue>,
    done: Completions,
}

impl Results {
    fn new() -> Results {
        let queue = MemoryQueue::new(Source::Results.default_queue(), Duration::from_secs(30));
        Results { done: Completions::start(queue.clone(), BatchSettings::default()), queue }
    }

    /// Sends `msgs` and receives them in one call, as a listener's batch.
    async fn batch(&self, msgs: &[Message]) -> Vec<Kept> {
        let out: Vec<Outgoing> = msgs.iter().map(|m| Outgoing { body: m.body.clone(), attrs: m.attrs.clone(), dedup: None }).collect();
        self.queue.send_messages(&out).await.unwrap();
        let got = self.queue.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(got.len(), msgs.len(), "one receive brings the batch");
        got.into_iter().map(|d| self.done.keep(d)).collect()
    }

    /// Deletes what the aggregator handed back, and waits for the deletes to be made.
    async fn delete(&self, kept: Vec<Kept>) -> usize {
        let n = kept.len();
        kept.into_iter().for_each(Kept::delete);
        tokio::time::sleep(Duration::from_secs(1)).await;
        n
    }

    fn calls(&self, op: Op) -> u64 {
        self.queue.calls().snapshot().calls(op)
    }
}

/// Every S3 call the controller made for the job before its report (record lookups, lease, loads,
/// payload reads, the open marker, checkpoints with a lost answer's retry and its read-back, a write
/// whose answer was lost and the job's reload) is in the report, once each, as the store counted it.
/// (The report's own writes and what follows them are not: see docs/requests.md.)
#[tokio::test(start_paused = true)]
async fn a_reports_requests_are_what_the_store_and_the_queue_counted_for_its_job() {
    let memory = MemoryStore::new();
    put_manifest(&memory, &manifest("qz7", &[1, 1, 1])).await;
    let store = Hooked::new(
        memory.clone(),
        JobCalls { job: "qz7", counts: Mutex::default(), at_report: Mutex::default(), reported: Default::default(), checkpoint_writes: AtomicUsize::new(0) },
    );
    let agg = quick(store.clone());
    let results = Results::new();

    // Chunk 0, checkpointed: its first write's answer is lost, the write found in place and read back.
    let a = agg.apply(Source::Results, results.batch(&[result("qz7", 0, vec![acct("a", 1, 100, 1)])]).await).await;
    assert!(a.delete.is_empty());
    assert_eq!(results.delete(agg.flush().await).await, 1, "checkpointed once the write is read back");

    // Chunk 1: the checkpoint lands but the controller hears an error: the job is dropped, held.
    agg.apply(Source::Results, results.batch(&[result("qz7", 1, vec![acct("b", 1, 200, 2)])]).await).await;
    assert!(agg.flush().await.is_empty());
    assert_eq!(agg.holding().held(None), 1, "held for the store to answer");

    // Tried again: the job is loaded from the checkpoint that landed (its message a duplicate now).
    let mut deleted = 0;
    for _ in 0..120 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        deleted += results.delete(agg.retry_held().await.delete).await;
        deleted += results.delete(agg.flush().await).await;
        if agg.holding().held(None) == 0 && agg.memory().pending() == 0 {
            break;
        }
    }
    assert_eq!((deleted, agg.holding().held(None)), (1, 0), "applied from the hold");

    // Chunk 2's payload is gone (a read that finds nothing), and the seal: the job finishes.
    let lost = with_payload(
        "qz7",
        2,
        1,
        AccountsPayload::Blob { blob: BlobRef { key: fleet_domain::layout::result_key("qz7", 2), sha256: "0".repeat(64), compressed_bytes: 9, raw_bytes: 9 } },
    );
    let last = agg.apply(Source::Results, results.batch(&[lost, sealed("qz7", 3)]).await).await;
    assert_eq!(results.delete(last.delete).await, 2, "the finished job's last messages");
    let r = report_of(&memory, "qz7").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Partial, 2, 1));

    let seen = lock(&store.at_report).clone().expect("the report was written through the store");
    assert_eq!(r.requests.s3, seen.by_service(fleet_domain::requests::Service::S3), "the report's S3 requests are the store's count for the job");
    // What that count holds: two writes and a read-back of the first checkpoint, the landed second
    // one, its reload's reads, the payload read that found nothing.
    assert!(seen.calls(Op::S3PutObject) >= 5 && seen.calls(Op::S3GetObject) >= 4, "{seen:?}");
    assert!(store.checkpoint_writes.load(std::sync::atomic::Ordering::SeqCst) >= 3);
    // SQS's calls, attributed by rule once what they serve is done: a receive per batch applied
    // (three: chunk 0, chunk 1 (applied again from the hold after the drop lost the first, with no
    // receive), the last batch), the deletes of each checkpoint written (the two that covered a
    // message, the ending's), none for the write the controller heard fail. The queue counted the same.
    let sqs = |name: &str| r.requests.sqs.get(name).copied().unwrap_or(0);
    assert_eq!((sqs("ReceiveMessage"), sqs("DeleteMessageBatch")), (3, 3), "{:?}", r.requests.sqs);
    assert_eq!(
        (sqs("ReceiveMessage"), sqs("DeleteMessageBatch")),
        (results.calls(Op::SqsReceiveMessage), results.calls(Op::SqsDeleteMessageBatch)),
        "the report's SQS requests are the queue's own count of the job's receives and deletes"
    );
}
