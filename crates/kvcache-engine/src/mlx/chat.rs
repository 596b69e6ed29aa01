//! [`Chat`] (the same loop as on candle) on the mlx models, which are
//! [`kvcache_models::LayerModel`]s: [`MlxLlama`] with one
//! `kvcache_mlx::layers::KvCache` per layer, or [`kvcache_models::mlx::MlxGemma`] over its
//! mixed layers ([`super::MlxGemmaChat`]). Each request begins a trie
//! session (paging the longest cached prefix in), prefills the rest (pausing
//! where the trie wants branch-point snapshots), then decodes greedily, and
//! closing the session stores what the caches hold.

use kvcache_mlx::layers::{KvCache, SnapshotEncoding};
use kvcache_models::mlx::MlxLlama;

use crate::chat::{Chat, Reuse};
use crate::Result;

/// The chat on mlx: [`Chat`] with the mlx Llama by default (or
/// [`kvcache_models::mlx::MlxGemma`]), usually with [`Reuse::Trie`].
pub type MlxChat<'m, M = MlxLlama> = Chat<'m, M>;

impl<'m> MlxChat<'m, MlxLlama> {
    /// A chat whose layer caches keep their snapshots as `encoding` says
    /// ([`SnapshotEncoding::Q8`]: 8-bit, so the same `budget_bytes` holds about
    /// 2x the snapshots of f16 layers, 3.6x of f32 ones).
    pub fn with_snapshot_encoding(
        model: &'m MlxLlama,
        budget_bytes: usize,
        encoding: SnapshotEncoding,
    ) -> Result<Self> {
        let caches = (0..model.config().n_layers)
            .map(|_| KvCache::new().with_snapshot_encoding(encoding))
            .collect::<kvcache_api::Result<Vec<_>>>()?;
        Self::with_layers(model, Reuse::Trie, caches, budget_bytes)
    }
}
