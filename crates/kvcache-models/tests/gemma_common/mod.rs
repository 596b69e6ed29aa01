//! Shared by the Gemma tests: a reference that computes every pass's attention
//! from scratch over plain per-sequence lists, and one conversation schedule
//! (long prefill, decode, a fork behind the end, a branch switch, an eviction,
//! a context shift) run through a `LayerGroupCache` and the reference side by side.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, IndexOp, Tensor};
use kvcache_api::{Batch, CausalCache, ForwardMode, Pos, PosRange, SeqId, VLayout};
use kvcache_causal::LayerGroupCache;
use kvcache_models::gemma::{causal_mask, Attend, Gemma};
use kvcache_models::BatchToken;

#[path = "../common/testing.rs"]
pub mod testing;

/// One sequence of the reference: positions and, per layer, the roped keys
/// and the values of every position, `[len, kv_heads, head_dim]`.
#[derive(Debug, Clone, Default)]
struct RefSeq {
    tokens: Vec<u32>,
    positions: Vec<Pos>,
    keys: Vec<Option<Tensor>>,
    values: Vec<Option<Tensor>>,
}

impl RefSeq {
    /// The first `len` entries.
    fn prefix(&self, len: usize) -> RefSeq {
        let cut = |t: &Option<Tensor>| t.as_ref().map(|t| t.narrow(0, 0, len).unwrap());
        RefSeq {
            tokens: self.tokens[..len].to_vec(),
            positions: self.positions[..len].to_vec(),
            keys: self.keys.iter().map(cut).collect(),
            values: self.values.iter().map(cut).collect(),
        }
    }
}

/// The from-scratch reference: no cells, no windows kept, no masks kept; each
/// pass builds its masks from positions (window layers see the last `window`).
pub struct Reference<'m> {
    model: &'m Gemma,
    seqs: HashMap<SeqId, RefSeq>,
}

impl<'m> Reference<'m> {
    pub fn new(model: &'m Gemma) -> Self {
        Reference {
            model,
            seqs: HashMap::new(),
        }
    }

