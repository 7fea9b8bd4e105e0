//! From the engine's threads to async handlers: a submitted request whose
//! events arrive on a tokio channel, cancelled in the engine when it is
//! dropped before its end — which is what happens when the client goes
//! away (hyper drops the response stream, or the handler's future).
//!
//! ```text
//!  engine node ──crossbeam──▶ forwarding thread (blocking pool) ──tokio mpsc──▶ handler / SSE stream
//!                 ◀── Engine::cancel(id) ── Generation dropped before Finished/Error
//! ```
//!
//! Each request in flight holds one blocking-pool thread that waits on the
//! engine's channel; the capacity permit it carries bounds how many there are.

use std::sync::Arc;

use kvsan_engine::engine::Engine;
use kvsan_engine::request::{Event, Request};
use kvsan_sanitizer::RequestId;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use super::metrics::{Metrics, RequestMetrics};

/// A request in the engine, seen from async code.
pub struct Generation {
    /// The engine's id of the request.
    pub id: RequestId,
    events: mpsc::UnboundedReceiver<Event>,
    engine: Arc<Engine>,
    /// Whether the engine ended the request (`Finished` or `Error` seen).
    ended: bool,
    /// The server's capacity this request takes, given back on drop.
    _permit: OwnedSemaphorePermit,
    /// Its metrics, recorded as its events pass (a drop before the end
    /// counts as an abort).
    metrics: RequestMetrics,
}

impl Generation {
    /// Submits `request` and starts forwarding its events.
    pub fn start(
        engine: &Arc<Engine>,
        request: Request,
        permit: OwnedSemaphorePermit,
        metrics: &Arc<Metrics>,
    ) -> Self {
        let metrics = metrics.request(request.prompt.len());
        let handle = engine.submit(request);
        let (tx, rx) = mpsc::unbounded_channel();
        let events = handle.events;
        // The thread ends with the engine's stream (the request ends, or is
        // cancelled) or as soon as nobody listens any more.
        tokio::task::spawn_blocking(move || {
            for event in events.iter() {
                if tx.send(event).is_err() {
                    break;
                }
            }
        });
        Generation {
            id: handle.id,
            events: rx,
            engine: engine.clone(),
            ended: false,
            _permit: permit,
            metrics,
        }
    }

    /// The next event; `None` once the stream ended, or if the engine
    /// stopped without ending it.
    pub async fn next(&mut self) -> Option<Event> {
        if self.ended {
            return None;
        }
        let event = self.events.recv().await;
        if matches!(event, None | Some(Event::Finished { .. } | Event::Error(_))) {
            self.ended = true;
        }
        match &event {
            Some(e) => self.metrics.event(e),
            None => self.metrics.end("error"),
        }
        event
    }

    /// Ends the request before the engine did (a stop string was reached):
    /// cancelled in the engine if it still runs.
    pub fn end(mut self) {
        if !self.ended {
            self.ended = true;
            self.engine.cancel(self.id);
            self.metrics.end("stop");
        }
    }
}

impl Drop for Generation {
    /// Dropped before its end: nobody waits for the answer any more.
    fn drop(&mut self) {
        if !self.ended {
            eprintln!(
                "kvsan: request {} cancelled: its client went away",
                self.id.0
            );
            self.engine.cancel(self.id);
        }
    }
}
