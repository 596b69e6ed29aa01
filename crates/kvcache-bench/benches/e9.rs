//! Benchmark E9 (issue 32): decode and prefill speed of each weight mode, on
//! SmolLM2-135M and Gemma 3 270M, against llama-server on the same files.
//!
//! Ours, in process, through the model and a causal cache (what the engine's
//! passes run, without HTTP): a 512-token prompt prefilled in one pass
//! (prefill tokens/s), then decode at batch 1, 4 and 10: that many sequences,
//! each prefilled with its own 32-token prompt, decode 64 tokens together,
//! greedily, one pass per step (decode tokens/s over the decode steps).
//! llama-server, over its HTTP `/completion` with the same token ids and its
//! own server-side `timings`: the prefill's `prompt_ms` (one request,
//! `n_predict` 1, no prompt cache), and the decode's `predicted_ms` (one
//! request per sequence, all at once, `ignore_eos`: the tokens of all of them
//! over the longest `predicted_ms`). The two alternate, round by round.
//!
//! Also printed: the bytes of matrices one decode step reads in each mode, the
//! machine's measured read bandwidth (two threads summing 1 GiB), and the
//! bandwidth limit they give (bandwidth / bytes per step) with the share of it
//! each decode at batch 1 reaches.
//!
//! ```text
//! cargo xtask bench -p kvcache-bench --bench e9
//! KVCACHE_E9_LLAMA_SERVER=/path/to/llama-server cargo xtask bench -p kvcache-bench --bench e9
//! ```
//!
//! Knobs: `KVCACHE_E9_MODELS` (`smollm2,gemma3`), `KVCACHE_E9_WEIGHTS`
//! (`f32,q8,q4,gguf`; `candle` too on request: its Q4_1 is slow),
//! `KVCACHE_E9_BATCHES` (`1,4,10`), `KVCACHE_E9_DECODE` (64),
//! `KVCACHE_E9_PREFILL` (512), `KVCACHE_E9_ROUNDS` (2),
//! `KVCACHE_E9_LLAMA_SERVER` (a llama-server binary; without it only ours
//! runs), `KVCACHE_E9_THREADS` (llama-server's `-t`, 2). Needs the model files
//! (`cargo xtask` fetches them); a model whose file is missing is skipped with
//! a printed reason.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, IndexOp, Tensor};
use kvcache_api::CausalConfig;
use kvcache_bench::knobs::{knob, list};
use kvcache_bench::trace::Trace;
use kvcache_models::gemma::GemmaFile;
use kvcache_models::{argmax, paths, BatchToken, Model, ModelFile, WeightMode};

type Error = Box<dyn std::error::Error>;

/// What one round measures, in tokens per second.
#[derive(Debug, Clone, Default)]
struct Speeds {
    prefill: f64,
    /// `(batch, decode tokens/s)`.
    decode: Vec<(usize, f64)>,
}

/// The workload's sizes and token ids.
struct Work {
    prefill: Vec<u32>,
    /// One 32-token prompt per sequence, as many as the largest batch.
    prompts: Vec<Vec<u32>>,
    batches: Vec<usize>,
    decode: usize,
}

impl Work {
    fn new() -> Result<Self, Error> {
        // Every E1 request's token ids one after another: real text, valid
        // ids in both vocabularies (SmolLM2's 49,152 < Gemma's 262,144).
        let trace = Trace::load(paths::e1_trace_path())?;
        let ids: Vec<u32> = trace
            .requests
            .iter()
            .flat_map(|r| r.token_ids.iter().copied())
            .collect();
        let batches: Vec<usize> = list("KVCACHE_E9_BATCHES", "1,4,10")
            .iter()
            .map(|b| b.parse())
            .collect::<Result<_, _>>()?;
        let most = batches.iter().copied().max().unwrap_or(1);
        let prefill = knob("KVCACHE_E9_PREFILL", 512);
        if ids.len() < prefill + 32 * most {
            return Err("the E1 trace is too short for these sizes".into());
        }
        Ok(Work {
            prefill: ids[..prefill].to_vec(),
            prompts: (0..most)
                .map(|s| ids[prefill + 32 * s..prefill + 32 * (s + 1)].to_vec())
                .collect(),
            batches,
            decode: knob("KVCACHE_E9_DECODE", 64),
        })
    }
}

