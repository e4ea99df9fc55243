//! Why one file: the page, its document and the cached reads behind it change together (a field shown is
//! a field read); the HTML is `status.html` beside it (included as a constant), the tests `tests.rs`.
//!
//! The status page, served by the controller on its own address (`--page-addr`), apart from the
//! metrics and health on `--http-addr`: `GET /` is one HTML page with its script and style inline (no
//! build step, nothing fetched from elsewhere) that reads `GET /status.json` every [`FRESH_FOR`] while
//! it is visible, and not at all while its tab is hidden. The document is made on demand and kept for
//! [`FRESH_FOR`] (one maker at a time), so the bucket is read for the page at most that often whatever
//! the number of tabs, and not at all when no one looks; the quarantine count (a LIST of up to a
//! thousand keys) is read anew at most every [`QUARANTINE_FRESH_FOR`]:
//!
//! - jobs: every open job of the fleet (the `open/` markers in the bucket, whichever controller owns
//!   them, with the progress its checkpoint's metadata carries: one HEAD each), and the jobs this
//!   controller finished last (its `JobFinished` events): ids, statuses and counts, no money;
//! - queues: depth of the work, results and both dead-letter queues, the oldest waiting work item's
//!   age against the SLA: from the scaling agent's `/state` when `--agent-url` is given and it
//!   answers (no request of ours), else read from SQS;
//! - the fleet: the agent's instances, its last decisions as a chart, the breakers of this
//!   controller and of the instances;
//! - dead letters and the quarantine count.
//!
//! Billing data is behind the page's token (`--page-token-file`): `GET /jobs/{id}` (one job's
//! progress) and `GET /jobs/{id}/report` (every account's totals) answer only a request carrying
//! `Authorization: Bearer <token>` (the page asks for it once and keeps it for the tab), and not at
//! all when the controller has no token. A report is streamed from the bucket as it is read, a few
//! at a time, never whole in memory.
//!
//! Every source is read under its own short deadline and reported on its own: a source that is down
//! (the agent, S3, SQS) leaves its section saying so, since when, and the rest of the page working.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use fleet_domain::layout::{check_job_id, checkpoint_keys, report_key, OPEN_PREFIX};
use fleet_domain::model::Progress;
use fleet_engine::admin::AdminToken;
use fleet_engine::http::Engines;
use fleet_io::blob::BlobStore;
use fleet_io::queue::Queue;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::Value;

use crate::events::{recent_finished, FinishedView};

/// The page itself.
const PAGE: &str = include_str!("status.html");

/// A status document is served again for this long before it is made anew (and the page asks this
/// often).
pub const FRESH_FOR: Duration = Duration::from_secs(5);

/// The quarantine count is read anew at most this often (it changes when a result is set aside, rarely).
pub const QUARANTINE_FRESH_FOR: Duration = Duration::from_secs(60);

/// Reports streamed at once; one more is refused with a 503 and `Retry-After`.
const REPORT_STREAMS: usize = 4;

/// A report's bytes must keep coming: a stream stalled this long is cut (the permit is given back).
const REPORT_CHUNK_DEADLINE: Duration = Duration::from_secs(30);

/// Each source's deadline: the page never waits on a hung dependency for longer.
const SOURCE_DEADLINE: Duration = Duration::from_millis(1500);

/// Most open jobs shown (a HEAD request each).
const MAX_OPEN_SHOWN: usize = 100;

/// Most quarantined messages counted (a LIST page).
const MAX_QUARANTINE_COUNTED: usize = 1000;

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

/// What the page reads, shared by its handlers.
#[derive(Clone)]
pub struct StatusSource {
    inner: Arc<Inner>,
}

