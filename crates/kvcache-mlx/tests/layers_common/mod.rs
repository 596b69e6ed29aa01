//! Helpers shared by the `layers_*` tests: K/V arrays whose every element
//! encodes which token wrote it, so tests can read back exactly which tokens
//! an array holds, and the mlx caches as subjects of the snapshot-cache
//! contract (`kvcache_api::contract`).
#![allow(dead_code, unused_imports)]

use std::ops::Range;

use kvcache_api::contract::Subject;
use kvcache_api::{DType, KvLayout, LayerCache, SnapshotCache};
use kvcache_mlx::layers::{KvCache, RecurrentCache, RotatingKvCache};
use mlx_rs::Array;

/// The value of element (batch `b < 4`, head `h < 4`, dim `d < 64`) of token
/// `id`'s keys; its values hold `-(code) - 0.5`. Exact in f32 for ids below 2^13.
pub fn code(id: u32, b: usize, h: usize, d: usize) -> f32 {
    assert!(
        id < (1 << 13) && b < 4 && h < 4 && d < 64,
        "({id}, {b}, {h}, {d}) out of range"
    );
    (((id as usize * 4 + b) * 4 + h) * 64 + d) as f32
}

/// The token id a key element encodes.
fn id_of(key: f32) -> u32 {
    (key as usize / 1024) as u32
}

/// Makes keys `[B, H, L, Dk]` and values `[B, H, L, Dv]` (f32) for tokens `ids`.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub b: usize,
    pub h: usize,
    pub dk: usize,
    pub dv: usize,
}

pub const SMALL: Shape = Shape {
    b: 2,
    h: 2,
    dk: 3,
    dv: 2,
};

impl Shape {
    pub fn kv(&self, ids: &[u32]) -> (Array, Array) {
        let l = ids.len();
        let mut k = Vec::with_capacity(self.b * self.h * l * self.dk);
        let mut v = Vec::with_capacity(self.b * self.h * l * self.dv);
        for b in 0..self.b {
            for h in 0..self.h {
                for &id in ids {
                    k.extend((0..self.dk).map(|d| code(id, b, h, d)));
                    v.extend((0..self.dv).map(|d| -code(id, b, h, d) - 0.5));
                }
            }
        }
        let dims = |d: usize| [self.b as i32, self.h as i32, l as i32, d as i32];
        (
            Array::from_slice(&k, &dims(self.dk)),
            Array::from_slice(&v, &dims(self.dv)),
        )
    }

    /// Bytes of `tokens` positions of keys plus values in f32.
    pub fn bytes(&self, tokens: usize) -> usize {
        tokens * self.b * self.h * (self.dk + self.dv) * 4
    }
}

/// Hands out fresh token ids.
#[derive(Default)]
pub struct Ids(u32);

impl Ids {
    pub fn next(&mut self, n: usize) -> Vec<u32> {
        let ids = (self.0..self.0 + n as u32).collect();
        self.0 += n as u32;
        ids
    }
}

/// Row-major f32 contents of `a` (evaluated).
pub fn f32s(a: &Array) -> Vec<f32> {
    let c = a.contiguous().unwrap();
    c.eval().unwrap();
    c.as_slice::<f32>().to_vec()
}

/// The token ids along the sequence axis of keys `[B, H, L, Dk]` and values
/// `[B, H, L, Dv]`, checking that every element agrees.
pub fn ids_of(keys: &Array, values: &Array) -> Vec<u32> {
    let ks = keys.shape().to_vec();
    let vs = values.shape().to_vec();
    assert_eq!(ks.len(), 4, "keys shape {ks:?}");
    assert_eq!(&ks[..3], &vs[..3], "keys {ks:?} vs values {vs:?}");
    let (b, h, l, dk, dv) = (
        ks[0] as usize,
        ks[1] as usize,
        ks[2] as usize,
        ks[3] as usize,
        vs[3] as usize,
    );
    let k = f32s(keys);
    let v = f32s(values);
    let ids: Vec<u32> = (0..l).map(|i| id_of(k[i * dk])).collect();
    for bi in 0..b {
        for hi in 0..h {
            for (i, &id) in ids.iter().enumerate() {
                for d in 0..dk {
                    let got = k[((bi * h + hi) * l + i) * dk + d];
                    assert_eq!(got, code(id, bi, hi, d), "keys[{bi},{hi},{i},{d}]");
                }
                for d in 0..dv {
                    let got = v[((bi * h + hi) * l + i) * dv + d];
                    assert_eq!(got, -code(id, bi, hi, d) - 0.5, "values[{bi},{hi},{i},{d}]");
                }
            }
        }
    }
    ids
}

