//! The agent's own health for its probes (`/readyz`, `/livez`): ready while it can see the queues and
//! the bus and nothing is paused for an outage; live while its loop keeps looking.

use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::AgentState;

/// Readiness and liveness of the agent, with the reasons when not.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AgentHealth {
    pub ready: bool,
    pub live: bool,
    pub reasons: Vec<String>,
}

/// Slack above the agent's own interval before its loop counts as stuck (a look's calls may take up
/// to their deadline).
pub const LOOK_SLACK: Duration = Duration::from_secs(90);

impl AgentState {
    /// Ready: the last look read the queues, nothing is paused for an outage, the bus (when used) is
    /// live. Live: a look ended within the interval plus [`LOOK_SLACK`] (or none yet).
    pub fn health(&self, now: Instant) -> AgentHealth {
        let mut reasons = Vec::new();
        if !self.last_look_ok {
            reasons.push("the last look could not read the queues".to_string());
        }
        for d in &self.paused_for {
            reasons.push(format!("paused for {d}"));
        }
        if self.bus_configured && !self.bus_live {
            reasons.push("bus subscription down".into());
        }
        let ready = reasons.is_empty();
        let bound = Duration::from_secs_f64(self.interval_s.max(1.0)) + LOOK_SLACK;
        let live = self.last_look.is_none_or(|t| now.saturating_duration_since(t) <= bound);
        if !live {
            reasons.push(format!("no look for more than {} s", bound.as_secs()));
        }
        AgentHealth { ready, live, reasons }
    }
}
