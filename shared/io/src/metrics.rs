//! The metrics every fleet process serves whatever it is (the engine's services and the scaling agent
//! alike): its own figures (`process_*`, read from `/proc` at each scrape, named as Prometheus's client
//! libraries name them) and its SQS, S3 and RabbitMQ calls (`fleet_call_*`, observed in
//! [`crate::call`], where every call passes).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Registers both: [`register_process`] and the call metrics ([`crate::call::register_metrics`]).
pub fn register(reg: &mut Registry) {
    register_process(reg);
    crate::call::register_metrics(reg);
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