/// Address range of a compact (row-contiguous) f32 array's data; panics on a
/// strided view, which is never compact.
pub fn data_range(a: &Array) -> Range<usize> {
    a.eval().unwrap();
    let data = a.try_as_slice::<f32>().unwrap_or_else(|e| {
        panic!(
            "not a compact array but a view of a larger buffer ({e:?}), shape {:?}",
            a.shape()
        )
    });
    let start = data.as_ptr() as usize;
    start..start + a.nbytes()
}

/// Whether two address ranges overlap.
pub fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// A snapshot type no cache knows.
pub use kvcache_api::contract::Foreign;

/// The error of `r`, which must have failed (snapshots are not `Debug`, so
/// `unwrap_err` is not available on snapshot results).
pub fn error_of<T>(r: kvcache_api::Result<T>) -> kvcache_api::CacheError {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

/// Batch 1, as host rows need.
pub const ONE_SEQ: Shape = Shape {
    b: 1,
    h: 2,
    dk: 4,
    dv: 4,
};

/// The mlx [`KvCache`] as a subject of the snapshot-cache contract.
pub struct MlxKv;

impl Subject for MlxKv {
    type Cache = KvCache;

    fn cache(&self) -> KvCache {
        KvCache::with_step(4).unwrap()
    }
    fn feed(&self, cache: &mut KvCache, tokens: &[u32]) {
        let (k, v) = ONE_SEQ.kv(tokens);
        cache.update(&k, &v).unwrap();
    }
    fn holds(&self, cache: &KvCache, tokens: &[u32]) -> bool {
        let live = cache.live().unwrap();
        cache.offset() == tokens.len() && live.map_or_else(Vec::new, |(k, v)| ids_of(&k, &v)) == tokens
    }
    fn bytes_per_token(&self) -> usize {
        ONE_SEQ.bytes(1)
    }
    fn host_layout(&self) -> Option<KvLayout> {
        Some(KvLayout::new(1, ONE_SEQ.h, ONE_SEQ.dk, DType::F32))
    }
}

/// The mlx [`RotatingKvCache`] with a window of `.0` as a subject of the
/// snapshot-cache contract.
pub struct MlxRotating(pub usize);

impl Subject for MlxRotating {
    type Cache = RotatingKvCache;

    fn cache(&self) -> RotatingKvCache {
        RotatingKvCache::with_step(self.0, 2).unwrap()
    }
    fn feed(&self, cache: &mut RotatingKvCache, tokens: &[u32]) {
        let (k, v) = SMALL.kv(tokens);
        cache.update(&k, &v).unwrap();
    }
    fn holds(&self, cache: &RotatingKvCache, tokens: &[u32]) -> bool {
        let window = cache.ordered_window().unwrap();
        let held = window.map_or_else(Vec::new, |(k, v)| ids_of(&k, &v));
        cache.offset() == tokens.len() && held == tokens[tokens.len().saturating_sub(self.0)..]
    }
}

/// The mlx [`RecurrentCache`] as a subject of the snapshot-cache contract:
/// its state is one `[1, 2]` f32 array, the token count and the sum of
/// `id * (position + 1)` over the tokens seen (exact in f32 for the
/// contract's ids).
pub struct MlxRecurrent;

impl MlxRecurrent {
    fn summary(tokens: &[u32], from: usize, state: [f32; 2]) -> [f32; 2] {
        tokens.iter().enumerate().fold(state, |[n, sum], (i, &id)| {
            [n + 1.0, sum + id as f32 * (from + i + 1) as f32]
        })
    }
}

impl Subject for MlxRecurrent {
    type Cache = RecurrentCache;

    fn cache(&self) -> RecurrentCache {
        RecurrentCache::new()
    }
    fn feed(&self, cache: &mut RecurrentCache, tokens: &[u32]) {
        let old = match cache.state() {
            [] => [0.0, 0.0],
            [a] => f32s(a).try_into().unwrap(),
            more => panic!("{} state arrays", more.len()),
        };
        let new = Self::summary(tokens, cache.offset(), old);
        cache
            .advance(tokens.len(), vec![Array::from_slice(&new, &[1, 2])])
            .unwrap();
    }
    fn holds(&self, cache: &RecurrentCache, tokens: &[u32]) -> bool {
        let held = match cache.state() {
            [] => vec![0.0, 0.0],
            [a] => f32s(a),
            _ => return false,
        };
        cache.offset() == tokens.len() && held == Self::summary(tokens, 0, [0.0, 0.0])
    }
}
