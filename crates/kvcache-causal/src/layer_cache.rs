//! A candle-backed [`LayerCache`]: one layer's keys and values of one live
//! sequence, pageable to [`Snapshot`]s, so that `kvcache_mlx::trie::PrefixCache`
//! (written against [`SnapshotCache`] only) can drive the candle model.
//!
//! Storage per layer: keys and values `[kv_heads, capacity, head_dim]` with the
//! first `offset` rows along dimension 1 live; capacity doubles as needed.
//! A snapshot owns a compact copy of its range.

use std::any::Any;
use std::ops::Range;

use candle_core::{DType, Device, Tensor};
use kvcache_api::{
    BoxedSnapshot, CacheError, KvLayout, LayerCache, LayerRows, LayerRowsMut, Result, Snapshot, SnapshotCache,
};

fn be(e: candle_core::Error) -> CacheError {
    CacheError::backend(e)
}

/// Paged-out keys and values of one layer for tokens `[from, to)`:
/// `[kv_heads, to - from, head_dim]` each.
#[derive(Debug)]
pub struct KvSnapshot {
    range: Range<usize>,
    keys: Tensor,
    values: Tensor,
}

impl Snapshot for KvSnapshot {
    fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    fn size_bytes(&self) -> usize {
        (self.keys.elem_count() + self.values.elem_count()) * self.keys.dtype().size_in_bytes()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// One layer's cache of one live sequence (see the module docs).
#[derive(Debug)]
pub struct CandleKv {
    kv_heads: usize,
    head_dim: usize,
    device: Device,
    /// `[kv_heads, capacity, head_dim]`, or `None` before the first token.
    keys: Option<Tensor>,
    values: Option<Tensor>,
    offset: usize,
}

impl CandleKv {
    /// An empty cache for `kv_heads` heads of `head_dim` (f32) on `device`.
    pub fn new(kv_heads: usize, head_dim: usize, device: &Device) -> Self {
        CandleKv {
            kv_heads,
            head_dim,
            device: device.clone(),
            keys: None,
            values: None,
            offset: 0,
        }
    }

    fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.dim(1).unwrap_or(0))
    }

    /// Makes room for `need` tokens, keeping the live ones.
    fn reserve(&mut self, need: usize) -> Result<()> {
        if need <= self.capacity() {
            return Ok(());
        }
        let cap = need.max(2 * self.capacity()).max(64);
        let shape = (self.kv_heads, cap, self.head_dim);
        let k = Tensor::zeros(shape, DType::F32, &self.device).map_err(be)?;
        let v = Tensor::zeros(shape, DType::F32, &self.device).map_err(be)?;
        if self.offset > 0 {
            let (ok, ov) = self.live().map_err(be)?;
            k.slice_set(&ok.contiguous().map_err(be)?, 1, 0).map_err(be)?;
            v.slice_set(&ov.contiguous().map_err(be)?, 1, 0).map_err(be)?;
        }
        self.keys = Some(k);
        self.values = Some(v);
        Ok(())
    }

    /// Views of the live rows, `[kv_heads, offset, head_dim]` each.
    fn live(&self) -> candle_core::Result<(Tensor, Tensor)> {
        match (&self.keys, &self.values) {
            (Some(k), Some(v)) => Ok((k.narrow(1, 0, self.offset)?, v.narrow(1, 0, self.offset)?)),
            _ => candle_core::bail!("empty layer cache"),
        }
    }

    /// Checks that host rows of `layout` fit this cache (f32, same heads and dims).
    fn expect_layout(&self, layout: &KvLayout) -> Result<()> {
        let mine = KvLayout::new(
            layout.layers,
            self.kv_heads,
            self.head_dim,
            kvcache_api::DType::F32,
        );
        mine.expect(layout)
    }

    /// Appends `[kv_heads, n, head_dim]` keys and values.
    fn append(&mut self, keys: &Tensor, values: &Tensor) -> Result<()> {
        let n = keys.dim(1).map_err(be)?;
        self.reserve(self.offset + n)?;
        let (k, v) = (
            self.keys.as_ref().expect("reserved"),
            self.values.as_ref().expect("reserved"),
        );
        k.slice_set(&keys.contiguous().map_err(be)?, 1, self.offset)
            .map_err(be)?;
        v.slice_set(&values.contiguous().map_err(be)?, 1, self.offset)
            .map_err(be)?;
        self.offset += n;
        Ok(())
    }
}

