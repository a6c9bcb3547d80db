//! `tokenpath serve --upstream URL[,URL...]` (or `[[upstream]]` tables in `--cluster FILE`): the
//! gateway in front of engines that are already running (vLLM, SGLang, TensorRT-LLM, llama.cpp's
//! server, another tokenpath — any OpenAI-compatible server; PD pairs from the file). The
//! gateway tokenizes with the model's tokenizer (`--tokenizer`: a GGUF file's metadata or a
//! Hugging Face `tokenizer.json`; no weights are loaded) to charge tenants and check the context,
//! and forwards everything else.

use crate::secret::Secret;
use anyhow::Context as _;
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokenpath_cli::cluster_file::{ClusterPlan, UpstreamEntry};
use tokenpath_cli::tokenizer::FileTokenizer;
use tokenpath_gateway::upstream::{
    max_model_len, PoolConfig, UpstreamKind, UpstreamPool, UpstreamSpec, DNS_INTERVAL,
};
use tokenpath_gateway::{Gateway, GatewayConfig};
use tokenpath_protocol::backend::ModelInfo;

/// Where the engine is, when it is not ours.
#[derive(Debug, Args)]
#[command(next_help_heading = "Gateway in front of your engines (--upstream)")]
pub(crate) struct UpstreamArgs {
    /// Serve through these running engines instead of loading the model here
    /// (`http://host:port`, comma-separated; the OpenAI paths are appended).
    #[arg(long, env = "TOKENPATH_UPSTREAM", value_name = "URL", value_delimiter = ',')]
    upstream: Vec<String>,
    /// The --upstream hosts are DNS names, resolved again every 10 s, one upstream per address
    /// (a Kubernetes headless Service).
    #[arg(long, env = "TOKENPATH_UPSTREAM_DISCOVER")]
    upstream_discover: bool,
    /// The upstreams' protocol: `openai`, or `tokenpath` (another tokenpath gateway). The PD
    /// kinds (`vllm-pd`, `sglang-pd`, `trtllm-pd`) need a role per server: list them in the
    /// cluster file's `[[upstream]]` tables or add them through `POST /admin/upstreams`.
    #[arg(long, default_value = "openai", env = "TOKENPATH_UPSTREAM_KIND", value_name = "KIND")]
    upstream_kind: UpstreamKind,
    /// The model name the upstream serves (default: the client's is sent as is).
    #[arg(long, env = "TOKENPATH_UPSTREAM_MODEL")]
    upstream_model: Option<String>,
    /// The upstream's API key (sent as a bearer token; the clients' keys never are). Prefer the
    /// environment variable.
    #[arg(long, env = "TOKENPATH_UPSTREAM_API_KEY", hide_env_values = true)]
    upstream_api_key: Option<Secret>,
    /// The model's tokenizer: a GGUF file or a Hugging Face `tokenizer.json` (or its directory).
    /// Default: the --model file's metadata.
    #[arg(long, env = "TOKENPATH_TOKENIZER", value_name = "PATH")]
    tokenizer: Option<PathBuf>,
    /// The upstream model's context length (default: `max_model_len` from its /v1/models).
    #[arg(long, env = "TOKENPATH_MAX_MODEL_LEN")]
    max_model_len: Option<usize>,
    /// Longest wait for the upstream's response headers, seconds.
    #[arg(long, default_value_t = tokenpath_gateway::upstream::DEFAULT_FIRST_BYTE_TIMEOUT.as_secs(), env = "TOKENPATH_UPSTREAM_FIRST_BYTE_TIMEOUT_S")]
    upstream_first_byte_timeout_s: u64,
    /// Longest silence between two chunks of a streamed answer, seconds.
    #[arg(long, default_value_t = tokenpath_gateway::upstream::DEFAULT_IDLE_TIMEOUT.as_secs(), env = "TOKENPATH_UPSTREAM_IDLE_TIMEOUT_S")]
    upstream_idle_timeout_s: u64,
}

