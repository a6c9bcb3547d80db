//! `tokenpath serve`: the gateway with one colocated worker on the embedded engine, or with worker
//! processes (`--prefill N --decode M` starts them here, `--cluster FILE` lists them elsewhere).
//!
//! Thin on purpose: parse flags (each with a `TOKENPATH_*` environment variable), load the model,
//! start the worker(s), bind, and hand over to `Gateway::serve` until Ctrl-C or SIGTERM.
//! Every decision (batching, admission, status codes, draining) lives in the worker and gateway
//! crates, where it is tested without a process.

use crate::generate::ModelArgs;
use crate::secret::Secret;
use crate::topology::{ChildArgs, Children, CpuList, SecretArgs};
use anyhow::Context as _;
use clap::Args;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokenpath_cli::cluster_file::{self, ClusterPlan};
use tokenpath_gateway::cluster::{Cluster, Registry};
use tokenpath_gateway::{AdminKey, ApiKeys, Gateway, GatewayConfig};
use tokenpath_protocol::auth::{Bytes32, ClusterSecret};
use tokenpath_timeline::WorkerId;
use tokenpath_worker::{Role, Worker, WorkerConfig};

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
    topology: TopologyArgs,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    secret: SecretArgs,
    #[command(flatten)]
    upstream: crate::upstream::UpstreamArgs,
    #[command(flatten)]
    spans: SpanArgs,
}

/// Upstream engines' spans (vLLM: `--otlp-traces-endpoint` pointed here).
#[derive(Debug, Args)]
#[command(next_help_heading = "Upstream engines' spans (OpenTelemetry)")]
struct SpanArgs {
    /// Receive the upstream engines' OTLP spans here (OTLP/HTTP at /v1/traces and OTLP/gRPC on
    /// the same port). Every forwarded request continues the client's `traceparent` (or starts
    /// a fresh trace) on each leg; the stages of the span that comes back are exported as
    /// `tokenpath_engine_span_stage_seconds`.
    #[arg(long, env = "TOKENPATH_OTLP_LISTEN")]
    otlp_listen: Option<std::net::SocketAddr>,
    /// Require `authorization: Bearer <token>` on every export.
    #[arg(long, env = "TOKENPATH_OTLP_TOKEN", hide_env_values = true, requires = "otlp_listen")]
    otlp_token: Option<String>,
    /// From admission, how long a request's span is waited for before it counts as missing.
    #[arg(long, default_value_t = 120.0, env = "TOKENPATH_OTLP_WAIT_S", requires = "otlp_listen")]
    otlp_wait_s: f64,
    #[command(flatten)]
    export: SpanExportArgs,
}

/// Spans out: this process's own timeline of each request.
#[derive(Debug, Args)]
pub(crate) struct SpanExportArgs {
    /// Export this process's spans to this OTLP/HTTP collector (base URL or its `/v1/traces`).
    /// A gateway exports per request a `tokenpath.request` span continuing the client's
    /// `traceparent` (the parent its workers' and engines' legs are given) and a span per
    /// stage it measured; a worker (and the workers `--prefill/--decode` start, which get this
    /// flag too) a span per stage it ran. Off by default.
    #[arg(long, env = "TOKENPATH_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// Bearer token for --otlp-endpoint.
    #[arg(long, env = "TOKENPATH_OTLP_ENDPOINT_TOKEN", hide_env_values = true, requires = "otlp_endpoint")]
    otlp_endpoint_token: Option<String>,
}

impl SpanExportArgs {
    /// The exporting task, when a collector is set (call on the runtime).
    pub(crate) fn exporter(&self) -> Option<tokenpath_otlp::SpanExporter> {
        let endpoint = self.otlp_endpoint.as_deref()?;
        Some(tokenpath_otlp::SpanExporter::start(endpoint, self.otlp_endpoint_token.clone()))
    }

    /// The same settings for a child `tokenpath worker` (the token in its environment).
    fn to_child(&self, child: &mut ChildArgs) {
        if let Some(e) = &self.otlp_endpoint {
            child.args.push(format!("--otlp-endpoint={e}"));
        }
        if let Some(t) = &self.otlp_endpoint_token {
            child.env.push(("TOKENPATH_OTLP_ENDPOINT_TOKEN", t.clone()));
        }
    }
}

