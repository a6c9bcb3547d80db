//! `tokenpath generate`: one prompt through the embedded engine, text streamed to stdout, the
//! prefill and decode timing to stderr.

use clap::Args;
use std::io::Write as _;
use std::path::PathBuf;
use tokenpath_engine::model::{Model, Numerics};
use tokenpath_engine::sampling::SamplingParams;
use tokenpath_engine::tokenizer::{ModelTokenizer, PromptMessage, Role};
use tokenpath_engine::{Engine, GenerateRequest};
use tokenpath_protocol::backend::ModelInfo;

/// Model selection shared by every command that loads the engine.
#[derive(Debug, Args)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// GGUF model file (default: the model `scripts/setup` fetched).
    #[arg(long, env = "TOKENPATH_MODEL")]
    pub model: Option<PathBuf>,
    /// Arithmetic of the forward pass: `fast` (the engine's kernels; prompts on bf16 AMX tiles
    /// where the CPU has them), `invariant` (the integer tiles for every product: a sequence's
    /// bits the same whatever its prompt's chunking and on every CPU) or `ggml` (llama.cpp's CPU
    /// arithmetic reproduced rounding for rounding: its greedy output token for token; about a
    /// fifteenth of the prefill speed and a sixth of decode's; Q4_1/Q8_0 models).
    #[arg(long, env = "TOKENPATH_NUMERICS", value_enum, default_value_t = NumericsArg::Fast)]
    pub numerics: NumericsArg,
}

/// `--numerics` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NumericsArg {
    Fast,
    Invariant,
    Ggml,
}

impl ModelArgs {
    pub fn path(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(tokenpath_engine::default_model_path)
    }

    /// Loads the engine with the chosen arithmetic.
    pub fn open_engine(&self) -> anyhow::Result<Engine> {
        let path = self.path();
        let load = || -> tokenpath_engine::error::Result<Engine> {
            let mut model = Model::open(&path)?;
            model.set_numerics(match self.numerics {
                NumericsArg::Fast => Numerics::Fast,
                NumericsArg::Invariant => Numerics::Invariant,
                NumericsArg::Ggml => Numerics::Ggml,
            })?;
            Engine::from_model(model)
        };
        load().map_err(|e| anyhow::anyhow!("loading {}: {e}", path.display()))
    }

    /// What a gateway in front of workers needs of the model, from one opening of the file (no
    /// weight is repacked): its limits, its tokenizer, and the file's BLAKE3
    /// (`model::file_digest`), which its workers must serve too.
    pub fn open_metadata(&self) -> anyhow::Result<(ModelInfo, ModelTokenizer, [u8; 32])> {
        let path = self.path();
        let load = || -> tokenpath_engine::error::Result<(ModelInfo, ModelTokenizer, [u8; 32])> {
            let file = tokenpath_engine::gguf::GgufFile::open(&path)?;
            let c = tokenpath_engine::model::ModelConfig::from_gguf(file.index())?;
            let info = ModelInfo { n_ctx: c.n_ctx, n_vocab: c.n_vocab };
            Ok((
                info,
                ModelTokenizer::from_gguf(file.index())?,
                tokenpath_engine::model::file_digest(file.bytes()),
            ))
        };
        load().map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))
    }

    /// The same selection as arguments for a child `tokenpath worker`.
    pub fn to_args(&self) -> Vec<String> {
        let numerics = match self.numerics {
            NumericsArg::Fast => "fast",
            NumericsArg::Invariant => "invariant",
            NumericsArg::Ggml => "ggml",
        };
        vec![format!("--model={}", self.path().display()), format!("--numerics={numerics}")]
    }
}

/// Sampling settings, OpenAI's names and ranges.
#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed for repeatable sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Penalty per distinct token already generated (−2..2).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Penalty per occurrence of a token already generated (−2..2).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
}

impl SamplingArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
        }
    }
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The user message (rendered with the model's chat template).
    #[arg(default_value = "What is the capital of France?")]
    prompt: String,
    /// Send the prompt as raw text, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Prompt tokens per prefill chunk.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let t0 = std::time::Instant::now();
    let engine = args.model.open_engine()?;
    let load = t0.elapsed();
    let text = if args.raw {
        args.prompt.clone()
    } else {
        engine.render_chat(&[PromptMessage::new(Role::User, args.prompt.clone())])?
    };
    let prompt = engine.encode_prompt(&text)?;
    let mut cache = engine.new_cache(prompt.len() + args.max_tokens + 16, 16)?;
    let req = GenerateRequest {
        sampling: args.sampling.params(),
        max_tokens: args.max_tokens,
        stop: args.stop,
        prefill_chunk: args.prefill_chunk,
    };
    let mut out = std::io::stdout().lock();
    let g = engine.generate(&mut cache, &prompt, &req, &mut |piece| {
        let _ = out.write_all(piece.as_bytes());
        let _ = out.flush();
    })?;
    let _ = writeln!(out);
    let secs = |d: std::time::Duration| d.as_secs_f64();
    let n = g.tokens.len();
    eprintln!(
        "model {} loaded in {:.0} ms | prompt {} tokens, prefill {:.0} ms ({:.1} tok/s) | {} tokens, decode {:.0} ms ({:.1} tok/s) | finish {:?}",
        engine.model().config().name.as_deref().unwrap_or("?"),
        secs(load) * 1e3,
        g.prompt_tokens,
        secs(g.prefill) * 1e3,
        g.prompt_tokens as f64 / secs(g.prefill).max(1e-9),
        n,
        secs(g.decode) * 1e3,
        n.saturating_sub(1) as f64 / secs(g.decode).max(1e-9),
        g.finish,
    );
    Ok(())
}