/// One round of ours: prefill, then decode at each batch size.
fn ours<M: Model>(model: &M, work: &Work) -> Result<Speeds, Error> {
    let device = Device::Cpu;
    let most = work.prompts.len();
    let context = (work.prefill.len() + 1).max(32 + work.decode + 1);
    let config = CausalConfig::new(most, context, work.prefill.len().max(most * 32));
    let mut speeds = Speeds::default();

    let mut cache = model.new_cache(&config, context, &device)?;
    let batch = BatchToken::run(0, 0, &work.prefill);
    let t = Instant::now();
    let hidden = model.hidden(&batch, &mut cache)?;
    let last = hidden.i(batch.len() - 1..)?;
    argmax(&model.logits(&last)?.squeeze(0)?.to_vec1::<f32>()?);
    speeds.prefill = work.prefill.len() as f64 / t.elapsed().as_secs_f64();

    for &b in &work.batches {
        let mut cache = model.new_cache(&config, context, &device)?;
        let batch: Vec<BatchToken> = (0..b)
            .flat_map(|s| BatchToken::run(s, 0, &work.prompts[s]))
            .collect();
        let hidden = model.hidden(&batch, &mut cache)?;
        let rows: Vec<u32> = (0..b as u32).map(|s| 32 * s + 31).collect();
        let mut next = pick(model, &hidden, &rows)?;
        let t = Instant::now();
        for step in 0..work.decode {
            let pos = 32 + step as i32;
            let batch: Vec<BatchToken> = next
                .iter()
                .enumerate()
                .map(|(seq, &token)| BatchToken { seq, pos, token })
                .collect();
            let hidden = model.hidden(&batch, &mut cache)?;
            let all: Vec<u32> = (0..b as u32).collect();
            next = pick(model, &hidden, &all)?;
        }
        speeds
            .decode
            .push((b, (b * work.decode) as f64 / t.elapsed().as_secs_f64()));
    }
    Ok(speeds)
}

/// The greedy next token of each of `rows` of `hidden` (`[n, dim]`).
fn pick<M: Model>(model: &M, hidden: &Tensor, rows: &[u32]) -> Result<Vec<u32>, Error> {
    let idx = Tensor::from_slice(rows, rows.len(), hidden.device())?;
    let logits = model.logits(&hidden.index_select(&idx, 0)?)?;
    Ok(logits.to_vec2::<f32>()?.iter().map(|r| argmax(r)).collect())
}

/// A llama-server this bench started, killed by process id when dropped.
struct LlamaServer {
    child: Child,
    port: u16,
}

impl LlamaServer {
    fn start(bin: &Path, model: &Path, slots: usize, context: usize) -> Result<Self, Error> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let threads = knob("KVCACHE_E9_THREADS", 2).to_string();
        let child = Command::new(bin)
            .args(["-m".as_ref(), model.as_os_str()])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-t", &threads, "-tb", &threads, "-np", &slots.to_string()])
            .args(["-c", &(slots * context).to_string(), "--no-warmup"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let server = LlamaServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Ok(body) = server.request("GET", "/health", None) {
                if body.contains("ok") {
                    return Ok(server);
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err("llama-server did not answer /health within 120 s".into())
    }

    /// One HTTP/1.1 request on a new connection (`Connection: close`); the body.
    fn request(&self, method: &str, path: &str, body: Option<&str>) -> Result<String, Error> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(600)))?;
        let body = body.unwrap_or("");
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response.split_once("\r\n\r\n").ok_or("no HTTP header")?;
        if !head.starts_with("HTTP/1.1 200") {
            return Err(format!("llama-server answered {}", head.lines().next().unwrap_or("")).into());
        }
        Ok(body.to_owned())
    }

    /// `/completion` of `prompt` for `n` tokens; its `timings`.
    fn complete(&self, prompt: &[u32], n: usize) -> Result<serde_json::Value, Error> {
        let body = serde_json::json!({
            "prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": true,
            "cache_prompt": false, "stream": false,
        });
        let answer: serde_json::Value =
            serde_json::from_str(&self.request("POST", "/completion", Some(&body.to_string()))?)?;
        Ok(answer["timings"].clone())
    }

