//! `tokenpath worker`: one engine instance in its own process, in role prefill, decode or both,
//! serving the worker protocol. `tokenpath serve --prefill N --decode M` starts these itself;
//! on several hosts, start them by hand and list them in a cluster file or let them register.
//!
//! The first line on stdout is `tokenpath worker listening on ADDR` (a parent that asked for
//! port 0 reads the port from it); logs go to stderr.

use crate::generate::ModelArgs;
use crate::serve::BatchingArgs;
use crate::topology::{pin_to_cpus, CpuList, SecretArgs};
use anyhow::Context as _;
use clap::Args;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokenpath_protocol::auth::{Bytes32, ClusterSecret};
use tokenpath_timeline::WorkerId;
use tokenpath_worker::net::server::{serve, ServerConfig};
use tokenpath_worker::net::KvTransport;
use tokenpath_worker::{Role, Worker, WorkerConfig};

/// Flags of `tokenpath worker`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// prefill, decode or both.
    #[arg(long, default_value = "both", env = "TOKENPATH_ROLE")]
    role: Role,
    /// Address to listen on for the gateway and for KV transfers (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0", env = "TOKENPATH_LISTEN")]
    listen: String,
    /// The worker's name in timelines and metrics (default: role and port).
    #[arg(long, env = "TOKENPATH_WORKER_ID")]
    id: Option<String>,
    /// Pin the process (and every engine thread) to these cores, e.g. `0` or `0,1` or `0-3`.
    #[arg(long, env = "TOKENPATH_CPUS")]
    cpus: Option<CpuList>,
    /// Register with this gateway at start (`http://host:port`).
    #[arg(long, env = "TOKENPATH_REGISTER")]
    register: Option<String>,
    /// The address the gateway should use to reach this worker (default: the bound address).
    #[arg(long, env = "TOKENPATH_ADVERTISE")]
    advertise: Option<String>,
    /// The gateway's admin key, for registering (`/admin/workers` takes no tenant key).
    #[arg(long, alias = "register-key", env = "TOKENPATH_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<crate::secret::Secret>,
    /// How KV moves to and from workers on the same host: `auto` (a shared-memory ring, set up
    /// per transfer; TCP when the peer is elsewhere or the ring cannot be set up) or `tcp`.
    #[arg(long, default_value = "auto", env = "TOKENPATH_KV_TRANSPORT")]
    kv_transport: KvTransport,
    /// Testing only: corrupt every outgoing KV transfer (exercises the decode side's fallback).
    #[arg(long, hide = true, env = "TOKENPATH_FAULT_CORRUPT_KV")]
    fault_corrupt_kv: bool,
    /// Seconds running requests get to finish after SIGTERM / Ctrl-C.
    #[arg(long, default_value_t = 30, env = "TOKENPATH_SHUTDOWN_GRACE_S")]
    shutdown_grace_s: u64,
    /// Serve `/metrics` (waiting, running, KV usage) and `/health` over HTTP on this address,
    /// for an endpoint picker in front of the workers (open: bind it where only it reaches).
    #[arg(long, env = "TOKENPATH_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    secret: SecretArgs,
    #[command(flatten)]
    spans: crate::serve::SpanExportArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    batching: BatchingArgs,
}

/// The secret this worker demands, refusing to serve a non-loopback address without one.
fn cluster_secret(args: &WorkerArgs) -> anyhow::Result<ClusterSecret> {
    if let Some((_, secret)) = args.secret.secret()? {
        return Ok(secret);
    }
    let ip = args
        .listen
        .rsplit_once(':')
        .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
        .and_then(|h| h.parse::<std::net::IpAddr>().ok());
    match ip {
        Some(ip) if ip.is_loopback() => {
            tracing::warn!(
                "!!! NO CLUSTER SECRET: any process on this host can use this worker (set {}) !!!",
                crate::topology::CLUSTER_SECRET_ENV
            );
            Ok(ClusterSecret::open())
        }
        _ => anyhow::bail!(
            "refusing to listen on {} without a cluster secret: set {} (the gateway needs the same \
             one), or listen on loopback",
            args.listen,
            crate::topology::CLUSTER_SECRET_ENV
        ),
    }
}

/// The address to register under: `--advertise`, else the bound one — which must then be one a
/// gateway can dial (`0.0.0.0` or `::` names no host to another machine, and only this one by
/// accident).
fn advertised(args: &WorkerArgs, local: std::net::SocketAddr) -> anyhow::Result<String> {
    match &args.advertise {
        Some(a) => Ok(a.clone()),
        None if local.ip().is_unspecified() => anyhow::bail!(
            "--register needs --advertise when listening on {local}: an unspecified address is \
             not one the gateway can reach (e.g. --advertise worker-host:{})",
            local.port()
        ),
        None => Ok(local.to_string()),
    }
}

