//! With the `cuda` feature, builds the paged-attention kernel
//! (`cuda/paged_attention.cu`) to PTX with `nvcc`, for the compute capability
//! in `CUDA_COMPUTE_CAP` (as candle's kernels read it; 75, the oldest CUDA 13 builds, if unset: the
//! driver compiles PTX for newer GPUs when it loads it). Without the feature
//! it does nothing.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=cuda/paged_attention.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("paged_attention.ptx");
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "75".to_string());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let status = Command::new(&nvcc)
        .args([
            "--ptx",
            "-O3",
            "-std=c++17",
            &format!("-arch=compute_{cap}"),
            "-o",
        ])
        .arg(&out)
        .arg("cuda/paged_attention.cu")
        .status()
        .unwrap_or_else(|e| panic!("the cuda feature needs nvcc ({nvcc}): {e}"));
    assert!(
        status.success(),
        "nvcc failed on cuda/paged_attention.cu: {status}"
    );
}
