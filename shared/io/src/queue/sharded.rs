//! A queue spread over N shards (seed 004: "use multiple queues and a segmentation strategy" once one
//! queue's limits are reached: in-flight messages, FIFO throughput). It reads as one [`Queue`] to
//! whoever sends to it, looks at its depth or drains it (initiator, scaling agent, controller);
//! processors run one listener per shard instead ([`Sharded::shards`]), so each shard's consumers
//! back off on their own.
//!
//! - **Send:** a message with a FIFO group goes to the shard its group hashes to (a group's order holds:
//!   all of it is on one shard); the others go round-robin, one message per shard in turn.
//! - **Receive:** the shards in turn from a rotating start, without waiting, until one has messages;
//!   only the last one asked waits (long poll). A receipt carries its shard (`{shard}:{receipt}`), so
//!   deletes and visibility changes go to the queue the message came from.
//! - **Depth:** the sum of the shards'. Calls count into one counter the shards share.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::{Delivery, Outgoing, Queue, QueueDepth, QueueInfo, Receipt};
use crate::call::CallCounter;
use crate::error::{Error, Result};

/// One queue over several (see the module header).
pub struct Sharded {
    name: String,
    shards: Vec<Arc<dyn Queue>>,
    calls: CallCounter,
    next_send: AtomicUsize,
    next_receive: AtomicUsize,
}

impl Sharded {
    /// The shards, in order (shard 0 first; its name is the sharded queue's). They are meant to count
    /// their calls into one counter (`SqsQueue::counting_into`, as `Aws::work_shards` opens them):
    /// shard 0's is this queue's.
    pub fn new(shards: Vec<Arc<dyn Queue>>) -> Result<Sharded> {
        let first = shards.first().ok_or_else(|| Error::Config("a sharded queue needs at least one shard".into()))?;
        let (name, calls) = (first.name().to_string(), first.calls().clone());
        Ok(Sharded { name, shards, calls, next_send: AtomicUsize::new(0), next_receive: AtomicUsize::new(0) })
    }

    /// One queue as it is, several as one [`Sharded`].
    pub fn of(mut shards: Vec<Arc<dyn Queue>>) -> Result<Arc<dyn Queue>> {
        if shards.len() == 1 {
            return Ok(shards.remove(0));
        }
        Ok(Arc::new(Sharded::new(shards)?))
    }

    /// Shards paired with their dead-letter queues as two queues: the work queue and its dead-letter
    /// queue (see [`Sharded::of`]).
    pub fn pairs<Q: Queue>(shards: &[(Arc<Q>, Arc<Q>)]) -> Result<(Arc<dyn Queue>, Arc<dyn Queue>)> {
        let work = shards.iter().map(|(q, _)| q.clone() as Arc<dyn Queue>).collect();
        let dlqs = shards.iter().map(|(_, d)| d.clone() as Arc<dyn Queue>).collect();
        Ok((Sharded::of(work)?, Sharded::of(dlqs)?))
    }

    /// The shards, for a listener each.
    pub fn shards(&self) -> &[Arc<dyn Queue>] {
        &self.shards
    }

    /// The shard a message goes to.
    fn shard_of(&self, m: &Outgoing) -> usize {
        match &m.attrs.group {
            Some(g) => shard_of_group(g, self.shards.len()),
            None => self.next_send.fetch_add(1, Ordering::Relaxed) % self.shards.len(),
        }
    }

    /// Entries split by the shard their receipt names, with their indexes in the call.
    fn split<'a, T>(&self, entries: impl Iterator<Item = (&'a str, T)>) -> Result<Vec<Vec<(usize, String, T)>>> {
        let mut by_shard: Vec<Vec<(usize, String, T)>> = (0..self.shards.len()).map(|_| Vec::new()).collect();
        for (i, (receipt, t)) in entries.enumerate() {
            let (shard, inner) = parse_receipt(receipt, self.shards.len())
                .ok_or_else(|| Error::corrupt(format!("receipt {receipt:?} names no shard of queue {}", self.name)))?;
            by_shard[shard].push((i, inner.to_string(), t));
        }
        Ok(by_shard)
    }
}

