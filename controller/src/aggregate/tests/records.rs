//! Messages held to the job's own records and to their sender's role: a seal, a count or a payload
//! that disagrees with the records is refused, results of jobs nobody submitted make nothing, and
//! only a role that may send a message makes it count.

use super::*;

/// Issue bug 1: a seal smaller than the manifest is refused (quarantined with the reason), never
/// applied: the job is not finished from the chunks that arrived; the real seal finishes it exact.
#[tokio::test]
async fn a_seal_that_disagrees_with_the_manifest_is_quarantined_never_applied() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("s3", &[1, 1, 1])).await;
    let agg = quick(store.clone());
    let one = |c: u32| result("s3", c, vec![acct("a", 1, 100, 1)]);
    let applied = agg.apply(Source::Results, keep(Source::Results, &[sealed("s3", 1), one(0)])).await;
    assert_eq!(applied.delete.len(), 1, "the forged seal is quarantined and deleted; the result waits for a checkpoint");
    assert!(report_of(&store, "s3").await.is_none(), "a seal of 1 does not finish a job of 3 chunks");
    let why = quarantined_of(&store, "s3").await;
    assert!(why.len() == 1 && why[0].contains("says 1 chunks, its manifest 3"), "{why:?}");
    agg.apply(Source::Results, keep(Source::Results, &[one(1), one(2), sealed("s3", 3)])).await;
    let r = report_of(&store, "s3").await.expect("the real seal finishes it");
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Complete, 3, 0));
}

/// Issue bug 2: a result declaring more rows than its chunk has is refused, not counted; the real
/// result is.
#[tokio::test]
async fn a_result_whose_count_differs_from_its_chunk_is_refused_never_counted() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("c3", &[3])).await;
    let agg = quick(store.clone());
    let forged = result("c3", 0, vec![acct("a", 3, 300, 3), acct("evil", 8, 800, 0)]);
    let real = result("c3", 0, vec![acct("a", 3, 300, 3)]);
    agg.apply(Source::Results, keep(Source::Results, &[forged, real, sealed("c3", 1)])).await;
    let r = report_of(&store, "c3").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 3), "11 transactions are never billed for 3 accepted");
    assert_eq!(r.accounts.iter().map(|a| a.account_id.as_str()).collect::<Vec<_>>(), ["a"]);
    let why = quarantined_of(&store, "c3").await;
    assert!(why.len() == 1 && why[0].contains("declares 11 transactions; the chunk has 3 as recorded"), "{why:?}");
}

/// Issue bug 3: a few kilobytes that declare 200,000 rows for a chunk of 3 are refused before any
/// decoding; one that declares the chunk's 3 rows is decoded within the chunk's figures (stopped at
/// its 4th row), and nothing held at once ever exceeds the memory budget.
#[tokio::test]
async fn a_well_formed_bomb_is_capped_by_its_chunk_and_the_budget() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("b3", &[3])).await;
    let rows: Vec<AccountTotals> = (0..200_000).map(|i| acct(&format!("x{i}"), 1, 1, 0)).collect();
    let csv = accounts_to_zstd_csv(rows.iter().map(AccountTotals::borrowed));
    assert!(csv.len() < 1 << 20, "small on the wire: {} bytes", csv.len());
    let data = fleet_domain::codec::base64_encode(&csv);
    let declared = with_payload("b3", 0, 200_000, AccountsPayload::ZstdCsv { data: data.clone() });
    let lying = with_payload("b3", 0, 3, AccountsPayload::ZstdCsv { data });
    let agg = quick_with(store.clone(), Options { decode_budget: 1 << 20, ..Options::default() });
    agg.apply(Source::Results, keep(Source::Results, &[declared, lying, sealed("b3", 1)])).await;
    let r = report_of(&store, "b3").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Partial, 0, 3));
    assert!(r.failed_chunks[0].reason.contains("decompresses to more than"), "{:?}", r.failed_chunks);
    assert!(agg.decode_budget().high_water() <= 1 << 20);
    assert!(quarantined_of(&store, "b3").await[0].contains("declares 200000 transactions"));
}

