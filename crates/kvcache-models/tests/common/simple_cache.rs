//! A deliberately plain `CausalCache`: cells are appended and never reused, every
//! cell is in every pass's range, keys/values are stored as f32 rows. It exists to
//! check the model's cached path independently of kvcache-causal.

use std::collections::BTreeSet;

use candle_core::{Device, Tensor};
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, ForwardMode, KeyShift, KvView, Pos, PosRange, Result, SeqId,
};

struct Cell {
    pos: Pos,
    seqs: BTreeSet<SeqId>,
}

/// See the module docs.
pub struct SimpleCache {
    config: CausalConfig,
    device: Device,
    shift: Option<Box<dyn KeyShift<Tensor>>>,
    cells: Vec<Cell>,
    /// `kv[layer][cell]`: key row and value row, `[kv_heads, head_dim]` each.
    kv: Vec<Vec<Option<(Tensor, Tensor)>>>,
    layer: usize,
    batch: Option<(Batch, usize)>,
}

impl SimpleCache {
    pub fn new(config: CausalConfig, device: &Device, shift: Option<Box<dyn KeyShift<Tensor>>>) -> Self {
        SimpleCache {
            config,
            device: device.clone(),
            shift,
            cells: Vec::new(),
            kv: Vec::new(),
            layer: 0,
            batch: None,
        }
    }

    fn check_seq(&self, seq: SeqId) -> Result<()> {
        if seq >= self.config.max_sequences {
            return Err(CacheError::SequenceOutOfRange {
                seq,
                max_sequences: self.config.max_sequences,
            });
        }
        Ok(())
    }
}

impl CausalCache for SimpleCache {
    type Tensor = Tensor;

    fn config(&self) -> &CausalConfig {
        &self.config
    }

    fn configure(&mut self, config: CausalConfig) -> Result<()> {
        *self = SimpleCache::new(config, &self.device.clone(), self.shift.take());
        Ok(())
    }

    fn start_forward(&mut self, batch: &Batch, _mode: ForwardMode) -> Result<()> {
        for &s in batch.sequences() {
            self.check_seq(s)?;
        }
        let first = self.cells.len();
        for (seq, pos) in batch.tokens() {
            self.cells.push(Cell {
                pos,
                seqs: BTreeSet::from([seq]),
            });
        }
        for layer in &mut self.kv {
            layer.resize(self.cells.len(), None);
        }
        self.batch = Some((batch.clone(), first));
        Ok(())
    }

    fn set_layer(&mut self, layer: usize) {
        self.layer = layer;
        while self.kv.len() <= layer {
            self.kv.push(vec![None; self.cells.len()]);
        }
    }

    fn set_causal(&mut self, _except: &[usize]) -> Result<()> {
        Err(CacheError::NotSupported("set_causal".into()))
    }

    fn put(&mut self, keys: &Tensor, values: &Tensor) -> Result<()> {
        let (batch, first) = self
            .batch
            .as_ref()
            .ok_or_else(|| CacheError::InvalidState("put".into()))?;
        let e = CacheError::backend;
        for i in 0..batch.len() {
            let k = keys.get(i).map_err(e)?;
            let v = values.get(i).map_err(e)?;
            self.kv[self.layer][first + i] = Some((k, v));
        }
        Ok(())
    }

    fn get(&self) -> Result<KvView<Tensor>> {
        let (batch, _) = self
            .batch
            .as_ref()
            .ok_or_else(|| CacheError::InvalidState("get".into()))?;
        let e = CacheError::backend;
        let layer = &self.kv[self.layer];
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for (k, v) in layer.iter().flatten() {
            ks.push(k.clone());
            vs.push(v.clone());
        }
        assert_eq!(ks.len(), self.cells.len(), "every cell has K/V for this layer");
        let keys = Tensor::stack(&ks, 0).map_err(e)?;
        let values = Tensor::stack(&vs, 0).map_err(e)?;
        let n = self.cells.len();
        let mut mask = vec![f32::NEG_INFINITY; batch.len() * n];
        for (i, (seq, pos)) in batch.tokens().enumerate() {
            for (j, cell) in self.cells.iter().enumerate() {
                let in_window = self
                    .config
                    .window
                    .is_none_or(|w| pos - cell.pos < w.window() as Pos);
                if cell.seqs.contains(&seq) && cell.pos <= pos && in_window {
                    mask[i * n + j] = 0.0;
                }
            }
        }
        let mask = Tensor::from_vec(mask, (batch.len(), n), &self.device).map_err(e)?;
        Ok(KvView { keys, values, mask })
    }

    fn copy_prefix(&mut self, src: SeqId, dst: SeqId, len: Pos) -> Result<()> {
        self.check_seq(src)?;
        self.check_seq(dst)?;
        for cell in &mut self.cells {
            cell.seqs.remove(&dst);
            if cell.seqs.contains(&src) && cell.pos < len {
                cell.seqs.insert(dst);
            }
        }
        Ok(())
    }

    fn can_resume(&self, _seq: SeqId, _pos: Pos) -> bool {
        true
    }

    fn remove(&mut self, seq: SeqId, range: PosRange) -> Result<()> {
        self.check_seq(seq)?;
        let shift = range.shift();
        let end = range.end;
        if let Some(end) = end {
            if let Some(c) = self
                .cells
                .iter()
                .find(|c| c.seqs.contains(&seq) && c.pos >= end && c.seqs.len() > 1)
            {
                return Err(CacheError::SharedCellShift { seq, pos: c.pos });
            }
            if self.shift.is_none() && self.cells.iter().any(|c| c.seqs.contains(&seq) && c.pos >= end) {
                return Err(CacheError::NotSupported("shift without a key shift".into()));
            }
        }
        for (j, cell) in self.cells.iter_mut().enumerate() {
            if !cell.seqs.contains(&seq) {
                continue;
            }
            if range.contains(cell.pos) {
                cell.seqs.remove(&seq);
            } else if end.is_some_and(|e| cell.pos >= e) && shift != 0 {
                cell.pos += shift;
                let f = self.shift.as_ref().expect("checked above");
                for (l, layer) in self.kv.iter_mut().enumerate() {
                    if let Some((k, _)) = layer[j].as_mut() {
                        let k3 = k.unsqueeze(0).map_err(CacheError::backend)?;
                        *k = f
                            .shift(l, &k3, &[shift])?
                            .squeeze(0)
                            .map_err(CacheError::backend)?;
                    }
                }
            }
        }
        Ok(())
    }
}