    pub fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.tokens.len())
    }

    pub fn tokens(&self, seq: SeqId) -> Vec<u32> {
        self.seqs.get(&seq).map_or(Vec::new(), |s| s.tokens.clone())
    }

    /// Hidden states `[n, dim]` of `tokens` appended to `seq`.
    pub fn step(&mut self, seq: SeqId, tokens: &[u32]) -> Tensor {
        let model = self.model;
        let layers = model.config().n_layers;
        let s = self.seqs.entry(seq).or_insert_with(|| RefSeq {
            keys: vec![None; layers],
            values: vec![None; layers],
            ..RefSeq::default()
        });
        let start = s.positions.last().map_or(0, |p| p + 1);
        let new: Vec<Pos> = (start..start + tokens.len() as Pos).collect();
        let mut all = s.positions.clone();
        all.extend(&new);
        let device = model.device().clone();
        let hidden = model
            .hidden_with(tokens, &new, &mut |layer, k, v| {
                let cat = |old: &Option<Tensor>, t: &Tensor| match old {
                    Some(old) => Tensor::cat(&[old, t], 0),
                    None => Ok(t.clone()),
                };
                let keys = cat(&s.keys[layer], k)?;
                let values = cat(&s.values[layer], v)?;
                s.keys[layer] = Some(keys.clone());
                s.values[layer] = Some(values.clone());
                let mask = causal_mask(&new, &all, model.config().window_of(layer), &device)?;
                Ok(Attend {
                    keys,
                    values,
                    mask,
                    permuted: false,
                })
            })
            .unwrap();
        s.tokens.extend_from_slice(tokens);
        s.positions = all;
        hidden
    }

    /// Starts a teacher-forced pass of `tokens` appended to `seq`: the tokens
    /// and positions now, each layer's keys and values by [`append`](Self::append).
    pub fn extend(&mut self, seq: SeqId, tokens: &[u32]) {
        let layers = self.model.config().n_layers;
        let s = self.seqs.entry(seq).or_insert_with(|| RefSeq {
            keys: vec![None; layers],
            values: vec![None; layers],
            ..RefSeq::default()
        });
        let start = s.tokens.len() as Pos;
        s.positions.extend(start..start + tokens.len() as Pos);
        s.tokens.extend_from_slice(tokens);
    }

    /// Appends roped keys and values `[n, kv_heads, head_dim]` to `seq`'s lists of `layer`.
    pub fn append(&mut self, seq: SeqId, layer: usize, k: &Tensor, v: &Tensor) {
        let s = self.seqs.get_mut(&seq).expect("extend before append");
        let cat = |old: &Option<Tensor>, t: &Tensor| match old {
            Some(old) => Tensor::cat(&[old, t], 0).unwrap(),
            None => t.clone(),
        };
        s.keys[layer] = Some(cat(&s.keys[layer], k));
        s.values[layer] = Some(cat(&s.values[layer], v));
    }

    /// Keys and values `[len, kv_heads, head_dim]` of `seq` in `layer`.
    pub fn lists(&self, seq: SeqId, layer: usize) -> (Tensor, Tensor) {
        let s = &self.seqs[&seq];
        (
            s.keys[layer].clone().expect("keys"),
            s.values[layer].clone().expect("values"),
        )
    }

    pub fn copy_prefix(&mut self, src: SeqId, dst: SeqId, len: usize) {
        let prefix = self.seqs[&src].prefix(len);
        self.seqs.insert(dst, prefix);
    }

    pub fn truncate(&mut self, seq: SeqId, len: usize) {
        let prefix = self.seqs[&seq].prefix(len);
        self.seqs.insert(seq, prefix);
    }

    pub fn leave(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }

    /// Removes positions `start..start + n`; later keys move down by `n`
    /// positions (re-rotated with the model's own RoPE), values stay.
    pub fn shift(&mut self, seq: SeqId, start: usize, n: usize) {
        let model = self.model;
        let s = self.seqs.get_mut(&seq).unwrap();
        let len = s.tokens.len();
        let tail = len - start - n;
        let back = vec![-(n as Pos); tail];
        for layer in 0..s.keys.len() {
            let k = s.keys[layer].as_ref().unwrap();
            let moved = model
                .rope(layer, &k.narrow(0, start + n, tail).unwrap(), &back)
                .unwrap();
            s.keys[layer] = Some(Tensor::cat(&[&k.narrow(0, 0, start).unwrap(), &moved], 0).unwrap());
            let v = s.values[layer].as_ref().unwrap();
            let kept = [
                v.narrow(0, 0, start).unwrap(),
                v.narrow(0, start + n, tail).unwrap(),
            ];
            s.values[layer] = Some(Tensor::cat(&kept, 0).unwrap());
        }
        s.tokens.drain(start..start + n);
        s.positions = (0..(len - n) as Pos).collect();
    }
}

/// The columns of one sequence's cells that some query of a pass sees.
struct Seen {
    /// By column: already in `seen`.
    taken: Vec<bool>,
    /// (position, column), in the order first seen.
    seen: Vec<(Pos, u32)>,
}

/// Largest absolute difference between two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    testing::max_abs_diff(a, b)
}

/// The cache and the reference driven together; logits compared on some rows.
pub struct Pair<'m> {
    pub model: &'m Gemma,
    pub cache: LayerGroupCache,
    pub reference: Reference<'m>,
    /// Rows compared: the last of each sequence in each pass, and every
    /// `row_stride`-th row.
    pub row_stride: usize,
    pub max_diff: f32,
    pub rows: usize,
    /// Teacher-forced (see [`Pair::teacher_forced`]): each layer's view is
    /// compared instead of the logits.
    pub forced: Option<ViewStats>,
}

/// What the teacher-forced comparison of the views found.
#[derive(Debug, Clone, Copy, Default)]
pub struct ViewStats {
    /// Largest difference between a visible cached key and the reference's
    /// key of the same position (0 until a context shift re-rotates keys).
    pub key_diff: f32,
    /// Largest difference between a visible cached value and the reference's.
    pub value_diff: f32,
    /// (layer, query) views compared, each position by position.
    pub views: usize,
    /// Keys and values compared.
    pub cells: usize,
}

