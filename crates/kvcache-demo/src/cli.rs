//! The command line: every flag, its default and its help, as clap types.

use std::path::PathBuf;

use clap::{Args, Parser, ValueEnum};
use kvcache_api::KvStorage;
use kvcache_engine::chat::Reuse;
use kvcache_models::WeightMode;

const EXAMPLES: &str = "\
Examples:
  cargo xtask demo                                  every part of the demo on the CPU
  cargo xtask demo -- --backend mlx --skip store    the prefix-trie chat on mlx-rs
  cargo xtask demo --model gemma3                   the windowed parts on Gemma 3 270M
  kvcache-demo --prompt 'Why is the sky blue?' --turns 2 --skip batching,window,shift
  kvcache-demo --bench-e1 --e1-policies trie,none --e1-predict 8
  kvcache-demo --bench-e3 --e3-restart 40           restart over a disk store
  kvcache-demo --bench-e4                           two replicas over one Redis (needs redis-server)

Without --model the model is $KVCACHE_MODEL, else the file `cargo xtask prepare` cached;
--model gemma3 is $KVCACHE_GEMMA (which `cargo xtask demo` sets when it can fetch Gemma).";

/// SmolLM2-135M-Instruct served through the kvcache-rs caches.
///
/// By default runs every part of the demo in turn: a multi-turn chat over the
/// prefix trie, a conversation continued by a second process from the prefix
/// store, continuous batching, a sliding window and a context shift. A
/// --bench-* flag runs one of the benchmarks of docs/BENCHMARKS.md instead.
#[derive(Debug, Parser)]
#[command(name = "kvcache-demo", version, after_help = EXAMPLES, max_term_width = 100)]
pub struct Cli {
    /// The model and where it runs.
    #[command(flatten, next_help_heading = "Model")]
    pub model: ModelArgs,
    /// The demo's parts.
    #[command(flatten, next_help_heading = "Demo")]
    pub demo: DemoArgs,
    /// The benchmarks.
    #[command(flatten, next_help_heading = "Benchmarks")]
    pub bench: BenchArgs,
    /// The prefix store and replica processes.
    #[command(flatten, next_help_heading = "Prefix store")]
    pub store: StoreArgs,
}

/// The model and where it runs.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// gemma3, or a GGUF model file [default: $KVCACHE_MODEL, else the `cargo xtask prepare` cache]
    ///
    /// gemma3 (or a Gemma 3 GGUF file) runs the demo's windowed parts on
    /// Gemma 3 270M, a sliding-window model: chat past the window and a
    /// context shift ($KVCACHE_GEMMA, set by `cargo xtask demo`).
    #[arg(long, value_name = "NAME|PATH", value_parser = model_choice)]
    pub model: Option<ModelChoice>,

    /// Caches the prefix-trie chat drives
    ///
    /// causal: candle layer caches; mlx: mlx-rs KvCaches (needs an mlx build:
    /// `cargo xtask demo` on Linux, or macOS). The other parts and the
    /// benchmarks run on candle either way.
    #[arg(long, value_enum, value_name = "NAME", default_value_t = Backend::Causal)]
    pub backend: Backend,

    /// Device of the candle model and caches (mlx uses its default device)
    #[arg(long, value_enum, value_name = "NAME", default_value_t = DeviceName::Cpu)]
    pub device: DeviceName,

    /// Weights: gguf (the file's 4- and 8-bit blocks, activations quantized per
    /// row, as llama.cpp multiplies them: the fastest on the CPU), q8 or q4
    /// (every matrix in 8- or 4-bit blocks), candle (candle's quantized
    /// kernels, on any device) or f32 (dequantized: the reference) [default:
    /// gguf on the CPU, candle on a GPU]
    #[arg(long, value_name = "MODE")]
    pub weights: Option<WeightMode>,

    /// How the causal cache stores keys and values (f32, f16, bf16 or q8_0)
    ///
    /// Applies to the parts on the causal cache (continuous batching, the
    /// sliding window, the context shift); the model still computes in f32.
    /// q8_0 holds 3.76x fewer bytes per cached token than f32.
    #[arg(long, value_name = "TYPE", default_value = "f32", value_parser = kv_type)]
    pub kv_type: KvStorage,
}

