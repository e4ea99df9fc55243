//! The controller's status page in a real headless browser (Debian's Chromium) on the real stack: the
//! page loads with its script, shows a job submitted by the test under way and then complete (with a
//! link to its report), the queues and the agent's fleet; with the agent stopped it says so and goes
//! on showing jobs and queues (read from SQS then).
//!
//! The browser runs the page's script against the controller (`--dump-dom` after a virtual-time
//! budget): what is asserted is the DOM the script built from `/status.json`, as a person would see
//! it. `FLEET_STATUS_SCREENSHOT=DIR` also saves screenshots of each step there. The page is on its own
//! address; its report is refused without the page's token and served with it.

use std::process::Command;
use std::time::{Duration, Instant};

use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue;
use tokio_util::sync::CancellationToken;

use crate::support::Fleet as _;
use crate::support::*;

/// Chromium's binary, when installed (`deploy/test.sh` installs it).
fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"].into_iter().find(|b| Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()))
}

fn headless(browser: &str) -> Command {
    let mut c = Command::new(browser);
    // --no-sandbox: the tests run as root in CI; the page is our own.
    c.args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--window-size=1280,1100"]);
    c.arg(format!("--user-data-dir={}", std::env::temp_dir().join(format!("fleet-chromium-{}", std::process::id())).display()));
    c
}

/// The DOM after the page's script ran for a few (virtual) seconds, without the script itself (its
/// text holds the markup it makes).
async fn dom(browser: &'static str, url: String) -> String {
    tokio::task::spawn_blocking(move || {
        let out = headless(browser).args(["--virtual-time-budget=3000", "--dump-dom", &url]).output().expect("run chromium");
        assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
        let d = String::from_utf8_lossy(&out.stdout).into_owned();
        d.split("<script>").next().unwrap_or_default().to_string()
    })
    .await
    .unwrap()
}

/// Saves a screenshot when `FLEET_STATUS_SCREENSHOT` names a directory.
async fn screenshot(browser: &'static str, url: String, name: &str) {
    let Some(dir) = std::env::var_os("FLEET_STATUS_SCREENSHOT") else { return };
    let path = std::path::Path::new(&dir).join(format!("{name}.png"));
    tokio::task::spawn_blocking(move || {
        let _ = headless(browser).args(["--virtual-time-budget=3000", &format!("--screenshot={}", path.display()), &url]).output();
    })
    .await
    .unwrap();
}

