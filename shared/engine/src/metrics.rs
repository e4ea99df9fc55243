//! The process's metrics beyond the listeners' own state: `fleet_build_info` (which binary, which version), the histogram of how
//! long handling one message took per queue (observed by dispatch), the process's memory, CPU,
//! threads and descriptors (`process_*`, read from `/proc` at each scrape, as Prometheus's client
//! libraries name them), its SQS, S3 and RabbitMQ calls (`fleet_call_*`, observed where every call
//! passes: `fleet_io::call`), and the metrics a service registers for itself (the controller's job and
//! checkpoint metrics), rendered with the listeners' into one exposition.

use std::sync::{LazyLock, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Label pairs of a metric.
pub type Labels = Vec<(String, String)>;

/// Histograms by label set, each made with the same buckets.
pub type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

/// Seconds, from 5 ms to about 80 s.
pub fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

static HANDLING: LazyLock<Histograms> = LazyLock::new(|| Family::new_with_constructor(seconds_histogram as fn() -> Histogram));

type Registration = Box<dyn Fn(&mut Registry) + Send + Sync>;

static EXTRA: Mutex<Vec<Registration>> = Mutex::new(Vec::new());

/// A batch of `messages` of `queue` took `seconds` to handle: each of them is observed with it.
pub(crate) fn observe_handling(queue: &str, messages: usize, seconds: f64) {
    let h = HANDLING.get_or_create(&vec![("queue".to_string(), queue.to_string())]);
    for _ in 0..messages {
        h.observe(seconds);
    }
}

/// Adds metrics of the service's own to every exposition: `f` registers (clones of) them.
pub fn register(f: impl Fn(&mut Registry) + Send + Sync + 'static) {
    fleet_io::lock(&EXTRA).push(Box::new(f));
}

/// `fleet_build_info{service, version} 1`, on every service.
pub fn register_build_info(reg: &mut Registry) {
    let info = Family::<Labels, Gauge>::default();
    info.get_or_create(&fleet_io::telemetry::build_info().to_vec()).set(1);
    reg.register("fleet_build_info", "Which binary and version this is (always 1)", info);
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

/// The handling histogram (under the listeners' prefix).
pub(crate) fn register_handling(listener: &mut Registry) {
    listener.register("handling_seconds", "Time to handle one message (its batch's handling time)", HANDLING.clone());
}

/// The service's own metrics ([`register`]).
pub(crate) fn register_service(reg: &mut Registry) {
    for f in fleet_io::lock(&EXTRA).iter() {
        f(reg);
    }
}
