//! The load generator's library: workloads, the arrival process, the client that records what it
//! observed, and the reports built from those records.
//!
//! Every number a report prints is computed by the `timeline` crate; this crate only decides
//! which records go in (the steady-state window) and how the results are laid out. Keeping the
//! report separate from the load generator means a saved run can be re-analysed later with another
//! window or SLO without re-running it (`tokenpath report`).

pub mod arrival;
pub mod client;
pub mod compare;
mod error;
pub mod html;
pub mod mock;
pub mod progress;
pub mod report;
pub mod run;
pub mod search;
pub mod side_by_side;
pub mod spans;
pub mod text;
pub mod tokens;
pub mod trace;
pub mod verdict;
pub mod workload;

pub use error::BenchError;