fn own(s: BoxedSnapshot) -> Result<Box<KvSnapshot>> {
    s.into_any()
        .downcast::<KvSnapshot>()
        .map_err(|_| CacheError::InvalidArgument("not a candle layer-cache snapshot".into()))
}

impl SnapshotCache for CandleKv {
    fn offset(&self) -> usize {
        self.offset
    }

    fn snapshot(&mut self, from: usize) -> Result<Option<BoxedSnapshot>> {
        if from >= self.offset {
            return Ok(None);
        }
        let (k, v) = self.live().map_err(be)?;
        let n = self.offset - from;
        // `copy` makes compact, owned storage: the snapshot keeps only its range.
        let keys = k.narrow(1, from, n).and_then(|t| t.copy()).map_err(be)?;
        let values = v.narrow(1, from, n).and_then(|t| t.copy()).map_err(be)?;
        Ok(Some(Box::new(KvSnapshot {
            range: from..self.offset,
            keys,
            values,
        })))
    }

    fn restore(&mut self, snapshot: Option<&dyn Snapshot>, target: usize) -> Result<bool> {
        let Some(snapshot) = snapshot else {
            if target > self.offset {
                return Ok(false);
            }
            self.offset = target;
            return Ok(true);
        };
        let snap = snapshot
            .as_any()
            .downcast_ref::<KvSnapshot>()
            .ok_or_else(|| CacheError::InvalidArgument("not a candle layer-cache snapshot".into()))?;
        let range = snap.range();
        if target > range.end || self.offset < range.start || target < range.start {
            return Ok(false);
        }
        self.offset = range.start;
        let take = target - range.start;
        if take > 0 {
            let k = snap.keys.narrow(1, 0, take).map_err(be)?;
            let v = snap.values.narrow(1, 0, take).map_err(be)?;
            self.append(&k, &v)?;
        }
        Ok(true)
    }

    fn merge(
        &mut self,
        parent: Option<BoxedSnapshot>,
        child: Option<BoxedSnapshot>,
    ) -> Result<Option<BoxedSnapshot>> {
        let (Some(parent), Some(child)) = (parent, child) else {
            return Ok(None);
        };
        let (p, c) = (own(parent)?, own(child)?);
        if p.range.end != c.range.start {
            return Err(CacheError::InvalidArgument(format!(
                "snapshots {:?} and {:?} are not consecutive",
                p.range, c.range
            )));
        }
        Ok(Some(Box::new(KvSnapshot {
            range: p.range.start..c.range.end,
            keys: Tensor::cat(&[&p.keys, &c.keys], 1).map_err(be)?,
            values: Tensor::cat(&[&p.values, &c.values], 1).map_err(be)?,
        })))
    }

    fn split(
        &mut self,
        snapshot: BoxedSnapshot,
        at: usize,
    ) -> Result<(Option<BoxedSnapshot>, Option<BoxedSnapshot>)> {
        let s = own(snapshot)?;
        if at <= s.range.start {
            return Ok((None, Some(s)));
        }
        if at >= s.range.end {
            return Ok((Some(s), None));
        }
        let k = at - s.range.start;
        let rest = s.range.end - at;
        let part =
            |t: &Tensor, from: usize, n: usize| t.narrow(1, from, n).and_then(|t| t.copy()).map_err(be);
        let parent = KvSnapshot {
            range: s.range.start..at,
            keys: part(&s.keys, 0, k)?,
            values: part(&s.values, 0, k)?,
        };
        let child = KvSnapshot {
            range: at..s.range.end,
            keys: part(&s.keys, k, rest)?,
            values: part(&s.values, k, rest)?,
        };
        Ok((Some(Box::new(parent)), Some(Box::new(child))))
    }

    fn free(&mut self) {
        self.keys = None;
        self.values = None;
        self.offset = 0;
    }

