//! What the controllers conclude, heard from their own tracing events: a controller that finds itself
//! fenced (its lease lost, its checkpoint written by another controller) says so. In a run with one
//! controller under one name nobody else can have written, so such a conclusion is wrong (a write
//! whose answer was lost and that met itself when tried again, taken for another's).

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// The conclusions heard, each as "message (fields)".
#[derive(Clone, Default)]
pub struct Heard(pub Arc<Mutex<Vec<String>>>);

/// What a controller says when it concludes that another controller owns a job now.
const FENCED: [&str; 4] = ["fenced", "lease lost", "written by another controller", "another controller, just now"];

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl<S: Subscriber> Layer<S> for Heard {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if *event.metadata().level() > tracing::Level::INFO {
            return;
        }
        let mut f = Fields(String::new());
        event.record(&mut f);
        if FENCED.iter().any(|w| f.0.contains(w)) {
            fleet_io::lock(&self.0).push(f.0.trim().to_string());
        }
    }
}