impl UpstreamArgs {
    /// The upstreams to serve through: the flags' or the cluster file's (not both).
    pub(crate) fn entries(&self, plan: &ClusterPlan) -> anyhow::Result<Vec<UpstreamEntry>> {
        if self.upstream.is_empty() {
            return Ok(plan.upstreams.clone());
        }
        anyhow::ensure!(
            plan.upstreams.is_empty() && plan.workers.is_empty(),
            "--upstream and a cluster file that lists workers or upstreams: list them in one place"
        );
        anyhow::ensure!(
            !self.upstream_kind.disaggregated(),
            "--upstream-kind {}: a PD kind needs a role per server; list them in the cluster \
             file's [[upstream]] tables or add them through POST /admin/upstreams",
            self.upstream_kind
        );
        self.upstream
            .iter()
            .map(|url| {
                let spec = UpstreamSpec {
                    kind: self.upstream_kind,
                    model: self.upstream_model.clone(),
                    ..UpstreamSpec::openai(url.as_str())
                };
                Ok(UpstreamEntry { spec: spec.validated()?, discover: self.upstream_discover })
            })
            .collect()
    }

    /// A gateway over `entries` (static members probed once before it serves; discovered ones
    /// join as their names resolve). The tokenizer: --tokenizer, else the cluster file's, else
    /// `default_tokenizer` (the --model file's metadata).
    pub(crate) async fn gateway(
        &self,
        entries: Vec<UpstreamEntry>,
        file_tokenizer: Option<PathBuf>,
        default_tokenizer: PathBuf,
        config: GatewayConfig,
    ) -> anyhow::Result<Gateway> {
        let path = self.tokenizer.clone().or(file_tokenizer).unwrap_or(default_tokenizer);
        let tokenizer = FileTokenizer::open(&path)?;
        tracing::info!(tokenizer = %path.display(), "{}", tokenizer.describe());
        let upstream_key = self.upstream_api_key.as_ref().map(|k| k.expose().to_owned());
        let probe = entries
            .iter()
            .find(|e| e.spec.role != tokenpath_protocol::cluster::WorkerRole::Prefill)
            .or(entries.first())
            .context("no upstream listed")?;
        let key = probe.spec.api_key.clone().or_else(|| upstream_key.clone());
        let probe = probe.spec.url.clone();
        let n_ctx = match self.max_model_len {
            Some(n) => n,
            None => max_model_len(&probe, key.as_deref())
                .await
                .with_context(|| format!("{probe}/v1/models gives no max_model_len; pass --max-model-len"))?,
        };
        let pool = PoolConfig {
            served_model_name: config.served_model_name.clone(),
            api_key: upstream_key,
            // Token ids are the upstream's to check.
            model_info: ModelInfo { n_ctx, n_vocab: u32::MAX as usize },
            first_byte_timeout: Duration::from_secs(self.upstream_first_byte_timeout_s.max(1)),
            idle_timeout: Duration::from_secs(self.upstream_idle_timeout_s.max(1)),
        };
        let (found, fixed): (Vec<_>, Vec<_>) = entries.into_iter().partition(|e| e.discover);
        let upstream = UpstreamPool::new(pool, fixed.into_iter().map(|e| e.spec).collect())
            .map_err(anyhow::Error::msg)?;
        for e in found {
            tracing::info!(name = %e.spec.url, kind = %e.spec.kind, "discovering upstreams by DNS");
            upstream.discover(e.spec, DNS_INTERVAL).map_err(anyhow::Error::msg)?;
        }
        if !upstream.check_health().await {
            tracing::warn!("an upstream does not answer its health probe yet; /ready says so until it does");
        }
        for u in upstream.upstreams().await {
            tracing::info!(upstream = %u.url, kind = %u.kind, role = %u.role, healthy = u.healthy, "upstream");
        }
        tracing::info!(n_ctx, "serving through upstreams");
        Ok(Gateway::new(config, Arc::new(upstream), Arc::new(tokenizer))?)
    }
}