/// Which processes run the model: one colocated worker in this process (the default), worker
/// processes started here (`--prefill N --decode M`), or workers listed in a cluster file.
#[derive(Debug, Args)]
#[command(next_help_heading = "Prefill/decode workers")]
struct TopologyArgs {
    /// Prefill worker processes to start (prefill/decode disaggregation; needs --decode ≥ 1).
    #[arg(long, default_value_t = 0, env = "TOKENPATH_PREFILL")]
    prefill: usize,
    /// Decode worker processes to start.
    #[arg(long, default_value_t = 0, env = "TOKENPATH_DECODE")]
    decode: usize,
    /// Cores for the prefill workers (e.g. `0`); default: not pinned.
    #[arg(long, env = "TOKENPATH_PREFILL_CPUS")]
    prefill_cpus: Option<CpuList>,
    /// Cores for the decode workers (e.g. `1`); default: not pinned.
    #[arg(long, env = "TOKENPATH_DECODE_CPUS")]
    decode_cpus: Option<CpuList>,
    /// Workers from a file (`[[worker]]` tables with `addr` and `role`; more may register at
    /// run time: `tokenpath worker --register http://this-gateway`), or upstream engines
    /// (`[[upstream]]` tables with `url`, `kind`, `role`, ...; see deploy/cluster.example.toml).
    #[arg(long, env = "TOKENPATH_CLUSTER", value_name = "cluster.toml")]
    cluster: Option<std::path::PathBuf>,
    /// Accept workers that register at run time even with no --cluster and no --prefill/--decode.
    #[arg(long, env = "TOKENPATH_ACCEPT_WORKERS")]
    accept_workers: bool,
}

impl TopologyArgs {
    fn is_cluster(&self) -> bool {
        self.prefill + self.decode > 0 || self.cluster.is_some() || self.accept_workers
    }
}

/// Where to listen and who may call.
#[derive(Debug, Args)]
#[command(next_help_heading = "Listening and access")]
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
    api_keys: Option<Secret>,
    /// API keys with per-tenant rate limits, from a TOML file (see deploy/keys.example.toml).
    #[arg(long, env = "TOKENPATH_API_KEYS_FILE", value_name = "PATH")]
    api_keys_file: Option<std::path::PathBuf>,
    /// Bind a non-loopback address even without API keys (anyone who reaches it can use it).
    #[arg(long, env = "TOKENPATH_ALLOW_OPEN_PUBLIC")]
    allow_open_public: bool,
    /// The operator's key for /admin/* (worker registration) and /metrics, never a tenant's.
    /// Without it those routes are served only on loopback. Prefer the environment variable.
    #[arg(long, env = "TOKENPATH_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<Secret>,
    /// Serve /metrics on this address of its own (open: bind it where only the scraper
    /// reaches), and not on the API's.
    #[arg(long, env = "TOKENPATH_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
}

/// How the worker batches and what it may hold.
#[derive(Debug, Args)]
#[command(next_help_heading = "Batching and KV cache")]
pub(crate) struct BatchingArgs {
    /// Most prompt tokens prefilled per engine step (chunked prefill; a prompt whose rest would be
    /// at most an eighth of this is finished in the same step).
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
    /// Do not reuse the KV of prompt prefixes seen before.
    #[arg(long, env = "TOKENPATH_NO_PREFIX_CACHE")]
    no_prefix_cache: bool,
    /// Who shares prefix-cache blocks: `tenant` (the default with API keys: no tenant can plant
    /// KV for another or probe what another sent) or `global`.
    #[arg(long, env = "TOKENPATH_PREFIX_CACHE_SCOPE", value_name = "global|tenant")]
    prefix_cache_scope: Option<tokenpath_gateway::PrefixScope>,
    /// Write one JSON line per engine step to this file (rows, prompt and decode tokens,
    /// attention work, the gap since the previous step): a profile of the scheduler, and what a
    /// step-time model is fitted to. `{worker}` in the path becomes each worker's name.
    #[arg(long, env = "TOKENPATH_STEP_LOG", value_name = "PATH")]
    step_log: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub(crate) kv_pool: crate::kv_pool::KvPoolArgs,
}

