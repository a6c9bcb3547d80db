//! A bench run: the schedule, the requests sent at their scheduled instants (each on its own
//! task, so a slow response never delays the next send), and the records collected. Bounded by
//! count: the run ends when every scheduled request has ended or timed out.

use crate::arrival::Arrival;
use crate::client::{send, Target};
use crate::workload::Workload;
use crate::BenchError;
use std::time::Instant;
use tokenpath_timeline::ClientRecord;

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The server.
    pub target: Target,
    /// What to ask.
    pub workload: Workload,
    /// When to ask (open loop).
    pub arrival: Arrival,
    /// Closed loop instead: this many clients, each sending its next request as soon as its
    /// previous one ended (`t_sched = t_send`; the arrival process is not used).
    pub concurrency: Option<usize>,
    /// How many requests.
    pub num_requests: usize,
    /// Seed of the workload and the arrival process.
    pub seed: u64,
}

/// Progress callback: (requests ended, requests total, the record that just ended).
pub type Progress<'a> = &'a mut (dyn FnMut(usize, usize, &ClientRecord) + Send);

/// Runs the load and returns one record per request, in id order.
pub async fn run(cfg: &RunConfig, progress: Progress<'_>) -> Result<Vec<ClientRecord>, BenchError> {
    cfg.arrival.validate()?;
    if cfg.num_requests == 0 {
        return Err(BenchError::NoRequests);
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| BenchError::Client(e.to_string()))?;
    let mut target = cfg.target.clone();
    if target.model.is_empty() {
        target.model = first_model(&client, &target).await?;
    }
    let specs = cfg.workload.requests(cfg.num_requests, cfg.seed);
    let t0 = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = tokio::task::JoinSet::new();
    match cfg.concurrency {
        Some(0) => return Err(BenchError::BadArrival("concurrency must be at least 1".into())),
        Some(n) => {
            // Client c sends requests c, c + n, c + 2n, ... back to back.
            let mut lanes: Vec<Vec<(u64, crate::workload::RequestSpec)>> = vec![Vec::new(); n];
            for (id, spec) in specs.into_iter().enumerate() {
                lanes[id % n].push((id as u64, spec));
            }
            for lane in lanes {
                let (client, target, tx) = (client.clone(), target.clone(), tx.clone());
                tasks.spawn(async move {
                    for (id, spec) in lane {
                        let _ = tx.send(send(&client, &target, id, &spec, t0, None).await);
                    }
                });
            }
        }
        None => {
            let start = tokio::time::Instant::from_std(t0);
            let schedule = cfg.arrival.schedule(cfg.num_requests, cfg.seed);
            for (id, (spec, at)) in specs.into_iter().zip(schedule).enumerate() {
                let (client, target, tx) = (client.clone(), target.clone(), tx.clone());
                tasks.spawn(async move {
                    tokio::time::sleep_until(start + at).await;
                    let _ = tx
                        .send(send(&client, &target, id as u64, &spec, t0, Some(at.as_nanos() as u64)).await);
                });
            }
        }
    }
    drop(tx);
    let mut records = Vec::with_capacity(cfg.num_requests);
    while let Some(rec) = rx.recv().await {
        progress(records.len() + 1, cfg.num_requests, &rec);
        records.push(rec);
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| BenchError::Client(format!("request task failed: {e}")))?;
    }
    records.sort_by_key(|r| r.id);
    Ok(records)
}

/// The first model the server lists at `/v1/models`, for runs that did not name one.
pub async fn first_model(client: &reqwest::Client, target: &Target) -> Result<String, BenchError> {
    let url = format!("{}/v1/models", target.url.trim_end_matches('/'));
    let mut req = client.get(&url);
    if let Some(k) = &target.api_key {
        req = req.bearer_auth(k);
    }
    let fail =
        |why: String| BenchError::Client(format!("no --model given and {url} did not name one: {why}"));
    let body: serde_json::Value =
        req.send().await.map_err(|e| fail(e.to_string()))?.json().await.map_err(|e| fail(e.to_string()))?;
    body["data"][0]["id"].as_str().map(str::to_owned).ok_or_else(|| fail("empty model list".into()))
}
