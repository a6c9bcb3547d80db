//! The relay against an upstream stream held in memory (no sockets: what is tested is how far
//! the relay reads ahead of its client, which kernel buffers would hide).

use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokenpath_protocol::work::{WorkStream, PAUSE_AT};
use tokenpath_timeline::RequestId;

fn relay() -> Relay {
    let now = Instant::now();
    Relay {
        served_model_name: Arc::from("served"),
        url: "http://upstream.test".into(),
        arrived: now,
        admitted: now,
        sent: now,
        prompt_tokens: 3,
        meter: None,
        client_usage: false,
        strip_chunk_usage: false,
        prefill: Prefill::None,
    }
}

/// `n` content chunks, a finishing chunk and `[DONE]`, each its own read; `pulled` counts the
/// reads the relay made.
fn upstream(n: usize, pulled: Arc<AtomicUsize>) -> Opened {
    let reads = futures_util::stream::iter(0..n + 2).map(move |i| {
        pulled.fetch_add(1, Ordering::Relaxed);
        let event = if i < n {
            format!(r#"data: {{"model":"m","choices":[{{"index":0,"delta":{{"content":"t{i}"}}}}]}}"#)
        } else if i == n {
            r#"data: {"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#.to_owned()
        } else {
            "data: [DONE]".to_owned()
        };
        Ok(bytes::Bytes::from(event + "\n\n"))
    });
    Opened { bytes: reads.boxed(), sse: SseDecoder::new(), pending: Vec::new() }
}

/// Regression: only a worker's text events counted towards a stream's backlog, so the relay of
/// an upstream never waited for its client and read a stalled client's whole answer into memory.
#[tokio::test]
async fn a_client_that_stops_reading_stops_the_relay_reading_its_upstream() {
    const N: usize = 1_000;
    let pulled = Arc::new(AtomicUsize::new(0));
    let (tx, mut client) = WorkStream::channel(RequestId(1));
    let opened = upstream(N, Arc::clone(&pulled));
    let relay = tokio::spawn(async move { relay().stream(opened, &tx, Duration::from_secs(30)).await });
    // The client reads nothing; the relay runs as far as it may (the test's runtime has one
    // thread, so it runs exactly while this task yields).
    for _ in 0..500 {
        tokio::task::yield_now().await;
    }
    let ahead = pulled.load(Ordering::Relaxed);
    assert!(ahead <= PAUSE_AT + 1, "the relay read {ahead} chunks ahead of a client that took none");
    // The client reads on: every chunk arrives, in order, then the end.
    let mut seen = 0;
    loop {
        match client.next().await {
            Some(WorkEvent::Chunk { json, tokens }) => {
                if seen < N {
                    assert!(json.contains(&format!("\"t{seen}\"")) && tokens == 1, "{seen}: {json}");
                    assert!(json.contains(r#""model":"served""#), "{json}");
                }
                seen += 1;
            }
            Some(WorkEvent::Finished { reason, usage, .. }) => {
                assert_eq!((reason, usage.completion_tokens), (FinishReason::Length, N as u64));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seen, N + 1, "every content chunk and the finishing one");
    assert_eq!(relay.await.unwrap(), Ended::Finished);
}
