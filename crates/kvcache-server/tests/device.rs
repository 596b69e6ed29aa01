//! `--device`: a GPU this build or machine lacks stops the server at start
//! with one clear line and a failing exit status (before the model is read),
//! and a device the flag cannot name is a usage error. (The server is built
//! without CUDA here: kvcache-models' `cuda` feature is off.)

use std::process::Command;

fn server(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvcache-server"))
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .unwrap()
}

#[test]
fn a_cuda_device_without_cuda_is_one_line_and_a_failure() {
    // The device is checked first: no model file is needed to see it refused.
    let out = server(&[
        "--device",
        "cuda",
        "--model",
        "/nonexistent/model.gguf",
        "--port",
        "0",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("cuda:0") && lines[0].contains("--features cuda"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_device_the_flag_cannot_name_is_a_usage_error() {
    let out = server(&["--device", "gpu", "--model", "/nonexistent/model.gguf"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--device") && stderr.contains("cpu, cuda or cuda:N"),
        "{stderr}"
    );
}
