//! The metrics every fleet process serves whatever it is (the engine's services and the scaling agent
//! alike): its own figures (`process_*`, read from `/proc` at each scrape, named as Prometheus's client
//! libraries name them) and its SQS, S3 and RabbitMQ calls (`fleet_call_*`, observed in
//! [`crate::call`], where every call passes, through a `Watch` each).

use std::sync::LazyLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::error::{Error, Result};
use crate::op::Op;

/// Registers both: [`register_process`] and [`register_calls`].
pub fn register(reg: &mut Registry) {
    register_process(reg);
    register_calls(reg);
}

/// The labels of a call's series.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CallLabels {
    /// SQS, S3 or RabbitMQ. Not `service`: scrape configs set a `service` target label (the fleet's
    /// own service), which would rename this one `exported_service`.
    dependency: &'static str,
    operation: &'static str,
}

/// The labels of a failed call's series: `outage` when the failure was the dependency's (no answer,
/// refused, 5xx, throttled: what the breakers count), not the request's.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ErrorLabels {
    dependency: &'static str,
    operation: &'static str,
    outage: &'static str,
}

/// Seconds, 1 ms to about 24 s (a long poll's 20 s wait included).
fn call_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.5, 12))
}

/// Call histograms by operation.
type CallHistograms = Family<CallLabels, Histogram, fn() -> Histogram>;

static SECONDS: LazyLock<CallHistograms> = LazyLock::new(|| Family::new_with_constructor(call_histogram as fn() -> Histogram));
static RETRIES: LazyLock<Family<CallLabels, Counter>> = LazyLock::new(Family::default);
static ERRORS: LazyLock<Family<ErrorLabels, Counter>> = LazyLock::new(Family::default);
static CANCELLED: LazyLock<Family<CallLabels, Counter>> = LazyLock::new(Family::default);

/// Observes a call once, when it is dropped: as it ended (after how many attempts, failed or not) or,
/// when its caller gave it up first (a receive cut off by the listener's own timeout or a stop), as
/// cancelled. All of an operation's series are made at its first call, at 0, so that an alert's
/// `increase` sees the first error.
pub(crate) struct Watch {
    op: Op,
    start: std::time::Instant,
    /// Attempts made and, when it failed, whether the failure was an outage; none until it ends.
    ended: Option<(u32, Option<bool>)>,
}

impl Watch {
    pub(crate) fn new(op: Op) -> Watch {
        Watch { op, start: std::time::Instant::now(), ended: None }
    }

    pub(crate) fn ended<T>(mut self, attempts: u32, r: &Result<T>) {
        self.ended = Some((attempts, r.as_ref().err().map(Error::is_outage)));
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let l = CallLabels { dependency: self.op.service().key(), operation: self.op.name() };
        SECONDS.get_or_create(&l).observe(self.start.elapsed().as_secs_f64());
        let (attempts, failed) = self.ended.unwrap_or((1, None));
        RETRIES.get_or_create(&l).inc_by(u64::from(attempts.saturating_sub(1)));
        let cancelled = CANCELLED.get_or_create(&l);
        if self.ended.is_none() {
            cancelled.inc();
        }
        for outage in [false, true] {
            let errors = ERRORS.get_or_create(&ErrorLabels { dependency: l.dependency, operation: l.operation, outage: if outage { "true" } else { "false" } });
            if failed == Some(outage) {
                errors.inc();
            }
        }
    }
}

/// Registers the process's call metrics (`fleet_call_seconds`, `fleet_call_retries_total`,
/// `fleet_call_cancelled_total`, `fleet_call_errors_total`, by `dependency` and `operation`) into `reg`.
pub fn register_calls(reg: &mut Registry) {
    reg.register(
        "fleet_call_seconds",
        "Time an SQS, S3 or RabbitMQ call took, its attempts and back-off included (a long poll its wait), by dependency and operation",
        SECONDS.clone(),
    );
    reg.register("fleet_call_retries", "Attempts of SQS, S3 or RabbitMQ calls beyond each call's first, by dependency and operation", RETRIES.clone());
    reg.register(
        "fleet_call_cancelled",
        "SQS, S3 or RabbitMQ calls their caller gave up before they ended (a receive cut off by a listener's own timeout or a stop), by dependency and operation",
        CANCELLED.clone(),
    );
    reg.register(
        "fleet_call_errors",
        "SQS, S3 or RabbitMQ calls that failed (after their retries), by dependency, operation and whether the failure was the dependency's (outage=true: no answer, refused, 5xx, throttled) or the request's",
        ERRORS.clone(),
    );
}

/// The process's own figures, read now: `process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_virtual_memory_bytes`, `process_threads`, `process_open_fds`, `process_max_fds`,
/// `process_start_time_seconds`. Left out where `/proc` cannot be read (not Linux).
pub fn register_process(reg: &mut Registry) {
    let Ok(me) = procfs::process::Process::myself() else { return };
    if let Ok(stat) = me.stat() {
        let ticks = procfs::ticks_per_second().max(1) as f64;
        let cpu = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        cpu.inc_by((stat.utime + stat.stime) as f64 / ticks);
        reg.register("process_cpu_seconds", "CPU time the process used, user and system, seconds", cpu);
        let gauge = |v: u64| {
            let g = Gauge::<i64>::default();
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
            g
        };
        reg.register("process_resident_memory_bytes", "Resident memory of the process, bytes", gauge(stat.rss.saturating_mul(procfs::page_size())));
        reg.register("process_virtual_memory_bytes", "Virtual memory of the process, bytes", gauge(stat.vsize));
        reg.register("process_threads", "Threads of the process", gauge(u64::try_from(stat.num_threads).unwrap_or(0)));
        if let Ok(boot) = procfs::boot_time_secs() {
            let start = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
            start.set(boot as f64 + stat.starttime as f64 / ticks);
            reg.register("process_start_time_seconds", "When the process started, Unix seconds", start);
        }
    }
    if let Ok(n) = me.fd_count() {
        let g = Gauge::<i64>::default();
        g.set(n as i64);
        reg.register("process_open_fds", "Open file descriptors of the process", g);
    }
    if let Ok(procfs::process::LimitValue::Value(max)) = me.limits().map(|l| l.max_open_files.soft_limit) {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(max).unwrap_or(i64::MAX));
        reg.register("process_max_fds", "Most file descriptors the process may open", g);
    }
}
