//! The engine's prefix store: which model it belongs to, the shape of its keys
//! and values, and opening the tiers a caller names (host memory always, then a
//! directory and Redis).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvcache_api::{Fingerprint, KvLayout};
use kvcache_store::{DiskTier, MemoryTier, RedisConfig, RedisTier, StoreConfig, Tier, TieredStore};

use crate::Result;
use kvcache_models::{Model, WeightMode};

/// The fingerprint of the model in `path` loaded with `weights`
/// ([`kvcache_models::loader::fingerprint`]: SHA-256 of the GGUF file's bytes
/// and of the weight mode, so that dequantized and quantized weights never
/// mix their prefixes).
pub fn model_fingerprint(path: &Path, weights: WeightMode) -> Result<Fingerprint> {
    Ok(kvcache_models::loader::fingerprint(path, weights)?)
}

/// The keys and values the candle layer caches hold for `model`: every layer,
/// its KV heads, f32.
pub fn kv_layout(model: &impl Model) -> KvLayout {
    model.kv_layout()
}

/// Where a store keeps its blocks, beside host memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// A local directory tier.
    pub dir: Option<PathBuf>,
    /// A Redis tier (`redis://host:port` or `redis+unix:///path`).
    pub redis: Option<String>,
}

/// Host memory the store keeps blocks in.
pub const MEMORY_BYTES: u64 = 1 << 30;

/// Disk the store's directory tier may fill.
pub const DISK_BYTES: u64 = 8 << 30;

/// A store for `layout` of the model `fingerprint`: host memory, then the tiers
/// `options` names, in that order.
pub fn open(fingerprint: Fingerprint, layout: KvLayout, options: &StoreOptions) -> Result<Arc<TieredStore>> {
    open_with(StoreConfig::new(fingerprint, layout), options)
}

/// [`open`] with the store's settings given (the writer queue's bound:
/// [`StoreConfig::queue_capacity`]).
pub fn open_with(config: StoreConfig, options: &StoreOptions) -> Result<Arc<TieredStore>> {
    let context = config.context();
    let mut tiers: Vec<Box<dyn Tier>> = vec![Box::new(MemoryTier::new(context, MEMORY_BYTES))];
    if let Some(dir) = &options.dir {
        tiers.push(Box::new(DiskTier::open(context, dir, DISK_BYTES)?));
    }
    if let Some(url) = &options.redis {
        tiers.push(Box::new(RedisTier::new(context, RedisConfig::new(url.clone()))?));
    }
    Ok(Arc::new(TieredStore::new(config, tiers)?))
}
