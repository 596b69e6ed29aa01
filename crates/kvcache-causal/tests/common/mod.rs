//! Helpers shared by the integration tests: the device under test, tensors filled
//! with one number per token, and readings of masks and visible cells.
#![allow(dead_code)]

pub mod fixture;
pub mod reference;

use std::sync::OnceLock;

use candle_core::{DType as CandleDType, Device, Tensor};
use kvcache_api::{CacheError, CausalCache, DType, Pos, Result, SeqId, StoredKv, VLayout};
use kvcache_causal::CausalKvCache;

/// The device tests run on: `KVCACHE_DEVICE` = `cpu` (default), `cuda` or `metal`.
///
/// One device for the whole test binary: candle's `Device::new_cuda(0)` makes a
/// new device (its own context and stream) each call, and tensors of two such
/// devices do not mix, although both are GPU 0.
pub fn device() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE
        .get_or_init(|| match std::env::var("KVCACHE_DEVICE").as_deref() {
            Err(_) | Ok("") | Ok("cpu") => Device::Cpu,
            Ok("cuda") => Device::new_cuda(0).expect("KVCACHE_DEVICE=cuda needs `--features cuda` and a GPU"),
            Ok("metal") => Device::new_metal(0).expect("KVCACHE_DEVICE=metal needs macOS with Metal"),
            Ok(other) => panic!("KVCACHE_DEVICE must be cpu, cuda or metal, not {other:?}"),
        })
        .clone()
}

/// The candle dtype of a kvcache dtype.
pub fn candle(dtype: DType) -> CandleDType {
    match dtype {
        DType::F32 => CandleDType::F32,
        DType::F16 => CandleDType::F16,
        DType::BF16 => CandleDType::BF16,
    }
}

/// `[tokens, heads, dim]` where every element of token `i` is `vals[i]`.
pub fn filled(vals: &[f32], heads: usize, dim: usize, dtype: DType, device: &Device) -> Tensor {
    let data: Vec<f32> = vals
        .iter()
        .flat_map(|&v| std::iter::repeat_n(v, heads * dim))
        .collect();
    Tensor::from_vec(data, (vals.len(), heads, dim), device)
        .and_then(|t| t.to_dtype(candle(dtype)))
        .unwrap()
}

/// A shift function that adds each cell's shift to every element of its key, so
/// shifted keys are visible in tests.
pub fn add_shift() -> Box<dyn kvcache_api::KeyShift<Tensor>> {
    Box::new(|_layer: usize, keys: &Tensor, shifts: &[Pos]| -> Result<Tensor> {
        let n = shifts.len();
        let deltas: Vec<f32> = shifts.iter().map(|&s| s as f32).collect();
        Tensor::from_vec(deltas, (n, 1, 1), keys.device())
            .and_then(|d| d.to_dtype(keys.dtype()))
            .and_then(|d| keys.broadcast_add(&d))
            .map_err(CacheError::backend)
    })
}