struct Inner {
    owner: String,
    store: Arc<dyn BlobStore>,
    /// The four queues by role, read when the agent does not answer.
    queues: Vec<(&'static str, Arc<dyn Queue>)>,
    engines: Engines,
    agent_url: Option<String>,
    http: Http,
    cache: tokio::sync::Mutex<Option<(Instant, Bytes)>>,
    /// When each failing source started failing (Unix seconds), for "down since".
    down_since: Mutex<std::collections::BTreeMap<&'static str, i64>>,
    /// Reports streamed now (at most [`REPORT_STREAMS`]).
    report_reads: Arc<tokio::sync::Semaphore>,
    /// The token billing data is served for; none: not served.
    token: Option<AdminToken>,
    /// The last quarantine count read and when.
    quarantine: tokio::sync::Mutex<Option<(Instant, usize)>>,
}

/// One queue's line.
#[derive(Debug, Serialize)]
struct QueueLine {
    role: &'static str,
    name: String,
    visible: u64,
    in_flight: u64,
    delayed: u64,
    /// The oldest waiting item's age (the work queue, from the agent).
    #[serde(skip_serializing_if = "Option::is_none")]
    oldest_age_s: Option<f64>,
}

/// An open job's line.
#[derive(Debug, Serialize)]
struct OpenJob {
    job_id: String,
    /// `None`: no checkpoint yet (being submitted, or its first results not saved).
    #[serde(flatten)]
    progress: Option<ProgressView>,
}

#[derive(Debug, Serialize)]
struct ProgressView {
    status: fleet_domain::model::JobStatus,
    sealed: bool,
    total_chunks: Option<u32>,
    accounted: u32,
    failed: u32,
    processed: u64,
    updated_unix: i64,
}

impl From<Progress> for ProgressView {
    fn from(p: Progress) -> Self {
        ProgressView {
            status: p.status,
            sealed: p.sealed,
            total_chunks: p.total,
            accounted: p.accounted,
            failed: p.failed,
            processed: p.processed,
            updated_unix: p.updated_unix,
        }
    }
}

/// A section that could not be read: why, and since when.
#[derive(Debug, Serialize)]
struct Down {
    error: String,
    since_unix: i64,
}

/// `/status.json`.
#[derive(Debug, Serialize)]
struct StatusDoc {
    generated_unix: i64,
    controller: String,
    open_jobs: Result<Vec<OpenJob>, Down>,
    /// More open jobs than shown.
    open_jobs_more: bool,
    finished: Vec<FinishedView>,
    queues: Result<Vec<QueueLine>, Down>,
    /// Where the queue depths come from: `agent` or `sqs`.
    queues_from: &'static str,
    quarantined: Result<usize, Down>,
    quarantined_more: bool,
    breakers: Vec<fleet_io::breaker::BreakerState>,
    /// Who reads each results partition (`partitions/owners.json`: partition number -> controller, none
    /// for a free one).
    partitions: Result<std::collections::BTreeMap<u16, Option<String>>, Down>,
    /// The agent's `/state`, as it sent it (`None`: no `--agent-url`).
    agent: Option<Result<Value, Down>>,
}

fn now_unix() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

impl StatusSource {
    /// `queues` by role: `work`, `results`, `work_dlq`, `results_dlq`.
    pub fn new(
        owner: String,
        store: Arc<dyn BlobStore>,
        queues: Vec<(&'static str, Arc<dyn Queue>)>,
        engines: Engines,
        agent_url: Option<String>,
        token: Option<AdminToken>,
    ) -> StatusSource {
        let http = Client::builder(TokioExecutor::new()).build_http();
        let agent_url = agent_url.map(|u| u.trim_end_matches('/').to_string()).filter(|u| !u.is_empty());
        StatusSource {
            inner: Arc::new(Inner {
                owner,
                store,
                queues,
                engines,
                agent_url,
                http,
                cache: tokio::sync::Mutex::new(None),
                down_since: Mutex::default(),
                report_reads: Arc::new(tokio::sync::Semaphore::new(REPORT_STREAMS)),
                token,
                quarantine: tokio::sync::Mutex::new(None),
            }),
        }
    }

    /// The page's routes: `/`, `/status.json`; with the token, `/jobs/{id}`, `/jobs/{id}/report`.
    pub fn router(self) -> Router {
        let token = self.inner.token.clone();
        let guard = move |method: Method, uri: Uri, headers: HeaderMap, req: axum::extract::Request, next: axum::middleware::Next| {
            let token = token.clone();
            async move {
                let Some(token) = token else {
                    return problem(
                        StatusCode::FORBIDDEN,
                        "this controller serves no job detail or report: it was started without a page token (--page-token-file)".to_string(),
                    );
                };
                if !token.authorizes(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes())) {
                    // Method and path only: nothing of what was sent.
                    tracing::info!(%method, path = uri.path(), "status page request refused: no valid bearer token");
                    let mut r = problem(StatusCode::UNAUTHORIZED, "the page's token is required (Authorization: Bearer ...)".to_string());
                    r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
                    return r;
                }
                next.run(req).await
            }
        };
        let billing = Router::new().route("/jobs/{id}", get(job)).route("/jobs/{id}/report", get(report)).route_layer(axum::middleware::from_fn(guard));
        Router::new().route("/", get(page)).route("/status", get(page)).route("/status.json", get(status_json)).merge(billing).with_state(self)
    }

