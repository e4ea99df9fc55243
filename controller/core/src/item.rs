//! What a message brings to a job: an item (a chunk result, a seal, an abandon, a dead-lettered work
//! item), the queue it came from, and the item ready to apply (its payload fetched and decoded, or
//! why it could not be). Parsing, checking a sender's role and fetching a payload are the
//! controller's (`controller::aggregate::item`).

use std::fmt;

use fleet_domain::billing::RowBatch;
use fleet_domain::model::{ChunkOutcome, ChunkResult, ResultMessage, WorkItem};

/// Which queue a batch came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// Chunk results from processors, seals and abandons from initiators.
    Results,
    /// Work items that exhausted their receives.
    WorkDeadLetter,
    /// Results (or seals) that exhausted their receives on the results queue, e.g. while S3 was down:
    /// applied like results.
    ResultsDeadLetter,
}

impl Source {
    pub const ALL: [Source; 3] = [Source::Results, Source::WorkDeadLetter, Source::ResultsDeadLetter];

    /// The queue's name when none is set.
    pub fn default_queue(self) -> &'static str {
        match self {
            Source::Results => "billing-results",
            Source::WorkDeadLetter => "billing-work-dlq",
            Source::ResultsDeadLetter => "billing-results-dlq",
        }
    }
}

pub enum Item {
    Result(ResultMessage),
    /// `reason`: set when a listener dead-lettered it itself (e.g. `expired`).
    Dead {
        item: WorkItem,
        receives: u32,
        reason: Option<String>,
    },
}

impl Item {
    pub fn job_id(&self) -> &str {
        match self {
            Item::Result(r) => r.job_id(),
            Item::Dead { item, .. } => &item.job_id,
        }
    }

    /// It carries a payload to decode (a processed result).
    pub fn decodes(&self) -> bool {
        matches!(self, Item::Result(ResultMessage::Chunk(ChunkResult { outcome: ChunkOutcome::Processed { .. }, .. })))
    }

    /// The chunk it is about (a result or a dead-lettered work item).
    pub fn chunk(&self) -> Option<u32> {
        match self {
            Item::Result(ResultMessage::Chunk(c)) => Some(c.chunk),
            Item::Dead { item, .. } | Item::Result(ResultMessage::DeadLettered { item, .. }) => Some(item.chunk),
            Item::Result(_) => None,
        }
    }
}

/// A payload that could not be read, with whether it may be read later (`retryable`: the store did
/// not answer; otherwise it is missing or corrupt for good). `E` is the driver's error.
#[derive(Debug)]
pub struct Unread<E> {
    pub error: E,
    pub retryable: bool,
}

impl<E: fmt::Display> fmt::Display for Unread<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

/// An item with its result payload fetched and decoded before its job is locked (`None`: it carries
/// no payload).
pub struct Ready<E> {
    pub item: Item,
    pub accounts: Option<Result<RowBatch, Unread<E>>>,
}

impl<E> Ready<E> {
    pub fn is_seal(&self) -> bool {
        matches!(self.item, Item::Result(ResultMessage::Sealed { .. }))
    }
}

#[cfg(test)]
impl<E> Ready<E> {
    /// A result message as the driver makes it ready: an inline payload decoded, nothing else read.
    pub(crate) fn of(msg: ResultMessage) -> Ready<E> {
        let accounts = match &msg {
            ResultMessage::Chunk(ChunkResult {
                outcome: ChunkOutcome::Processed { payload: fleet_domain::model::AccountsPayload::Inline { accounts } },
                ..
            }) => Some(Ok(accounts.iter().map(fleet_domain::billing::AccountTotals::borrowed).collect())),
            _ => None,
        };
        Ready { item: Item::Result(msg), accounts }
    }
}