/// Issue bug 4: results for job ids nobody submitted make no job, lease, checkpoint or report: they
/// wait a few receives on the queue, then are quarantined; from a dead-letter queue, at once.
#[tokio::test]
async fn results_for_jobs_nobody_submitted_make_nothing_and_are_quarantined() {
    let store = MemoryStore::new();
    let agg = quick(store.clone());
    let forged: Vec<Message> = (0..50).map(|i| result(&format!("forged{i}"), 0, vec![acct("a", 1, 100, 1)])).collect();
    let first = agg.apply(Source::Results, keep(Source::Results, &forged)).await;
    assert_eq!((first.release.len(), first.delete.len()), (50, 0), "back to the queue for a while");
    let again: Vec<Message> = forged.iter().map(|m| Message { receive_count: UNRECORDED_RECEIVES, ..m.clone() }).collect();
    let last = agg.apply(Source::Results, keep(Source::Results, &again)).await;
    assert_eq!((last.release.len(), last.delete.len()), (0, 50), "quarantined, then deleted");
    let dead = agg.apply(Source::ResultsDeadLetter, keep(Source::ResultsDeadLetter, &forged[..5])).await;
    assert_eq!(dead.delete.len(), 5, "from the dead-letter queue at once");
    assert_eq!(agg.memory().open_jobs(), 0);
    for prefix in ["leases/", "jobs/", "open/", "warehouse/", "tables/"] {
        assert!(store.list(prefix, 10).await.unwrap().is_empty(), "nothing under {prefix}");
    }
    assert_eq!(quarantined_of(&store, "forged7").await.len(), 1);
}

/// Issue bug 5: a seal for a job with no manifest is quarantined after a bounded wait, never cycled.
#[tokio::test]
async fn a_seal_without_a_manifest_is_quarantined_after_a_bounded_wait() {
    let store = MemoryStore::new();
    put_records(&store, "nm", &[1]).await;
    let agg = quick(store.clone());
    let seal = sealed("nm", 1);
    assert_eq!(agg.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&seal))).await.release.len(), 1);
    let late = Message { receive_count: UNRECORDED_RECEIVES, ..seal };
    assert_eq!(agg.apply(Source::Results, keep(Source::Results, &[late])).await.delete.len(), 1);
    let why = quarantined_of(&store, "nm").await;
    assert!(why.len() == 1 && why[0].contains("has no manifest"), "{why:?}");
}

/// Issue 58, remnants: a chunk blob without a record (the release before records) is held to the
/// manifest once the manifest exists, not to the message's own count; and a result that could decode
/// to more than the whole decode budget is refused, not decoded alone past it.
#[tokio::test]
async fn an_unrecorded_chunk_is_judged_by_the_manifest_and_an_oversized_share_refused() {
    let store = MemoryStore::new();
    put_chunks(&store, "old", 2).await;
    let m = manifest("old", &[3, 2]);
    store.put(&manifest_key("old"), Bytes::from(serde_json::to_vec(&m).unwrap()), "application/json").await.unwrap();
    let agg = quick_with(store.clone(), Options { decode_budget: 4 << 20, ..Options::default() });
    // 11 transactions declared for a chunk of 3: refused against the manifest.
    let eleven = result("old", 0, (0..11).map(|i| acct(&format!("a{i}"), 1, 100, 1)).collect());
    let applied = agg.apply(Source::Results, keep(Source::Results, &[eleven])).await;
    assert_eq!(applied.delete.len(), 1, "quarantined");
    let why = quarantined_of(&store, "old").await;
    assert!(why.iter().any(|w| w.contains("declares 11 transactions; the chunk has 3")), "{why:?}");
    // Without a manifest, the declared count is all there is: a result declaring a million rows
    // could decode far past a 4 MiB budget, and is refused.
    put_chunks(&store, "old2", 1).await;
    let huge = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: "old2".into(),
        chunk: 0,
        transactions: 1_000_000,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: vec![acct("z", 1_000_000, 100, 1)] } },
        requests: RequestCounts::default(),
    });
    let applied = agg.apply(Source::Results, keep(Source::Results, &[msg(serde_json::to_string(&huge).unwrap())])).await;
    assert_eq!(applied.delete.len(), 1, "quarantined");
    let why = quarantined_of(&store, "old2").await;
    assert!(why.iter().any(|w| w.contains("more than the decode budget")), "{why:?}");
    assert_eq!(agg.memory().open_jobs(), 0, "nothing applied");
}

