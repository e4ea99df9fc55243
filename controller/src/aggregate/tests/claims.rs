//! Each transaction billed once across jobs (issue 60), through the aggregator on the in-memory
//! store: a later job's rows that an earlier job billed are taken out of its totals and named in its
//! report; a finish cut short after its claims (the report's write failing, then a controller that
//! takes over from the committed ending) finds its own claims as its own and takes the others' out
//! once.

use super::*;

/// Stores job `job`'s chunk `chunk` as the initiator does: `rows` as `(txn_id, account, amount)` in
/// EUR, its record in the blob's metadata.
async fn put_chunk(store: &MemoryStore, job: &str, chunk: u32, rows: &[(&str, &str, &str)]) {
    let mut csv = String::from("txn_id,account_id,amount,currency,timestamp\n");
    for (id, a, amount) in rows {
        csv.push_str(&format!("{id},{a},{amount},EUR,2026-12-01T10:00:00Z\n"));
    }
    let record = ChunkRecord { transactions: rows.len() as u64, raw_bytes: csv.len() as u64, partition: None };
    let body = Bytes::from(zstd::bulk::compress(csv.as_bytes(), 1).unwrap());
    store.put_if(&fleet_domain::layout::chunk_key(job, chunk), body, "application/zstd", &record.to_meta(), &Cond::Any).await.unwrap();
}

/// Job `job` of one chunk holding `rows`, submitted: its manifest and chunk.
async fn submitted(store: &MemoryStore, job: &str, rows: &[(&str, &str, &str)]) {
    let m = manifest(job, &[rows.len() as u64]);
    store.put(&manifest_key(job), Bytes::from(serde_json::to_vec(&m).unwrap()), "application/json").await.unwrap();
    put_chunk(store, job, 0, rows).await;
}

/// Default tariff: 10.00 pays 0.59, 5.00 pays 0.45 (0.445 half away from zero), 1.00 pays 0.33.
const A: [(&str, &str, &str); 2] = [("x1", "acc-1", "10.00"), ("x2", "acc-2", "5.00")];
const B: [(&str, &str, &str); 2] = [("x2", "acc-2", "5.00"), ("x3", "acc-1", "1.00")];

fn b_result() -> Message {
    result("b", 0, vec![acct("acc-1", 1, 100, 33), acct("acc-2", 1, 500, 45)])
}

#[tokio::test]
async fn a_row_another_job_billed_first_is_not_billed_again_and_is_named() {
    let store = MemoryStore::new();
    submitted(&store, "a", &A).await;
    submitted(&store, "b", &B).await;
    let agg = quick(store.clone());
    agg.apply(Source::Results, keep(Source::Results, &[result("a", 0, vec![acct("acc-1", 1, 1000, 59), acct("acc-2", 1, 500, 45)]), sealed("a", 1)])).await;
    let ra = report_of(&store, "a").await.expect("a finished");
    assert_eq!((ra.transactions.processed, ra.transactions.duplicates), (2, 0));
    agg.apply(Source::Results, keep(Source::Results, &[b_result(), sealed("b", 1)])).await;
    let rb = report_of(&store, "b").await.expect("b finished");
    assert_eq!((rb.status, rb.transactions.processed, rb.transactions.duplicates), (JobStatus::Complete, 1, 1));
    let rows: Vec<(&str, u64, &str, &str)> = rb.accounts.iter().map(|a| (a.account_id.as_str(), a.count, a.gross.as_str(), a.fees.as_str())).collect();
    assert_eq!(rows, [("acc-1", 1, "1.00", "0.33")], "x2 taken out, its account gone");
    let dup = rb.rejected.iter().find(|r| r.txn_id.as_deref() == Some("x2")).expect("x2 named");
    assert!(dup.reason.starts_with("txn_id: already billed by job a"), "{}", dup.reason);
    assert_eq!(rb.totals.iter().map(|c| (c.currency.as_str(), c.count, c.gross.as_str())).collect::<Vec<_>>(), [("EUR", 1, "1.00")]);
}

