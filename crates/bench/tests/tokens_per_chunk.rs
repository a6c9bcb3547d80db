//! Servers that put several tokens in one SSE event: per-token ITL is the chunk gap divided by
//! the tokens each event carries, counted from the cumulative usage a server streams on every
//! chunk (vLLM's `continuous_usage_stats`). Regression: every content event counted as one token,
//! so with 2 tokens per event ITL equalled the chunk gap. Against `tokenpath mock-engine`'s
//! server on loopback, 2 and 3 tokens per event.

#![allow(clippy::unwrap_used)]

use std::time::Duration;
use tokenpath_bench::arrival::Arrival;
use tokenpath_bench::client::{Endpoint, Target};
use tokenpath_bench::mock::{MockConfig, Persona};
use tokenpath_bench::report::{Report, ReportOptions};
use tokenpath_bench::run::{run, RunConfig};

async fn mock(per_chunk: usize, continuous: bool) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let config = MockConfig {
        persona: Persona::Plain,
        tokens: 0,
        model: "m".into(),
        log: None,
        otlp: None,
        token_delay: Duration::from_millis(4),
        always_usage: false,
        tokens_per_chunk: per_chunk,
        continuous_usage: continuous,
    };
    tokio::spawn(tokenpath_bench::mock::serve(listener, config, std::future::pending()));
    url
}

fn target(url: &str) -> Target {
    Target {
        url: url.into(),
        model: "m".into(),
        api_key: None,
        stream: true,
        ignore_eos: false,
        timeout: Duration::from_secs(20),
        endpoint: Endpoint::Chat,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_event_counts_the_tokens_it_carries() {
    for per_chunk in [2usize, 3] {
        let url = mock(per_chunk, true).await;
        let w = "fixed:8:12".parse().unwrap();
        let cfg = RunConfig::new(target(&url), w, Arrival::Poisson { rate: 50.0 }, 4, 1);
        let records = run(&cfg, &mut |_, _, _| {}).await.unwrap();
        for r in &records {
            assert!(r.is_ok(), "{r:?}");
            let content: Vec<u32> = r.events.iter().map(|e| e.tokens).filter(|&t| t > 0).collect();
            assert_eq!(content.len(), 12usize.div_ceil(per_chunk), "{per_chunk} per event");
            assert!(content.iter().all(|&t| t as usize == per_chunk), "{content:?}");
            assert_eq!(content.iter().sum::<u32>(), 12, "the events' tokens add up to usage");
        }
        let report = Report::build(&records, &ReportOptions::default()).unwrap();
        assert!(!report.notes.iter().any(|n| n.contains("split is unknown")), "{:?}", report.notes);
        let (itl, gap) = (report.summary.itl_ms.unwrap(), report.summary.chunk_gap_ms.unwrap());
        // Per token: `per_chunk` samples per gap, each the gap divided among its tokens.
        assert_eq!(itl.count, gap.count * per_chunk as u64, "{itl:?} {gap:?}");
        let ratio = gap.mean / itl.mean;
        assert!((ratio - per_chunk as f64).abs() < 1e-6, "chunk gap / ITL = {ratio}");
    }
}

/// Without usage per chunk the split is unknown: each content event counts as one token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_usage_per_chunk_an_event_is_one_token() {
    let url = mock(2, false).await;
    let w = "fixed:8:6".parse().unwrap();
    let cfg = RunConfig::new(target(&url), w, Arrival::Poisson { rate: 50.0 }, 2, 1);
    let records = run(&cfg, &mut |_, _, _| {}).await.unwrap();
    for r in &records {
        let content: Vec<u32> = r.events.iter().map(|e| e.tokens).filter(|&t| t > 0).collect();
        assert_eq!(content, vec![1, 1, 1], "{r:?}");
    }
    let report = Report::build(&records, &ReportOptions::default()).unwrap();
    assert!(report.notes.iter().any(|n| n.contains("the split is unknown")), "{:?}", report.notes);
}

/// One token per whitespace-separated word: the mock's " tok" pieces count exactly.
#[derive(Debug)]
struct Words;

impl tokenpath_bench::tokens::PromptTokenizer for Words {
    fn encode(&self, text: &str) -> Vec<u32> {
        text.split_whitespace().map(|w| w.len() as u32).collect()
    }
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&n| "x".repeat(n as usize)).collect::<Vec<_>>().join(" ")
    }
    fn chat_prompt(
        &self,
        messages: &[tokenpath_bench::tokens::PromptMessage],
        _limit: usize,
    ) -> Result<Vec<u32>, tokenpath_protocol::ProtocolError> {
        Ok(messages.iter().flat_map(|m| self.encode(&m.content)).collect())
    }
    fn text_prompt(&self, text: &str, _limit: usize) -> Result<Vec<u32>, tokenpath_protocol::ProtocolError> {
        Ok(self.encode(text))
    }
}

/// Without usage per chunk but with the model's tokenizer, each event's text says how many
/// tokens it carried: 2 and 3 per event, ITL the chunk gap divided among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tokenizer_splits_events_by_their_text() {
    for per_chunk in [2usize, 3] {
        let url = mock(per_chunk, false).await;
        let w = "fixed:8:12".parse().unwrap();
        let mut cfg = RunConfig::new(target(&url), w, Arrival::Poisson { rate: 50.0 }, 3, 1);
        cfg.tokenizer = Some(std::sync::Arc::new(Words));
        let records = run(&cfg, &mut |_, _, _| {}).await.unwrap();
        for r in &records {
            assert!(r.is_ok(), "{r:?}");
            let content: Vec<u32> = r.events.iter().map(|e| e.tokens).filter(|&t| t > 0).collect();
            assert_eq!(content, vec![per_chunk as u32; 12 / per_chunk], "{per_chunk} per event");
        }
        let report = Report::build(&records, &ReportOptions::default()).unwrap();
        assert!(!report.notes.iter().any(|n| n.contains("split is unknown")), "{:?}", report.notes);
        let (itl, gap) = (report.summary.itl_ms.unwrap(), report.summary.chunk_gap_ms.unwrap());
        assert_eq!(itl.count, gap.count * per_chunk as u64, "{itl:?} {gap:?}");
    }
}
