//! The KV pool's flags (shared by `serve`, `worker` and `kv-pool`) and `tokenpath kv-pool`: the
//! host's pool in a process of its own, so its RAM tier outlives every server and worker that
//! uses it (without it, the first of them to open the pool hosts it and the RAM tier lasts as
//! long as that process).
//!
//! The first line on stdout is `tokenpath kv-pool hosting SOCKET`; logs go to stderr.

use anyhow::Context as _;
use clap::Args;
use std::io::Write as _;
use std::path::PathBuf;

use crate::generate::ModelArgs;
use crate::serve::parse_size;

/// The environment variable of `--kv-pool-remote-key`.
const KV_POOL_REMOTE_KEY_ENV: &str = "TOKENPATH_KV_POOL_REMOTE_KEY";

/// The environment variable of `--kv-pool-remote` (also how worker children get it).
const KV_POOL_REMOTE_ENV: &str = "TOKENPATH_KV_POOL_REMOTE";

/// The KV pool's flags.
#[derive(Debug, Args)]
#[command(next_help_heading = "KV pool")]
pub(crate) struct KvPoolArgs {
    /// Share prefix KV blocks through the host's KV pool in this directory: a host-RAM tier every
    /// worker on the host reads and writes, and an SSD tier behind it that outlives the process
    /// (a restarted server serves prompt prefixes it computed before). The first process on the
    /// host to open it hosts it (or `tokenpath kv-pool`). Blocks are bound to the model file's
    /// digest, KV layout, numerics and tenant scope, and checked before use.
    #[arg(long, env = "TOKENPATH_KV_POOL", value_name = "DIR")]
    kv_pool: Option<PathBuf>,
    /// Size of the pool's host-RAM tier (`512MiB`, `2GiB`, bytes).
    #[arg(long, env = "TOKENPATH_KV_POOL_RAM", value_name = "SIZE", default_value = "512MiB", value_parser = parse_size)]
    kv_pool_ram: u64,
    /// Size of the pool's SSD tier file (`1GiB`, bytes; 0: RAM only), preallocated.
    #[arg(long, env = "TOKENPATH_KV_POOL_SSD", value_name = "SIZE", default_value = "1GiB", value_parser = parse_size)]
    kv_pool_ssd: u64,
    /// Write a block down from the pool's RAM tier only once it was seen a second time (a hit,
    /// or computed again after it left RAM): blocks nobody reuses cost no SSD or remote write.
    #[arg(long, env = "TOKENPATH_KV_POOL_SECOND_SIGHTING")]
    kv_pool_second_sighting: bool,
    /// A Valkey/Redis server as the pool's remote tier, shared by the pools of several hosts
    /// (`redis://[:password@]host:port/db`). Prefer the environment variable: a password on a
    /// command line is readable by other users.
    #[arg(long, env = KV_POOL_REMOTE_ENV, value_name = "URL", hide_env_values = true, requires = "kv_pool_remote_key")]
    kv_pool_remote: Option<String>,
    /// The secret every pool of the fleet authenticates remote-tier values with (at least 16
    /// bytes; a value without its MAC is never served). Set it in the environment.
    #[arg(long, env = KV_POOL_REMOTE_KEY_ENV, value_name = "SECRET", hide_env_values = true)]
    kv_pool_remote_key: Option<String>,
}

impl KvPoolArgs {
    /// The pool these flags describe (`None` without `--kv-pool`).
    pub(crate) fn config(&self) -> Option<tokenpath_worker::KvPoolConfig> {
        self.kv_pool.clone().map(|dir| tokenpath_worker::KvPoolConfig {
            ram_bytes: self.kv_pool_ram,
            ssd_bytes: self.kv_pool_ssd,
            second_sighting: self.kv_pool_second_sighting,
            remote: self.kv_pool_remote.clone(),
            remote_key: self.kv_pool_remote_key.clone(),
            ..tokenpath_worker::KvPoolConfig::new(dir)
        })
    }

    /// The same flags for a child `tokenpath worker` (secrets go by [`Self::child_env`]).
    pub(crate) fn push_args(&self, a: &mut Vec<String>) {
        if let Some(d) = &self.kv_pool {
            // One pool for every child: the first to start hosts it, the others join.
            a.push(format!("--kv-pool={}", d.display()));
            a.push(format!("--kv-pool-ram={}", self.kv_pool_ram));
            a.push(format!("--kv-pool-ssd={}", self.kv_pool_ssd));
            if self.kv_pool_second_sighting {
                a.push("--kv-pool-second-sighting".into());
            }
        }
    }

    /// The remote tier's URL and secret for a child, by environment (never on a command line).
    pub(crate) fn child_env(&self) -> Vec<(&'static str, String)> {
        let mut env = Vec::new();
        if let Some(url) = &self.kv_pool_remote {
            env.push((KV_POOL_REMOTE_ENV, url.clone()));
        }
        if let Some(key) = &self.kv_pool_remote_key {
            env.push((KV_POOL_REMOTE_KEY_ENV, key.clone()));
        }
        env
    }
}

/// Flags of `tokenpath kv-pool`.
#[derive(Debug, Args)]
pub struct KvPoolHostArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    pool: KvPoolArgs,
}

/// Hosts the pool until SIGTERM or Ctrl-C, then writes its RAM tier's dirty blocks down.
pub fn run(args: KvPoolHostArgs) -> anyhow::Result<()> {
    let cfg = args.pool.config().context("tokenpath kv-pool needs --kv-pool DIR")?;
    // The model is read for what keys its blocks (shape, numerics, layout, the file's digest),
    // exactly as its workers compute it; its weights are not used otherwise.
    let engine = args.model.open_engine()?;
    let layout = engine.kv_layout(tokenpath_worker::DEFAULT_BLOCK_SIZE);
    let namespace = tokenpath_worker::prefix_namespace(&engine, layout, true);
    let block_bytes = layout.block_elems() * 2;
    drop(engine);
    let host = tokenpath_kv::pool::PoolHost::start(&cfg, namespace, block_bytes)
        .with_context(|| format!("hosting the KV pool in {}", cfg.dir.display()))?
        .with_context(|| format!("another process hosts the KV pool in {} already", cfg.dir.display()))?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "tokenpath kv-pool hosting {}", host.socket().display())?;
        out.flush()?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        tokio::select! {
            _ = term.recv() => {}
            r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
        }
        anyhow::Ok(())
    })?;
    tracing::info!("stopping the KV pool");
    drop(host);
    Ok(())
}