pub fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let secret = cluster_secret(&args)?;
    if args.register.is_some() && args.advertise.is_none() {
        // Refused before the model loads when the flags alone say so.
        if let Ok(listen) = args.listen.parse::<std::net::SocketAddr>() {
            advertised(&args, listen)?;
        }
    }
    if let Some(cpus) = &args.cpus {
        // Before any thread exists: every thread started later inherits the mask.
        pin_to_cpus(cpus)?;
    }
    let engine = Arc::new(args.model.open_engine()?);
    // What the gateway checks before it routes here (`StatsMsg::model`).
    let model = Some(Bytes32(engine.model().weights_digest()));
    let threads = args.cpus.as_ref().map_or(2, CpuList::len).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let local = listener.local_addr().context("reading the bound address")?;
        let id = args.id.clone().unwrap_or_else(|| format!("{}-{}", args.role, local.port()));
        let config = WorkerConfig { id: WorkerId(id.clone()), ..args.batching.worker_config() };
        let worker = Worker::spawn(engine, config).context("starting the worker")?;
        tracing::info!(%local, role = %args.role, worker = %id, cpus = ?args.cpus, "worker ready");
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "tokenpath worker listening on {local}")?;
            out.flush()?;
        }
        if let Some(gateway) = args.register.clone() {
            // Registration is a heartbeat: a gateway that was down, or restarted and forgot its
            // run-time workers, learns of this one again within one period.
            let advertise = advertised(&args, local)?;
            let (role, key) = (args.role, args.admin_key.clone());
            tokio::spawn(async move {
                let mut ok = false;
                loop {
                    match register(&gateway, &advertise, role, key.as_ref().map(|k| k.expose())).await {
                        Ok(()) if !ok => {
                            tracing::info!(%advertise, "registered with the gateway");
                            ok = true;
                        }
                        Ok(()) => {}
                        Err(e) => {
                            if ok {
                                tracing::warn!("registering with the gateway failed (retrying): {e:#}");
                            } else {
                                tracing::debug!("registering with the gateway failed (retrying): {e:#}");
                            }
                            ok = false;
                        }
                    }
                    tokio::time::sleep(REGISTER_EVERY).await;
                }
            });
        }
        let draining = Arc::new(AtomicBool::new(false));
        let server = ServerConfig {
            role: args.role,
            fault_corrupt_kv: args.fault_corrupt_kv,
            kv_transport: args.kv_transport,
            secret,
            draining: Arc::clone(&draining),
            spans: args.spans.exporter(),
            model,
        };
        let handle = worker.handle();
        if let Some(addr) = args.metrics_listen {
            let ml = tokenpath_gateway::bind(&addr.to_string()).await?;
            let at = ml.local_addr().context("reading the metrics address")?;
            tracing::info!(metrics = %at, "serving /metrics and /health on http://{at}");
            let backend = Arc::new(handle.clone()) as Arc<dyn tokenpath_gateway::Backend>;
            tokio::spawn(tokenpath_gateway::serve_backend_metrics(ml, backend, Default::default()));
        }
        let serving = tokio::spawn(serve(listener, handle.clone(), server));
        tokenpath_gateway::shutdown_signal().await;
        // Drain: new requests are refused (the gateway routes elsewhere), the running ones —
        // streams, awaited handoffs, KV transfers — finish, within the grace period.
        draining.store(true, Ordering::Release);
        let grace = Duration::from_secs(args.shutdown_grace_s);
        tracing::info!(in_flight = handle.in_flight(), grace_s = grace.as_secs(), "worker draining");
        let deadline = tokio::time::Instant::now() + grace;
        while handle.in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The last events leave the sockets.
        tokio::time::sleep(Duration::from_millis(200)).await;
        serving.abort();
        tracing::info!(left = handle.in_flight(), "worker stopping");
        anyhow::Ok(())
    })
}

/// How often a worker started with `--register` registers again.
const REGISTER_EVERY: Duration = Duration::from_secs(10);

/// `POST {gateway}/admin/workers` with this worker's address and role.
async fn register(gateway: &str, addr: &str, role: Role, key: Option<&str>) -> anyhow::Result<()> {
    let url = format!("{}/admin/workers", gateway.trim_end_matches('/'));
    let mut req = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .context("building the registration client")?
        .post(&url)
        .header("content-type", "application/json")
        .body(serde_json::json!({ "addr": addr, "role": role.to_string() }).to_string());
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.with_context(|| format!("registering with {url}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        anyhow::bail!("the gateway refused the registration ({status}): {body}");
    }
    Ok(())
}
