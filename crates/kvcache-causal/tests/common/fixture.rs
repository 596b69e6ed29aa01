//! Scenario files under `fixtures/causal/`: a config line and steps, run against
//! the real cache, with inline expectations, producing a transcript for insta.
//!
//! ```text
//! # comment
//! config sequences=2 capacity=16 batch=16 window=2 shift=add
//! batch seq=0,0,1 pos=0,1,0 val=1,2,3      start_forward + put (one value per token)
//! reserve seq=0,0 pos=0,1                  a reserve pass (puts zeros)
//! causal 1,2                               set_causal(except)
//! remove 0 1..                             remove(seq, range); `1..3` is closed
//! copy 0 1 2                               copy_prefix(src, dst, len)
//! expect mask 0xxx/00xx                    the mask grid of the pass, rows by `/`
//! expect keys 1 2 3 4                      layer 0 keys of the pass range, by cell
//! expect cells 0 1                         the cells of the pass's tokens
//! expect range 0..4                        the pass's cell range
//! expect sees s0p4: 3=4 4=5/6              what token (seq 0, pos 4) sees: pos=key[/value]
//! expect resume 0 5 true                   can_resume(seq, pos)
//! expect used 3                            used cells
//! fail SharedCellShift: remove 0 0..1      the step must fail with that error and
//!                                          leave the whole state unchanged
//! ```
//!
//! Config keys: sequences, capacity, batch, window, memory, chunk, padding=B,C,
//! placement=scattered|contiguous, threshold, shift=add|none, heads, dim.

use std::fmt::Write;
use std::path::PathBuf;

use candle_core::Device;
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, DType, ForwardMode, Placement, Pos, PosRange, SeqId,
    SlidingWindow, VLayout,
};
use kvcache_causal::CausalKvCache;

use super::{add_shift, filled, grid, sees, Seen};

/// The directory holding the causal scenario files.
pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/causal")
}

/// Runs `fixtures/causal/{name}.txt` in every dtype and value layout on the test
/// device, checks that all transcripts agree, and snapshots the transcript.
pub fn check_scenario(name: &str) {
    let path = dir().join(format!("{name}.txt"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let device = super::device();
    let mut first: Option<String> = None;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for layout in [VLayout::Normal, VLayout::Permuted] {
            let transcript = run(&text, dtype, layout, &device)
                .unwrap_or_else(|e| panic!("{name} ({dtype}, {layout:?}): {e}"));
            match &first {
                None => first = Some(transcript),
                Some(f) => assert_eq!(
                    f, &transcript,
                    "{name}: {dtype} {layout:?} differs from f32 Normal"
                ),
            }
        }
    }
    let transcript = first.expect("ran at least once");
    let mut settings = insta::Settings::clone_current();
    // Snapshots live in tests/snapshots/, named after the fixture file.
    settings.set_snapshot_path("../snapshots");
    settings.set_prepend_module_to_snapshot(false);
    settings.set_omit_expression(true);
    settings.set_description(format!(
        "fixtures/causal/{name}.txt (every dtype and value layout)"
    ));
    settings.bind(|| insta::assert_snapshot!(name, transcript));
}

struct Setup {
    config: CausalConfig,
    shift: bool,
    heads: usize,
    dim: usize,
}

fn parse_config(words: &[&str], dtype: DType, layout: VLayout) -> Result<Setup, String> {
    let mut kv = std::collections::BTreeMap::new();
    for w in words {
        let (k, v) = w
            .split_once('=')
            .ok_or(format!("config word {w:?} is not key=value"))?;
        kv.insert(k, v);
    }
    let num = |k: &str, default: usize| -> Result<usize, String> {
        kv.get(k).map_or(Ok(default), |v| {
            v.parse().map_err(|_| format!("{k}={v} is not a number"))
        })
    };
    let mut config = CausalConfig::new(num("sequences", 1)?, num("capacity", 16)?, num("batch", 16)?)
        .with_dtype(dtype)
        .with_mask_dtype(dtype)
        .with_v_layout(layout);
    if let Some(w) = kv.get("window") {
        let w: usize = w.parse().map_err(|_| "bad window")?;
        config = config.with_window(match kv.get("memory") {
            Some(m) => SlidingWindow::with_memory(w, m.parse().map_err(|_| "bad memory")?),
            None => SlidingWindow::new(w),
        });
    }
    if let Some(c) = kv.get("chunk") {
        config = config.with_chunk_size(c.parse().map_err(|_| "bad chunk")?);
    }
    if let Some(p) = kv.get("padding") {
        let (b, c) = p.split_once(',').ok_or("padding=B,C")?;
        config = config.with_padding(
            b.parse().map_err(|_| "bad padding")?,
            c.parse().map_err(|_| "bad padding")?,
        );
    }
    match kv.get("placement").copied() {
        None | Some("scattered") => {}
        Some("contiguous") => config = config.with_placement(Placement::Contiguous),
        Some(other) => return Err(format!("unknown placement {other}")),
    }
    if let Some(t) = kv.get("threshold") {
        config = config.with_compact_threshold(Some(t.parse().map_err(|_| "bad threshold")?));
    }
    Ok(Setup {
        config,
        shift: kv.get("shift") == Some(&"add"),
        heads: num("heads", 1)?,
        dim: num("dim", 4)?,
    })
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>, String> {
    s.split(',')
        .map(|x| x.trim().parse().map_err(|_| format!("bad list item {x:?}")))
        .collect()
}

fn field<'a>(words: &[&'a str], key: &str) -> Result<&'a str, String> {
    words
        .iter()
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .ok_or(format!("missing {key}="))
}