impl<'m> Pair<'m> {
    pub fn new(model: &'m Gemma, cache: LayerGroupCache, row_stride: usize) -> Self {
        Pair {
            model,
            cache,
            reference: Reference::new(model),
            row_stride,
            max_diff: 0.0,
            rows: 0,
            forced: None,
        }
    }

    /// The cache and the reference driven along one trajectory: every pass
    /// runs the model once, through the cache, and at every layer the
    /// reference appends the same keys and values (the same layer input
    /// through the same weights) and the cache's view is checked against it:
    /// each query sees exactly the positions the from-scratch rule gives it
    /// (window or causal), holding the reference's keys and values. The
    /// logits are not compared (see the quantized test for why).
    pub fn teacher_forced(model: &'m Gemma, cache: LayerGroupCache) -> Self {
        Pair {
            forced: Some(ViewStats::default()),
            ..Pair::new(model, cache, usize::MAX)
        }
    }

    /// One forward pass: `parts` are `(seq, tokens)`, interleaved round-robin.
    pub fn pass(&mut self, parts: &[(SeqId, &[u32])]) {
        let mut batch = Vec::new();
        let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); parts.len()];
        let longest = parts.iter().map(|p| p.1.len()).max().unwrap_or(0);
        for i in 0..longest {
            for (k, &(seq, tokens)) in parts.iter().enumerate() {
                if let Some(&token) = tokens.get(i) {
                    let pos = (self.reference.len(seq) + i) as Pos;
                    rows_of[k].push(batch.len());
                    batch.push(BatchToken { seq, pos, token });
                }
            }
        }
        if self.forced.is_some() {
            self.forced_pass(parts, &batch, &rows_of);
            return;
        }
        let cached = self.model.hidden(&batch, &mut self.cache).unwrap();
        self.cache.check();
        for (k, &(seq, tokens)) in parts.iter().enumerate() {
            let reference = self.reference.step(seq, tokens);
            let n = tokens.len();
            let picked: Vec<usize> = (0..n)
                .filter(|&i| i + 1 == n || i % self.row_stride == 0)
                .collect();
            let cached_rows: Vec<u32> = picked.iter().map(|&i| rows_of[k][i] as u32).collect();
            let index = |rows: &[u32]| Tensor::new(rows, cached.device()).unwrap();
            let ours = self
                .model
                .logits(&cached.index_select(&index(&cached_rows), 0).unwrap())
                .unwrap();
            let picked32: Vec<u32> = picked.iter().map(|&i| i as u32).collect();
            let theirs = self
                .model
                .logits(&reference.index_select(&index(&picked32), 0).unwrap())
                .unwrap();
            self.max_diff = self.max_diff.max(max_abs_diff(&ours, &theirs));
            self.rows += picked.len();
        }
    }

    /// One teacher-forced pass (see [`teacher_forced`](Self::teacher_forced)):
    /// `rows_of[k]` are the batch rows of `parts[k]`.
    fn forced_pass(&mut self, parts: &[(SeqId, &[u32])], batch: &[BatchToken], rows_of: &[Vec<usize>]) {
        let model = self.model;
        let (cache, reference) = (&mut self.cache, &mut self.reference);
        let mut stats = self.forced.expect("a teacher-forced pair");
        for &(seq, tokens) in parts {
            reference.extend(seq, tokens);
        }
        let b = Batch::from_tokens(batch.iter().map(|t| (t.seq, t.pos))).unwrap();
        let tokens: Vec<u32> = batch.iter().map(|t| t.token).collect();
        let n = tokens.len();
        cache.start_forward(&b, ForwardMode::Compute).unwrap();
        let device = model.device().clone();
        model
            .hidden_with(&tokens, b.positions(), &mut |layer, k, v| {
                cache.set_layer(layer);
                let permuted = cache.config().v_layout == VLayout::Permuted;
                cache.put(k, v)?;
                let view = cache.get()?;
                let keys = view.keys.to_dtype(DType::F32)?;
                let values = view.values.to_dtype(DType::F32)?;
                let mask = view.mask.narrow(0, 0, n)?.to_dtype(DType::F32)?;
                // The reference's lists grow by this pass's rows of each sequence.
                for (part, &(seq, _)) in parts.iter().enumerate() {
                    let rows: Vec<u32> = rows_of[part].iter().map(|&r| r as u32).collect();
                    let rows = Tensor::new(rows.as_slice(), &device)?;
                    reference.append(seq, layer, &k.index_select(&rows, 0)?, &v.index_select(&rows, 0)?);
                }
                let group = &cache.groups()[usize::from(model.config().is_global(layer))];
                let first_cell = group.pass_range().expect("a pass in progress").start;
                let cell_values = if permuted {
                    values.permute((2, 0, 1))?
                } else {
                    values.clone()
                };
                let cells = mask.dim(1)?;
                let flat = mask.flatten_all()?.to_vec1::<f32>()?;
                let window = model.config().window_of(layer);
                // Each column's position and sequences, read once.
                let mut cell_of: Vec<Option<(Pos, Vec<SeqId>)>> = vec![None; cells];
                // Every position some query of a sequence sees, with its column.
                let mut columns: BTreeMap<SeqId, Seen> = BTreeMap::new();
                for (row, token) in batch.iter().enumerate() {
                    let Seen { taken, seen } = columns.entry(token.seq).or_insert_with(|| Seen {
                        taken: vec![false; cells],
                        seen: Vec::new(),
                    });
                    let (mut lo, mut hi, mut count) = (Pos::MAX, Pos::MIN, 0);
                    for (col, &m) in flat[row * cells..(row + 1) * cells].iter().enumerate() {
                        if m != 0.0 {
                            continue;
                        }
                        let (pos, seqs) = cell_of[col].get_or_insert_with(|| {
                            let info = group.cell(first_cell + col).expect("a visible cell is used");
                            (info.pos, info.sequences)
                        });
                        assert!(seqs.contains(&token.seq), "a cell of another sequence");
                        (lo, hi, count) = (lo.min(*pos), hi.max(*pos), count + 1);
                        if !taken[col] {
                            taken[col] = true;
                            seen.push((*pos, col as u32));
                        }
                    }
                    // A sequence's cells hold distinct positions (`check`), so
                    // this is the set of positions the from-scratch rule gives.
                    let from = window.map_or(0, |w| (token.pos - w as Pos + 1).max(0));
                    assert_eq!(
                        (lo, hi, count),
                        (from, token.pos, (token.pos - from + 1) as usize),
                        "layer {layer}, seq {} at {}: positions seen (first, last, count)",
                        token.seq,
                        token.pos
                    );
                    stats.views += 1;
                }
                for (seq, Seen { seen, .. }) in columns {
                    let cols: Vec<u32> = seen.iter().map(|s| s.1).collect();
                    let idx: Vec<u32> = seen.iter().map(|s| s.0 as u32).collect();
                    let cols = Tensor::new(cols.as_slice(), &device)?;
                    let idx = Tensor::new(idx.as_slice(), &device)?;
                    let (ref_k, ref_v) = reference.lists(seq, layer);
                    let dk = max_abs_diff(&keys.index_select(&cols, 0)?, &ref_k.index_select(&idx, 0)?);
                    let dv = max_abs_diff(
                        &cell_values.index_select(&cols, 0)?,
                        &ref_v.index_select(&idx, 0)?,
                    );
                    stats.key_diff = stats.key_diff.max(dk);
                    stats.value_diff = stats.value_diff.max(dv);
                    stats.cells += seen.len();
                }
                Ok(Attend {
                    keys,
                    values,
                    mask,
                    permuted,
                })
            })
            .unwrap();
        self.cache.check();
        self.forced = Some(stats);
    }

    /// `tokens` through `seq` in passes of at most `chunk`.
    pub fn feed(&mut self, seq: SeqId, tokens: &[u32], chunk: usize) {
        for part in tokens.chunks(chunk) {
            self.pass(&[(seq, part)]);
        }
    }

    pub fn copy_prefix(&mut self, src: SeqId, dst: SeqId, len: usize) {
        assert!(
            self.cache.can_resume(src, len as Pos),
            "seq {src} cannot resume at {len}"
        );
        self.cache.copy_prefix(src, dst, len as Pos).unwrap();
        self.reference.copy_prefix(src, dst, len);
    }

    pub fn truncate(&mut self, seq: SeqId, len: usize) {
        self.cache.remove(seq, PosRange::from(len as Pos..)).unwrap();
        self.reference.truncate(seq, len);
        assert!(
            self.cache.can_resume(seq, len as Pos),
            "seq {seq} cannot resume at {len}"
        );
    }

    pub fn leave(&mut self, seq: SeqId) {
        self.cache.remove(seq, PosRange::from(..)).unwrap();
        self.reference.leave(seq);
    }

    pub fn shift(&mut self, seq: SeqId, start: usize, n: usize) {
        let range = PosRange::from(start as Pos..(start + n) as Pos);
        self.cache.remove(seq, range).unwrap();
        self.reference.shift(seq, start, n);
    }

    /// Logits of the last `rows` tokens of `seq` by full recompute against the
    /// reference's (valid while `seq` has had no shift).
    pub fn full_recompute_diff(&mut self, seq: SeqId, rows: usize) -> f32 {
        let tokens = self.reference.tokens(seq);
        let full = self.model.hidden_full(&tokens).unwrap();
        let n = tokens.len();
        let last = self.model.logits(&full.i(n - rows..n).unwrap()).unwrap();
        // Recompute the same rows through the reference's lists: truncate a copy
        // and step the last tokens again.
        let mut again = Reference::new(self.model);
        again.seqs.insert(seq, self.reference.seqs[&seq].prefix(n - rows));
        let hidden = again.step(seq, &tokens[n - rows..]);
        max_abs_diff(&last, &self.model.logits(&hidden).unwrap())
    }
}