    /// Notes a source's outcome: `Err` keeps the time it first failed.
    fn outcome<T>(&self, source: &'static str, r: Result<T, String>) -> Result<T, Down> {
        let mut down = fleet_io::lock(&self.inner.down_since);
        match r {
            Ok(v) => {
                down.remove(source);
                Ok(v)
            }
            Err(error) => {
                let since_unix = *down.entry(source).or_insert_with(now_unix);
                Err(Down { error, since_unix })
            }
        }
    }

    async fn agent_state(&self) -> Option<Result<Value, String>> {
        let base = self.inner.agent_url.as_ref()?;
        let get = async {
            let uri: hyper::Uri = format!("{base}/state").parse().map_err(|e| format!("agent URL {base}: {e}"))?;
            let resp = self.inner.http.get(uri).await.map_err(|e| format!("{base}: {}", fleet_io::error::root_cause(&e)))?;
            if !resp.status().is_success() {
                return Err(format!("{base}/state answered {}", resp.status()));
            }
            // Bounded: an agent (or whatever answers at its URL) cannot make the page hold more.
            let body = http_body_util::Limited::new(resp.into_body(), MAX_AGENT_STATE)
                .collect()
                .await
                .map_err(|e| format!("{base}/state: {e} (at most {MAX_AGENT_STATE} bytes are read)"))?
                .to_bytes();
            serde_json::from_slice::<Value>(&body).map_err(|e| format!("{base}/state: {e}"))
        };
        Some(match tokio::time::timeout(SOURCE_DEADLINE, get).await {
            Ok(r) => r,
            Err(_) => Err(format!("{base} did not answer within {} ms", SOURCE_DEADLINE.as_millis())),
        })
    }

    async fn open_jobs(&self) -> Result<(Vec<OpenJob>, bool), String> {
        let store = self.inner.store.as_ref();
        let keys = bounded(store.list(OPEN_PREFIX, MAX_OPEN_SHOWN + 1)).await?;
        let more = keys.len() > MAX_OPEN_SHOWN;
        let ids: Vec<String> = keys.iter().take(MAX_OPEN_SHOWN).filter_map(|k| k.strip_prefix(OPEN_PREFIX)).map(str::to_string).collect();
        let heads = futures::future::join_all(ids.iter().map(|id| async move { bounded(fleet_io::blob::head_first(store, &checkpoint_keys(id))).await })).await;
        let mut jobs = Vec::with_capacity(ids.len());
        for (job_id, head) in ids.into_iter().zip(heads) {
            // A job whose checkpoint cannot be read now is shown without progress.
            let progress = head.ok().flatten().and_then(|m| Progress::from_meta(&m)).map(ProgressView::from);
            jobs.push(OpenJob { job_id, progress });
        }
        Ok((jobs, more))
    }

    async fn queues_from_sqs(&self) -> Result<Vec<QueueLine>, String> {
        let reads = self.inner.queues.iter().map(|(role, q)| async move {
            let d = bounded(q.depth()).await?;
            Ok::<_, String>(QueueLine { role, name: q.name().to_string(), visible: d.visible, in_flight: d.in_flight, delayed: d.delayed, oldest_age_s: None })
        });
        futures::future::join_all(reads).await.into_iter().collect()
    }

    /// The quarantine count, read anew at most every [`QUARANTINE_FRESH_FOR`] (a failed read is tried
    /// again at the next document).
    async fn quarantined(&self) -> Result<usize, String> {
        let mut last = self.inner.quarantine.lock().await;
        if let Some((at, n)) = *last {
            if at.elapsed() < QUARANTINE_FRESH_FOR {
                return Ok(n);
            }
        }
        let n = bounded(fleet_io::quarantine::list(self.inner.store.as_ref(), MAX_QUARANTINE_COUNTED + 1)).await?.len();
        *last = Some((Instant::now(), n));
        Ok(n)
    }

