use std::sync::atomic::AtomicUsize;

use super::*;

type Log = Arc<Mutex<Vec<(Duration, Vec<u32>)>>>;

/// A pump that records (time since start, batch) and takes `work` per call; fails items in `fail`
/// once each.
fn recorder(start: Instant, work: Duration, fail: Vec<u32>) -> (Pump<u32>, Log, Arc<AtomicUsize>) {
    let log: Log = Arc::default();
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let fail = Arc::new(Mutex::new(fail));
    let (l, r, p) = (log.clone(), running.clone(), peak.clone());
    let pump: Pump<u32> = Arc::new(move |_, batch: Vec<u32>| {
        let (l, r, p, fail) = (l.clone(), r.clone(), p.clone(), fail.clone());
        Box::pin(async move {
            let now = r.fetch_add(1, Ordering::SeqCst) + 1;
            p.fetch_max(now, Ordering::SeqCst);
            lock(&l).push((start.elapsed(), batch.clone()));
            tokio::time::sleep(work).await;
            r.fetch_sub(1, Ordering::SeqCst);
            let mut f = lock(&fail);
            let mut failed = Vec::new();
            for x in &batch {
                if let Some(i) = f.iter().position(|y| y == x) {
                    f.remove(i);
                    failed.push(*x);
                }
            }
            failed
        })
    });
    (pump, log, peak)
}

const S: BatchSettings = BatchSettings { batch_size: 10, push_interval: Duration::from_millis(100), max_concurrency: 2, max_attempts: 3 };