/// The demo's parts.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// A user message; repeat for several [default: built-in questions]
    #[arg(long = "prompt", value_name = "TEXT")]
    pub prompts: Vec<String>,

    /// Conversations to answer (the chat and continuous batching)
    #[arg(long, value_name = "N", default_value_t = 6, value_parser = positive)]
    pub conversations: usize,

    /// Turns per conversation in the prefix-trie chat
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = positive)]
    pub turns: usize,

    /// Sequences decoding at once in continuous batching
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = positive)]
    pub slots: usize,

    /// Tokens to generate per reply
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = positive)]
    pub max_new: usize,

    /// Sliding window of the windowed run, in positions
    #[arg(long, value_name = "N", default_value_t = 48, value_parser = positive)]
    pub window: usize,

    /// Context of the context-shift run, in positions
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = positive)]
    pub context: usize,

    /// Parts to skip, comma-separated
    #[arg(long, value_enum, value_name = "PARTS", value_delimiter = ',')]
    pub skip: Vec<Part>,
}

/// The benchmarks.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Run E1 (the chat trace: trie vs single-entry vs no reuse) and exit
    #[arg(long)]
    pub bench_e1: bool,

    /// Run E2 (8 sequences decoding together vs one after another) and exit
    #[arg(long)]
    pub bench_e2: bool,

    /// Run E3 (the E1 trace, restarted over a disk store) and exit
    ///
    /// The first --e3-restart requests are answered by one replica process, the
    /// rest by a new one over the same directory: evaluated tokens, and time to
    /// first token after the restart against recomputation.
    #[arg(long)]
    pub bench_e3: bool,

    /// Run E4 (two replicas alternating over one Redis vs no store; needs
    /// redis-server on PATH) and exit
    #[arg(long)]
    pub bench_e4: bool,

    /// The E1 trace (E1, E3, E4, the store demo and replicas) [default: fixtures/e1_trace.json]
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,

    /// First N requests of the trace (E1, E3, E4)
    #[arg(long, value_name = "N", default_value_t = 80, value_parser = positive)]
    pub e1_requests: usize,

    /// Tokens generated per trace request (E1, E3, E4, replicas)
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = positive)]
    pub e1_predict: usize,

    /// E1's reuse policies, comma-separated, run one after another
    #[arg(
        long,
        value_enum,
        value_name = "LIST",
        value_delimiter = ',',
        default_values_t = [Policy::Trie, Policy::Single, Policy::None]
    )]
    pub e1_policies: Vec<Policy>,

    /// Tokens each sequence decodes in E2
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = positive)]
    pub e2_tokens: usize,

    /// Alternating runs of E2
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = positive)]
    pub e2_runs: usize,

    /// Requests E3 answers before the restart
    #[arg(long, value_name = "N", default_value_t = 40, value_parser = positive)]
    pub e3_restart: usize,
}

/// The prefix store and replica processes.
#[derive(Debug, Args)]
pub struct StoreArgs {
    /// Keep the prefix store in DIR (the store demo and --replica)
    #[arg(long, value_name = "DIR")]
    pub store_dir: Option<PathBuf>,

    /// Share the prefix store through Redis (--replica)
    #[arg(long, value_name = "URL", value_hint = clap::ValueHint::Url)]
    pub redis: Option<String>,

    /// Serve trace requests as commands on stdin (what E3, E4 and the store demo start)
    ///
    /// One command a line on stdin (`run I`, `recompute I`, `flush`), one JSON
    /// answer a line on stdout; see kvcache_bench::replica.
    #[arg(long)]
    pub replica: bool,
}

/// What `--model` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelChoice {
    /// `gemma3`: Gemma 3 270M at $KVCACHE_GEMMA.
    Gemma3,
    /// A GGUF file.
    File(PathBuf),
}

/// The caches of the prefix-trie chat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Everything on candle; the trie drives kvcache-causal's CandleKv layer caches
    Causal,
    /// The trie chat on mlx-rs through kvcache-mlx's KvCache
    Mlx,
}

/// A candle device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceName {
    /// The CPU
    Cpu,
    /// The first NVIDIA GPU (build with `--features cuda`)
    Cuda,
    /// Apple's GPU (macOS)
    Metal,
}

