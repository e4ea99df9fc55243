//! A chunk counts once, whatever arrives and in whatever order: duplicates, redelivery, a
//! restart, dead letters and failure reports against real results, hostile and inconsistent values.

use super::*;

#[tokio::test]
async fn duplicates_count_once_and_report_is_exact() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j1", &[2, 1])).await;
    let agg = quick(store.clone());
    let r0 = result("j1", 0, vec![acct("a", 2, 1000, 100)]);
    let applied = agg.apply(Source::Results, keep(Source::Results, &[r0.clone(), r0.clone()])).await;
    assert!(applied.delete.is_empty(), "nothing is deleted before a checkpoint covers it");
    assert_eq!(agg.memory().pending(), 2);
    assert_eq!(agg.flush().await.len(), 2, "duplicates are deleted too, after the checkpoint");
    let meta = store.head(&checkpoint_key("j1")).await.unwrap().expect("checkpoint written");
    let p = fleet_domain::model::Progress::from_meta(&meta).expect("progress in the metadata");
    assert_eq!((p.status, p.accounted, p.failed, p.processed), (JobStatus::Running, 1, 0, 2));
    assert!(report_of(&store, "j1").await.is_none());
    agg.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r0))).await;
    agg.apply(Source::Results, keep(Source::Results, &[result("j1", 1, vec![acct("a", 1, -500, 0)])])).await;
    assert!(report_of(&store, "j1").await.is_none(), "every chunk is in, but the job is not sealed yet");
    agg.apply(Source::Results, keep(Source::Results, &[sealed("j1", 2)])).await;
    let r = report_of(&store, "j1").await.expect("report written once sealed");
    assert_eq!(r.status, JobStatus::Complete);
    assert_eq!((r.transactions.processed, r.transactions.failed, r.transactions.rejected), (3, 0, 1));
    assert_eq!((r.accounts[0].count, r.accounts[0].gross.as_str(), r.accounts[0].net.as_str()), (3, "5.00", "4.00"));
    let csv = String::from_utf8(store.get(&accounts_key("j1")).await.unwrap().unwrap().to_vec()).unwrap();
    assert_eq!(csv.lines().nth(1), Some("a,EUR,3,5.00,1.00,4.00"));
    // A late duplicate after the report changes nothing.
    agg.apply(Source::Results, keep(Source::Results, &[r0])).await;
    assert_eq!(report_of(&store, "j1").await.unwrap().accounts, r.accounts);
}

#[tokio::test]
async fn restart_resumes_from_checkpoint() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j2", &[1, 1, 1])).await;
    let first = quick(store.clone());
    first.apply(Source::Results, keep(Source::Results, &[result("j2", 0, vec![acct("a", 1, 100, 33)]), sealed("j2", 3)])).await;
    first.apply(Source::Results, keep(Source::Results, &[result("j2", 1, vec![acct("b", 1, 200, 36)])])).await;
    first.flush().await; // checkpointed; then "crash" before the deletes
    first.apply(Source::Results, keep(Source::Results, &[result("j2", 2, vec![acct("a", 1, 300, 39)])])).await;
    drop(first); // chunk 2 was applied in memory only: lost with the crash, and not deleted
    let second = quick(store.clone());
    // chunk 1 is redelivered (its delete was lost), then chunk 2 arrives
    second.apply(Source::Results, keep(Source::Results, &[result("j2", 1, vec![acct("b", 1, 200, 36)]), result("j2", 2, vec![acct("a", 1, 300, 39)])])).await;
    let r = report_of(&store, "j2").await.unwrap();
    assert_eq!(r.transactions.processed, 3);
    assert_eq!(r.accounts.iter().map(|a| (a.account_id.as_str(), a.count, a.gross.as_str())).collect::<Vec<_>>(), [("a", 2, "4.00"), ("b", 1, "2.00")]);
}