    /// One round of theirs, as [`ours`].
    fn round(&self, work: &Work) -> Result<Speeds, Error> {
        let timings = self.complete(&work.prefill, 1)?;
        let prefill = timings["prompt_n"].as_f64().unwrap_or(0.0)
            / timings["prompt_ms"].as_f64().unwrap_or(f64::NAN)
            * 1e3;
        let mut decode = Vec::new();
        for &b in &work.batches {
            let all: Vec<serde_json::Value> = std::thread::scope(|scope| {
                let handles: Vec<_> = work.prompts[..b]
                    .iter()
                    .map(|prompt| {
                        scope.spawn(move || self.complete(prompt, work.decode).map_err(|e| e.to_string()))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .map_err(|_| "a request thread panicked")?
                            .map_err(|e| e.to_string())
                    })
                    .collect::<Result<_, String>>()
            })?;
            let tokens: f64 = all.iter().map(|t| t["predicted_n"].as_f64().unwrap_or(0.0)).sum();
            let longest = all
                .iter()
                .map(|t| t["predicted_ms"].as_f64().unwrap_or(0.0))
                .fold(0.0, f64::max);
            decode.push((b, tokens / longest * 1e3));
        }
        Ok(Speeds { prefill, decode })
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Read bandwidth in GB/s: two threads summing halves of 1 GiB, best of 3.
fn bandwidth() -> f64 {
    let data = vec![1u64; 1 << 27];
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let halves: Vec<_> = data
                .chunks(data.len() / 2)
                .map(|half| s.spawn(move || half.iter().fold(0u64, |a, &v| a.wrapping_add(v))))
                .collect();
            halves.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        assert_eq!(sum, data.len() as u64);
        best = best.max((data.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prints one row per mode: medians over the rounds.
fn report(name: &str, bytes: Option<usize>, rounds: &[Speeds], gbps: f64) {
    let prefill = median(rounds.iter().map(|r| r.prefill).collect());
    let mut line = format!("| {name} | {prefill:.0} |");
    let mut batch1 = None;
    for (i, &(b, _)) in rounds[0].decode.iter().enumerate() {
        let d = median(rounds.iter().map(|r| r.decode[i].1).collect());
        if b == 1 {
            batch1 = Some(d);
        }
        line += &format!(" {d:.1} |");
    }
    match (bytes, batch1) {
        (Some(bytes), Some(d)) => {
            let limit = gbps * 1e9 / bytes as f64;
            line += &format!(
                " {:.1} MB | {limit:.0} | {:.0}% |",
                bytes as f64 / 1e6,
                100.0 * d / limit
            );
        }
        _ => line += " | | |",
    }
    println!("{line}");
}

fn run_model(
    label: &str,
    path: &Path,
    modes: &[WeightMode],
    work: &Work,
    rounds: usize,
    gbps: f64,
) -> Result<(), Error> {
    let llama_bin = std::env::var_os("KVCACHE_E9_LLAMA_SERVER").map(PathBuf::from);
    let theirs = match &llama_bin {
        Some(bin) => Some(LlamaServer::start(bin, path, work.prompts.len(), 1024)?),
        None => None,
    };
    let batches: Vec<String> = work.batches.iter().map(|b| format!("decode @{b}")).collect();
    println!("\n{label} ({}):\n", path.display());
    println!(
        "| weights | prefill {} tok/s | {} | matrix bytes / step | limit @1 tok/s | of limit |",
        work.prefill.len(),
        batches.join(" | ")
    );
    println!("|---|---|{}---|---|---|", "---|".repeat(work.batches.len()));
    let mut their_rounds = Vec::new();
    for &mode in modes {
        let gemma = label == "gemma3";
        let mut our_rounds = Vec::new();
        let load = Instant::now();
        let bytes = if gemma {
            let model = GemmaFile::open(path)?.load(&Device::Cpu, mode, &mut |_| {})?;
            eprintln!("{label} {mode}: loaded in {:.1} s", load.elapsed().as_secs_f64());
            for _ in 0..rounds {
                our_rounds.push(ours(&model, work)?);
                if let Some(server) = &theirs {
                    their_rounds.push(server.round(work)?);
                }
            }
            model.matrix_bytes()
        } else {
            let model = ModelFile::open(path)?.load(&Device::Cpu, mode, &mut |_| {})?;
            eprintln!("{label} {mode}: loaded in {:.1} s", load.elapsed().as_secs_f64());
            for _ in 0..rounds {
                our_rounds.push(ours(&model, work)?);
                if let Some(server) = &theirs {
                    their_rounds.push(server.round(work)?);
                }
            }
            model.matrix_bytes()
        };
        report(mode.name(), Some(bytes), &our_rounds, gbps);
    }
    if !their_rounds.is_empty() {
        report("llama-server", None, &their_rounds, gbps);
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    // SAFETY: first thing in main, before any thread starts.
    let threads = unsafe { kvcache_models::threads::tune_cpu_threads() };
    let modes: Vec<WeightMode> = list("KVCACHE_E9_WEIGHTS", "f32,q8,q4,gguf")
        .iter()
        .map(|m| m.parse())
        .collect::<Result<_, _>>()?;
    let rounds = knob("KVCACHE_E9_ROUNDS", 2).max(1);
    let work = Work::new()?;
    let gbps = bandwidth();
    println!(
        "E9: {} threads, read bandwidth {gbps:.1} GB/s, {rounds} rounds (medians), decode {} steps",
        threads.threads, work.decode
    );
    for model in list("KVCACHE_E9_MODELS", "smollm2,gemma3") {
        let path = match model.as_str() {
            "smollm2" => paths::model_path(),
            "gemma3" => std::env::var_os(kvcache_models::gemma::GEMMA_ENV).map(PathBuf::from),
            other => return Err(format!("no model {other:?}: smollm2 or gemma3").into()),
        };
        match path.filter(|p| p.is_file()) {
            Some(path) => run_model(&model, &path, &modes, &work, rounds, gbps)?,
            None => println!("\n{model}: skipped, its file is not there (`cargo xtask prepare --model`)"),
        }
    }
    Ok(())
}
