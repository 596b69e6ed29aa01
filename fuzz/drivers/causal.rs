//! Causal-cache operation sequences from arbitrary bytes.
//!
//! The bytes choose a configuration (sometimes an invalid one), a key-shift
//! function (sometimes a misbehaving one) and a list of operations in any order:
//! forward passes over arbitrary batches (out-of-range sequences, negative,
//! repeated or huge positions, oversized, reserve mode), `set_layer`, `put` with
//! right and wrong shapes and dtypes, `get`, `set_causal`, `remove`,
//! `copy_prefix`, `can_resume` and `configure`.
//!
//! After every operation: no panic, [`CausalKvCache::check`] passes, a rejected
//! call left [`CausalKvCache::state`] identical, and an accepted one did what it
//! says (tokens land in cells of their sequence and see themselves, `put` stores
//! exactly the given keys, `remove` and `copy_prefix` leave exactly the expected
//! positions).
#![allow(dead_code)]

use candle_core::{DType as CandleDType, Device, Tensor};
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, DType, ForwardMode, KeyShift, Placement, Pos, PosRange,
    Result, SeqId, SlidingWindow, VLayout,
};
use kvcache_causal::CausalKvCache;

use super::input::Input;

/// What the key-shift function does when a removal moves positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShiftKind {
    /// The cache has no shift function: shifting removals are `NotSupported`.
    None,
    /// Adds each cell's shift to its keys.
    Add,
    /// Fails with a backend error on layer 1 (after layer 0 succeeded).
    Fails,
    /// Returns one row too few.
    WrongShape,
    /// Returns keys of another dtype.
    WrongDType,
    /// Returns its input unchanged.
    Identity,
    /// Returns a new view of the cache's own storage.
    Alias,
}

/// The cache under test.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Its configuration (possibly invalid).
    pub config: CausalConfig,
    /// Its key-shift function.
    pub shift: ShiftKind,
    /// Key/value heads of well-formed `put`s.
    pub heads: usize,
    /// Key width of well-formed `put`s.
    pub dim: usize,
    /// Value width of well-formed `put`s.
    pub dim_v: usize,
}

/// A position in a generated batch, resolved when the operation runs.
#[derive(Debug, Clone, Copy)]
pub enum PosSpec {
    /// `k` past the sequence's next position.
    Next(u8),
    /// Exactly this position.
    Abs(Pos),
}

/// One call on the cache.
#[derive(Debug, Clone)]
pub enum Op {
    /// `start_forward` over these tokens (the batch may be malformed).
    Forward {
        /// `(sequence, position)` per token.
        tokens: Vec<(SeqId, PosSpec)>,
        /// Reserve mode instead of compute.
        reserve: bool,
    },
    /// `set_layer`.
    SetLayer(usize),
    /// `put` of `batch_delta`-adjusted length with these shape/dtype defects.
    Put {
        /// Added to the pass's token count (0 for a well-formed put).
        batch_delta: i8,
        /// Added to the heads.
        heads_delta: u8,
        /// Added to the value width.
        dim_v_delta: u8,
        /// Keys in a dtype other than the cache's.
        wrong_dtype: bool,
    },
    /// `get`.
    Get,
    /// `set_causal` with these batch indices.
    SetCausal(Vec<usize>),
    /// `remove(seq, start..end)` or `start..`.
    Remove {
        /// Sequence.
        seq: SeqId,
        /// First position removed.
        start: Pos,
        /// One past the last, or to the end.
        end: Option<Pos>,
    },
    /// `copy_prefix(src, dst, len)`.
    CopyPrefix {
        /// Source sequence.
        src: SeqId,
        /// Destination sequence.
        dst: SeqId,
        /// Prefix length.
        len: Pos,
    },
    /// `can_resume(seq, pos)`.
    CanResume {
        /// Sequence.
        seq: SeqId,
        /// Position.
        pos: Pos,
    },
    /// `configure` with this configuration (possibly invalid).
    Configure(CausalConfig),
}

