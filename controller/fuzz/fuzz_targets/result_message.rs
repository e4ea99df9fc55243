//! Fuzz target: a results-queue message body through the controller's aggregator (parse, apply,
//! checkpoint, report) on the in-memory store must not panic; a sealed job of one chunk makes the
//! report path reachable.
#![no_main]

use std::sync::OnceLock;

use controller::{Aggregator, Source};
use fleet_io::memory::MemoryStore;
use fleet_io::queue::Message;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().build().expect("runtime"))
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(body) = std::str::from_utf8(data) else { return };
    runtime().block_on(async {
        let store = MemoryStore::new();
        let mut agg = Aggregator::new(store);
        let sealed = r#"{"kind":"sealed","v":1,"job_id":"f","total_chunks":1}"#;
        let msgs = [
            Message { id: "1".into(), body: body.to_string(), receipt: "r1".into(), receive_count: 1, ..Default::default() },
            Message { id: "2".into(), body: sealed.into(), receipt: "r2".into(), receive_count: 1, ..Default::default() },
        ];
        agg.apply(Source::Results, &msgs).await;
        agg.apply(Source::ResultsDeadLetter, &msgs[..1]).await;
        agg.flush().await;
    });
});
