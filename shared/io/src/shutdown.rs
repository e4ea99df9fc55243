//! Service lifecycle: tracing and signal set-up around a service's start function (`serve`),
//! SIGINT/SIGTERM cancelling a token that every task watches, and `drain`, which waits for the tracked
//! tasks under a bound.

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A token cancelled on the first SIGINT or SIGTERM.
pub fn on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = match signal(SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot install SIGTERM handler");
                    let _ = tokio::signal::ctrl_c().await;
                    t.cancel();
                    return;
                }
            };
            tokio::select! {
                biased;
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
                _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
        t.cancel();
    });
    token
}

/// Closes the tracker and waits for its tasks at most `grace`. Returns false when it timed out.
pub async fn drain(tracker: &TaskTracker, grace: Duration) -> bool {
    tracker.close();
    match tokio::time::timeout(grace, tracker.wait()).await {
        Ok(()) => true,
        Err(_) => {
            tracing::warn!(grace_s = grace.as_secs_f64(), remaining = tracker.len(), "drain timed out; abandoning in-flight work (it will be redelivered)");
            false
        }
    }
}

/// The body of a service binary: sets up tracing (`info` by default), turns SIGINT/SIGTERM into a
/// cancelled token, runs `start` with it and maps the outcome to the exit code (errors are logged).
pub async fn serve<F, Fut>(log_json: bool, start: F) -> ExitCode
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let _telemetry = crate::telemetry::init(log_json, "info");
    let outcome = start(on_signals()).await;
    crate::call::write_called();
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