    /// Host rows are `[kv_heads, rows, head_dim]` f32, like the live buffers.
    fn read_rows(&self, rows: Range<usize>, mut out: LayerRowsMut<'_>) -> Result<bool> {
        self.expect_layout(&out.layout)?;
        if rows.end > self.offset || rows.start > rows.end || out.tokens != rows.len() {
            return Ok(false);
        }
        let (k, v) = self.live().map_err(be)?;
        let n = rows.len();
        for (tensor, keys) in [(k, true), (v, false)] {
            let data = tensor
                .narrow(1, rows.start, n)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(be)?;
            for head in 0..self.kv_heads {
                let dst = if keys {
                    out.head_keys(head, 0..n)
                } else {
                    out.head_values(head, 0..n)
                };
                let src = &data[head * n * self.head_dim..(head + 1) * n * self.head_dim];
                for (d, x) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        Ok(true)
    }

    fn append_rows(&mut self, src: LayerRows<'_>, rows: Range<usize>) -> Result<bool> {
        self.expect_layout(&src.layout)?;
        if rows.end > src.tokens || rows.start > rows.end {
            return Err(CacheError::InvalidArgument(format!(
                "rows {rows:?} outside the {} held",
                src.tokens
            )));
        }
        if rows.is_empty() {
            return Ok(true);
        }
        let n = rows.len();
        let gather = |keys: bool| -> Result<Tensor> {
            let mut data = Vec::with_capacity(self.kv_heads * n * self.head_dim);
            for head in 0..self.kv_heads {
                let bytes = if keys {
                    src.head_keys(head, rows.clone())
                } else {
                    src.head_values(head, rows.clone())
                };
                data.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                );
            }
            Tensor::from_vec(data, (self.kv_heads, n, self.head_dim), &self.device).map_err(be)
        };
        let (k, v) = (gather(true)?, gather(false)?);
        self.append(&k, &v)?;
        Ok(true)
    }
}

impl LayerCache for CandleKv {
    type Array = Tensor;

    /// `keys`/`values`: `[1, kv_heads, n, head_dim]`; returns everything the new
    /// tokens attend to, `[1, kv_heads, offset + n, head_dim]` each.
    fn update(&mut self, keys: &Tensor, values: &Tensor) -> Result<(Tensor, Tensor)> {
        let expect = |t: &Tensor, what: &'static str| -> Result<Tensor> {
            match t.dims() {
                &[1, h, _, d] if h == self.kv_heads && d == self.head_dim => t.squeeze(0).map_err(be),
                dims => Err(CacheError::ShapeMismatch {
                    what,
                    expected: vec![1, self.kv_heads, 0, self.head_dim],
                    got: dims.to_vec(),
                }),
            }
        };
        let (k, v) = (expect(keys, "keys")?, expect(values, "values")?);
        self.append(&k, &v)?;
        let (k, v) = self.live().map_err(be)?;
        Ok((k.unsqueeze(0).map_err(be)?, v.unsqueeze(0).map_err(be)?))
    }

    fn state(&self) -> Vec<Tensor> {
        self.live().map(|(k, v)| vec![k, v]).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcache_api::{DType as KvDType, HostKv};

    fn filled(tokens: usize) -> CandleKv {
        let mut cache = CandleKv::new(2, 4, &Device::Cpu);
        let n = 2 * tokens * 4;
        let keys = Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap();
        let keys = keys.reshape((1, 2, tokens, 4)).unwrap();
        let values = (&keys * -1.0).unwrap();
        cache.update(&keys, &values).unwrap();
        cache
    }

    #[test]
    fn rows_go_to_the_host_and_back() {
        let source = filled(7);
        let layout = KvLayout::new(1, 2, 4, KvDType::F32);
        let mut kv = HostKv::zeroed(layout, 2, 5);
        assert!(source.read_rows(2..7, kv.layer_mut(0)).unwrap());
        // Head 1, token 2 of the source: elements (1 * 7 + 2) * 4 ..
        let first = f32::from_le_bytes(kv.layer(0).head_keys(1, 0..1)[..4].try_into().unwrap());
        assert_eq!(first, 36.0);

        // A cache holding the first two rows takes the other five from the host.
        let mut target = filled(7);
        target.restore(None, 2).unwrap();
        assert!(target.append_rows(kv.layer(0), 0..5).unwrap());
        assert_eq!(target.offset(), 7);
        for (a, b) in source.state().iter().zip(target.state()) {
            let diff = (a - &b).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
        }
        // Rows that are not live, and host rows of another shape, are refused.
        assert!(!source
            .read_rows(5..9, HostKv::zeroed(layout, 5, 4).layer_mut(0))
            .unwrap());
        let other = KvLayout::new(1, 3, 4, KvDType::F32);
        assert!(target
            .append_rows(HostKv::zeroed(other, 0, 1).layer(0), 0..1)
            .is_err());
        assert_eq!(target.offset(), 7);
    }
}