/// A configuration; about one in five is invalid in one field.
fn config(input: &mut Input) -> CausalConfig {
    let seqs = input.pick(&[1, 2, 3, 4, 4, 66]);
    let capacity = input.range(1, 24);
    let batch = input.range(1, 8);
    let mut config = CausalConfig::new(seqs, capacity, batch);
    match input.below(16) {
        0..=7 => {}
        8..=11 => config = config.with_window(SlidingWindow::new(input.range(1, 8))),
        12..=14 => {
            let w = input.range(1, 8);
            config = config.with_window(SlidingWindow::with_memory(w, w + input.below(5)));
        }
        // Invalid windows: zero, or memory below the window.
        _ => config = config.with_window(SlidingWindow::with_memory(input.below(4), input.below(4))),
    }
    if input.chance(25) {
        config = config.with_chunk_size(input.below(6).max(usize::from(input.chance(80))));
        // 0 is invalid
    }
    config = config
        .with_placement(input.pick(&[Placement::Scattered, Placement::Contiguous]))
        .with_v_layout(input.pick(&[VLayout::Normal, VLayout::Permuted]))
        .with_dtype(input.pick(&[DType::F32, DType::F16, DType::BF16]))
        .with_mask_dtype(input.pick(&[DType::F32, DType::F16, DType::BF16]));
    match input.below(16) {
        0..=9 => {}
        10..=14 => config = config.with_compact_threshold(Some(f32::from(input.u8()) / 255.0)),
        _ => config = config.with_compact_threshold(Some(input.pick(&[-0.5, 1.5, f32::NAN]))),
    }
    if input.chance(30) {
        let invalid = input.chance(10);
        let (b, c) = (input.range(1, 3), input.range(1, 4));
        // 0 is invalid.
        config = config.with_padding(b * usize::from(!invalid), c);
        if invalid && input.chance(50) {
            config = config.with_padding(b, 0);
        }
    }
    config
}

fn seq(input: &mut Input, seqs: usize) -> SeqId {
    match input.below(16) {
        15 => seqs + input.below(3),
        14 => usize::MAX,
        _ => input.below(seqs.min(8)) * seqs.div_ceil(8).max(1) % seqs,
    }
}

fn pos(input: &mut Input) -> Pos {
    match input.below(10) {
        0 => input.pick(&[-1, Pos::MIN, Pos::MAX, Pos::MAX - 1, 1 << 20]),
        _ => Pos::from(input.u8() % 40),
    }
}

fn op(input: &mut Input, seqs: usize) -> Op {
    match input.below(20) {
        0..=6 => {
            let n = match input.below(10) {
                0 => 0,
                1 => input.range(9, 12),
                _ => input.range(1, 4),
            };
            let tokens = (0..n)
                .map(|_| {
                    let s = seq(input, seqs);
                    let p = if input.chance(85) {
                        PosSpec::Next(input.below(3) as u8 * u8::from(input.chance(20)))
                    } else {
                        PosSpec::Abs(pos(input))
                    };
                    (s, p)
                })
                .collect();
            Op::Forward {
                tokens,
                reserve: input.chance(8),
            }
        }
        7 => Op::SetLayer(if input.chance(5) {
            usize::MAX
        } else {
            input.below(4)
        }),
        8..=11 => {
            let defect = input.chance(15);
            Op::Put {
                batch_delta: if defect { input.pick(&[-1, 1, 0, 0]) } else { 0 },
                heads_delta: if defect { input.below(2) as u8 } else { 0 },
                dim_v_delta: if defect { input.below(2) as u8 } else { 0 },
                wrong_dtype: defect && input.chance(30),
            }
        }
        12 => Op::Get,
        13 => Op::SetCausal((0..input.below(3)).map(|_| input.below(10)).collect()),
        14 | 15 => {
            let seq = seq(input, seqs);
            let start = pos(input);
            let end = match input.below(3) {
                0 => None,
                1 => Some(pos(input)),
                _ => Some(start.saturating_add(Pos::from(input.below(4) as u8))),
            };
            Op::Remove { seq, start, end }
        }
        16 | 17 => Op::CopyPrefix {
            src: seq(input, seqs),
            dst: seq(input, seqs),
            len: pos(input),
        },
        18 => Op::CanResume {
            seq: seq(input, seqs),
            pos: pos(input),
        },
        _ => Op::Configure(config(input)),
    }
}