/// `m` signed with `key` (as its role's sender signs it).
fn signed(mut m: Message, key: &fleet_io::auth::Key) -> Message {
    m.attrs.auth = Some(key.sign(&m.body));
    m
}

/// `m` (a result) with its chunk's token, as `submitter` made it for the work item.
fn with_token(mut m: Message, submitter: &fleet_io::auth::Key) -> Message {
    let Ok(ResultMessage::Chunk(c)) = serde_json::from_str::<ResultMessage>(&m.body) else { panic!("a result") };
    m.attrs.chunk_token = Some(submitter.chunk_token(&c.job_id, c.chunk));
    m
}

/// Issue 58, findings 2 and 4 (authority by role): with a keyring, a message counts only when a role
/// that may send it signed it. A processor's forged abandon (any results-queue sender knew the job's
/// id) and an unsigned or submitter-signed result are quarantined; the job finishes exact from its
/// processors' results and its submitter's seal; an operator's abandon still ends a job.
#[tokio::test]
async fn only_a_role_that_may_send_a_message_makes_it_count() {
    use fleet_io::auth::{Key, Keyring, Role};
    let (processor, submitter, operator) = (Key::generate(Role::Processor), Key::generate(Role::Submitter), Key::generate(Role::Operator));
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("rl", &[1, 1])).await;
    let keyring = Some(Keyring::new([processor.clone(), submitter.clone(), operator.clone()]));
    let agg = quick_with(store.clone(), Options { keyring, ..Options::default() });
    let forged = [
        signed(abandon("rl"), &processor),
        result("rl", 0, vec![acct("mallory", 1, 99_999_999_999, 0)]),
        signed(result("rl", 1, vec![acct("mallory", 1, 99_999_999_999, 0)]), &submitter),
        signed(sealed("rl", 2), &processor),
    ];
    let applied = agg.apply(Source::Results, keep(Source::Results, &forged)).await;
    assert_eq!(applied.delete.len(), 4, "all four quarantined, then deleted");
    assert_eq!(agg.memory().open_jobs(), 0, "nothing of the job loaded or leased");
    let why = quarantined_of(&store, "rl").await;
    assert_eq!(why.len(), 4, "{why:?}");
    assert!(why.iter().any(|w| w.contains("an abandon of job rl signed by a processor, which may not send one")), "{why:?}");
    assert!(why.iter().any(|w| w.contains("is not signed")), "{why:?}");
    // A rogue processor's result with the recorded count and its own account, signed with its own
    // key but without the chunk's token (it was not handed the work item).
    let rogue = signed(result("rl", 0, vec![acct("mallory", 1, 99_999_999_999, 0)]), &processor);
    assert_eq!(agg.apply(Source::Results, keep(Source::Results, &[rogue])).await.delete.len(), 1);
    assert!(quarantined_of(&store, "rl").await.iter().any(|w| w.contains("no valid token of its chunk")));
    let real = [
        signed(with_token(result("rl", 0, vec![acct("a", 1, 100, 1)]), &submitter), &processor),
        signed(with_token(result("rl", 1, vec![acct("b", 1, 200, 2)]), &submitter), &processor),
        signed(sealed("rl", 2), &submitter),
    ];
    agg.apply(Source::Results, keep(Source::Results, &real)).await;
    let r = report_of(&store, "rl").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed, r.accounts.len()), (JobStatus::Complete, 2, 2));
    assert!(r.accounts.iter().all(|a| a.account_id != "mallory"));
    // An operator's abandon counts.
    put_manifest(&store, &manifest("op", &[1, 1])).await;
    agg.apply(Source::Results, keep(Source::Results, &[signed(with_token(result("op", 0, vec![acct("a", 1, 100, 1)]), &submitter), &processor)])).await;
    agg.apply(Source::Results, keep(Source::Results, &[signed(abandon("op"), &operator)])).await;
    assert_eq!(report_of(&store, "op").await.expect("abandoned").status, JobStatus::Abandoned);
}