/// The conversation schedule on a model of window `w`: `text` (at least
/// `3.5 w` tokens) is the conversation, `other` (at least `w`) the tokens of
/// a branch. The branch switch is also checked against a full recompute of
/// the original (and of the fork, with `full_fork`). Returns `(max logit
/// difference, rows compared, full-recompute difference)`; a teacher-forced
/// pair checks views instead (its `forced` stats) and returns zeros.
pub fn conversation(
    pair: &mut Pair,
    w: usize,
    text: &[u32],
    other: &[u32],
    chunk: usize,
    full_fork: bool,
) -> (f32, usize, f32) {
    let t0 = std::time::Instant::now();
    let lap = |what: &str| eprintln!("{what}: {:.1}s", t0.elapsed().as_secs_f64());
    let long = 3 * w + w / 4;
    assert!(
        text.len() >= long + 8 + w / 2 && other.len() >= w,
        "text too short"
    );
    // A long first turn, a few decode steps, then the rest past 3 windows.
    let first = w + w / 3;
    pair.feed(0, &text[..first], chunk);
    for i in first..first + 4 {
        pair.pass(&[(0, &text[i..i + 1])]);
    }
    pair.feed(0, &text[first + 4..long], chunk);
    lap("prefill and decode");
    // The conversation forks half a window behind its end (another reply to
    // an earlier turn): the fork and the original advance in one batch.
    let fork = long - w / 2;
    pair.copy_prefix(0, 1, fork);
    pair.pass(&[(1, &other[..w / 2 + 3]), (0, &text[long..long + 2])]);
    // Branch switch: the original goes back a quarter window and takes
    // another way from there.
    let back = long + 2 - w / 4;
    pair.truncate(0, back);
    pair.feed(0, &other[w / 2..w / 2 + 6], chunk);
    // Both cached branches agree with a full recompute of their tokens.
    lap("fork and switch");
    // (A teacher-forced pair has no trajectory of its own to recompute.)
    let mut full = 0.0;
    if pair.forced.is_none() {
        full = pair.full_recompute_diff(0, 3);
    }
    if full_fork && pair.forced.is_none() {
        full = full.max(pair.full_recompute_diff(1, 3));
    }
    lap("full recompute");
    // Eviction: the fork leaves; the original goes on untouched.
    pair.leave(1);
    pair.pass(&[(0, &text[long + 2..long + 6])]);
    // Context shift: keep the first 4 tokens, drop the next window.
    pair.shift(0, 4, w);
    pair.feed(0, &text[long + 6..long + 8 + w / 2], chunk);
    pair.pass(&[(0, &text[long + 8 + w / 2 - 1..long + 8 + w / 2])]);
    lap("shift");
    (pair.max_diff, pair.rows, full)
}