/// Decodes a case from fuzz bytes.
pub fn decode(bytes: &[u8]) -> (Setup, Vec<Op>) {
    let mut input = Input::new(bytes);
    let setup = Setup {
        config: config(&mut input),
        shift: input.pick(&[
            ShiftKind::None,
            ShiftKind::Add,
            ShiftKind::Add,
            ShiftKind::Fails,
            ShiftKind::WrongShape,
            ShiftKind::WrongDType,
            ShiftKind::Identity,
            ShiftKind::Alias,
        ]),
        heads: input.range(1, 2),
        dim: input.range(1, 3),
        dim_v: input.range(1, 3),
    };
    let seqs = setup.config.max_sequences;
    let mut ops = Vec::new();
    while !input.is_empty() && ops.len() < 256 {
        ops.push(op(&mut input, seqs));
    }
    (setup, ops)
}

fn candle(dtype: DType) -> CandleDType {
    match dtype {
        DType::F32 => CandleDType::F32,
        DType::F16 => CandleDType::F16,
        DType::BF16 => CandleDType::BF16,
    }
}

fn err(e: candle_core::Error) -> CacheError {
    CacheError::backend(e)
}

fn shift_fn(kind: ShiftKind) -> Option<Box<dyn KeyShift<Tensor>>> {
    let f: Box<dyn KeyShift<Tensor>> = match kind {
        ShiftKind::None => return None,
        ShiftKind::Add => Box::new(|_: usize, keys: &Tensor, shifts: &[Pos]| -> Result<Tensor> {
            let deltas: Vec<f32> = shifts.iter().map(|&s| s as f32).collect();
            Tensor::from_vec(deltas, (shifts.len(), 1, 1), keys.device())
                .and_then(|d| d.to_dtype(keys.dtype()))
                .and_then(|d| keys.broadcast_add(&d))
                .map_err(err)
        }),
        ShiftKind::Fails => Box::new(|layer: usize, keys: &Tensor, _: &[Pos]| -> Result<Tensor> {
            if layer == 1 {
                Err(CacheError::Backend("injected shift failure".into()))
            } else {
                (keys + 1.0).map_err(err)
            }
        }),
        ShiftKind::WrongShape => Box::new(|_: usize, keys: &Tensor, _: &[Pos]| -> Result<Tensor> {
            let n = keys.dim(0).map_err(err)?;
            if n > 1 {
                keys.narrow(0, 0, n - 1).map_err(err)
            } else {
                Tensor::cat(&[keys, keys], 0).map_err(err)
            }
        }),
        ShiftKind::WrongDType => Box::new(|_: usize, keys: &Tensor, _: &[Pos]| -> Result<Tensor> {
            let other = if keys.dtype() == CandleDType::F32 {
                CandleDType::F16
            } else {
                CandleDType::F32
            };
            keys.to_dtype(other).map_err(err)
        }),
        ShiftKind::Identity => Box::new(|_: usize, keys: &Tensor, _: &[Pos]| Ok(keys.clone())),
        ShiftKind::Alias => Box::new(|_: usize, keys: &Tensor, _: &[Pos]| -> Result<Tensor> {
            let n = keys.dim(0).map_err(err)?;
            keys.narrow(0, 0, n).map_err(err)
        }),
    };
    Some(f)
}

/// Statistics of one run, for reporting.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    /// Operations accepted.
    pub accepted: usize,
    /// Operations rejected with a typed error (state verified unchanged).
    pub rejected: usize,
    /// Batches whose construction was rejected (`Batch::from_tokens`).
    pub bad_batches: usize,
}

struct Run {
    cache: CausalKvCache,
    setup: Setup,
    /// Tokens of the compute pass in progress, as the cache accepted them.
    pass: Option<(Vec<(SeqId, Pos)>, bool)>,
    puts: usize,
}

impl Run {
    fn next_pos(&self, seq: SeqId) -> Pos {
        self.cache
            .positions(seq)
            .last()
            .map_or(0, |&(p, _)| p.saturating_add(1))
    }

    /// The pass in progress as the cache sees it (a metadata change ends it).
    fn live_pass(&self) -> Option<usize> {
        self.cache
            .pass_range()
            .map(|_| self.pass.as_ref().map_or(0, |p| p.0.len()))
    }

    /// `[n, heads, dim]`, token `i` filled with `sign * (base + i)`.
    fn kv(&self, n: usize, heads: usize, dim: usize, dtype: DType, base: f32, sign: f32) -> Result<Tensor> {
        let data: Vec<f32> = (0..n)
            .flat_map(|i| std::iter::repeat_n(sign * (base + i as f32), heads * dim))
            .collect();
        Tensor::from_vec(data, (n, heads, dim), &Device::Cpu)
            .and_then(|t| t.to_dtype(candle(dtype)))
            .map_err(CacheError::backend)
    }