/// Polls the page until `pred` holds for its DOM; the last DOM on failure.
async fn until(browser: &'static str, url: &str, within: Duration, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let d = dom(browser, url.to_string()).await;
        if pred(&d) {
            return d;
        }
        assert!(t0.elapsed() < within, "the page did not show {what} within {within:?}; its DOM:\n{d}");
        // A browser start is heavy on two cores shared with the other tests: a look a second.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A GET carrying the page's bearer token: the whole answer.
async fn get_with_token(addr: &str, path: &str, token: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n").as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_a_job_to_completion_and_keeps_working_without_the_agent() {
    let Some(browser) = chromium() else {
        assert!(std::env::var_os("FLEET_REQUIRE_STACK").is_none(), "Chromium is not installed (deploy/test.sh installs it)");
        eprintln!("skipped: no Chromium");
        return;
    };
    let Some(s) = stack(QueueSettings::default()).await else { return };
    let stop = CancellationToken::new();
    let agent_http = free_addr();
    let agent_stop = CancellationToken::new();
    let agent = {
        let watched =
            scaling_agent::Watched { work: s.work.clone(), work_dlq: s.work_dlq.clone(), results: s.results.clone(), results_dlq: s.results_dlq.clone() };
        let deps = scaling_agent::Deps {
            watched,
            publish: s.names.trigger_bus(),
            subscription: None,
            backend: std::sync::Arc::new(scaling_agent::backend::NoneBackend::new(1)),
        };
        let settings = scaling_agent::Settings { http_addr: Some(agent_http), ..scaling_agent::Settings::quick() };
        tokio::spawn(scaling_agent::run(settings, deps, agent_stop.clone()))
    };
    let (controller_http, controller_page) = (free_addr(), free_addr());
    const TOKEN: &str = "status-page-test-token-42";
    let controller = tokio::spawn(controller::run(
        controller::Settings {
            listener: fleet_engine::args::ListenerArgs { http_addr: Some(controller_http), ..fleet_engine::args::ListenerArgs::quick() },
            page_addr: Some(controller_page),
            page_token: Some(fleet_engine::admin::AdminToken::parse(TOKEN).unwrap()),
            drain_secs: 10,
            settle_secs: 3,
            agent_url: Some(format!("http://{agent_http}")),
            ..Default::default()
        },
        controller::Deps {
            results: s.results.clone(),
            work_dlq: s.work_dlq.clone(),
            results_dlq: s.results_dlq.clone(),
            store: s.store.clone(),
            work: Some(s.work.clone()),
            triggers: s.names.subscribe([s.results.name(), s.work_dlq.name(), s.results_dlq.name()].map(fleet_io::trigger::work_key).to_vec(), &stop),
            publish: s.names.trigger_bus(),
        },
        stop.clone(),
    ));
    let url = format!("http://{controller_page}/");

    // Loads, with its script: the fleet section from the agent, four queues, no job yet.
    let d = until(browser, &url, Duration::from_secs(30), "the agent's fleet and four queues", |d| {
        d.contains(r#"id="agent" data-state="up""#) && d.matches("<tr data-queue=").count() == 4
    })
    .await;
    assert!(d.contains(r#"id="no-open""#), "a new stack has no job under way: {d}");
    // Metrics and health on their own address, the page on its own.
    assert!(get(&controller_http.to_string(), "/metrics").await.is_some_and(|r| r.starts_with("HTTP/1.0 200")));
    assert!(get(&controller_http.to_string(), "/status.json").await.is_some_and(|r| r.starts_with("HTTP/1.0 404")), "no page beside the metrics");

    // A job submitted while no processor runs: under way, its chunks known once it is sealed.
    let dir = tempfile::tempdir().unwrap();
    let files = vec![generated(dir.path(), "status.csv", 4_000, 50, 7)];
    let job = s.submit(&files, 500).await;
    let row = format!(r#"data-job="{}""#, job.job_id);
    let d =
        until(browser, &url, Duration::from_secs(30), "the job under way", |d| d.split(r#"id="jobs-finished""#).next().is_some_and(|open| open.contains(&row)))
            .await;
    assert!(d.contains(&format!("0 / {}", job.total_chunks)) || d.contains("no checkpoint yet"), "the job's progress: {d}");
    screenshot(browser, url.clone(), "1-under-way").await;

    // A processor bills it: complete, among the finished jobs, with its report linked.
    let processor = s.start_processor(fast_processor());
    let done = format!(r#"{row} data-status="complete""#);
    let d = until(browser, &url, Duration::from_secs(90), "the job complete", |d| d.contains(&done)).await;
    assert!(d.contains(&format!(r#"href="/jobs/{}/report""#, job.job_id)), "the report's link: {d}");
    let path = format!("/jobs/{}/report", job.job_id);
    let refused = get(&controller_page.to_string(), &path).await.expect("the report link answers");
    assert!(refused.starts_with("HTTP/1.0 401"), "no report without the page's token: {}", &refused[..refused.len().min(400)]);
    assert!(!refused.contains("\"accounts\""), "{refused}");
    let report = get_with_token(&controller_page.to_string(), &path, TOKEN).await;
    assert!(report.starts_with("HTTP/1.0 200"), "{}", &report[..report.len().min(400)]);
    let body: serde_json::Value = serde_json::from_str(report.split("\r\n\r\n").nth(1).unwrap()).expect("the report is JSON");
    assert_eq!((body["job_id"].as_str(), body["status"].as_str()), (Some(job.job_id.as_str()), Some("complete")));
    assert_eq!(body["transactions"]["processed"].as_u64(), Some(4_000));
    screenshot(browser, url.clone(), "2-complete").await;

    // The agent stops: the page says so, and jobs and queues are still there (queues read from SQS).
    agent_stop.cancel();
    agent.await.unwrap().unwrap();
    let d = until(browser, &url, Duration::from_secs(30), "the agent down", |d| d.contains(r#"id="agent" data-state="down""#)).await;
    assert!(d.contains(&done), "the finished job is still shown: {d}");
    assert_eq!(d.matches("<tr data-queue=").count(), 4, "the queues are still shown: {d}");
    assert!(d.contains("(from SQS)"), "{d}");
    assert!(d.contains("the scaling agent unreachable since"), "{d}");
    screenshot(browser, url.clone(), "3-agent-down").await;

    processor.stop().await;
    stop.cancel();
    controller.await.unwrap().unwrap();
}
