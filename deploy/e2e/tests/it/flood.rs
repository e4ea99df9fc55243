//! Benchmark (ignored by `cargo test`; run by `deploy/bench-flood.sh`): the controller's memory under a
//! flood of crafted results. A real job is submitted in chunks of 50,000 transactions (no processor
//! runs), then the results queue is flooded with well-formed bombs for its chunks: each declares its
//! chunk's count (so it passes the records check) and carries 60,000 account rows in about 150 KB, so each
//! decodes up to its chunk's cap before it is refused. A real controller process takes them; its peak
//! RSS (VmHWM) is printed for two decode budgets, next to its RSS when idle.

use std::time::{Duration, Instant};

use fleet_domain::billing::AccountTotals;
use fleet_domain::model::{AccountsPayload, ChunkOutcome, ChunkResult, ResultMessage};
use fleet_domain::requests::RequestCounts;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue as _;

use crate::support::Fleet as _;
use rust_decimal::Decimal;

/// `VmRSS` and `VmHWM` of a process, KiB.
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| status.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0);
    (field("VmRSS:"), field("VmHWM:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a benchmark: deploy/bench-flood.sh"]
async fn bench_controller_rss_under_a_flood_of_crafted_results() {
    let floods: usize = std::env::var("FLOOD_MESSAGES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
    for budget_mib in ["64", "256"] {
        let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 5, visibility_timeout: Duration::from_secs(30) }).await else { return };
        let dir = tempfile::tempdir().unwrap();
        let files = vec![crate::support::generated(dir.path(), "flood.csv", 500_000, 2_000, 7)];
        let job = st.submit(&files, 50_000).await;
        let rows: Vec<AccountTotals> = (0..60_000)
            .map(|i| AccountTotals { account_id: format!("b{i}"), currency: "EUR".into(), count: 1, gross: Decimal::ONE, fees: Decimal::ZERO })
            .collect();
        let data = fleet_domain::codec::base64_encode(&fleet_domain::codec::accounts_to_zstd_csv(rows.iter().map(AccountTotals::borrowed)));
        let body = |c: u32| {
            serde_json::to_string(&ResultMessage::Chunk(ChunkResult {
                v: 1,
                job_id: job.job_id.clone(),
                chunk: c,
                transactions: 50_000,
                outcome: ChunkOutcome::Processed { payload: AccountsPayload::ZstdCsv { data: data.clone() } },
                requests: RequestCounts::default(),
            }))
            .unwrap()
        };
        let t = Instant::now();
        let bodies: Vec<String> = (0..floods).map(|i| body((i % job.total_chunks as usize) as u32)).collect();
        futures::future::join_all(bodies.chunks(10).map(|b| st.results.send(b.to_vec()))).await.into_iter().for_each(|r| {
            r.unwrap();
        });
        let sent = t.elapsed();
        let envs = [("CONTROLLER_DECODE_BUDGET_MIB", budget_mib), ("CONTROLLER_SETTLE_SECS", "600")];
        let mut ctl = crate::support::controller_process(&st, "flood", &envs);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let idle = rss_kib(ctl.id());
        let t = Instant::now();
        let mut peak = idle.1;
        loop {
            let d = st.results.depth().await.unwrap();
            peak = peak.max(rss_kib(ctl.id()).1);
            if d.visible + d.in_flight == 0 || t.elapsed() > Duration::from_secs(600) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let took = t.elapsed();
        peak = peak.max(rss_kib(ctl.id()).1);
        println!(
            "== flood: {floods} results of {} KB each ({} MB sent in {:.1} s), decode budget {budget_mib} MiB: controller RSS idle {} MiB, peak {} MiB, drained in {:.1} s",
            bodies[0].len() / 1000,
            bodies.iter().map(String::len).sum::<usize>() / 1_000_000,
            sent.as_secs_f64(),
            idle.0 / 1024,
            peak / 1024,
            took.as_secs_f64()
        );
        let _ = ctl.kill();
        let _ = ctl.wait();
    }
}