    /// Runs `op`; returns its outcome.
    fn apply(&mut self, op: &Op, tally: &mut Tally) -> Result<()> {
        match op {
            Op::Forward { tokens, reserve } => {
                let resolved: Vec<(SeqId, Pos)> = tokens
                    .iter()
                    .map(|&(seq, p)| {
                        let pos = match p {
                            PosSpec::Next(k) => self.next_pos(seq).saturating_add(Pos::from(k)),
                            PosSpec::Abs(pos) => pos,
                        };
                        (seq, pos)
                    })
                    .collect();
                // Tokens of one sequence in one pass take consecutive positions.
                let mut seen: Vec<(SeqId, Pos)> = Vec::new();
                let resolved: Vec<(SeqId, Pos)> = resolved
                    .into_iter()
                    .map(|(seq, pos)| {
                        let bump = seen.iter().filter(|t| t.0 == seq && t.1 == pos).count() as Pos;
                        let t = (seq, pos.saturating_add(bump));
                        seen.push((seq, pos));
                        t
                    })
                    .collect();
                let batch = match Batch::from_tokens(resolved.iter().copied()) {
                    Ok(b) => b,
                    Err(e) => {
                        assert!(matches!(e, CacheError::InvalidBatch(_)), "batch error {e:?}");
                        tally.bad_batches += 1;
                        return Err(e);
                    }
                };
                let mode = if *reserve {
                    ForwardMode::Reserve
                } else {
                    ForwardMode::Compute
                };
                self.cache.start_forward(&batch, mode)?;
                self.pass = Some((resolved, *reserve));
                self.verify_pass(&batch, *reserve);
                Ok(())
            }
            Op::SetLayer(layer) => {
                self.cache.set_layer(*layer);
                assert_eq!(self.cache.layer(), *layer);
                Ok(())
            }
            Op::Put {
                batch_delta,
                heads_delta,
                dim_v_delta,
                wrong_dtype,
            } => {
                let n = self.live_pass().unwrap_or(1);
                let n = (n as i64 + i64::from(*batch_delta)).max(0) as usize;
                let dtype = self.cache.config().dtype;
                let key_dtype = match (*wrong_dtype, dtype) {
                    (false, d) => d,
                    (true, DType::F32) => DType::BF16,
                    (true, _) => DType::F32,
                };
                self.puts += 1;
                let base = 1.0 + 10.0 * (self.puts % 8) as f32;
                let heads = self.setup.heads + usize::from(*heads_delta);
                let keys = self.kv(n, heads, self.setup.dim, key_dtype, base, 1.0)?;
                let values = self.kv(
                    n,
                    heads,
                    self.setup.dim_v + usize::from(*dim_v_delta),
                    dtype,
                    base,
                    -1.0,
                )?;
                self.cache.put(&keys, &values)?;
                if let Some((tokens, false)) = &self.pass {
                    assert_eq!(
                        n,
                        tokens.len(),
                        "put of {n} tokens accepted for a pass of {}",
                        tokens.len()
                    );
                    for (i, &cell) in self.cache.pass_cells().iter().enumerate() {
                        let data = self.cache.read_cell(self.cache.layer(), cell as usize).unwrap();
                        let want = base + i as f32;
                        assert!(
                            data.keys.iter().all(|&k| k == want) && data.values.iter().all(|&v| v == -want),
                            "token {i} in cell {cell}: stored {data:?}, put {want}"
                        );
                    }
                }
                Ok(())
            }
            Op::Get => {
                let view = self.cache.get()?;
                let range = self.cache.pass_range().expect("get succeeded mid-pass");
                assert_eq!(view.keys.dims()[0], range.len(), "keys view rows");
                assert_eq!(view.mask.dims()[1], range.len(), "mask columns");
                Ok(())
            }
            Op::SetCausal(except) => self.cache.set_causal(except),
            Op::Remove { seq, start, end } => {
                let range = PosRange {
                    start: *start,
                    end: *end,
                };
                let before = self.cache.positions(*seq);
                self.cache.remove(*seq, range)?;
                let expected: Vec<Pos> = before
                    .iter()
                    .filter(|&&(p, _)| !range.contains(p))
                    .map(|&(p, _)| match range.end {
                        Some(e) if p >= e => p + range.shift(),
                        _ => p,
                    })
                    .collect();
                let after: Vec<Pos> = self.cache.positions(*seq).iter().map(|t| t.0).collect();
                assert_eq!(after, expected, "positions of {seq} after remove({range:?})");
                self.pass = None;
                Ok(())
            }
            Op::CopyPrefix { src, dst, len } => {
                let source = self.cache.positions(*src);
                self.cache.copy_prefix(*src, *dst, *len)?;
                let expected: Vec<(Pos, usize)> = source.into_iter().filter(|t| t.0 < *len).collect();
                assert_eq!(
                    self.cache.positions(*dst),
                    expected,
                    "copy_prefix({src}, {dst}, {len})"
                );
                self.pass = None;
                Ok(())
            }
            Op::CanResume { seq, pos } => {
                let can = self.cache.can_resume(*seq, *pos);
                if self.cache.config().effective_memory().is_none() {
                    assert!(can, "can_resume({seq}, {pos}) false without a bounded memory");
                }
                Ok(())
            }
            Op::Configure(config) => {
                self.cache.configure(config.clone())?;
                assert_eq!(self.cache.config(), config);
                assert_eq!(self.cache.used_cells(), 0);
                self.pass = None;
                Ok(())
            }
        }
    }

