//! The status page's unit tests: what it shows of the fleet, the jobs and the quarantine, and how
//! often it asks the store.

use super::*;
use fleet_io::blob::memory::MemoryStore;
use fleet_io::call::Op;
use fleet_io::queue::memory::MemoryQueue;

const TOKEN: &str = "page-token-0123456789";

fn source(store: Arc<MemoryStore>, agent_url: Option<String>) -> StatusSource {
    let q = |n: &str| -> Arc<dyn Queue> { MemoryQueue::new(n, Duration::from_secs(30)) };
    let queues = vec![("work", q("w")), ("results", q("r")), ("work_dlq", q("wd")), ("results_dlq", q("rd"))];
    StatusSource::new("c1".into(), store, queues, Engines::default(), agent_url, Some(AdminToken::parse(TOKEN).unwrap()))
}

#[tokio::test]
async fn the_document_lists_open_jobs_with_progress_and_says_which_source_is_down() {
    use fleet_domain::layout::{checkpoint_key, legacy_checkpoint_key};
    let store = MemoryStore::new();
    store.put("open/j1", Bytes::new(), "text/plain").await.unwrap();
    store.put("open/j2", Bytes::new(), "text/plain").await.unwrap();
    let p = Progress {
        status: fleet_domain::model::JobStatus::Running,
        sealed: true,
        total: Some(8),
        accounted: 3,
        failed: 1,
        processed: 15,
        updated_unix: 7,
        partition: Some(2),
    };
    store.put_if(&checkpoint_key("j1"), Bytes::from_static(b"{}"), "application/json", &p.to_meta(), &fleet_io::blob::Cond::Any).await.unwrap();
    // A job begun before `checkpoints/`: its checkpoint where an earlier release kept it.
    store.put("open/j3", Bytes::new(), "text/plain").await.unwrap();
    let p3 = Progress { accounted: 5, ..p };
    store.put_if(&legacy_checkpoint_key("j3"), Bytes::from_static(b"{}"), "application/json", &p3.to_meta(), &fleet_io::blob::Cond::Any).await.unwrap();
    // An agent URL where nothing listens: its section is down, the rest is there.
    let s = source(store, Some("http://127.0.0.1:9".into()));
    let doc: Value = serde_json::from_slice(&s.document().await).unwrap();
    let open = doc["open_jobs"]["Ok"].as_array().unwrap();
    assert_eq!(open.len(), 3, "{doc}");
    assert_eq!((open[2]["job_id"].as_str(), open[2]["accounted"].as_u64()), (Some("j3"), Some(5)), "{doc}");
    assert_eq!((open[0]["job_id"].as_str(), open[0]["total_chunks"].as_u64(), open[0]["accounted"].as_u64()), (Some("j1"), Some(8), Some(3)));
    assert!(open[1].get("status").is_none(), "j2 has no checkpoint: no progress");
    assert!(doc["agent"]["Err"]["error"].as_str().unwrap().contains("127.0.0.1:9"), "{doc}");
    assert_eq!(doc["queues_from"], "sqs");
    assert_eq!(doc["queues"]["Ok"].as_array().unwrap().len(), 4);
    assert_eq!(doc["quarantined"]["Ok"], 0);
}

#[test]
fn queue_lines_come_from_the_agents_last_look() {
    let q = |n: &str| -> Arc<dyn Queue> { MemoryQueue::new(n, Duration::from_secs(30)) };
    let queues = vec![("work", q("w")), ("results", q("r"))];
    let state = serde_json::json!({
        "depths": { "work": {"visible": 5, "in_flight": 2, "delayed": 0}, "results": {"visible": 1, "in_flight": 0, "delayed": 3} },
        "observed": { "oldest_age": {"secs": 4, "nanos": 500_000_000} }
    });
    let lines = queues_from_agent(&state, &queues).unwrap();
    assert_eq!((lines[0].visible, lines[0].in_flight, lines[0].oldest_age_s), (5, 2, Some(4.5)));
    assert_eq!((lines[1].delayed, lines[1].oldest_age_s), (3, None));
    assert!(queues_from_agent(&serde_json::json!({ "depths": null }), &queues).is_none(), "no look yet: read SQS");
}

/// Serves `s`'s router on a free port; its address.
async fn serve(s: StatusSource) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, s.router()).await });
    addr
}

/// One GET over a fresh connection: status code and body.
async fn get(addr: std::net::SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    c.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n{auth}\r\n").as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    c.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text.split("\r\n\r\n").nth(1).unwrap_or_default().to_string())
}

#[tokio::test]
async fn reports_and_job_detail_are_served_only_with_the_pages_token() {
    let store = MemoryStore::new();
    let report = format!("{{\"job_id\":\"j1\",\"accounts\":[{}]}}", vec!["{\"account_id\":\"A1\",\"net\":\"1.00\"}"; 5000].join(","));
    store.put(&report_key("j1"), Bytes::from(report.clone()), "application/json").await.unwrap();
    let addr = serve(source(store.clone(), None)).await;

    for path in ["/jobs/j1/report", "/jobs/j1"] {
        let (code, body) = get(addr, path, None).await;
        assert_eq!(code, 401, "{path} without the token: {body}");
        assert!(!body.contains("A1"), "nothing of the report: {body}");
        assert_eq!(get(addr, path, Some("page-token-wrong-789")).await.0, 401, "{path} with another token");
    }
    let (code, body) = get(addr, "/jobs/j1/report", Some(TOKEN)).await;
    assert_eq!((code, body.len()), (200, report.len()), "the report, whole, with the token");
    assert_eq!(body, report);
    let (code, body) = get(addr, "/jobs/j1", Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("/jobs/j1/report"), "{body}");
    assert_eq!(get(addr, "/jobs/nope/report", Some(TOKEN)).await.0, 404);
    // The page and its document need no token: they carry no money.
    assert_eq!(get(addr, "/", None).await.0, 200);
    assert_eq!(get(addr, "/status.json", None).await.0, 200);

    // A controller without a token serves no billing data to anyone.
    let q = |n: &str| -> Arc<dyn Queue> { MemoryQueue::new(n, Duration::from_secs(30)) };
    let open = StatusSource::new("c2".into(), store, vec![("results", q("r"))], Engines::default(), None, None);
    let addr = serve(open).await;
    let (code, body) = get(addr, "/jobs/j1/report", Some(TOKEN)).await;
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("--page-token-file"), "{body}");
}

#[tokio::test]
async fn the_quarantine_count_is_read_at_most_once_a_minute() {
    let store = MemoryStore::new();
    let s = source(store.clone(), None);
    let lists = || store.calls().snapshot().calls(Op::S3ListObjectsV2);
    assert_eq!(s.quarantined().await, Ok(0));
    let after_first = lists();
    assert!(after_first >= 1, "the first count lists");
    assert_eq!(s.quarantined().await, Ok(0));
    assert_eq!(lists(), after_first, "the second within a minute does not");
}
