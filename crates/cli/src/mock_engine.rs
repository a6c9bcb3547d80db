//! `tokenpath mock-engine`: the model-less OpenAI server of `tokenpath_bench::mock`, on loopback
//! by default, for `scripts/bench-gateway`, `scripts/check-router-diff` and `scripts/bench-client`.

use anyhow::Context as _;
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use tokenpath_bench::mock::{self, MockConfig, Persona};

/// Flags of `tokenpath mock-engine`.
#[derive(Debug, Args)]
pub struct MockEngineArgs {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1:8100")]
    listen: SocketAddr,
    /// The engine it plays: plain, vllm-prefill, vllm-decode, sglang-prefill, sglang-decode.
    #[arg(long, default_value = "plain")]
    persona: String,
    /// Content chunks per answer (0: as many as the request's max_tokens, at most 256).
    #[arg(long, default_value_t = 0)]
    tokens: usize,
    /// Microseconds between a stream's events (0: the whole stream in one write).
    #[arg(long, default_value_t = 0)]
    token_delay_us: u64,
    /// Send the usage chunk on every stream, asked for or not.
    #[arg(long)]
    always_usage: bool,
    /// Tokens each content chunk carries.
    #[arg(long, default_value_t = 1)]
    tokens_per_chunk: usize,
    /// Every content chunk carries the cumulative usage (vLLM's continuous_usage_stats); also
    /// when a request asks with `stream_options.continuous_usage_stats`.
    #[arg(long)]
    continuous_usage: bool,
    /// Threads of its runtime (1: one core's worth, the cheapest when pinned).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// The model name it lists.
    #[arg(long, default_value = "mock")]
    model: String,
    /// Export a vLLM-shaped `llm_request` span for every request that carries a `traceparent`
    /// to this OTLP receiver (base URL, e.g. `http://127.0.0.1:4318`), with the latencies the
    /// mock measured.
    #[arg(long)]
    otlp_endpoint: Option<String>,
    /// Export over OTLP/gRPC instead of OTLP/HTTP protobuf.
    #[arg(long, requires = "otlp_endpoint")]
    otlp_grpc: bool,
    /// Append every generation request to this JSONL file.
    #[arg(long)]
    log: Option<PathBuf>,
}

pub fn run(args: MockEngineArgs) -> anyhow::Result<()> {
    let persona: Persona = args.persona.parse().map_err(anyhow::Error::msg)?;
    let config = MockConfig {
        persona,
        tokens: args.tokens,
        model: args.model,
        log: args.log,
        token_delay: std::time::Duration::from_micros(args.token_delay_us),
        always_usage: args.always_usage,
        tokens_per_chunk: args.tokens_per_chunk,
        continuous_usage: args.continuous_usage,
        otlp: args
            .otlp_endpoint
            .map(|endpoint| tokenpath_bench::mock::MockOtlp { endpoint, grpc: args.otlp_grpc }),
    };
    let runtime = match args.threads {
        0 | 1 => tokio::runtime::Builder::new_current_thread().enable_all().build()?,
        n => tokio::runtime::Builder::new_multi_thread().worker_threads(n).enable_all().build()?,
    };
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let bound = listener.local_addr()?;
        // Scripts read the port from stdout (`--listen 127.0.0.1:0`).
        println!("port={}", bound.port());
        tracing::info!(persona = args.persona, "mock engine listening on http://{bound}");
        mock::serve(listener, config, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serving (or opening the request log)")?;
        anyhow::Ok(())
    })
}
