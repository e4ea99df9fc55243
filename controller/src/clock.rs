//! The controller's one clock. Every time the controller writes into shared state or compares with
//! what another controller wrote (a lease's expiry, a checkpoint's `updated_at`, how long a job has
//! had no news) is read here, so the deterministic simulation (`fleet-sim`) drives all of them from
//! tokio's paused clock, and production reads the system's wall clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// Wall-clock time as the controller sees it.
#[derive(Debug, Clone, Copy, Default)]
pub enum Clock {
    /// The system's wall clock.
    #[default]
    System,
    /// Wall time that starts at `epoch_ms` when `start` was read and moves with tokio's clock (so a
    /// simulation under paused time ages leases and checkpoints as it advances that clock).
    Driven { epoch_ms: u64, start: Instant },
}

impl Clock {
    /// A clock at `epoch_ms` now, moving with tokio's clock.
    pub fn driven(epoch_ms: u64) -> Clock {
        Clock::Driven { epoch_ms, start: Instant::now() }
    }

    /// Unix time, milliseconds.
    pub fn now_ms(&self) -> u64 {
        match self {
            Clock::System => SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            Clock::Driven { epoch_ms, start } => epoch_ms + start.elapsed().as_millis() as u64,
        }
    }

    /// Unix time, seconds.
    pub fn now_unix(&self) -> i64 {
        (self.now_ms() / 1000) as i64
    }

    /// Now in RFC 3339, to the millisecond.
    pub fn rfc3339(&self) -> String {
        let ns = i128::from(self.now_ms()) * 1_000_000;
        time::OffsetDateTime::from_unix_timestamp_nanos(ns)
            .ok()
            .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
            .unwrap_or_else(|| "1970-01-01T00:00:00Z".to_string())
    }

    /// How long ago an RFC 3339 time was (zero when it is unreadable or in the future).
    pub fn since_rfc3339(&self, at: &str) -> Duration {
        let Ok(t) = time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339) else { return Duration::ZERO };
        let at_ms = (t.unix_timestamp_nanos() / 1_000_000).max(0) as u64;
        Duration::from_millis(self.now_ms().saturating_sub(at_ms))
    }

    /// How long ago a Unix time in seconds was (zero when in the future).
    pub fn since_unix(&self, at: i64) -> Duration {
        Duration::from_secs(u64::try_from(self.now_unix().saturating_sub(at)).unwrap_or(0))
    }

    /// The tokio instant `ago` before now (now itself when the clock has not run that long).
    pub fn instant_ago(ago: Duration) -> Instant {
        let now = Instant::now();
        now.checked_sub(ago).unwrap_or(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_driven_clock_moves_with_tokio_time() {
        let c = Clock::driven(1_700_000_000_000);
        let written = c.rfc3339();
        tokio::time::sleep(Duration::from_millis(61_250)).await;
        assert_eq!(c.now_ms(), 1_700_000_061_250);
        assert_eq!(c.since_rfc3339(&written), Duration::from_millis(61_250));
        assert_eq!(c.since_unix(1_700_000_000), Duration::from_secs(61));
        assert_eq!(c.since_rfc3339("not a time"), Duration::ZERO);
    }
}
