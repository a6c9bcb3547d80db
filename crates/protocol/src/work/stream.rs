//! The events of one request on their way to whoever reads them ([`WorkStream`]), and the
//! count of what is sent but not yet read ([`Backlog`]) that pauses a sequence whose reader
//! stopped. Both the producers (a worker's batcher, the gateway's relays of remote workers and
//! upstreams) and every reader (the gateway's HTTP layer) touch it, so it sits on the boundary.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokenpath_timeline::RequestId;
use tokio::sync::mpsc as tmpsc;

use super::WorkEvent;

/// The events of one request. Dropping it cancels the request: the worker notices at its next
/// step and frees the sequence's KV blocks.
#[derive(Debug)]
pub struct WorkStream {
    id: RequestId,
    rx: tmpsc::UnboundedReceiver<WorkEvent>,
    backlog: Backlog,
}

/// Whether an event counts in the [`Backlog`]: the ones a stream carries many of — a worker's
/// text and an upstream's chunks. (Counting only text once let the gateway's relay of an upstream
/// read a stalled client's whole answer into memory instead of pausing the upstream.)
fn paced(e: &WorkEvent) -> bool {
    matches!(e, WorkEvent::Text { .. } | WorkEvent::Chunk { .. })
}

/// A sequence pauses (is not stepped) while this many of its text events wait unread.
pub const PAUSE_AT: usize = 64;
/// A paused sequence resumes once its reader is down to this many.
pub const RESUME_AT: usize = 16;

/// Text events a sequence sent that its reader has not taken yet: generation pauses for a
/// client that stops reading instead of running ahead of it (security review H7). Shared by the
/// batcher (which counts sends) and the [`WorkStream`] (which counts takes); a relaxed counter is
/// enough, since a pause that starts or ends a step late changes nothing but timing.
#[derive(Clone, Debug, Default)]
pub struct Backlog(Arc<BacklogState>);

#[derive(Debug, Default)]
struct BacklogState {
    unread: AtomicUsize,
    /// Woken when the reader takes the backlog below [`PAUSE_AT`] (for async senders).
    drained: tokio::sync::Notify,
}

impl Backlog {
    /// One more text event was sent.
    pub fn sent(&self) {
        self.0.unread.fetch_add(1, Ordering::Relaxed);
    }

    fn taken(&self) {
        let before = self.0.unread.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if before == Ok(PAUSE_AT) {
            self.0.drained.notify_waiters();
        }
    }

    /// Text events sent and not yet taken.
    pub fn get(&self) -> usize {
        self.0.unread.load(Ordering::Relaxed)
    }

    /// Waits until fewer than [`PAUSE_AT`] text events are unread.
    async fn room(&self) {
        loop {
            let drained = self.0.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.get() < PAUSE_AT {
                return;
            }
            drained.await;
        }
    }
}

/// The sending side of [`WorkStream::channel`]: events go through at once, and a relay that
/// waits for [`StreamSender::room`] before reading its source passes the reader's pace on (the
/// gateway's relay of a remote worker stops reading the worker's socket, so the worker pauses).
#[derive(Debug)]
pub struct StreamSender {
    tx: tmpsc::UnboundedSender<WorkEvent>,
    backlog: Backlog,
}

impl StreamSender {
    /// Sends `event`; `false` when the reader is gone.
    pub fn send(&self, event: WorkEvent) -> bool {
        if paced(&event) {
            self.backlog.sent();
        }
        self.tx.send(event).is_ok()
    }

    /// Resolves when the reader is gone.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }

    /// Resolves when the reader has fewer than [`PAUSE_AT`] text events unread.
    pub async fn room(&self) {
        self.backlog.room().await;
    }
}

impl WorkStream {
    /// The stream of a request whose producer counts its sends into `backlog` itself (a worker's
    /// batcher, which checks the backlog before stepping the sequence).
    pub fn from_batcher(id: RequestId, rx: tmpsc::UnboundedReceiver<WorkEvent>, backlog: Backlog) -> Self {
        Self { id, rx, backlog }
    }

    /// A stream fed by the returned sender, for backends other than a local batcher (the
    /// gateway's remote workers): the same type reaches the HTTP layer either way.
    pub fn channel(id: RequestId) -> (StreamSender, Self) {
        let (tx, rx) = tmpsc::unbounded_channel();
        let backlog = Backlog::default();
        (StreamSender { tx, backlog: backlog.clone() }, Self { id, rx, backlog })
    }

    fn took(&self, e: &Option<WorkEvent>) {
        if e.as_ref().is_some_and(paced) {
            self.backlog.taken();
        }
    }

    /// The request this stream belongs to.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next event; `None` once the stream is over.
    pub async fn next(&mut self) -> Option<WorkEvent> {
        let e = self.rx.recv().await;
        self.took(&e);
        e
    }

    /// An event that is already waiting, without waiting for one (`None` when none is ready or
    /// the stream is over: [`next`](Self::next) tells the two apart).
    pub fn try_next(&mut self) -> Option<WorkEvent> {
        let e = self.rx.try_recv().ok();
        self.took(&e);
        e
    }

    /// The next event, blocking the calling thread (not for async code).
    pub fn blocking_next(&mut self) -> Option<WorkEvent> {
        let e = self.rx.blocking_recv();
        self.took(&e);
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A relay (the gateway's, of a remote worker) that waits for `room` reads its source no
    /// faster than the stream's reader takes events: the reader's pace travels upstream.
    #[tokio::test]
    async fn a_relay_waits_while_its_reader_is_behind() {
        let (tx, mut stream) = WorkStream::channel(tokenpath_timeline::RequestId(1));
        let text = || WorkEvent::Text { delta: "x".into(), tokens: 1 };
        // An upstream's chunks count as a worker's text does (regression: they did not).
        let chunk = || WorkEvent::Chunk { json: "{}".into(), tokens: 1 };
        for i in 0..PAUSE_AT {
            assert!(tx.send(if i % 2 == 0 { text() } else { chunk() }));
        }
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), tx.room()).await;
        assert!(waiting.is_err(), "room while the reader is {} behind", PAUSE_AT);
        let room = tokio::spawn(async move {
            tx.room().await;
            tx
        });
        assert!(matches!(stream.next().await, Some(WorkEvent::Text { .. })));
        let tx = room.await.unwrap();
        assert!(tx.send(text()), "the reader took one: room again");
        drop(stream);
        tx.closed().await;
    }
}