#[tokio::test(start_paused = true)]
async fn flushes_by_size_at_once_and_by_interval_otherwise() {
    let start = Instant::now();
    let (pump, log, _) = recorder(start, Duration::from_millis(1), vec![]);
    let b = Batcher::start(1, S, pump);
    for i in 0..13 {
        b.push(0, i);
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(lock(&log).len(), 1, "a full batch goes out at once");
    assert_eq!(lock(&log)[0], (Duration::ZERO, (0..10).collect()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let l = lock(&log).clone();
    assert_eq!(l.len(), 2);
    assert_eq!(l[1].1, vec![10, 11, 12], "the rest after the push interval, FIFO");
    assert!(l[1].0 >= Duration::from_millis(100) && l[1].0 < Duration::from_millis(120), "{:?}", l[1].0);
    b.complete(true).await;
}

#[tokio::test(start_paused = true)]
async fn fans_out_up_to_max_concurrency_per_slot() {
    let start = Instant::now();
    let (pump, log, peak) = recorder(start, Duration::from_millis(50), vec![]);
    let b = Batcher::start(2, S, pump);
    for i in 0..50 {
        b.push(0, i);
    }
    b.complete(true).await;
    assert_eq!(peak.load(Ordering::SeqCst), 2);
    let mut all: Vec<u32> = lock(&log).iter().flat_map(|(_, b)| b.clone()).collect();
    assert_eq!(all.len(), 50);
    all.sort();
    assert_eq!(all, (0..50).collect::<Vec<_>>());
    // 5 batches, 2 at a time, 50 ms each: done in 150 ms.
    assert!(start.elapsed() >= Duration::from_millis(150) && start.elapsed() < Duration::from_millis(200), "{:?}", start.elapsed());
}

#[tokio::test(start_paused = true)]
async fn failed_entries_are_retried_and_drain_waits_for_them() {
    let start = Instant::now();
    let (pump, log, _) = recorder(start, Duration::from_millis(1), vec![3, 7]);
    let b = Batcher::start(1, S, pump);
    for i in 0..10 {
        b.push(0, i);
    }
    b.complete(true).await;
    let l = lock(&log).clone();
    assert_eq!(l.len(), 2, "{l:?}");
    assert_eq!(l[1].1, vec![3, 7]);
    assert_eq!(b.stats.retried.load(Ordering::Relaxed), 2);
}

#[tokio::test(start_paused = true)]
async fn gives_up_after_max_attempts() {
    let start = Instant::now();
    let (pump, log, _) = recorder(start, Duration::from_millis(1), vec![1, 1, 1, 1]);
    // Item 1 fails on every attempt (the fail list holds it four times).
    let b = Batcher::start(1, S, pump);
    b.push(0, 1);
    b.complete(true).await;
    assert_eq!(lock(&log).len(), 3);
    assert_eq!(b.stats.given_up.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn slots_are_kept_apart() {
    type Flushes = Vec<(usize, Vec<u32>)>;
    let log: Arc<Mutex<Flushes>> = Arc::default();
    let l = log.clone();
    let b = Batcher::start(
        3,
        S,
        Arc::new(move |slot, batch: Vec<u32>| {
            lock(&l).push((slot, batch));
            Box::pin(async { Vec::new() })
        }),
    );
    for i in 0..30 {
        b.push((i % 3) as usize, i);
    }
    b.complete(true).await;
    for (slot, batch) in lock(&log).iter() {
        assert!(batch.iter().all(|i| (*i % 3) as usize == *slot), "slot {slot}: {batch:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn complete_without_drain_drops_pending() {
    let start = Instant::now();
    let (pump, log, _) = recorder(start, Duration::from_millis(1), vec![]);
    let b = Batcher::start(1, S, pump);
    for i in 0..5 {
        b.push(0, i);
    }
    b.complete(false).await;
    assert!(lock(&log).is_empty());
    let (pump, log, _) = recorder(start, Duration::from_millis(1), vec![]);
    let b = Batcher::start(1, S, pump);
    for i in 0..5 {
        b.push(0, i);
    }
    b.complete(true).await;
    assert_eq!(lock(&log).len(), 1);
    assert!(start.elapsed() < Duration::from_millis(100), "drain does not wait for the push interval");
}

/// What is pushed once the batcher has completed (a handler that outlived its listener's stop) still
/// goes out, on a call of its own, instead of waiting in a slot nobody flushes.
#[tokio::test(start_paused = true)]
async fn an_item_pushed_after_completion_still_goes_out() {
    let start = Instant::now();
    let (pump, log, _) = recorder(start, Duration::from_millis(1), vec![]);
    let b = Batcher::start(1, S, pump);
    b.push(0, 1);
    b.complete(true).await;
    b.push(0, 2);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let sent: Vec<u32> = lock(&log).iter().flat_map(|(_, batch)| batch.clone()).collect();
    assert_eq!(sent, [1, 2]);
}

/// A release of a message whose extension is already in flight waits for that call's answer: the
/// two calls could land in either order, and an extension landing after the release made the
/// message invisible again for the extension's time with nobody holding it (the simulation, seed
/// 61207294: a hold's two-minute extension landed after the hand-back). Here SQS answers the
/// extension after 2 s; the release issued meanwhile lands after it.
#[tokio::test(start_paused = true)]
async fn a_release_during_an_extension_in_flight_lands_after_it() {
    use fleet_io::memory::MemoryQueue;
    use fleet_io::queue::Queue;
    let q = MemoryQueue::new("q", Duration::from_secs(30));
    q.send(vec!["m".to_string()]).await.unwrap();
    let d = q.receive(1, Duration::ZERO).await.unwrap().pop().expect("a message");
    let receipt = d.receipt().to_string();
    let done = Completions::start(q.clone(), BatchSettings { push_interval: Duration::from_millis(10), ..BatchSettings::default() });
    q.delay_next_changes(1, Duration::from_secs(2));
    let kept = done.keep(d);
    kept.extend(Duration::from_secs(120));
    // The extension's call is under way (answered in 2 s); the message is handed back meanwhile.
    tokio::time::sleep(Duration::from_millis(500)).await;
    kept.release(Duration::from_secs(1));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(q.hidden_for(&receipt).is_none_or(|left| left <= Duration::from_secs(1)), "hidden for {:?} after the hand-back", q.hidden_for(&receipt));
    assert_eq!(q.receive(1, Duration::ZERO).await.unwrap().len(), 1, "visible again a second after its hand-back");
}