fn range(s: &str) -> Result<PosRange, String> {
    let (a, b) = s.split_once("..").ok_or(format!("{s:?} is not a range"))?;
    let start: Pos = a.parse().map_err(|_| format!("bad range start {a:?}"))?;
    Ok(match b {
        "" => PosRange::from(start..),
        b => PosRange::from(start..b.parse::<Pos>().map_err(|_| format!("bad range end {b:?}"))?),
    })
}

fn number(v: f32) -> String {
    format!("{v}")
}

fn seen_text(seen: &Seen) -> String {
    if seen.is_empty() {
        return "-".into();
    }
    seen.iter()
        .map(|&(p, k, v)| {
            if k == v {
                format!("{p}={}", number(k))
            } else {
                format!("{p}={}/{}", number(k), number(v))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn error_name(e: &CacheError) -> &'static str {
    match e {
        CacheError::Full { .. } => "Full",
        CacheError::NotSupported(_) => "NotSupported",
        CacheError::InvalidBatch(_) => "InvalidBatch",
        CacheError::SequenceOutOfRange { .. } => "SequenceOutOfRange",
        CacheError::ShapeMismatch { .. } => "ShapeMismatch",
        CacheError::DTypeMismatch { .. } => "DTypeMismatch",
        CacheError::SharedCellShift { .. } => "SharedCellShift",
        CacheError::InvalidState(_) => "InvalidState",
        CacheError::InvalidArgument(_) => "InvalidArgument",
        CacheError::Backend(_) => "Backend",
        _ => "Other",
    }
}

struct Runner<'a> {
    setup: Setup,
    cache: CausalKvCache,
    device: &'a Device,
    /// The tokens of the pass in progress.
    tokens: Vec<(SeqId, Pos)>,
    out: String,
}

impl Runner<'_> {
    fn step(&mut self, line: &str) -> Result<(), CacheError> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let bad = |m: String| CacheError::InvalidArgument(format!("fixture: {m}"));
        match words[0] {
            "batch" | "reserve" => {
                let seqs: Vec<SeqId> = list(field(&words, "seq").map_err(bad)?).map_err(bad)?;
                let pos: Vec<Pos> = list(field(&words, "pos").map_err(bad)?).map_err(bad)?;
                let vals: Vec<f32> = match words[0] {
                    "batch" => list(field(&words, "val").map_err(bad)?).map_err(bad)?,
                    _ => vec![0.0; seqs.len()],
                };
                let mode = if words[0] == "batch" {
                    ForwardMode::Compute
                } else {
                    ForwardMode::Reserve
                };
                let batch = Batch::new(pos, seqs)?;
                self.cache.start_forward(&batch, mode)?;
                self.tokens = batch.tokens().collect();
                self.cache.set_layer(0);
                let (h, d, dtype) = (self.setup.heads, self.setup.dim, self.setup.config.dtype);
                let kv = filled(&vals, h, d, dtype, self.device);
                self.cache.put(&kv, &kv)?;
                self.describe_pass();
            }
            "causal" => {
                let except: Vec<usize> = if words.len() > 1 {
                    list(words[1]).map_err(bad)?
                } else {
                    vec![]
                };
                self.cache.set_causal(&except)?;
                self.describe_pass();
            }
            "remove" => {
                let seq = words[1].parse().map_err(|_| bad("bad seq".into()))?;
                self.cache.remove(seq, range(words[2]).map_err(bad)?)?;
                self.describe_sequences();
            }
            "copy" => {
                let n: Vec<i64> = words[1..4]
                    .iter()
                    .map(|w| w.parse().map_err(|_| bad(format!("bad number {w}"))))
                    .collect::<Result<_, _>>()?;
                self.cache
                    .copy_prefix(n[0] as SeqId, n[1] as SeqId, n[2] as Pos)?;
                self.describe_sequences();
            }
            other => return Err(bad(format!("unknown step {other}"))),
        }
        self.cache.check();
        Ok(())
    }

    fn describe_pass(&mut self) {
        let range = self.cache.pass_range().expect("pass in progress");
        let view = self.cache.get().expect("get after put");
        let keys = super::host(&view.keys);
        let row = keys.len() / range.len();
        let cells: Vec<String> = self.cache.pass_cells().iter().map(|c| c.to_string()).collect();
        let _ = writeln!(
            self.out,
            "  range {}..{}  cells [{}]",
            range.start,
            range.end,
            cells.join(" ")
        );
        let key_text: Vec<String> = (0..range.len())
            .map(|j| match self.cache.cell(range.start + j) {
                Some(_) => number(keys[j * row]),
                None => ".".into(),
            })
            .collect();
        let _ = writeln!(self.out, "  keys  {}", key_text.join(" "));
        let rows = grid(&view.mask);
        let seen = sees(&self.cache, &self.tokens);
        for (i, row) in rows.iter().enumerate() {
            let spaced: Vec<String> = row.chars().map(String::from).collect();
            match self.tokens.get(i) {
                Some(&(s, p)) => {
                    let label = format!("s{s}p{p}");
                    let _ = writeln!(
                        self.out,
                        "  {label:<7} {}   sees {}",
                        spaced.join(" "),
                        seen_text(&seen[i])
                    );
                }
                None => {
                    let _ = writeln!(self.out, "  {:<7} {}", "pad", spaced.join(" "));
                }
            }
        }
    }

    fn describe_sequences(&mut self) {
        for seq in 0..self.setup.config.max_sequences {
            let held = self.cache.positions(seq);
            if held.is_empty() {
                continue;
            }
            let items: Vec<String> = held
                .iter()
                .map(|&(p, cell)| {
                    let data = self.cache.read_cell(0, cell).expect("stored");
                    let (k, v) = (data.keys[0], data.values[0]);
                    let kv = if k == v {
                        number(k)
                    } else {
                        format!("{}/{}", number(k), number(v))
                    };
                    format!("{p}={kv}@{cell}")
                })
                .collect();
            let _ = writeln!(self.out, "  s{seq}: {}", items.join(" "));
        }
        let _ = writeln!(self.out, "  used {}", self.cache.used_cells());
    }

    fn expect(&mut self, words: &[&str]) -> Result<(), String> {
        match words[0] {
            "mask" => {
                let view = self.cache.get().map_err(|e| e.to_string())?;
                let got = grid(&view.mask).join("/");
                if got != words[1] {
                    return Err(format!("mask {got}, expected {}", words[1]));
                }
            }
            "keys" => {
                let view = self.cache.get().map_err(|e| e.to_string())?;
                let keys = super::host(&view.keys);
                let row = keys.len() / view.keys.dims()[0];
                let got: Vec<String> = keys.iter().step_by(row).map(|&k| number(k)).collect();
                if got != words[1..] {
                    return Err(format!("keys {got:?}, expected {:?}", &words[1..]));
                }
            }
            "cells" => {
                let got: Vec<String> = self.cache.pass_cells().iter().map(|c| c.to_string()).collect();
                if got != words[1..] {
                    return Err(format!("cells {got:?}, expected {:?}", &words[1..]));
                }
            }
            "range" => {
                let r = self.cache.pass_range().ok_or("no pass")?;
                let got = format!("{}..{}", r.start, r.end);
                if got != words[1] {
                    return Err(format!("range {got}, expected {}", words[1]));
                }
            }
            "sees" => {
                let label = words[1].trim_end_matches(':');
                let i = self
                    .tokens
                    .iter()
                    .position(|&(s, p)| format!("s{s}p{p}") == label)
                    .ok_or(format!("no token {label} in the pass"))?;
                let got = seen_text(&sees(&self.cache, &self.tokens)[i]);
                let want = words[2..].join(" ");
                if got != want {
                    return Err(format!("{label} sees [{got}], expected [{want}]"));
                }
            }
            "resume" => {
                let seq: SeqId = words[1].parse().map_err(|_| "bad seq")?;
                let pos: Pos = words[2].parse().map_err(|_| "bad pos")?;
                let want: bool = words[3].parse().map_err(|_| "bad bool")?;
                if self.cache.can_resume(seq, pos) != want {
                    return Err(format!("can_resume({seq}, {pos}) should be {want}"));
                }
            }
            "used" => {
                let want: usize = words[1].parse().map_err(|_| "bad count")?;
                if self.cache.used_cells() != want {
                    return Err(format!("{} used cells, expected {want}", self.cache.used_cells()));
                }
            }
            other => return Err(format!("unknown expectation {other}")),
        }
        Ok(())
    }
}