/// The shard of `n` a FIFO message group is kept on (stable across processes and releases).
pub fn shard_of_group(group: &str, n: usize) -> usize {
    (xxhash_rust::xxh3::xxh3_64(group.as_bytes()) % n.max(1) as u64) as usize
}

fn parse_receipt(receipt: &str, n: usize) -> Option<(usize, &str)> {
    let (shard, inner) = receipt.split_once(':')?;
    let shard: usize = shard.parse().ok()?;
    (shard < n).then_some((shard, inner))
}

#[async_trait]
impl Queue for Sharded {
    fn name(&self) -> &str {
        &self.name
    }

    fn shard_names(&self) -> Vec<String> {
        self.shards.iter().map(|s| s.name().to_string()).collect()
    }

    fn as_sharded(&self) -> Option<&Sharded> {
        Some(self)
    }

    async fn send_messages(&self, msgs: &[Outgoing]) -> Result<u64> {
        let mut by_shard: Vec<Vec<Outgoing>> = vec![Vec::new(); self.shards.len()];
        for m in msgs {
            by_shard[self.shard_of(m)].push(m.clone());
        }
        let sends = self.shards.iter().zip(&by_shard).filter(|(_, m)| !m.is_empty()).map(|(q, m)| q.send_messages(m));
        Ok(futures::future::try_join_all(sends).await?.into_iter().sum())
    }

    async fn receive(&self, max: u32, wait: Duration) -> Result<Vec<Delivery>> {
        let n = self.shards.len();
        let start = self.next_receive.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            let shard = (start + k) % n;
            let got = self.shards[shard].receive(max, if k + 1 == n { wait } else { Duration::ZERO }).await?;
            if !got.is_empty() {
                return Ok(got
                    .into_iter()
                    .map(|d| {
                        let (message, receipt) = d.into_parts();
                        Delivery::new(message, format!("{shard}:{}", receipt.0))
                    })
                    .collect());
            }
        }
        Ok(Vec::new())
    }

    async fn delete_receipts(&self, receipts: &[&Receipt]) -> Result<Vec<usize>> {
        let by_shard = self.split(receipts.iter().map(|r| (r.as_str(), ())))?;
        let calls = self.shards.iter().zip(by_shard).filter(|(_, e)| !e.is_empty()).map(|(q, e)| async move {
            let inner: Vec<Receipt> = e.iter().map(|(_, r, _)| Receipt(r.clone())).collect();
            let refs: Vec<&Receipt> = inner.iter().collect();
            let failed = q.delete_receipts(&refs).await?;
            Ok::<_, Error>(failed.into_iter().map(|j| e[j].0).collect::<Vec<_>>())
        });
        let mut failed: Vec<usize> = futures::future::try_join_all(calls).await?.into_iter().flatten().collect();
        failed.sort_unstable();
        Ok(failed)
    }

    async fn change_visibility(&self, entries: &[(&str, Duration)]) -> Result<Vec<usize>> {
        let by_shard = self.split(entries.iter().copied())?;
        let calls = self.shards.iter().zip(by_shard).filter(|(_, e)| !e.is_empty()).map(|(q, e)| async move {
            let inner: Vec<(&str, Duration)> = e.iter().map(|(_, r, d)| (r.as_str(), *d)).collect();
            let failed = q.change_visibility(&inner).await?;
            Ok::<_, Error>(failed.into_iter().map(|j| e[j].0).collect::<Vec<_>>())
        });
        let mut failed: Vec<usize> = futures::future::try_join_all(calls).await?.into_iter().flatten().collect();
        failed.sort_unstable();
        Ok(failed)
    }

    async fn depth(&self) -> Result<QueueDepth> {
        let depths = futures::future::try_join_all(self.shards.iter().map(|q| q.depth())).await?;
        Ok(depths.into_iter().fold(QueueDepth::default(), |a, d| QueueDepth {
            visible: a.visible + d.visible,
            in_flight: a.in_flight + d.in_flight,
            delayed: a.delayed + d.delayed,
        }))
    }

    async fn info(&self) -> Result<QueueInfo> {
        self.shards[0].info().await
    }

    fn calls(&self) -> &CallCounter {
        &self.calls
    }

    fn breaker(&self) -> Option<Arc<crate::breaker::Breaker>> {
        self.shards[0].breaker()
    }
}