    /// After an accepted `start_forward`: every token sits in its own cell of its
    /// sequence at its position and sees itself; padding rows see nothing.
    fn verify_pass(&self, batch: &Batch, reserve: bool) {
        let state = self.cache.picture().unwrap();
        let pass = state.pass.as_ref().expect("a pass in progress");
        let cols = pass.range.len();
        let rows = pass.mask.len().checked_div(cols).unwrap_or(0);
        assert!(rows >= batch.len(), "{rows} mask rows for {} tokens", batch.len());
        if reserve {
            assert!(pass.cells.is_empty());
            assert!(
                pass.mask.iter().all(|&m| m == f32::NEG_INFINITY),
                "reserve mask not fully masked"
            );
            return;
        }
        assert_eq!(pass.cells.len(), batch.len());
        let mut cells = pass.cells.clone();
        cells.sort_unstable();
        cells.dedup();
        assert_eq!(cells.len(), batch.len(), "two tokens share a cell");
        for (i, (seq, pos)) in batch.tokens().enumerate() {
            let cell = pass.cells[i];
            let info = self.cache.cell(cell).expect("a placed token's cell is used");
            assert_eq!(info.pos, pos, "token {i}'s cell {cell} position");
            assert_eq!(info.sequences, vec![seq], "token {i}'s cell {cell} sequences");
            assert!(
                pass.range.contains(&cell),
                "token {i}'s cell {cell} outside {:?}",
                pass.range
            );
            assert_eq!(
                pass.mask[i * cols + cell - pass.range.start],
                0.0,
                "token {i} does not see itself"
            );
        }
        for row in batch.len()..rows {
            assert!(
                pass.mask[row * cols..(row + 1) * cols]
                    .iter()
                    .all(|&m| m == f32::NEG_INFINITY),
                "padding row {row} sees something"
            );
        }
    }
}

/// Runs a decoded case, panicking on any violation.
pub fn run(setup: &Setup, ops: &[Op]) -> Tally {
    let mut tally = Tally::default();
    let cache = match CausalKvCache::new(setup.config.clone(), Device::Cpu, shift_fn(setup.shift)) {
        Ok(cache) => cache,
        Err(e) => {
            assert!(
                matches!(e, CacheError::InvalidArgument(_)),
                "bad config gave {e:?}"
            );
            assert!(
                setup.config.validate().is_err(),
                "a valid config was refused: {e}"
            );
            return tally;
        }
    };
    let mut run = Run {
        cache,
        setup: setup.clone(),
        pass: None,
        puts: 0,
    };
    for op in ops {
        let before = run.cache.picture().expect("picture");
        match run.apply(op, &mut tally) {
            Ok(()) => tally.accepted += 1,
            Err(e) => {
                tally.rejected += 1;
                run.cache.check();
                let after = run.cache.picture().expect("picture");
                assert!(after == before, "{op:?} was rejected ({e}) but changed the cache");
            }
        }
        run.cache.check();
    }
    tally
}

/// Decodes and runs fuzz bytes (the cargo-fuzz entry point).
pub fn fuzz(bytes: &[u8]) -> Tally {
    let (setup, ops) = decode(bytes);
    run(&setup, &ops)
}