#[tokio::test]
async fn dead_letter_makes_job_partial_and_failed_result_wins_once() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j3", &[4, 5])).await;
    let agg = quick(store.clone());
    agg.apply(Source::Results, keep(Source::Results, &[sealed("j3", 2), result("j3", 0, vec![acct("a", 4, 400, 10)])])).await;
    let item = WorkItem {
        partition: 0,
        v: 1,
        job_id: "j3".into(),
        chunk: 1,
        transactions: 5,
        blob: BlobRef { key: fleet_domain::layout::chunk_key("j3", 1), sha256: "0".repeat(64), compressed_bytes: 1, raw_bytes: 1 },
        tariff: Tariff::default(),
    };
    agg.apply(Source::WorkDeadLetter, keep(Source::WorkDeadLetter, &[msg(serde_json::to_string(&item).unwrap())])).await;
    let r = report_of(&store, "j3").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    assert_eq!((r.transactions.processed, r.transactions.failed), (4, 5));
    assert_eq!(r.failed_chunks.len(), 1);
    assert_eq!(r.failed_chunks[0].chunk, 1);
}

#[tokio::test]
async fn a_real_result_beats_a_dead_letter_or_a_failure_report_in_either_order() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j9", &[2, 3, 4, 5])).await;
    let agg = quick(store.clone());
    let r1 = result("j9", 1, vec![acct("b", 3, 300, 30)]);
    let r2 = result("j9", 2, vec![acct("c", 4, 400, 40)]);
    // Chunk 1: dead-lettered (its delete failed after it was billed), then its real result.
    agg.apply(Source::WorkDeadLetter, keep(Source::WorkDeadLetter, &[dead_letter("j9", 1, 3)])).await;
    agg.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r1))).await;
    // Chunk 2: a failure report (a processor that gave up), then the real result of another try.
    agg.apply(Source::Results, keep(Source::Results, &[failed("j9", 2, 4, "S3 GetObject: no answer")])).await;
    agg.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r2))).await;
    // Chunk 3: the real result first, then a dead letter of it: the result stays.
    agg.apply(Source::Results, keep(Source::Results, &[result("j9", 3, vec![acct("d", 5, 500, 50)])])).await;
    agg.apply(Source::WorkDeadLetter, keep(Source::WorkDeadLetter, &[dead_letter("j9", 3, 5)])).await;
    agg.apply(Source::Results, keep(Source::Results, &[failed("j9", 3, 5, "late failure report")])).await;
    // A second copy of a corrected chunk's result counts once.
    agg.apply(Source::Results, keep(Source::Results, &[r1, r2])).await;
    agg.apply(Source::Results, keep(Source::Results, &[result("j9", 0, vec![acct("a", 2, 200, 20)]), sealed("j9", 4)])).await;
    let r = report_of(&store, "j9").await.expect("finished");
    assert_eq!(r.status, JobStatus::Complete, "{:?}", r.failed_chunks);
    assert_eq!((r.transactions.processed, r.transactions.failed), (14, 0));
    assert!(r.failed_chunks.is_empty());
    assert_eq!(r.accounts.iter().map(|a| (a.account_id.as_str(), a.count)).collect::<Vec<_>>(), [("a", 2), ("b", 3), ("c", 4), ("d", 5)]);
}

#[tokio::test]
async fn a_correction_survives_a_restart() {
    // One controller restarted twice (its own leases are its own at once).
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j10", &[2, 3])).await;
    let first = quick_owned(store.clone(), "c1".into(), LEASE);
    first.apply(Source::WorkDeadLetter, keep(Source::WorkDeadLetter, &[dead_letter("j10", 1, 3)])).await;
    first.flush().await; // the failure is checkpointed
    drop(first);
    let second = quick_owned(store.clone(), "c1".into(), LEASE);
    second.apply(Source::Results, keep(Source::Results, &[result("j10", 1, vec![acct("b", 3, 300, 30)])])).await;
    second.flush().await;
    let meta = store.head(&checkpoint_key("j10")).await.unwrap().expect("checkpoint written");
    let p = fleet_domain::model::Progress::from_meta(&meta).expect("progress in the metadata");
    assert_eq!((p.accounted, p.failed, p.processed), (1, 0, 3), "the correction is checkpointed");
    drop(second);
    let third = quick_owned(store.clone(), "c1".into(), LEASE);
    third.apply(Source::Results, keep(Source::Results, &[result("j10", 0, vec![acct("a", 2, 200, 20)]), sealed("j10", 2)])).await;
    let r = report_of(&store, "j10").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Complete, 5, 0), "{:?}", r.failed_chunks);
}

