//! The demo's last word: what its own two runs say, in sentences — where each run's TTFT p99
//! came from, what disaggregating prefill and decode changed (the worst stall, TTFT and why,
//! TPOT, goodput under the SLO), and the `tokenpath plan` command that asks the same question
//! for a GPU fleet. Built only from [`Report`]s, so every number in it is one the table above it
//! shows; a sentence whose numbers are missing is left out rather than guessed.

use crate::report::Report;
use std::fmt::Write as _;
use tokenpath_timeline::{Summary, TailMetric};

/// A change worth a sentence: more than 10% either way.
const NOTABLE: f64 = 0.10;

/// `x` ms, readable: seconds from 10 s up.
fn ms(x: f64) -> String {
    if x >= 10_000.0 {
        format!("{:.1} s", x / 1000.0)
    } else if x >= 100.0 {
        format!("{x:.0} ms")
    } else {
        format!("{x:.1} ms")
    }
}

/// "fell from A to B" / "rose from A to B" / "stayed at about A".
fn moved(a: f64, b: f64) -> String {
    if a > 0.0 && ((b - a) / a).abs() <= NOTABLE {
        format!("stayed at about {}", ms(b))
    } else if b < a {
        format!("fell from {} to {}", ms(a), ms(b))
    } else {
        format!("rose from {} to {}", ms(a), ms(b))
    }
}

/// A server stage's distribution in a run.
fn stage<'r>(r: &'r Report, name: &str) -> Option<&'r Summary> {
    r.stages.get(&format!("{name}_ms"))
}

/// "TTFT p99 X: 62% prefill, 30% queue" for one run.
fn ttft_tail(label: &str, r: &Report) -> Option<String> {
    let p99 = r.summary.ttft_ms.as_ref()?.p99;
    let tail = r.tail.iter().find(|t| t.metric == TailMetric::Ttft)?;
    let parts: Vec<String> = tail
        .shares
        .iter()
        .filter(|(_, s)| *s >= 0.05)
        .take(3)
        .map(|(c, s)| format!("{:.0}% in {c}", s * 100.0))
        .collect();
    (!parts.is_empty())
        .then(|| format!("{label}: TTFT p99 {}, its slowest requests' time {}.", ms(p99), parts.join(", ")))
}

