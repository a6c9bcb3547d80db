//! `tokenpath mock-engine`: the model-less OpenAI server of `tokenpath_bench::mock`, on loopback
//! by default, for `scripts/bench-gateway` and `scripts/check-router-diff`.

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
    /// Content chunks per answer.
    #[arg(long, default_value_t = 8)]
    tokens: usize,
    /// The model name it lists.
    #[arg(long, default_value = "mock")]
    model: String,
    /// Append every generation request to this JSONL file.
    #[arg(long)]
    log: Option<PathBuf>,
}

pub fn run(args: MockEngineArgs) -> anyhow::Result<()> {
    let persona: Persona = args.persona.parse().map_err(anyhow::Error::msg)?;
    let config = MockConfig { persona, tokens: args.tokens, model: args.model, log: args.log };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        let bound = listener.local_addr()?;
        tracing::info!(persona = args.persona, "mock engine listening on http://{bound}");
        mock::serve(listener, config, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serving (or opening the request log)")?;
        anyhow::Ok(())
    })
}