#[tokio::test]
async fn missing_manifest_keeps_messages_for_redelivery() {
    let store = MemoryStore::new();
    let agg = quick(store.clone());
    let batch = [result("j4", 0, vec![acct("a", 1, 100, 1)]), sealed("j4", 1)];
    let applied = agg.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert!(applied.delete.is_empty(), "not deleted: the job cannot be finished yet");
    put_manifest(&store, &manifest("j4", &[1])).await;
    let applied = agg.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert_eq!(applied.delete.len(), 2);
    assert_eq!(report_of(&store, "j4").await.unwrap().transactions.processed, 1);
}

#[tokio::test]
async fn chunks_beyond_the_sealed_size_are_ignored() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j6", &[1])).await;
    let agg = quick(store.clone());
    agg.apply(Source::Results, keep(Source::Results, &[sealed("j6", 1), result("j6", 5, vec![acct("x", 9, 900, 9)])])).await;
    assert!(report_of(&store, "j6").await.is_none());
    agg.apply(Source::Results, keep(Source::Results, &[result("j6", 0, vec![acct("a", 1, 100, 1)])])).await;
    let r = report_of(&store, "j6").await.unwrap();
    assert_eq!(r.transactions.processed, 1);
    assert_eq!(r.accounts.len(), 1);
}

#[tokio::test]
async fn inconsistent_result_is_a_failed_chunk_and_garbage_is_quarantined() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j5", &[3])).await;
    let agg = quick(store.clone());
    let mut bad: ResultMessage = serde_json::from_str(&result("j5", 0, vec![acct("a", 2, 100, 1)]).body).unwrap();
    if let ResultMessage::Chunk(c) = &mut bad {
        c.transactions = 3;
    }
    let garbage = Message { id: "g1".into(), body: "{not json".into(), receive_count: 2, ..Default::default() };
    let applied = agg.apply(Source::Results, keep(Source::Results, &[msg(serde_json::to_string(&bad).unwrap()), garbage, sealed("j5", 1)])).await;
    assert_eq!(applied.delete.len(), 3, "the garbage message is quarantined, then deleted");
    let q = fleet_io::quarantine::read(store.as_ref(), "quarantine/billing-results/g1.json").await.unwrap().expect("quarantined");
    assert_eq!((q.body.as_str(), q.receive_count, q.queue.as_str()), ("{not json", 2, "billing-results"));
    assert!(q.reason.contains("invalid JSON"), "{}", q.reason);
    let r = report_of(&store, "j5").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    assert!(r.failed_chunks[0].reason.contains("counts 2"));
}