/// Runs one scenario text; returns its transcript or the first failed expectation.
pub fn run(text: &str, dtype: DType, layout: VLayout, device: &Device) -> Result<String, String> {
    let mut runner: Option<Runner> = None;
    let mut done = String::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |m: String| format!("line {}: {m}", n + 1);
        let words: Vec<&str> = line.split_whitespace().collect();
        if words[0] == "config" {
            let setup = parse_config(&words[1..], dtype, layout).map_err(at)?;
            let shift = setup.shift.then(add_shift);
            let cache = CausalKvCache::new(setup.config.clone(), device.clone(), shift)
                .map_err(|e| at(e.to_string()))?;
            if let Some(previous) = runner.take() {
                done.push_str(&previous.out);
            }
            let mut out = String::new();
            let _ = writeln!(out, "{line}");
            runner = Some(Runner {
                setup,
                cache,
                device,
                tokens: vec![],
                out,
            });
            continue;
        }
        let r = runner
            .as_mut()
            .ok_or_else(|| at("the first step must be `config`".into()))?;
        if words[0] == "expect" {
            r.expect(&words[1..]).map_err(at)?;
            continue;
        }
        if words[0] == "fail" {
            let (head, step) = line.split_once(':').ok_or_else(|| at("fail NAME: step".into()))?;
            let want = head.trim_start_matches("fail").trim();
            let before = r.cache.picture().map_err(|e| at(e.to_string()))?;
            match r.step(step.trim()) {
                Ok(()) => return Err(at(format!("`{}` should fail with {want}", step.trim()))),
                Err(e) if error_name(&e) == want => {
                    let _ = writeln!(r.out, "{line}\n  -> {e}");
                }
                Err(e) => return Err(at(format!("failed with {e}, expected {want}"))),
            }
            r.cache.check();
            if r.cache.picture().map_err(|e| at(e.to_string()))? != before {
                return Err(at("a rejected step changed the cache".into()));
            }
            continue;
        }
        let _ = writeln!(r.out, "{line}");
        r.step(line).map_err(|e| at(e.to_string()))?;
    }
    done.push_str(&runner.ok_or("empty scenario")?.out);
    Ok(done)
}
