//! The E1 trace as the serving examples (E6/E7, E4r) take it: the same
//! command-line arguments, and the requests of the first conversations.

use std::path::PathBuf;

use kvcache_bench::trace::{Request, Trace};

use crate::stream::Error;

/// Which part of the E1 trace to send, and how.
#[derive(Debug, clap::Args)]
pub struct E1Args {
    /// The trace file [default: the project's fixtures/e1_trace.json].
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The first N conversations of the trace (all turns of each).
    #[arg(long, default_value_t = 10)]
    pub conversations: usize,
    /// Tokens to generate per request [default: the trace's n_predict].
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// The model name sent in each request.
    #[arg(long, default_value = "SmolLM2-135M-Instruct")]
    pub model: String,
    /// Print one line per request.
    #[arg(long)]
    pub verbose: bool,
    /// Where the started server(s) run the model: `cpu`, `cuda` or `cuda:N`
    /// (their `--device`; CUDA needs a server built with `--features cuda`).
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,
    /// Extra flags for the started server(s) (e.g. `--server-arg=--attention=dense`).
    #[arg(long = "server-arg", value_name = "FLAG", allow_hyphen_values = true)]
    pub server_args: Vec<String>,
}

impl E1Args {
    /// The flags a started server gets: `--device`, then `--server-arg`s.
    pub fn server_flags(&self) -> Vec<String> {
        let mut flags = vec![format!("--device={}", self.device)];
        flags.extend(self.server_args.iter().cloned());
        flags
    }
}

/// The loaded trace and what of it a run sends.
pub struct E1Run {
    /// Where the trace was read from.
    pub path: PathBuf,
    /// The whole trace.
    pub trace: Trace,
    /// The requests of the first `conversations` conversations, in trace order.
    pub requests: Vec<Request>,
    /// Tokens generated per request.
    pub max_tokens: usize,
}

impl E1Args {
    /// Reads the trace and picks the requests.
    pub fn load(&self) -> Result<E1Run, Error> {
        let path = self
            .trace
            .clone()
            .unwrap_or_else(kvcache_models::paths::e1_trace_path);
        let trace = Trace::load(&path).map_err(|e| e.to_string())?;
        let requests: Vec<Request> = trace
            .requests
            .iter()
            .filter(|r| r.conv < self.conversations)
            .cloned()
            .collect();
        let max_tokens = self
            .max_tokens
            .unwrap_or_else(|| requests.first().map_or(1, |r| r.n_predict));
        Ok(E1Run {
            path,
            trace,
            requests,
            max_tokens,
        })
    }
}

impl E1Run {
    /// "trace PATH: N requests of C conversations, T tokens generated each".
    pub fn describe(&self, conversations: usize) -> String {
        format!(
            "trace {}: {} requests of {} conversations, {} tokens generated each",
            self.path.display(),
            self.requests.len(),
            conversations.min(self.trace.conversations.len()),
            self.max_tokens
        )
    }
}