impl DeviceName {
    /// The flag's value, as replicas get it.
    pub fn as_flag(self) -> &'static str {
        match self {
            DeviceName::Cpu => "cpu",
            DeviceName::Cuda => "cuda",
            DeviceName::Metal => "metal",
        }
    }
}

/// A part of the demo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Part {
    /// The multi-turn chat over the prefix trie
    Chat,
    /// A conversation continued by a second process from the disk store
    Store,
    /// Continuous batching of several conversations
    Batching,
    /// Sequences attending through a sliding window
    Window,
    /// One sequence generating past its context
    Shift,
}

/// An E1 reuse policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    /// The prefix trie across conversations
    Trie,
    /// The previous request's longest common prefix
    Single,
    /// Every prompt from scratch
    None,
}

impl From<Policy> for Reuse {
    fn from(p: Policy) -> Self {
        match p {
            Policy::Trie => Reuse::Trie,
            Policy::Single => Reuse::SingleEntry,
            Policy::None => Reuse::None,
        }
    }
}

/// What a run does, from the flags: the first of these that is set wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `--replica`
    Replica,
    /// `--bench-e3` and/or `--bench-e4`
    StoreBench,
    /// `--bench-e1`
    E1,
    /// `--bench-e2`
    E2,
    /// The demo's parts
    Demo,
}

impl Cli {
    /// What this run does.
    pub fn mode(&self) -> Mode {
        let b = &self.bench;
        if self.store.replica {
            Mode::Replica
        } else if b.bench_e3 || b.bench_e4 {
            Mode::StoreBench
        } else if b.bench_e1 {
            Mode::E1
        } else if b.bench_e2 {
            Mode::E2
        } else {
            Mode::Demo
        }
    }

    /// The user messages: `--prompt`s, else the built-in questions.
    pub fn questions(&self) -> Vec<String> {
        if self.demo.prompts.is_empty() {
            kvcache_bench::bench::SAMPLE_QUESTIONS
                .iter()
                .map(|q| q.to_string())
                .collect()
        } else {
            self.demo.prompts.clone()
        }
    }

    /// Whether `--skip` names `part`.
    pub fn skips(&self, part: Part) -> bool {
        self.demo.skip.contains(&part)
    }

    /// The E1 trace's path.
    pub fn trace_path(&self) -> PathBuf {
        self.bench
            .trace
            .clone()
            .unwrap_or_else(kvcache_models::paths::e1_trace_path)
    }
}

fn model_choice(s: &str) -> Result<ModelChoice, String> {
    match s {
        "" => Err("a model name (gemma3) or a GGUF file".into()),
        "gemma3" | "gemma" => Ok(ModelChoice::Gemma3),
        path => Ok(ModelChoice::File(PathBuf::from(path))),
    }
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("a positive integer, got {s:?}")),
    }
}

