//! `tokenpath plan`: "colocated or PD, and how many of each?" for a GPU fleet, answered by the
//! simulator over a roofline model of the hardware. Thin: the catalogue, the roofline and the
//! sweep live in `tokenpath_sim::plan`.

use crate::bench::LoadArgs;
use clap::Args;
use tokenpath_sim::plan::{self, Efficiency, PlanRow, PlanSpec, Replica};
use tokenpath_sim::WorkerShape;
use tokenpath_timeline::SloSpec;

/// `tokenpath plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The model (`llama-3.1-8b`, `llama-3.1-70b`, `qwen2.5-7b`, `qwen2.5-72b`, `mixtral-8x7b`,
    /// `opt-13b`, `smollm2-135m`).
    #[arg(long = "model", value_name = "NAME")]
    model_shape: String,
    /// The accelerator (`h100`, `h200`, `a100`, `l40s`, `rtx4090`, `mi300x`).
    #[arg(long)]
    gpu: String,
    /// GPUs in the fleet.
    #[arg(long, default_value_t = 8)]
    gpus: usize,
    /// Tensor-parallel degree of one replica.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// The KV link between prefill and decode replicas (`nvlink`, `pcie4`, `100gbe`, `200gbe`,
    /// `400gbe`, `ib-ndr`).
    #[arg(long, default_value = "400gbe")]
    link: String,
    /// Bytes per weight (2: BF16, 1: FP8).
    #[arg(long, default_value_t = 2.0)]
    weight_bytes: f64,
    /// The SLOs goodput counts.
    #[arg(long, default_value = "ttft:2s,tpot:50ms")]
    slo: SloSpec,
    /// Fraction of peak FLOP/s reached (assumed; the answer is also given at ±30%).
    #[arg(long, default_value_t = 0.5)]
    compute_efficiency: f64,
    /// Fraction of peak memory bandwidth reached (assumed).
    #[arg(long, default_value_t = 0.7)]
    memory_efficiency: f64,
    /// Most prompt tokens per step.
    #[arg(long, default_value_t = 8192)]
    prefill_chunk: usize,
    /// Most sequences per step.
    #[arg(long, default_value_t = 256)]
    max_batch: usize,
    /// A bench run (`tokenpath bench --out`) against ONE replica of this GPU and model, made
    /// with the same workload flags as this command: the compute and memory efficiencies are
    /// fitted so one simulated replica shows its TTFT and TPOT medians, then used for the plan.
    #[arg(long, value_name = "RUN.json")]
    calibrate: Option<std::path::PathBuf>,
    #[command(flatten)]
    load: LoadArgs,
    #[command(flatten)]
    trace: crate::sim::MooncakeArgs,
    /// Write every row as JSON here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let replica = Replica {
        gpu: plan::gpu(&args.gpu)?,
        tp: args.tp.max(1),
        model: plan::model(&args.model_shape)?,
        weight_bytes: args.weight_bytes,
        kv_bytes: 2,
    };
    anyhow::ensure!(args.gpus >= replica.tp, "--gpus must hold at least one replica of --tp GPUs");
    let eff = Efficiency {
        compute: args.compute_efficiency,
        memory: args.memory_efficiency,
        ..Efficiency::default()
    };
    anyhow::ensure!(
        (0.01..=1.0).contains(&eff.compute) && (0.01..=1.0).contains(&eff.memory),
        "efficiencies are fractions of peak in (0, 1]"
    );
    let spec = PlanSpec {
        replica,
        replicas: args.gpus / replica.tp,
        eff,
        link_gbps: plan::link(&args.link)?,
        worker: WorkerShape {
            kv_blocks: 1,
            block_size: 16,
            prefill_chunk: args.prefill_chunk,
            max_batch: args.max_batch,
            prefix_cache: true,
            n_ctx: 1,
        },
        slo: args.slo.clone(),
        seed: args.load.seed,
    };
    let input = args.trace.input(&args.load, "plan")?;
    println!(
        "plan: {} on {} × {} (TP {}, {} replicas, {} GB KV each: {} tokens), KV link {} ({} GB/s); {} at {} req/s, {} requests; SLO {}",
        replica.model.name,
        args.gpus,
        replica.gpu.name,
        replica.tp,
        spec.replicas,
        (replica.kv_tokens()? as u64 * replica.model.kv_bytes_per_token(2)) / 1_000_000_000,
        replica.kv_tokens()?,
        args.link,
        spec.link_gbps,
        args.trace.name(&args.load),
        args.load.rate,
        input.requests.len(),
        args.slo
    );
    let mut spec = spec;
    if let Some(run) = &args.calibrate {
        let doc: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(run).map_err(|e| anyhow::anyhow!("reading {}: {e}", run.display()))?,
        )?;
        let p50 = |k: &str| doc["summary"][k]["p50"].as_f64().unwrap_or(0.0);
        let want = plan::Measured { tpot_p50_ms: p50("tpot_ms"), ttft_p50_ms: p50("ttft_ms") };
        spec.eff = plan::fit_efficiency(&spec, &input, want)?;
        println!(
            "calibrated on {} (TTFT p50 {:.0} ms, TPOT p50 {:.1} ms): compute {:.0}%, memory {:.0}% of peak",
            run.display(),
            want.ttft_p50_ms,
            want.tpot_p50_ms,
            spec.eff.compute * 100.0,
            spec.eff.memory * 100.0
        );
    }
    let eff = spec.eff;
    let rows = plan::sweep(&spec, eff, &input)?;
    print_rows(&rows);
    let Some(best) = plan::best(&rows) else {
        println!("answer: no split meets {} at this rate on this fleet (every goodput is 0)", args.slo);
        return Ok(());
    };
    // How much the pick depends on the assumed efficiencies.
    let mut bounds = Vec::new();
    for f in [0.7, 1.3] {
        let other = plan::sweep(&spec, eff.scaled(f), &input)?;
        let pick = plan::best(&other).map(|r| r.topology);
        let same = other.iter().find(|r| r.topology == best.topology).map_or(0.0, |r| r.goodput_rps);
        bounds.push((f, pick, same));
    }
    println!(
        "answer: {} — goodput {:.2} req/s ({:.3} per GPU), attainment {:.1}%; TTFT p99 tail {}",
        describe(best),
        best.goodput_rps,
        best.goodput_per_gpu,
        best.attainment * 100.0,
        best.ttft_tail
    );
    for (f, pick, goodput) in &bounds {
        let moved = match pick {
            Some(t) if *t == best.topology => "same pick".to_owned(),
            Some(t) => format!("the pick becomes {}", topo(t)),
            None => "no pick".to_owned(),
        };
        println!("  efficiencies ×{f}: its goodput {goodput:.2} req/s; {moved}");
    }
    println!("  (roofline with assumed efficiencies: {}; a step time from a measured run is `tokenpath calibrate` + `tokenpath sim`)", replica.calibration(eff, spec.link_gbps).provenance.notes.join("; "));
    if let Some(path) = &args.out {
        let doc = serde_json::json!({ "spec": { "replica": replica, "replicas": spec.replicas, "eff": eff, "link_gbps": spec.link_gbps }, "rows": rows });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn topo(t: &tokenpath_sim::Topology) -> String {
    if t.colocated > 0 {
        format!("{} colocated", t.colocated)
    } else {
        format!("{}P{}D", t.prefill, t.decode)
    }
}

fn describe(r: &PlanRow) -> String {
    topo(&r.topology)
}

fn print_rows(rows: &[PlanRow]) {
    println!(
        "{:<14}{:>12}{:>8}{:>14}{:>12}{:>14}{:>14}  TTFT p99 from",
        "topology", "attainment", "failed", "goodput r/s", "per GPU", "TTFT p99 ms", "TPOT p99 ms"
    );
    for r in rows {
        let ms = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.0}"));
        println!(
            "{:<14}{:>11.1}%{:>8}{:>14.2}{:>12.3}{:>14}{:>14}  {}",
            describe(r),
            r.attainment * 100.0,
            r.failed,
            r.goodput_rps,
            r.goodput_per_gpu,
            ms(r.ttft_p99_ms),
            ms(r.tpot_p99_ms),
            r.ttft_tail
        );
    }
}
