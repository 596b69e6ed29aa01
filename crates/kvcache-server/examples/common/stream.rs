//! What the serving examples share on the client side: one streamed request
//! (a completion of token ids, or any body) with its usage and time to first
//! token, and the nearest-rank quantile. Each example uses a part of it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Errors of an example.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// What one streamed completion reported.
#[derive(Debug, Clone, Copy)]
pub struct Streamed {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: usize,
    /// `usage.completion_tokens`.
    pub completion_tokens: usize,
    /// From sending the request to the first chunk with a choice.
    pub ttft: Duration,
}

/// One streamed greedy completion of token ids at `url`'s `/v1/completions`,
/// read to `[DONE]`; the first token is the first chunk with a choice.
pub async fn complete(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    tokens: &[u32],
    max_tokens: usize,
) -> Result<Streamed, Error> {
    let body = json!({
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    stream(http, &format!("{url}/v1/completions"), &body, |chunk| {
        chunk["choices"].as_array().is_some_and(|c| !c.is_empty())
    })
    .await
}

/// Posts `body` (a streamed request asking for usage) to `endpoint` and
/// reads the server-sent events to `[DONE]`: the usage, and the time to the
/// first chunk `is_first_token` accepts.
pub async fn stream(
    http: &reqwest::Client,
    endpoint: &str,
    body: &Value,
    is_first_token: impl Fn(&Value) -> bool,
) -> Result<Streamed, Error> {
    stream_each(http, endpoint, body, is_first_token, |_| {}).await
}

/// [`stream`], handing every chunk to `each` on the way (e.g. to collect
/// the generated text).
pub async fn stream_each(
    http: &reqwest::Client,
    endpoint: &str,
    body: &Value,
    is_first_token: impl Fn(&Value) -> bool,
    mut each: impl FnMut(&Value),
) -> Result<Streamed, Error> {
    let start = Instant::now();
    let mut response = http.post(endpoint).json(body).send().await?;
    if !response.status().is_success() {
        let status = response.status();
        return Err(format!("{endpoint}: {status}: {}", response.text().await?).into());
    }
    let mut buffer = String::new();
    let (mut ttft, mut usage, mut done) = (None, None, false);
    while let Some(chunk) = response.chunk().await? {
        buffer.push_str(std::str::from_utf8(&chunk)?);
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data)?;
                if ttft.is_none() && is_first_token(&v) {
                    ttft = Some(start.elapsed());
                }
                each(&v);
                if !v["usage"].is_null() {
                    usage = Some(v["usage"].clone());
                }
            }
        }
    }
    let usage = usage.ok_or("no usage")?;
    if !done {
        return Err("stream ended without [DONE]".into());
    }
    let field = |v: &Value| v.as_u64().map(|n| n as usize).ok_or("usage field missing");
    Ok(Streamed {
        prompt_tokens: field(&usage["prompt_tokens"])?,
        cached_tokens: field(&usage["prompt_tokens_details"]["cached_tokens"])?,
        completion_tokens: field(&usage["completion_tokens"])?,
        ttft: ttft.ok_or("no token")?,
    })
}

/// The `q` quantile (nearest rank) of `v`; 0 for none.
pub fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}