/// `1GiB`, `512MiB`, `64KiB`, `2G`, `100M` (binary multiples) or plain bytes.
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| format!("`{s}` is not a size (e.g. 1GiB, 512MiB)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        other => return Err(format!("unknown size unit `{other}` in `{s}` (B, KiB, MiB, GiB, TiB)")),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("`{s}` is too large"))
}

impl BatchingArgs {
    /// The worker configuration these flags describe.
    pub(crate) fn worker_config(&self) -> WorkerConfig {
        WorkerConfig {
            prefill_chunk: self.prefill_chunk,
            max_queue: self.max_queue,
            max_batch: self.max_batch,
            kv_tokens: self.kv_tokens,
            prefix_cache: !self.no_prefix_cache,
            step_log: self.step_log.clone(),
            kv_pool: self.kv_pool.config(),
            ..WorkerConfig::default()
        }
    }

    /// The same flags for a child `tokenpath worker`.
    fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            format!("--prefill-chunk={}", self.prefill_chunk),
            format!("--max-queue={}", self.max_queue),
            format!("--max-batch={}", self.max_batch),
        ];
        if let Some(k) = self.kv_tokens {
            a.push(format!("--kv-tokens={k}"));
        }
        if self.no_prefix_cache {
            a.push("--no-prefix-cache".into());
        }
        if let Some(p) = &self.step_log {
            // Several children: each writes its own file.
            let p = p.to_string_lossy();
            let p = if p.contains(tokenpath_worker::WORKER_PLACEHOLDER) {
                p.into_owned()
            } else {
                format!("{p}.{}", tokenpath_worker::WORKER_PLACEHOLDER)
            };
            a.push(format!("--step-log={p}"));
        }
        self.kv_pool.push_args(&mut a);
        a
    }
}

