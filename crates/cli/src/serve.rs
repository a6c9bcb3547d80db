//! `tokenpath serve`: the gateway and one colocated worker on the embedded engine.
//!
//! Thin on purpose: parse flags (each with a `TOKENPATH_*` environment variable), load the model,
//! start the worker thread, bind, and hand over to `Gateway::serve` until Ctrl-C or SIGTERM.
//! Every decision (batching, admission, status codes, draining) lives in the worker and gateway
//! crates, where it is tested without a process.

use crate::generate::ModelArgs;
use anyhow::Context as _;
use clap::Args;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokenpath_engine::Engine;
use tokenpath_gateway::{ApiKeys, Gateway, GatewayConfig};
use tokenpath_timeline::WorkerId;
use tokenpath_worker::{Worker, WorkerConfig};

/// Flags of `tokenpath serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    listen: ListenArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    batching: BatchingArgs,
    #[command(flatten)]
    http: HttpArgs,
}

/// Where to listen and who may call.
#[derive(Debug, Args)]
struct ListenArgs {
    /// Address to bind. Without API keys only loopback is allowed (see --allow-open-public).
    #[arg(long, default_value = "127.0.0.1", env = "TOKENPATH_HOST")]
    host: IpAddr,
    /// Port to bind (0: any free port).
    #[arg(long, default_value_t = 8000, env = "TOKENPATH_PORT")]
    port: u16,
    /// API keys as `tenant:key,tenant2:key2`. Prefer the environment variable: command lines
    /// are visible to every user of the machine.
    #[arg(long, env = "TOKENPATH_API_KEYS", hide_env_values = true)]
    api_keys: Option<String>,
    /// Bind a non-loopback address even without API keys (anyone who reaches it can use it).
    #[arg(long, env = "TOKENPATH_ALLOW_OPEN_PUBLIC")]
    allow_open_public: bool,
}

/// How the worker batches and what it may hold.
#[derive(Debug, Args)]
struct BatchingArgs {
    /// Most prompt tokens prefilled per engine step (chunked prefill).
    #[arg(long, default_value_t = tokenpath_worker::DEFAULT_PREFILL_CHUNK, env = "TOKENPATH_PREFILL_CHUNK")]
    prefill_chunk: usize,
    /// Most requests waiting for a slot; more get 503 with Retry-After.
    #[arg(long, default_value_t = tokenpath_worker::DEFAULT_MAX_QUEUE, env = "TOKENPATH_MAX_QUEUE")]
    max_queue: usize,
    /// Most sequences in the running batch.
    #[arg(long, default_value_t = tokenpath_worker::DEFAULT_MAX_BATCH, env = "TOKENPATH_MAX_BATCH")]
    max_batch: usize,
    /// KV cache size in tokens (default: four full contexts).
    #[arg(long, env = "TOKENPATH_KV_TOKENS")]
    kv_tokens: Option<usize>,
}

/// HTTP-side limits and names.
#[derive(Debug, Args)]
struct HttpArgs {
    /// Largest request body accepted (larger: 413).
    #[arg(long, default_value_t = tokenpath_gateway::DEFAULT_MAX_BODY_BYTES, env = "TOKENPATH_MAX_BODY_BYTES")]
    max_body_bytes: usize,
    /// The model name clients use (default: the model file's name without extension).
    #[arg(long, env = "TOKENPATH_SERVED_MODEL_NAME")]
    served_model_name: Option<String>,
    /// Seconds running streams get to finish after Ctrl-C / SIGTERM.
    #[arg(long, default_value_t = 30, env = "TOKENPATH_SHUTDOWN_GRACE_S")]
    shutdown_grace_s: u64,
    /// The machine's peak GFLOP/s, exported in /metrics so achieved FLOP/s shows as a share of it.
    #[arg(long, env = "TOKENPATH_PEAK_GFLOPS")]
    peak_gflops: Option<f64>,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let path = args.model.path();
    let served_model_name = args.http.served_model_name.clone().unwrap_or_else(|| {
        path.file_stem().map_or_else(|| "tokenpath".to_owned(), |s| s.to_string_lossy().into_owned())
    });
    let api_keys =
        ApiKeys::parse(args.listen.api_keys.as_deref().unwrap_or("")).map_err(anyhow::Error::msg)?;
    if api_keys.is_empty() {
        if !args.listen.host.is_loopback() && !args.listen.allow_open_public {
            anyhow::bail!(
                "refusing to bind {} without API keys: set TOKENPATH_API_KEYS (tenant:key,...) or pass \
                 --allow-open-public",
                args.listen.host
            );
        }
        tracing::warn!(
            host = %args.listen.host,
            "!!! NO API KEYS: anyone who can reach this address can use the model (set TOKENPATH_API_KEYS) !!!"
        );
    } else {
        tracing::info!(keys = api_keys.len(), "API keys required");
    }
    tracing::info!(model = %path.display(), "loading model");
    let engine = Arc::new(Engine::open(&path).with_context(|| format!("loading {}", path.display()))?);
    let config = WorkerConfig {
        id: WorkerId("w0".into()),
        prefill_chunk: args.batching.prefill_chunk,
        max_queue: args.batching.max_queue,
        max_batch: args.batching.max_batch,
        kv_tokens: args.batching.kv_tokens,
        ..WorkerConfig::default()
    };
    let worker = Worker::spawn(engine, config).context("starting the worker")?;
    let gateway = Gateway::new(
        GatewayConfig {
            served_model_name: served_model_name.clone(),
            max_body_bytes: args.http.max_body_bytes,
            shutdown_grace: Duration::from_secs(args.http.shutdown_grace_s),
            peak_flops: args.http.peak_gflops.map(|g| g * 1e9),
            api_keys,
        },
        worker.handle(),
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let addr = std::net::SocketAddr::new(args.listen.host, args.listen.port);
        let listener = tokenpath_gateway::bind(&addr.to_string()).await?;
        let local = listener.local_addr().context("reading the bound address")?;
        tracing::info!(%local, model = %served_model_name, "serving the OpenAI API on http://{local}/v1");
        gateway.serve(listener, tokenpath_gateway::shutdown_signal()).await?;
        anyhow::Ok(())
    })?;
    tracing::info!("stopped");
    Ok(())
}
