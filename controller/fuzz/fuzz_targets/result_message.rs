//! Fuzz target: a results-queue message body through the controller's aggregator (parse, apply,
//! checkpoint, report) on the in-memory store must not panic; a sealed job of one chunk makes the
//! report path reachable.
#![no_main]

use std::sync::OnceLock;

use controller::{Aggregator, Source};
use fleet_engine::Completions;
use fleet_io::memory::{MemoryQueue, MemoryStore};
use fleet_io::queue::{Delivery, Message};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().build().expect("runtime"))
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(body) = std::str::from_utf8(data) else { return };
    runtime().block_on(async {
        let store = MemoryStore::new();
        let agg = Aggregator::with(store, controller::aggregate::Options::default());
        let done = Completions::start(MemoryQueue::new("billing-results", std::time::Duration::from_secs(30)), Default::default());
        let sealed = r#"{"kind":"sealed","v":1,"job_id":"f","total_chunks":1}"#;
        let msg = |id: &str, body: &str| {
            done.keep(Delivery::new(Message { id: id.into(), body: body.into(), receive_count: 1, ..Default::default() }, format!("r{id}")))
        };
        agg.apply(Source::Results, vec![msg("1", body), msg("2", sealed)]).await;
        agg.apply(Source::ResultsDeadLetter, vec![msg("3", body)]).await;
        for k in agg.flush().await {
            k.delete();
        }
        done.finish(true).await;
    });
});
