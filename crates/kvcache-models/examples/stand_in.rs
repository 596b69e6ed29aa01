//! Stand-in model files (`kvcache_models::stand_in`): a GGUF's skeleton made
//! where the model is, and filled with random weights where it is not.
//!
//! ```text
//! stand_in skeleton MODEL.gguf SKELETON.gguf
//! stand_in fill SKELETON.gguf MODEL.gguf [SEED]
//! ```
//!
//! `cargo xtask cuda-bundle` makes skeletons of SmolLM2 and Gemma 3 and
//! carries them; the GPU machine's run fills them.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use kvcache_models::stand_in::{self, Skeleton};

const USAGE: &str =
    "usage: stand_in skeleton MODEL.gguf SKELETON.gguf | stand_in fill SKELETON.gguf MODEL.gguf [SEED]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let t0 = Instant::now();
    let done = match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["skeleton", model, out] => stand_in::write_skeleton(Path::new(model), Path::new(out)),
        ["fill", skeleton, out] => stand_in::fill(Path::new(skeleton), Path::new(out), 0),
        ["fill", skeleton, out, seed] => match seed.parse() {
            Ok(seed) => stand_in::fill(Path::new(skeleton), Path::new(out), seed),
            Err(_) => {
                eprintln!("stand_in: SEED must be an unsigned integer, not {seed:?}");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match done {
        Ok(Skeleton {
            tensors,
            metadata_keys,
        }) => {
            let out = Path::new(&args[2]);
            let bytes = std::fs::metadata(out).map_or(0, |m| m.len());
            println!(
                "stand_in {}: {} ({} tensors, {metadata_keys} metadata keys, {:.1} MB) in {:.1} s",
                args[0],
                out.display(),
                tensors.len(),
                bytes as f64 / 1e6,
                t0.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("stand_in {}: {e}", args[0]);
            ExitCode::FAILURE
        }
    }
}