#[tokio::test]
async fn hostile_values_fail_their_chunk_and_leave_other_jobs_alone() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("h1", &[1, 1, 2])).await;
    put_manifest(&store, &manifest("ok", &[1])).await;
    let agg = quick(store.clone());
    let huge = Decimal::MAX - Decimal::ONE;
    // Another currency: the EUR total is near its limit after chunk 0.
    let usd = |a: &str| AccountTotals { currency: "USD".into(), ..acct(a, 1, 100, 1) };
    let mut big_requests = result("h1", 2, vec![usd("c"), usd("c2")]);
    big_requests.body = big_requests.body.replace("\"requests\":{}", "\"requests\":{\"sqs.ReceiveMessage\":18446744073709551615}");
    assert!(big_requests.body.contains("18446744073709551615"), "{}", big_requests.body);
    let batch = [
        sealed("h1", 3),
        // Each fits alone; their sum does not.
        result("h1", 0, vec![AccountTotals { gross: huge, ..acct("a", 1, 0, 0) }]),
        result("h1", 1, vec![AccountTotals { gross: huge, ..acct("a", 1, 0, 0) }]),
        big_requests,
        result("ok", 0, vec![acct("z", 1, 500, 5)]),
        sealed("ok", 1),
    ];
    let applied = agg.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert_eq!(applied.delete.len(), batch.len());
    let r = report_of(&store, "h1").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    assert_eq!((r.transactions.processed, r.transactions.failed), (3, 1));
    assert!(r.failed_chunks[0].reason.contains("would overflow"), "{:?}", r.failed_chunks);
    assert_eq!(r.requests.total, u64::MAX, "request counts saturate instead of wrapping");
    // A count that cannot be summed.
    let agg = quick(store.clone());
    put_manifest(&store, &manifest("h2", &[1])).await;
    let rows = vec![acct("a", u64::MAX, 100, 1), acct("b", 2, 100, 1)];
    let m = result("h2", 0, rows);
    assert!(m.body.contains("\"transactions\":1,"), "the wrapped count: {}", m.body);
    agg.apply(Source::Results, keep(Source::Results, &[m, sealed("h2", 1)])).await;
    let r = report_of(&store, "h2").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    // Two rows for a chunk of one transaction: refused before they are summed.
    assert!(r.failed_chunks[0].reason.contains("result has 2 account rows; its chunk has 1 transactions"), "{:?}", r.failed_chunks);
    let ok = report_of(&store, "ok").await.unwrap();
    assert_eq!((ok.status, ok.transactions.processed, ok.accounts[0].gross.as_str()), (JobStatus::Complete, 1, "5.00"));
}

#[tokio::test]
async fn hostile_results_are_bounded_by_their_declared_rows_and_their_own_keys() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("x1", &[2, 2, 2, 2])).await;
    put_manifest(&store, &manifest("other", &[1])).await;
    // A payload of 2 declared rows that inflates to 16 MiB: refused at its cap (2 rows' worth).
    let long_id = "a".repeat(16 << 20);
    let bomb = accounts_to_zstd_csv(
        [fleet_domain::billing::RowRef { account_id: &long_id, currency: "EUR", count: 2, gross: Decimal::new(100, 2), fees: Decimal::new(10, 2) }].into_iter(),
    );
    assert!(bomb.len() < 64 * 1024, "a small message: {} bytes", bomb.len());
    let inline_bomb = with_payload("x1", 0, 2, AccountsPayload::ZstdCsv { data: fleet_domain::codec::base64_encode(&bomb) });
    // The same as a result blob (its declared raw size a lie too).
    let key = fleet_domain::layout::result_key("x1", 1);
    store.put(&key, Bytes::from(bomb.clone()), "application/zstd").await.unwrap();
    let blob_bomb = with_payload(
        "x1",
        1,
        2,
        AccountsPayload::Blob { blob: BlobRef { key, sha256: sha256_hex(&bomb), compressed_bytes: bomb.len() as u64, raw_bytes: 1 << 30 } },
    );
    // A result pointing at another job's object (its checksum right).
    let theirs = fleet_domain::layout::result_key("other", 0);
    let good = accounts_to_zstd_csv(
        [fleet_domain::billing::RowRef { account_id: "a", currency: "EUR", count: 2, gross: Decimal::new(100, 2), fees: Decimal::new(10, 2) }].into_iter(),
    );
    store.put(&theirs, Bytes::from(good.clone()), "application/zstd").await.unwrap();
    let foreign = with_payload(
        "x1",
        2,
        2,
        AccountsPayload::Blob { blob: BlobRef { key: theirs, sha256: sha256_hex(&good), compressed_bytes: good.len() as u64, raw_bytes: 1024 } },
    );
    // A failure report whose count would wrap a sum: it contradicts the chunk's record (refused,
    // quarantined); the real one counts.
    let huge = failed("x1", 3, u64::MAX, "hostile count");
    let agg = quick(store.clone());
    let batch = [
        inline_bomb,
        blob_bomb,
        foreign,
        huge,
        failed("x1", 3, 2, "bad rows"),
        sealed("x1", 4),
        result("other", 0, vec![acct("z", 1, 500, 5)]),
        sealed("other", 1),
    ];
    let applied = agg.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert_eq!(applied.delete.len(), batch.len());
    let refused = quarantined_of(&store, "x1").await;
    assert_eq!(refused.len(), 1, "the forged count is quarantined");
    assert!(refused[0].contains("declares 18446744073709551615 transactions; the chunk has 2"), "{}", refused[0]);
    let r = report_of(&store, "x1").await.expect("finished");
    assert_eq!(r.status, JobStatus::Partial);
    let reasons: Vec<(u32, &str)> = r.failed_chunks.iter().map(|f| (f.chunk, f.reason.as_str())).collect();
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    // The chunk's worth of bytes (its record: 2 rows of 200 bytes), not the 16 MiB the payloads hold
    // nor the 1 GiB the blob claims.
    let cap = format!("decompresses to more than {} bytes", limits::Figures { transactions: 2, raw_bytes: Some(200) }.max_bytes());
    assert!(reasons[0].1.contains("result unreadable") && reasons[0].1.contains(&cap), "{reasons:?}");
    assert!(reasons[1].1.contains("result unreadable") && reasons[1].1.contains(&cap), "{reasons:?}");
    assert!(reasons[2].1.contains("is not the key of job x1 chunk 2"), "{reasons:?}");
    assert_eq!(r.transactions.failed, 8, "failed chunks count their manifest's transactions, not what hostile results declared");
    assert_eq!(r.transactions.processed, 0);
    let ok = report_of(&store, "other").await.unwrap();
    assert_eq!((ok.status, ok.transactions.processed), (JobStatus::Complete, 1));
}

