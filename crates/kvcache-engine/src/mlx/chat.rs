//! The mlx models as [`kvcache_models::LayerModel`]s, so that [`ChatServer`] (the
//! same loop as on candle) runs them: [`MlxLlama`] with one
//! `kvcache_mlx::layers::KvCache` per layer, or [`kvcache_models::mlx::MlxGemma`] over its
//! mixed layers ([`super::MlxGemmaChatServer`]). Each request begins a trie
//! session (paging the longest cached prefix in), prefills the rest (pausing
//! where the trie wants branch-point snapshots), then decodes greedily, and
//! closing the session stores what the caches hold.

use kvcache_mlx::layers::{KvCache, SnapshotEncoding};
use mlx_rs::Array;

use crate::chat::{ChatServer, Reuse};
use crate::Result;
use kvcache_models::mlx::MlxLlama;
use kvcache_models::LayerModel;

/// The Llama over `KvCache`s, which rewind to any offset.
impl LayerModel for MlxLlama {
    type Array = Array;
    type Layer = KvCache;

    const RESUMABLE: bool = false;

    fn new_layers(&self) -> Result<Vec<KvCache>> {
        Ok((0..self.config().n_layers).map(|_| KvCache::new()).collect())
    }

    fn hidden_layers(&self, tokens: &[u32], caches: &mut [KvCache]) -> Result<Array> {
        MlxLlama::hidden_layers(self, tokens, caches)
    }

    fn next_token(&self, hidden: &Array) -> Result<u32> {
        MlxLlama::next_token(self, hidden)
    }
}

/// The chat server on mlx: [`ChatServer`] with the mlx Llama by default (or
/// [`kvcache_models::mlx::MlxGemma`]), usually with [`Reuse::Trie`].
pub type MlxChatServer<'m, M = MlxLlama> = ChatServer<'m, M>;

impl<'m> MlxChatServer<'m, MlxLlama> {
    /// A server whose layer caches keep their snapshots as `encoding` says
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
