//! Request accounting: how many SQS and S3 calls were made, by operation. The clients count every call
//! they make (`fleet_io::call::CallCounter`, process-wide totals, for metrics); pipelines attribute
//! calls to the job they served, and those per-job counts travel in work results and end up in the
//! job's report.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Calls by `"service.Operation"` name (`"sqs.ReceiveMessage"`, `"s3.PutObject"`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestCounts(pub BTreeMap<String, u64>);

impl From<BTreeMap<String, u64>> for RequestCounts {
    fn from(calls: BTreeMap<String, u64>) -> Self {
        RequestCounts(calls)
    }
}

impl RequestCounts {
    /// Adds `n` calls (saturating: counts come from queue messages and must never wrap).
    pub fn add(&mut self, op: &str, n: u64) {
        if n > 0 {
            let c = self.0.entry(op.to_string()).or_default();
            *c = c.saturating_add(n);
        }
    }

    pub fn merge(&mut self, other: &RequestCounts) {
        for (k, v) in &other.0 {
            self.add(k, *v);
        }
    }

    /// Takes back counts merged before (an operation that did not happen after all).
    pub fn sub(&mut self, other: &RequestCounts) {
        for (k, v) in &other.0 {
            if let Some(c) = self.0.get_mut(k) {
                *c = c.saturating_sub(*v);
            }
        }
    }

    pub fn total(&self) -> u64 {
        self.0.values().fold(0u64, |n, v| n.saturating_add(*v))
    }

    /// Calls of one service keyed by bare operation name.
    pub fn by_service(&self, service: &str) -> BTreeMap<String, u64> {
        let prefix = format!("{service}.");
        self.0.iter().filter_map(|(k, v)| k.strip_prefix(&prefix).map(|op| (op.to_string(), *v))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_and_group_by_service() {
        let mut a = RequestCounts::default();
        a.add("sqs.ReceiveMessage", 2);
        a.add("s3.GetObject", 3);
        let mut b = RequestCounts::default();
        b.add("sqs.ReceiveMessage", 1);
        b.add("sqs.DeleteMessageBatch", 0);
        a.merge(&b);
        assert_eq!(a.total(), 6);
        assert_eq!(a.by_service("sqs").values().sum::<u64>(), 3);
        assert_eq!(a.by_service("s3").get("GetObject"), Some(&3));
        assert!(!a.0.contains_key("sqs.DeleteMessageBatch"));
    }
}