    async fn make(&self) -> StatusDoc {
        let (agent, open, quarantine, owners) =
            tokio::join!(self.agent_state(), self.open_jobs(), self.quarantined(), bounded(self.inner.store.get(fleet_domain::layout::PARTITIONS_KEY)));
        let partitions = owners.and_then(|body| match body {
            None => Ok(Default::default()),
            Some(b) => serde_json::from_slice::<crate::partitions::Table>(&b)
                .map(|t| t.owners.into_iter().map(|(p, o)| (p, o.owner)).collect())
                .map_err(|e| format!("unreadable partition ownership: {e}")),
        });
        let agent = agent.map(|r| self.outcome("agent", r));
        let from_agent = match &agent {
            Some(Ok(state)) => queues_from_agent(state, &self.inner.queues),
            _ => None,
        };
        let (queues, queues_from) = match from_agent {
            Some(q) => (Ok(q), "agent"),
            None => (self.queues_from_sqs().await, "sqs"),
        };
        let (open_jobs, open_jobs_more) = match self.outcome("store", open) {
            Ok((jobs, more)) => (Ok(jobs), more),
            Err(d) => (Err(d), false),
        };
        let quarantined_more = quarantine.as_ref().is_ok_and(|n| *n > MAX_QUARANTINE_COUNTED);
        let mut breakers: Vec<fleet_io::breaker::BreakerState> = Vec::new();
        for e in &self.inner.engines.all() {
            for b in e.state().breakers {
                if !breakers.iter().any(|x| x.dependency == b.dependency) {
                    breakers.push(b);
                }
            }
        }
        StatusDoc {
            generated_unix: now_unix(),
            controller: self.inner.owner.clone(),
            open_jobs,
            open_jobs_more,
            finished: recent_finished(),
            queues: self.outcome("queues", queues),
            queues_from,
            quarantined: self.outcome("quarantine", quarantine.map(|n| n.min(MAX_QUARANTINE_COUNTED))),
            quarantined_more,
            breakers,
            partitions: self.outcome("partitions", partitions),
            agent,
        }
    }