/// HTTP-side limits and names.
#[derive(Debug, Args)]
#[command(next_help_heading = "HTTP limits")]
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
    /// Seconds a client may take to send a request's headers (also the longest a keep-alive
    /// connection stays idle).
    #[arg(long, default_value_t = 20, env = "TOKENPATH_HEADER_TIMEOUT_S")]
    header_timeout_s: u64,
    /// Seconds a client may take to send a request's body.
    #[arg(long, default_value_t = 60, env = "TOKENPATH_BODY_TIMEOUT_S")]
    body_timeout_s: u64,
    /// Most HTTP connections open at once; more are closed on arrival.
    #[arg(long, default_value_t = 1024, env = "TOKENPATH_MAX_CONNECTIONS")]
    max_connections: usize,
    /// Seconds a response may wait for the client to take bytes before the connection is cut
    /// and the request cancelled (generation never waits for a slow reader).
    #[arg(long, default_value_t = 30, env = "TOKENPATH_WRITE_TIMEOUT_S")]
    write_timeout_s: u64,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let path = args.model.path();
    let served_model_name = args.http.served_model_name.clone().unwrap_or_else(|| {
        path.file_stem().map_or_else(|| "tokenpath".to_owned(), |s| s.to_string_lossy().into_owned())
    });
    let api_keys = match (&args.listen.api_keys_file, &args.listen.api_keys) {
        (Some(_), Some(_)) => anyhow::bail!(
            "API keys given twice: use either --api-keys-file (TOKENPATH_API_KEYS_FILE) or --api-keys \
             (TOKENPATH_API_KEYS)"
        ),
        (Some(path), None) => ApiKeys::load(path)?,
        (None, spec) => {
            ApiKeys::parse(spec.as_ref().map_or("", |s| s.expose())).map_err(anyhow::Error::msg)?
        }
    };
    if api_keys.is_empty() {
        if !args.listen.host.is_loopback() && !args.listen.allow_open_public {
            anyhow::bail!(
                "refusing to bind {} without API keys: set TOKENPATH_API_KEYS (tenant:key,...) or \
                 --api-keys-file, or pass --allow-open-public",
                args.listen.host
            );
        }
        tracing::warn!(
            host = %args.listen.host,
            "!!! NO API KEYS: anyone who can reach this address can use the model (set TOKENPATH_API_KEYS) !!!"
        );
    } else {
        let limited: Vec<&str> =
            api_keys.tenants().filter(|(_, l)| !l.is_unlimited()).map(|(t, _)| t.0.as_str()).collect();
        tracing::info!(keys = api_keys.len(), rate_limited_tenants = ?limited, "API keys required");
    }
    let mut gateway_config = GatewayConfig {
        served_model_name: served_model_name.clone(),
        max_body_bytes: args.http.max_body_bytes,
        shutdown_grace: Duration::from_secs(args.http.shutdown_grace_s),
        peak_flops: args.http.peak_gflops.map(|g| g * 1e9),
        api_keys,
        admin_key: args
            .listen
            .admin_key
            .as_ref()
            .map(|k| AdminKey::new(k.expose()))
            .transpose()
            .map_err(anyhow::Error::msg)?,
        metrics_elsewhere: args.listen.metrics_listen.is_some(),
        http: tokenpath_gateway::HttpLimits {
            header_read: Duration::from_secs(args.http.header_timeout_s.max(1)),
            body_read: Duration::from_secs(args.http.body_timeout_s.max(1)),
            max_connections: args.http.max_connections.max(1),
            write_stall: Duration::from_secs(args.http.write_timeout_s.max(1)),
        },
        prefix_cache_scope: args.batching.prefix_cache_scope,
        // Set once the runtime runs (the receiver and the exporter are tasks).
        engine_spans: None,
        span_export: None,
    };
    // Two async threads, or one when the process may run on one core only (`taskset -c 0`, a
    // one-CPU container): two threads on one core only take turns, a context switch per
    // hand-over (scripts/bench-gateway-cpu measures it).
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores.clamp(1, 2))
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Dropped last: every worker process started here is killed and reaped on the way out.
    let mut children = Children::default();
    let mut local = None;
    runtime.block_on(async {
        gateway_config.span_export = args.spans.export.exporter();
        // Kept for as long as the gateway serves.
        let _receiver = match args.spans.otlp_listen {
            Some(listen) => {
                let rc = tokenpath_otlp::ReceiverConfig::new(listen).with_token(args.spans.otlp_token.clone());
                let r = tokenpath_otlp::Receiver::start(rc).await?;
                gateway_config.engine_spans = Some(tokenpath_gateway::EngineSpans {
                    store: r.store.clone(),
                    wait: Duration::from_secs_f64(args.spans.otlp_wait_s.clamp(1.0, 3600.0)),
                });
                Some(r)
            }
            None => None,
        };
        let plan = match &args.topology.cluster {
            Some(file) => cluster_file::load(file, |var| std::env::var(var).ok())?,
            None => ClusterPlan::default(),
        };
        let upstreams = args.upstream.entries(&plan)?;
        let gateway = if !upstreams.is_empty() {
            let t = &args.topology;
            anyhow::ensure!(
                t.prefill + t.decode == 0 && !t.accept_workers,
                "upstreams serve through engines that run elsewhere; they take no workers \
                 (--prefill/--decode/--accept-workers)"
            );
            args.upstream.gateway(upstreams, plan.tokenizer.clone(), path.clone(), gateway_config).await?
        } else if args.topology.is_cluster() {
            // A cluster gateway reads only the file's tokenizer, limits and digest: the weights
            // stay with the workers.
            let (model, tokenizer, digest) = args.model.open_metadata()?;
            let (text, secret) = match args.secret.secret()? {
                Some(s) => s,
                None if args.topology.prefill + args.topology.decode > 0
                    && args.topology.cluster.is_none()
                    && !args.topology.accept_workers =>
                {
                    // Only our own children: a fresh secret nobody else ever sees.
                    let text = ClusterSecret::generate().map_err(anyhow::Error::msg)?;
                    let secret = ClusterSecret::new(&text).map_err(anyhow::Error::msg)?;
                    (text, secret)
                }
                None => {
                    // Workers that are not our children can only be loopback ones without a
                    // secret (a worker refuses a public address without one).
                    tracing::warn!(
                        "!!! NO CLUSTER SECRET: only workers on this host without one can serve; set {} \
                         here and on every worker !!!",
                        crate::topology::CLUSTER_SECRET_ENV
                    );
                    (String::new(), ClusterSecret::open())
                }
            };
            let workers = start_workers(&args, plan.workers, &mut children, &text)?;
            // Workers serving another file than the one this gateway tokenizes for are refused.
            let registry = Registry::start_for_model(workers, secret, Some(Bytes32(digest)));
            if args.topology.prefill + args.topology.decode > 0 || args.topology.cluster.is_some() {
                tracing::info!("waiting for the workers to come up");
                if !registry.wait_ready(Duration::from_secs(300)).await {
                    let dead = children.exited();
                    anyhow::bail!("the workers did not come up (exited: {dead:?}); see their logs above");
                }
            }
            let cluster = Arc::new(Cluster::new(registry, model));
            Gateway::with_cluster(gateway_config, cluster, Arc::new(tokenizer))?
        } else {
            tracing::info!(model = %path.display(), "loading model");
            let engine = Arc::new(args.model.open_engine()?);
            let config = WorkerConfig { id: WorkerId("w0".into()), ..args.batching.worker_config() };
            let worker = Worker::spawn(Arc::clone(&engine), config).context("starting the worker")?;
            let handle = worker.handle();
            local = Some(worker);
            Gateway::new(gateway_config, Arc::new(handle), engine)?
        };
        let addr = std::net::SocketAddr::new(args.listen.host, args.listen.port);
        let listener = tokenpath_gateway::bind(&addr.to_string()).await?;
        let bound = listener.local_addr().context("reading the bound address")?;
        if let Some(m) = args.listen.metrics_listen {
            let ml = tokenpath_gateway::bind(&m.to_string()).await?;
            let at = ml.local_addr().context("reading the metrics address")?;
            tracing::info!(metrics = %at, "serving /metrics on http://{at}/metrics");
            let serving = gateway.serve_metrics(ml);
            tokio::spawn(async move {
                if let Err(e) = serving.await {
                    tracing::error!("the metrics listener failed: {e}");
                }
            });
        }
        tracing::info!(local = %bound, model = %served_model_name, "serving the OpenAI API on http://{bound}/v1");
        gateway.serve(listener, tokenpath_gateway::shutdown_signal()).await?;
        anyhow::Ok(())
    })?;
    drop(local);
    drop(children);
    tracing::info!("stopped");
    Ok(())
}