#[tokio::test]
async fn a_result_whose_blob_is_gone_fails_its_chunk_and_stranded_results_count() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("s1", &[1, 1])).await;
    let agg = quick(store.clone());
    let lost = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: "s1".into(),
        chunk: 1,
        transactions: 1,
        outcome: ChunkOutcome::Processed {
            payload: AccountsPayload::Blob {
                blob: BlobRef { key: fleet_domain::layout::result_key("s1", 1), sha256: "0".repeat(64), compressed_bytes: 9, raw_bytes: 9 },
            },
        },
        requests: RequestCounts::default(),
    });
    // From the results dead-letter queue (S3 was down for minutes): applied like any result.
    let applied = agg.apply(Source::ResultsDeadLetter, keep(Source::ResultsDeadLetter, &[sealed("s1", 2), result("s1", 0, vec![acct("a", 1, 100, 1)])])).await;
    assert!(applied.delete.is_empty());
    let applied = agg.apply(Source::ResultsDeadLetter, keep(Source::ResultsDeadLetter, &[msg(serde_json::to_string(&lost).unwrap())])).await;
    assert_eq!(applied.delete.len(), 3);
    assert!(applied.delete.iter().all(|k| k.queue() == Source::ResultsDeadLetter.default_queue()));
    let r = report_of(&store, "s1").await.unwrap();
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Partial, 1, 1));
    assert!(r.failed_chunks[0].reason.contains("result unreadable"), "{:?}", r.failed_chunks);
}