    /// The status document, made anew at most every [`FRESH_FOR`] (one maker at a time).
    async fn document(&self) -> Bytes {
        let mut cache = self.inner.cache.lock().await;
        if let Some((at, doc)) = cache.as_ref() {
            if at.elapsed() < FRESH_FOR {
                return doc.clone();
            }
        }
        let doc = Bytes::from(serde_json::to_vec(&self.make().await).unwrap_or_default());
        *cache = Some((Instant::now(), doc.clone()));
        doc
    }
}

/// A call under the page's deadline, its error as text (no credentials: errors name endpoints).
async fn bounded<T>(f: impl std::future::Future<Output = fleet_io::Result<T>>) -> Result<T, String> {
    match tokio::time::timeout(SOURCE_DEADLINE, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {} ms", SOURCE_DEADLINE.as_millis())),
    }
}

/// The queue lines from the agent's last look (`depths`, `observed.oldest_age`), named as ours.
fn queues_from_agent(state: &Value, queues: &[(&'static str, Arc<dyn Queue>)]) -> Option<Vec<QueueLine>> {
    let depths = state.get("depths")?.as_object()?;
    let oldest = state.get("observed").and_then(|o| o.get("oldest_age")).and_then(duration_secs);
    queues
        .iter()
        .map(|(role, q)| {
            let d = depths.get(*role)?;
            let n = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
            Some(QueueLine {
                role,
                name: q.name().to_string(),
                visible: n("visible"),
                in_flight: n("in_flight"),
                delayed: n("delayed"),
                oldest_age_s: if *role == "work" { oldest } else { None },
            })
        })
        .collect()
}

/// A serde `Duration` (`{"secs":..,"nanos":..}`) as seconds.
fn duration_secs(v: &Value) -> Option<f64> {
    let secs = v.get("secs")?.as_f64()?;
    let nanos = v.get("nanos").and_then(Value::as_f64).unwrap_or(0.0);
    Some(secs + nanos / 1e9)
}

async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")], PAGE).into_response()
}

async fn status_json(State(s): State<StatusSource>) -> Response {
    ([(header::CONTENT_TYPE, "application/json"), (header::CACHE_CONTROL, "no-store")], s.document().await).into_response()
}

fn problem(code: StatusCode, msg: String) -> Response {
    (code, [(header::CONTENT_TYPE, "application/json")], serde_json::json!({ "error": msg }).to_string()).into_response()
}

/// One job's progress, whoever owns it (its checkpoint's metadata).
async fn job(State(s): State<StatusSource>, Path(id): Path<String>) -> Response {
    if let Err(e) = check_job_id(&id) {
        return problem(StatusCode::BAD_REQUEST, e.to_string());
    }
    let store = s.inner.store.as_ref();
    let (cp_keys, report_key) = (checkpoint_keys(&id), report_key(&id));
    let (head, report) = tokio::join!(bounded(fleet_io::blob::head_first(store, &cp_keys)), bounded(store.head(&report_key)));
    match (head, report) {
        (Err(e), _) | (_, Err(e)) => problem(StatusCode::SERVICE_UNAVAILABLE, format!("the bucket does not answer: {e}")),
        (Ok(None), Ok(None)) => problem(StatusCode::NOT_FOUND, format!("no checkpoint or report of job {id} (yet)")),
        (Ok(meta), Ok(report)) => {
            let progress = meta.as_ref().and_then(Progress::from_meta).map(ProgressView::from);
            let body = serde_json::json!({ "job_id": id, "progress": progress, "report": report.is_some().then(|| format!("/jobs/{id}/report")) });
            axum::Json(body).into_response()
        }
    }
}

/// The agent's `/state` is read up to this many bytes (it is a few KB).
const MAX_AGENT_STATE: usize = 1 << 20;

/// A finished job's report, as the warehouse holds it, streamed as it is read (a million accounts'
/// report is about 135 MB: never whole in memory), at most [`REPORT_STREAMS`] at a time.
async fn report(State(s): State<StatusSource>, Path(id): Path<String>) -> Response {
    if let Err(e) = check_job_id(&id) {
        return problem(StatusCode::BAD_REQUEST, e.to_string());
    }
    let Ok(permit) = s.inner.report_reads.clone().try_acquire_owned() else {
        let mut r = problem(StatusCode::SERVICE_UNAVAILABLE, format!("{REPORT_STREAMS} reports are being read; try again in a few seconds"));
        r.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("2"));
        return r;
    };
    match tokio::time::timeout(Duration::from_secs(10), s.inner.store.get_stream(&report_key(&id))).await {
        Ok(Ok(Some(blob))) => {
            let key = report_key(&id);
            // The permit goes with the body: it is given back when the body is sent, cut or dropped.
            let chunks = futures::stream::unfold((blob.chunks, Some(permit), key), |(mut chunks, permit, key)| async move {
                permit.as_ref()?;
                match tokio::time::timeout(REPORT_CHUNK_DEADLINE, futures::StreamExt::next(&mut chunks)).await {
                    Ok(Some(Ok(b))) => Some((Ok(b), (chunks, permit, key))),
                    Ok(None) => None,
                    Ok(Some(Err(e))) => {
                        tracing::warn!(key, error = %e, "a report's body broke off while it was served");
                        Some((Err(std::io::Error::other(e.to_string())), (chunks, None, key)))
                    }
                    Err(_) => {
                        tracing::warn!(key, "a report's body stalled while it was served: cut");
                        Some((Err(std::io::Error::other("the bucket stopped sending")), (chunks, None, key)))
                    }
                }
            });
            let mut r = Response::new(axum::body::Body::from_stream(chunks));
            r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
            if let Some(len) = blob.len {
                r.headers_mut().insert(header::CONTENT_LENGTH, header::HeaderValue::from(len));
            }
            r
        }
        Ok(Ok(None)) => problem(StatusCode::NOT_FOUND, format!("job {id} has no report (yet)")),
        Ok(Err(e)) => problem(StatusCode::SERVICE_UNAVAILABLE, format!("the bucket does not answer: {e}")),
        Err(_) => problem(StatusCode::SERVICE_UNAVAILABLE, "the bucket did not answer within 10 s".to_string()),
    }
}

#[cfg(test)]
mod tests;