fn kv_type(s: &str) -> Result<KvStorage, String> {
    s.parse::<KvStorage>().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("kvcache-demo").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults_match_the_old_flags() {
        let cli = parse(&[]).unwrap();
        assert_eq!(cli.mode(), Mode::Demo);
        assert_eq!(
            (
                cli.demo.conversations,
                cli.demo.slots,
                cli.demo.max_new,
                cli.demo.turns
            ),
            (6, 4, 32, 3)
        );
        assert_eq!((cli.demo.window, cli.demo.context), (48, 64));
        assert_eq!((cli.bench.e1_requests, cli.bench.e1_predict), (80, 32));
        assert_eq!(
            (cli.bench.e2_tokens, cli.bench.e2_runs, cli.bench.e3_restart),
            (32, 3, 40)
        );
        assert_eq!(
            cli.bench.e1_policies,
            [Policy::Trie, Policy::Single, Policy::None]
        );
        assert_eq!(cli.model.backend, Backend::Causal);
        assert_eq!(cli.model.device, DeviceName::Cpu);
        assert_eq!(cli.model.weights, None);
        assert_eq!(cli.model.kv_type, KvStorage::F32);
        assert_eq!(
            cli.questions().len(),
            kvcache_bench::bench::SAMPLE_QUESTIONS.len()
        );
    }

    #[test]
    fn the_flags_other_code_passes_keep_their_spelling() {
        // What the store demo and E3/E4 start replicas of this program with
        // (crate::replicas, also benches/end_to_end.rs).
        let replicas = crate::replicas::Replicas {
            exe: PathBuf::from("kvcache-demo"),
            model: PathBuf::from("m.gguf"),
            trace: PathBuf::from("t.json"),
            n_predict: 8,
            device: DeviceName::Cpu.as_flag(),
            weights: WeightMode::Q4,
        };
        let store = kvcache_engine::store::StoreOptions {
            dir: Some(PathBuf::from("/tmp/s")),
            redis: Some("redis+unix:///tmp/r.sock".into()),
        };
        let command = replicas.command(&store);
        let args: Vec<&str> = command.get_args().map(|a| a.to_str().unwrap()).collect();
        let cli = parse(&args).unwrap();
        assert_eq!(cli.mode(), Mode::Replica);
        assert_eq!(cli.model.model, Some(ModelChoice::File(PathBuf::from("m.gguf"))));
        assert_eq!(cli.trace_path(), PathBuf::from("t.json"));
        assert_eq!(cli.bench.e1_predict, 8);
        assert_eq!(cli.model.weights, Some(WeightMode::Q4));
        assert_eq!(cli.store.store_dir, Some(PathBuf::from("/tmp/s")));
        assert_eq!(cli.store.redis.as_deref(), Some("redis+unix:///tmp/r.sock"));
    }

    #[test]
    fn lists_values_and_aliases_parse() {
        let cli = parse(&[
            "--skip",
            "chat,store",
            "--e1-policies",
            "trie,none",
            "--weights",
            "quantized",
            "--backend",
            "mlx",
            "--prompt",
            "a",
            "--prompt",
            "b",
            "--kv-type",
            "q8_0",
        ])
        .unwrap();
        assert_eq!(cli.model.kv_type, KvStorage::Q8_0);
        assert_eq!(cli.demo.skip, [Part::Chat, Part::Store]);
        assert!(cli.skips(Part::Store) && !cli.skips(Part::Shift));
        assert_eq!(cli.bench.e1_policies, [Policy::Trie, Policy::None]);
        assert_eq!(cli.model.weights, Some(WeightMode::Candle));
        assert_eq!(cli.model.backend, Backend::Mlx);
        assert_eq!(cli.questions(), ["a", "b"]);
        assert_eq!(Reuse::from(Policy::Single), Reuse::SingleEntry);
    }

    #[test]
    fn gemma3_names_the_sliding_window_model() {
        for name in ["gemma3", "gemma"] {
            let cli = parse(&["--model", name, "--skip", "shift"]).unwrap();
            assert_eq!(cli.model.model, Some(ModelChoice::Gemma3));
            assert_eq!(cli.mode(), Mode::Demo);
            assert!(cli.skips(Part::Shift) && !cli.skips(Part::Chat));
        }
        // Anything else is a file, relative or not.
        let cli = parse(&["--model", "./gemma3"]).unwrap();
        assert_eq!(
            cli.model.model,
            Some(ModelChoice::File(PathBuf::from("./gemma3")))
        );
        assert_eq!(parse(&[]).unwrap().model.model, None);
        assert!(parse(&["--model", ""]).is_err());
    }

    #[test]
    fn modes_keep_their_precedence() {
        assert_eq!(parse(&["--bench-e1", "--bench-e2"]).unwrap().mode(), Mode::E1);
        assert_eq!(parse(&["--bench-e2"]).unwrap().mode(), Mode::E2);
        assert_eq!(
            parse(&["--bench-e1", "--bench-e4"]).unwrap().mode(),
            Mode::StoreBench
        );
        assert_eq!(parse(&["--bench-e3", "--replica"]).unwrap().mode(), Mode::Replica);
    }

    #[test]
    fn bad_values_are_rejected() {
        for args in [
            &["--slots", "0"][..],
            &["--max-new", "-3"],
            &["--e1-policies", "trie,lru"],
            &["--skip", "everything"],
            &["--device", "tpu"],
            &["--weights", "q5"],
            &["--kv-type", "q4_1"],
            &["--bogus"],
            &["--model"],
        ] {
            assert!(parse(args).is_err(), "{args:?} parsed");
        }
        let err = parse(&["--turns", "zero"]).unwrap_err().to_string();
        assert!(err.contains("a positive integer, got \"zero\""), "{err}");
    }
}