/// Sequence 5: results for chunks 0, 1 and 5 of a three-chunk job arrive before its seal. Chunk 5
/// has no chunk blob: it is not counted, so the seal of 3 does not complete the job without chunk 2,
/// and the totals never hold chunk 5's rows (a 3-row job was once reported complete with 11).
#[tokio::test]
async fn a_chunk_beyond_the_job_before_its_seal_is_not_counted() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("bj", &[1, 1, 1])).await;
    let agg = quick(store.clone());
    let one = |c: u32| result("bj", c, vec![acct("a", 1, 100, 1)]);
    let forged = result("bj", 5, vec![acct("a", 8, 800, 8), acct("evil", 1, 100, 0)]);
    agg.apply(Source::Results, keep(Source::Results, &[one(0), one(1), forged])).await;
    agg.apply(Source::Results, keep(Source::Results, &[sealed("bj", 3)])).await;
    assert!(report_of(&store, "bj").await.is_none(), "complete without chunk 2");
    agg.apply(Source::Results, keep(Source::Results, &[one(2)])).await;
    let r = report_of(&store, "bj").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 3));
    assert_eq!(r.accounts.iter().map(|a| (a.account_id.as_str(), a.count)).collect::<Vec<_>>(), [("a", 3)]);
    // A real failure report for a chunk whose blob is gone, before the seal: it waits on the queue
    // (the job has no record of the chunk until its manifest is written), then counts.
    put_records(&store, "gone", &[1]).await;
    let report = failed("gone", 1, 1, "blob does not exist");
    let first = agg.apply(Source::Results, keep(Source::Results, &[one_of("gone", 0), report.clone()])).await;
    assert!(first.release.len() == 1 && first.delete.is_empty(), "the report waits on the queue, the result in the job");
    store.put(&manifest_key("gone"), Bytes::from(serde_json::to_vec(&manifest("gone", &[1, 1])).unwrap()), "application/json").await.unwrap();
    agg.apply(Source::Results, keep(Source::Results, &[sealed("gone", 2)])).await;
    assert!(report_of(&store, "gone").await.is_none(), "the failure report was not counted before the seal");
    agg.apply(Source::Results, keep(Source::Results, &[report])).await;
    let r = report_of(&store, "gone").await.expect("finished once the report came back");
    assert_eq!((r.status, r.failed_chunks.len(), r.failed_chunks[0].chunk), (JobStatus::Partial, 1, 1));
}

/// Sequence 6: a failure report on the last chunk lands before its real result. The job waits the
/// settle time before it is finished, and the real result replaces the failure (it was once
/// finished `partial` at once and the real result dropped). A failure with nothing after it
/// finishes the job `partial` once the settle time has passed.
#[tokio::test(start_paused = true)]
async fn a_real_result_after_a_failure_on_the_last_chunk_still_counts() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("ff", &[1, 1])).await;
    put_manifest(&store, &manifest("fp", &[1, 1])).await;
    let agg = Aggregator::with(store.clone(), Options::default());
    let one = |job: &str, c: u32| result(job, c, vec![acct("a", 1, 100, 1)]);
    for job in ["ff", "fp"] {
        agg.apply(Source::Results, keep(Source::Results, &[one(job, 0), sealed(job, 2), failed(job, 1, 1, "bad rows")])).await;
    }
    agg.flush_idle().await;
    assert!(report_of(&store, "ff").await.is_none() && report_of(&store, "fp").await.is_none(), "finished before the settle time");
    tokio::time::advance(SETTLE / 2).await;
    agg.apply(Source::Results, keep(Source::Results, &[one("ff", 1)])).await;
    let r = report_of(&store, "ff").await.expect("the real result completes it");
    assert_eq!((r.status, r.transactions.processed, r.failed_chunks.len()), (JobStatus::Complete, 2, 0));
    agg.flush_idle().await;
    assert!(report_of(&store, "fp").await.is_none());
    tokio::time::advance(SETTLE / 2).await;
    agg.flush_idle().await;
    let r = report_of(&store, "fp").await.expect("finished once settled");
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Partial, 1, 1));
}

/// Issue 58, remnant: a job whose results account for fewer transactions than its manifest accepted
/// (processed + failed != accepted) is never written `complete`.
#[tokio::test]
async fn a_report_is_complete_only_when_every_accepted_transaction_is_counted() {
    let store = MemoryStore::new();
    let mut m = manifest("cnt", &[1, 1]);
    put_manifest(&store, &m).await;
    // The manifest's own figures disagree with its chunks (accepted 3, chunks 1 + 1).
    m.accepted = 3;
    store.put(&manifest_key("cnt"), Bytes::from(serde_json::to_vec(&m).unwrap()), "application/json").await.unwrap();
    let agg = quick(store.clone());
    let msgs = [result("cnt", 0, vec![acct("a", 1, 100, 1)]), result("cnt", 1, vec![acct("b", 1, 100, 1)]), sealed("cnt", 2)];
    agg.apply(Source::Results, keep(Source::Results, &msgs)).await;
    let r = report_of(&store, "cnt").await.expect("finished");
    assert_eq!(r.status, JobStatus::Partial, "{:?}", r.note);
    assert!(r.note.as_deref().is_some_and(|n| n.contains("manifest accepted 3")), "{:?}", r.note);
}