/// Fails every write of job `job`'s accounts (its report's first object) while `down` is set.
struct ReportDown {
    job: &'static str,
    down: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl Hook for ReportDown {
    async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> Result<Option<String>> {
        if put.key == accounts_key(self.job) && self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::Service {
                service: fleet_io::error::Service::S3,
                operation: "PutObject",
                detail: "report write refused".into(),
                retryable: true,
                source: None,
            });
        }
        put.to(inner).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_finish_cut_short_after_its_claims_finds_them_its_own_and_bills_exactly() {
    let store = MemoryStore::new();
    submitted(&store, "a", &A).await;
    submitted(&store, "b", &B).await;
    let first = quick(store.clone());
    first.apply(Source::Results, keep(Source::Results, &[result("a", 0, vec![acct("acc-1", 1, 1000, 59), acct("acc-2", 1, 500, 45)]), sealed("a", 1)])).await;
    assert!(report_of(&store, "a").await.is_some());
    // b's finish claims, then its report cannot be written: the controller dies there.
    let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let hooked = Hooked::new(store.clone(), ReportDown { job: "b", down: down.clone() });
    let dying = quick(hooked);
    dying.apply(Source::Results, keep(Source::Results, &[b_result(), sealed("b", 1)])).await;
    assert!(report_of(&store, "b").await.is_none(), "its report was not written");
    assert!(!store.list(fleet_domain::layout::CLAIMS_PREFIX, 10).await.unwrap().is_empty(), "its claims were");
    drop(dying);
    // Another controller takes b over once its lease has run out, from its committed ending.
    tokio::time::sleep(Duration::from_secs(600)).await;
    let heir = quick_owned(store.clone(), "heir".into(), Duration::from_secs(30));
    // Its seal comes back (redelivered) until the heir may take the lease (judged on its own clock).
    for _ in 0..60 {
        heir.apply(Source::Results, keep(Source::Results, &[sealed("b", 1)])).await;
        if report_of(&store, "b").await.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    let rb = report_of(&store, "b").await.expect("b finished by its heir");
    assert_eq!((rb.transactions.processed, rb.transactions.duplicates), (1, 1), "x3 its own claim, x2 a's: taken out once");
    assert_eq!(rb.accounts.iter().map(|a| (a.account_id.as_str(), a.count)).collect::<Vec<_>>(), [("acc-1", 1)]);
}

/// A job abandoned before its manifest (Ctrl-C early in its submission) whose row another job billed
/// first: that row's fee is taken out as its processor billed it, with the tariff its initiator
/// stored first (here 0.10 + 1%: 5.00 pays 0.15, 1.00 pays 0.11), not the default one.
#[tokio::test]
async fn a_job_without_a_manifest_takes_its_duplicates_out_at_its_own_tariff() {
    let store = MemoryStore::new();
    submitted(&store, "a", &A).await;
    let agg = quick(store.clone());
    agg.apply(Source::Results, keep(Source::Results, &[result("a", 0, vec![acct("acc-1", 1, 1000, 59), acct("acc-2", 1, 500, 45)]), sealed("a", 1)])).await;
    assert!(report_of(&store, "a").await.is_some());
    // b: its chunk and tariff stored, no manifest; billed at its own tariff, then abandoned.
    let tariff: Tariff = serde_json::from_str(r#"{"fixed_fee":"0.10","percent":"1.0"}"#).unwrap();
    store.put(&fleet_domain::layout::tariff_key("b"), Bytes::from(serde_json::to_vec(&tariff).unwrap()), "application/json").await.unwrap();
    put_chunk(&store, "b", 0, &B).await;
    let billed = result("b", 0, vec![acct("acc-1", 1, 100, 11), acct("acc-2", 1, 500, 15)]);
    agg.apply(Source::Results, keep(Source::Results, &[billed, abandon("b")])).await;
    let rb = report_of(&store, "b").await.expect("b finished, abandoned");
    assert_eq!((rb.status, rb.transactions.processed, rb.transactions.duplicates), (JobStatus::Abandoned, 1, 1));
    assert_eq!(rb.accounts.iter().map(|a| (a.account_id.as_str(), a.count, a.fees.as_str())).collect::<Vec<_>>(), [("acc-1", 1, "0.11")]);
    assert_eq!(rb.totals.iter().map(|c| (c.count, c.fees.as_str())).collect::<Vec<_>>(), [(1, "0.11")], "x2's own fee, 0.15, taken out");
}