/// The verdict on `base` (colocated) against `other` (disaggregated), and the plan command for
/// `workload` at `rate` under `slo`.
pub fn render(base: (&str, &Report), other: (&str, &Report), workload: &str, rate: f64, slo: &str) -> String {
    let ((bl, b), (ol, o)) = (base, other);
    let mut out = String::from("Verdict (from the numbers above):\n");
    let mut say = |s: String| {
        let _ = writeln!(out, "  - {s}");
    };
    for (label, r) in [(bl, b), (ol, o)] {
        match ttft_tail(label, r) {
            Some(s) => say(s),
            None => say(format!("{label}: no per-stage timing in the records, so no split of its p99.")),
        }
    }
    let gap = |r: &Report| r.summary.chunk_gap_ms.as_ref().map(|s: &Summary| s.max);
    if let (Some(a), Some(c)) = (gap(b), gap(o)) {
        say(format!(
            "The worst stall (the longest wait between two tokens of one answer) {} with {ol} against {bl}.",
            moved(a, c)
        ));
    }
    if let (Some(a), Some(c)) = (b.summary.ttft_ms.as_ref(), o.summary.ttft_ms.as_ref()) {
        let mut why = Vec::new();
        if let (Some(pa), Some(pc)) = (stage(b, "prefill").map(|s| s.p50), stage(o, "prefill").map(|s| s.p50))
        {
            if pc > pa * (1.0 + NOTABLE) {
                why.push(format!("prefill ran on fewer cores (prefill stage p50 {} → {})", ms(pa), ms(pc)));
            } else if pc < pa * (1.0 - NOTABLE) {
                why.push(format!(
                    "prefill no longer shared its steps with decodes (prefill stage p50 {} → {})",
                    ms(pa),
                    ms(pc)
                ));
            }
        }
        if let (Some(qa), Some(qc)) = (stage(b, "queue").map(|s| s.p99), stage(o, "queue").map(|s| s.p99)) {
            if (qc - qa).abs() > NOTABLE * qa.max(1.0) && (qc - qa).abs() >= 1.0 {
                why.push(format!(
                    "requests waited {} for a slot (queue p99 {} → {})",
                    if qc > qa { "longer" } else { "less" },
                    ms(qa),
                    ms(qc)
                ));
            }
        }
        if let Some(k) = stage(o, "kv_transfer").map(|s| s.p50) {
            why.push(format!("moving the KV cost {} per request (kv_transfer p50)", ms(k)));
        }
        let because = if why.is_empty() { String::new() } else { format!(": {}", why.join("; ")) };
        say(format!("TTFT p99 {} with {ol}{because}.", moved(a.p99, c.p99)));
    }
    if let (Some(a), Some(c)) = (b.summary.tpot_ms.as_ref(), o.summary.tpot_ms.as_ref()) {
        let note = if c.p99 < a.p99 * (1.0 - NOTABLE) {
            " — decode steps no longer wait behind prompt chunks"
        } else if c.p99 > a.p99 * (1.0 + NOTABLE) {
            " — decode had fewer cores"
        } else {
            ""
        };
        say(format!("TPOT p99 {} with {ol}{note}.", moved(a.p99, c.p99)));
    }
    if let (Some(a), Some(c)) = (b.summary.goodput_rps, o.summary.goodput_rps) {
        let better = if (c - a).abs() <= NOTABLE * a.max(0.01) {
            "about the same on this machine".to_owned()
        } else if c > a {
            format!("{ol} serves more within it on this machine")
        } else {
            format!("{bl} serves more within it on this machine")
        };
        say(format!(
            "Under the SLO {slo}, goodput {a:.2} req/s ({bl}) against {c:.2} req/s ({ol}): {better}."
        ));
    }
    let _ = writeln!(
        out,
        "The same question for a GPU fleet (colocated or PD, and how many of each), at ten times this rate:\n  tokenpath plan --model llama-3.1-8b --gpu h100 --gpus 8 --workload {workload} --rate {} --num-requests 1000 --slo {slo}",
        rate * 10.0
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use tokenpath_timeline::TailAttribution;

    fn summary(p50: f64, p99: f64, max: f64) -> Summary {
        Summary {
            count: 100,
            mean: p50,
            std: 0.0,
            min: 0.0,
            p50,
            p90: p99,
            p95: p99,
            p99,
            p999: max,
            max,
            p999_low_samples: false,
        }
    }

    fn report(
        ttft: (f64, f64),
        tpot_p99: f64,
        gap_max: f64,
        prefill_p50: f64,
        goodput: f64,
        shares: &[(&str, f64)],
    ) -> Report {
        let rec = tokenpath_timeline::ClientRecord::new(tokenpath_timeline::RequestId(1), 0, 0, true);
        let mut r =
            Report::build(&[rec], &crate::report::ReportOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        r.summary.ttft_ms = Some(summary(ttft.0, ttft.1, ttft.1));
        r.summary.tpot_ms = Some(summary(tpot_p99 / 2.0, tpot_p99, tpot_p99));
        r.summary.chunk_gap_ms = Some(summary(20.0, gap_max / 2.0, gap_max));
        r.summary.goodput_rps = Some(goodput);
        r.stages = BTreeMap::from([(
            "prefill_ms".to_owned(),
            summary(prefill_p50, prefill_p50 * 2.0, prefill_p50 * 3.0),
        )]);
        r.tail = vec![TailAttribution {
            metric: TailMetric::Ttft,
            percentile: 99.0,
            threshold_ms: ttft.1,
            requests: 2,
            shares: shares.iter().map(|(c, s)| ((*c).to_owned(), *s)).collect(),
        }];
        r
    }

    #[test]
    fn it_says_what_changed_and_why_from_the_numbers() {
        let colo = report(
            (600.0, 2400.0),
            300.0,
            2500.0,
            500.0,
            0.6,
            &[("prefill", 0.7), ("queue", 0.28), ("other", 0.02)],
        );
        let pd = report((900.0, 3100.0), 80.0, 300.0, 800.0, 0.9, &[("prefill", 0.8), ("kv_transfer", 0.15)]);
        let v = render(("colocated", &colo), ("pd-1p1d", &pd), "agent-longtail", 0.8, "ttft:2s,tpot:100ms");
        for want in [
            "colocated: TTFT p99 2400 ms, its slowest requests' time 70% in prefill, 28% in queue.",
            "pd-1p1d: TTFT p99 3100 ms, its slowest requests' time 80% in prefill, 15% in kv_transfer.",
            "The worst stall (the longest wait between two tokens of one answer) fell from 2500 ms to 300 ms",
            "TTFT p99 rose from 2400 ms to 3100 ms with pd-1p1d: prefill ran on fewer cores (prefill stage p50 500 ms → 800 ms)",
            "TPOT p99 fell from 300 ms to 80.0 ms with pd-1p1d — decode steps no longer wait behind prompt chunks.",
            "goodput 0.60 req/s (colocated) against 0.90 req/s (pd-1p1d): pd-1p1d serves more within it",
            "tokenpath plan --model llama-3.1-8b --gpu h100 --gpus 8 --workload agent-longtail --rate 8 --num-requests 1000 --slo ttft:2s,tpot:100ms",
        ] {
            assert!(v.contains(want), "missing {want:?} in:\n{v}");
        }
        assert!(!v.contains("other"), "shares under 5% are left out:\n{v}");
    }

    #[test]
    fn missing_numbers_leave_their_sentence_out() {
        let mut colo = report((600.0, 2400.0), 300.0, 2500.0, 500.0, 0.6, &[]);
        colo.summary.chunk_gap_ms = None;
        colo.summary.goodput_rps = None;
        let pd = report((600.0, 2450.0), 310.0, 300.0, 510.0, 0.9, &[("prefill", 1.0)]);
        let v = render(("a", &colo), ("b", &pd), "fixed:128:64", 1.0, "ttft:2s");
        assert!(v.contains("a: no per-stage timing"), "{v}");
        assert!(!v.contains("worst stall") && !v.contains("goodput"), "{v}");
        assert!(v.contains("TTFT p99 stayed at about 2450 ms with b."), "{v}");
        assert!(v.contains("TPOT p99 stayed at about 310 ms with b."), "{v}");
    }
}