#[cfg(all(test, feature = "test-util"))]
mod tests {
    use super::*;
    use crate::queue::memory::MemoryQueue;
    use crate::queue::Attrs;

    fn sharded(n: usize) -> (Vec<Arc<MemoryQueue>>, Sharded) {
        let shards: Vec<Arc<MemoryQueue>> = (0..n).map(|i| MemoryQueue::new(&format!("work-{i}"), Duration::from_secs(30))).collect();
        let q = Sharded::new(shards.iter().map(|s| s.clone() as Arc<dyn Queue>).collect()).unwrap();
        (shards, q)
    }

    fn msg(body: &str, group: Option<&str>) -> Outgoing {
        Outgoing { body: body.into(), attrs: Attrs { group: group.map(String::from), ..Attrs::default() }, dedup: None }
    }

    #[tokio::test]
    async fn spreads_plain_messages_and_keeps_each_group_on_one_shard() {
        let (shards, q) = sharded(4);
        let plain: Vec<Outgoing> = (0..20).map(|i| msg(&format!("m{i}"), None)).collect();
        q.send_messages(&plain).await.unwrap();
        for s in &shards {
            assert_eq!(s.depth().await.unwrap().visible, 5, "round-robin puts 5 of 20 on {}", s.name());
        }
        let grouped: Vec<Outgoing> = (0..30).map(|i| msg(&format!("g{i}"), Some(["a", "b", "c"][i % 3]))).collect();
        q.send_messages(&grouped).await.unwrap();
        let mut seen: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
        for (i, s) in shards.iter().enumerate() {
            loop {
                let got = s.receive(10, Duration::ZERO).await.unwrap();
                if got.is_empty() {
                    break;
                }
                for d in got.iter().filter(|d| d.attrs.group.is_some()) {
                    seen.entry(d.attrs.group.clone().unwrap()).or_default().push(i);
                }
            }
        }
        for g in ["a", "b", "c"] {
            assert_eq!(seen[g], vec![shard_of_group(g, 4); 10], "every message of group {g} is on its shard");
        }
        assert_eq!(q.depth().await.unwrap().in_flight, 50, "the depth is the shards' sum");
        assert_eq!(q.shard_names(), vec!["work-0", "work-1", "work-2", "work-3"]);
    }

    #[tokio::test]
    async fn receives_from_every_shard_and_completes_on_the_one_a_message_came_from() {
        let (shards, q) = sharded(3);
        shards[2].send(vec!["only".into()]).await.unwrap();
        // Whatever shard the rotation starts at, the message on shard 2 is found in one receive.
        for _ in 0..3 {
            let got = q.receive(10, Duration::ZERO).await.unwrap();
            assert_eq!(got.len(), 1);
            assert!(got[0].receipt().starts_with("2:"), "{}", got[0].receipt());
            got.into_iter().next().unwrap().release(&q, Duration::ZERO).await.unwrap();
        }
        let got = q.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(q.delete(got).await.unwrap(), 1);
        assert_eq!(shards[2].depth().await.unwrap(), QueueDepth::default());
        assert!(q.receive(10, Duration::ZERO).await.unwrap().is_empty());
        // A receipt that names no shard is refused, not sent anywhere.
        let stray = Receipt("7:x".into());
        assert!(q.delete_receipts(&[&stray]).await.is_err());
    }

    #[tokio::test]
    async fn a_batch_over_several_shards_reports_its_failed_entries_by_their_place_in_the_call() {
        let (shards, q) = sharded(2);
        q.send((0..4).map(|i| format!("m{i}")).collect()).await.unwrap();
        let mut got = Vec::new();
        while got.len() < 4 {
            got.extend(q.receive(10, Duration::ZERO).await.unwrap());
        }
        got.sort_by_key(|d| d.receipt().to_string());
        // Shard 1's entries are the last two after sorting: fail its first one.
        shards[1].fail_next_entries(1);
        let receipts: Vec<Receipt> = got.into_iter().map(Delivery::into_receipt).collect();
        let refs: Vec<&Receipt> = receipts.iter().collect();
        assert_eq!(q.delete_receipts(&refs).await.unwrap(), vec![2]);
        assert_eq!(q.depth().await.unwrap().in_flight, 1);
    }
}