/// A tensor as f32 on the host.
pub fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(CandleDType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// The mask of the pass as text rows (`0` visible, `x` masked).
pub fn grid(mask: &Tensor) -> Vec<String> {
    let (_, cols) = mask.dims2().unwrap();
    host(mask)
        .chunks(cols)
        .map(|row| {
            row.iter()
                .map(|&v| {
                    if v == 0.0 {
                        '0'
                    } else {
                        assert!(v == f32::NEG_INFINITY, "mask entries are 0 or -inf, got {v}");
                        'x'
                    }
                })
                .collect()
        })
        .collect()
}

/// What one query token sees: `(position, key, value)` of every cell its mask row
/// lets through, read from the stored tensors of the current layer, by position.
pub type Seen = Vec<(Pos, f32, f32)>;

/// For each token of the pass (`tokens` in batch order), what it sees through the
/// real mask and the real storage. Panics if a visible cell is free, belongs to
/// another sequence, or shows a position twice.
pub fn sees(cache: &CausalKvCache, tokens: &[(SeqId, Pos)]) -> Vec<Seen> {
    let view = cache.get().unwrap();
    let range = cache.pass_range().unwrap();
    let keys = host(&view.keys);
    let values = host(&view.values);
    let key_row = keys.len() / range.len();
    let value_at = |j: usize| match cache.config().v_layout {
        VLayout::Normal => values[j * (values.len() / range.len())],
        VLayout::Permuted => values[j],
    };
    let rows = grid(&view.mask);
    let seen: Vec<Seen> = tokens
        .iter()
        .enumerate()
        .map(|(i, &(seq, _))| {
            let mut seen: Seen = rows[i]
                .chars()
                .enumerate()
                .filter(|&(_, c)| c == '0')
                .map(|(j, _)| {
                    let cell = range.start + j;
                    let info = cache
                        .cell(cell)
                        .unwrap_or_else(|| panic!("token {i} sees free cell {cell}"));
                    assert!(
                        info.sequences.contains(&seq),
                        "token {i} sees cell {cell} of {info:?}"
                    );
                    (info.pos, keys[j * key_row], value_at(j))
                })
                .collect();
            seen.sort_by_key(|s| s.0);
            assert!(
                seen.windows(2).all(|w| w[0].0 < w[1].0),
                "token {i} sees a position twice"
            );
            seen
        })
        .collect();
    assert_eq!(
        sees_paged(cache, tokens),
        seen,
        "the paged view shows other cells or data than the dense mask"
    );
    seen
}

/// For each token of the pass, what it sees through the paged view
/// ([`CausalCache::get_paged`]): the cells of its runs, their keys and values
/// read from the stored planes in their stored type (decoded here, one element),
/// by position. [`sees`] checks it equals what the dense mask shows.
pub fn sees_paged(cache: &CausalKvCache, tokens: &[(SeqId, Pos)]) -> Vec<Seen> {
    let view = cache.get_paged().unwrap();
    assert_eq!(view.runs.rows(), tokens.len(), "a row of runs per token");
    let compute = candle(cache.config().dtype);
    let value_axis = match view.v_layout {
        VLayout::Normal => 0,
        VLayout::Permuted => 2,
    };
    (0..tokens.len())
        .map(|i| {
            let mut seen: Seen = view
                .runs
                .row(i)
                .iter()
                .flat_map(|run| run.cells())
                .map(|cell| {
                    let info = cache
                        .cell(cell)
                        .unwrap_or_else(|| panic!("paged row {i} sees free cell {cell}"));
                    let key = stored_element(&view.keys, 0, cell, compute);
                    (
                        info.pos,
                        key,
                        stored_element(&view.values, value_axis, cell, compute),
                    )
                })
                .collect();
            seen.sort_by_key(|s| s.0);
            seen
        })
        .collect()
}

/// The first element of `cell` in a stored plane whose cell axis is `axis`, read
/// as `get` reads it in the compute dtype `compute`.
fn stored_element(plane: &StoredKv<Tensor>, axis: usize, cell: usize, compute: CandleDType) -> f32 {
    let first = |t: &Tensor| t.narrow(axis, cell, 1).unwrap().flatten_all().unwrap();
    let value = match plane {
        StoredKv::Float(t) => first(t).to_dtype(compute).unwrap(),
        StoredKv::Q8_0 { quants, scales } => {
            let q = host(&first(quants))[0] - 128.0;
            let d = host(&first(scales))[0];
            Tensor::new(&[q * d], &Device::Cpu)
                .unwrap()
                .to_dtype(compute)
                .unwrap()
        }
    };
    host(&value)[0]
}

/// Every `(sequence, position, key, value)` the cache holds in `layer`, read from
/// storage, sorted.
pub fn contents(cache: &CausalKvCache, layer: usize) -> Vec<(SeqId, Pos, f32, f32)> {
    let mut out = Vec::new();
    for seq in 0..cache.config().max_sequences {
        for (pos, cell) in cache.positions(seq) {
            let data = cache.read_cell(layer, cell).unwrap();
            out.push((seq, pos, data.keys[0], data.values[0]));
        }
    }
    out
}

/// Runs `call`, which must fail with an error `is_expected` accepts, and checks that
/// nothing changed.
pub fn rejected(
    cache: &mut CausalKvCache,
    call: impl FnOnce(&mut CausalKvCache) -> Result<()>,
    is_expected: impl Fn(&CacheError) -> bool,
) {
    let before = cache.picture().unwrap();
    let err = call(cache).expect_err("the call should be rejected");
    assert!(is_expected(&err), "unexpected error: {err:?}");
    cache.check();
    assert!(
        cache.picture().unwrap() == before,
        "rejected call ({err}) changed the cache"
    );
}
