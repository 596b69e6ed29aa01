//! The engine's CUDA paged-attention kernel run on the CPU: its source
//! (`cuda/paged_attention.cu`) compiled as C++ with `shim.h`, which runs each
//! thread block's threads as CPU threads, and `harness.cpp`, which reads
//! launches from a file. Tests record launches ([`Launches::push`]: what
//! [`PagedLaunch`] would send to the GPU, plus the queries and the stored
//! tensors' storage), run them all in one process ([`Launches::run`]) and
//! compare the outputs with the CPU kernel and the dense reference.
//!
//! Needs a C++20 compiler (`c++`, or `CXX`): `cargo xtask test` has one (it
//! builds MLX) and sets [`REQUIRE_ENV`]; elsewhere a missing compiler skips.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use candle_core::{DType, Storage, Tensor};
use kvcache_api::{PagedKv, StoredKv};
use kvcache_models::attention::device::PagedLaunch;

/// Environment variable that makes a missing C++ compiler a failure instead of
/// a skipped test (`cargo xtask test` sets it to `1`).
pub const REQUIRE_ENV: &str = "KVCACHE_REQUIRE_CXX";

/// The harness built with `threads` threads a block (the kernel's
/// `PA_THREADS`), once per test process; `None` (the test skips) where no C++
/// compiler is found and [`REQUIRE_ENV`] is not `1`.
pub fn harness(threads: u32) -> Option<&'static Path> {
    static BUILT: OnceLock<Vec<(u32, Option<PathBuf>)>> = OnceLock::new();
    let built = BUILT.get_or_init(|| [32, 128].into_iter().map(|t| (t, build(t))).collect());
    let (_, exe) = built
        .iter()
        .find(|(t, _)| *t == threads)
        .unwrap_or_else(|| panic!("harness built for 32 and 128 threads, not {threads}"));
    exe.as_deref()
}

fn build(threads: u32) -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Under target/ (cargo's scratch folder for integration tests), one name per
    // block size: built aside and renamed, so concurrent test processes never
    // run a half-written harness, and runs do not pile up copies in /tmp.
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let out = scratch.join(format!("cuda-on-cpu-{threads}"));
    let aside = scratch.join(format!("cuda-on-cpu-{threads}.{}", std::process::id()));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let status = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O2",
            "-pthread",
            "-Wall",
            "-Wno-unknown-pragmas",
            "-Werror",
        ])
        .arg(format!("-DPA_THREADS={threads}"))
        .arg(dir.join("tests/cuda_on_cpu/harness.cpp"))
        .arg("-o")
        .arg(&aside)
        .status();
    match status {
        Ok(s) => {
            assert!(s.success(), "{cxx} failed on the kernel's harness: {s}");
            std::fs::rename(&aside, &out).unwrap();
            Some(out)
        }
        Err(e) => {
            assert!(
                std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
                "no C++ compiler ({cxx}: {e}) and {REQUIRE_ENV}=1"
            );
            let _ = writeln!(
                std::io::stderr(),
                "skipped: the CUDA kernel on the CPU: {cxx}: {e}"
            );
            None
        }
    }
}

/// Launches recorded for one run of the harness.
#[derive(Default)]
pub struct Launches {
    bytes: Vec<u8>,
    outputs: Vec<usize>,
}

impl Launches {
    /// Records `launch` (built for `q` and `view`, every tensor on the CPU).
    pub fn push(&mut self, launch: &PagedLaunch, q: &Tensor, view: &PagedKv<'_, Tensor>) {
        let b = &mut self.bytes;
        b.extend_from_slice(&launch.kernel_type().code().to_le_bytes());
        b.extend_from_slice(launch.args().as_bytes());
        blob(b, &storage_bytes(&q.contiguous().unwrap()));
        for stored in [&view.keys, &view.values] {
            let (data, scales) = match stored {
                StoredKv::Float(t) => (storage_bytes(t), Vec::new()),
                StoredKv::Q8_0 { quants, scales } => (storage_bytes(quants), storage_bytes(scales)),
            };
            blob(b, &data);
            blob(b, &scales);
        }
        let runs: Vec<u8> = launch.runs().iter().flat_map(|w| w.to_le_bytes()).collect();
        blob(b, &runs);
        let (rows, width) = launch.out_dims();
        self.outputs.push(rows * width);
    }

    /// Runs every launch through `harness`: each one's output, in order.
    pub fn run(&self, harness: &Path) -> Vec<Vec<f32>> {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let tag = format!("{}-{:?}", std::process::id(), std::thread::current().id());
        let input = dir.join(format!("launches-{tag}"));
        let output = dir.join(format!("outputs-{tag}"));
        std::fs::write(&input, &self.bytes).unwrap();
        let status = Command::new(harness).arg(&input).arg(&output).status().unwrap();
        assert!(status.success(), "the harness failed: {status}");
        let raw = std::fs::read(&output).unwrap();
        let _ = std::fs::remove_file(&input);
        let _ = std::fs::remove_file(&output);
        let floats: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(
            floats.len(),
            self.outputs.iter().sum::<usize>(),
            "outputs of every launch"
        );
        let mut at = 0;
        self.outputs
            .iter()
            .map(|&len| {
                at += len;
                floats[at - len..at].to_vec()
            })
            .collect()
    }
}

fn blob(b: &mut Vec<u8>, bytes: &[u8]) {
    b.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    b.extend_from_slice(bytes);
}

/// Every element of the storage behind `t` (not only its view), as bytes: the
/// kernel indexes storage through the launch's strides.
fn storage_bytes(t: &Tensor) -> Vec<u8> {
    let (storage, _) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        panic!("the harness reads CPU tensors");
    };
    match t.dtype() {
        DType::F32 => cpu
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F16 => cpu
            .as_slice::<half::f16>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::BF16 => cpu
            .as_slice::<half::bf16>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::U8 => cpu.as_slice::<u8>().unwrap().to_vec(),
        other => panic!("stored in {other:?}"),
    }
}
