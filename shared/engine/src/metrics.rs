//! The process's metrics beyond the listeners' own state: `fleet_build_info` (which binary, which version), the histogram of how
//! long handling one message took per queue (observed by dispatch), the process's own figures and
//! its calls (`fleet_io::metrics`: `process_*`, `fleet_call_*`), and the metrics a service registers
//! for itself (the controller's job and checkpoint metrics), rendered with the listeners' into one
//! exposition.

use std::sync::{LazyLock, Mutex};

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