/// Starts the `--prefill`/`--decode` worker processes beside the cluster file's `workers`.
fn start_workers(
    args: &ServeArgs,
    mut workers: Vec<(String, Role)>,
    children: &mut Children,
    secret: &str,
) -> anyhow::Result<Vec<(String, Role)>> {
    let t = &args.topology;
    if (t.prefill == 0) != (t.decode == 0) {
        anyhow::bail!(
            "prefill/decode disaggregation needs both --prefill and --decode (got {} and {})",
            t.prefill,
            t.decode
        );
    }
    let mut extra = ChildArgs { args: args.batching.to_args(), env: Vec::new() };
    extra.env.extend(args.batching.kv_pool.child_env());
    extra.args.extend(args.model.to_args());
    args.spans.export.to_child(&mut extra);
    for (role, n, cpus) in
        [(Role::Prefill, t.prefill, &t.prefill_cpus), (Role::Decode, t.decode, &t.decode_cpus)]
    {
        for i in 0..n {
            let name = format!("{}{i}", if role == Role::Prefill { "p" } else { "d" });
            let addr = children.spawn(&name, role, cpus.as_ref(), &extra, secret)?;
            tracing::info!(worker = %name, %addr, %role, cpus = ?cpus, "worker process started");
            workers.push((addr, role));
        }
    }
    Ok(workers)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_take_binary_units_and_refuse_the_rest() {
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 64 KiB "), Ok(64 << 10));
        for bad in ["", "GiB", "1.5GiB", "1PB", "-1", "99999999999TiB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
