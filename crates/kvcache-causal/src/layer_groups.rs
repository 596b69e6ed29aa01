//! [`LayerGroupCache`]: one causal cache per group of layers, driven as one.
//!
//! Models such as Gemma 3 interleave sliding-window layers with global layers; each
//! kind needs its own cache (different windows, sizes and masks) but every forward
//! pass and every sequence edit must reach all of them. Operations are two-phase:
//! every group validates (and computes anything fallible, such as re-rotated keys)
//! before any group changes, so an error leaves every group as it was.

use candle_core::Tensor;
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, ForwardMode, KvView, PagedKv, Pos, PosRange, Result, SeqId,
};

use crate::cache::CausalKvCache;
use crate::inspect::CachePicture;

/// Several [`CausalKvCache`]s behind one [`CausalCache`], routed by layer.
///
/// `start_forward`, `set_causal`, `remove` and `copy_prefix` go to every group;
/// `put` and `get` go to the group of the current layer (layers keep their global
/// index inside each group, so a shift function sees the real layer number).
/// [`config`](CausalCache::config) is the configuration of the current layer's
/// group, and [`can_resume`](CausalCache::can_resume) holds when every group can
/// resume.
///
/// ```
/// use candle_core::Device;
/// use kvcache_api::{Batch, CausalCache, CausalConfig, ForwardMode, SlidingWindow};
/// use kvcache_causal::{CausalKvCache, LayerGroupCache};
///
/// let global = CausalConfig::new(1, 1024, 64);
/// let local = global.clone().with_window(SlidingWindow::new(128));
/// let groups = vec![
///     CausalKvCache::new(local, Device::Cpu, None)?,
///     CausalKvCache::new(global, Device::Cpu, None)?,
/// ];
/// // Gemma 3's pattern: five local layers, then one global layer.
/// let layers = (0..12).map(|l| if l % 6 == 5 { 1 } else { 0 }).collect();
/// let mut cache = LayerGroupCache::new(groups, layers)?;
/// cache.start_forward(&Batch::sequence(0, 0, 8)?, ForwardMode::Compute)?;
/// cache.set_layer(5);
/// assert_eq!(cache.config().window, None);
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
#[derive(Debug)]
pub struct LayerGroupCache {
    groups: Vec<CausalKvCache>,
    group_of_layer: Vec<usize>,
    layer: usize,
}

impl LayerGroupCache {
    /// Groups `groups`, where layer `l` uses group `group_of_layer[l]`.
    pub fn new(groups: Vec<CausalKvCache>, group_of_layer: Vec<usize>) -> Result<Self> {
        if groups.is_empty() {
            return Err(CacheError::InvalidArgument(
                "a layer-group cache needs at least one group".into(),
            ));
        }
        if let Some((layer, &g)) = group_of_layer
            .iter()
            .enumerate()
            .find(|(_, &g)| g >= groups.len())
        {
            return Err(CacheError::InvalidArgument(format!(
                "layer {layer} maps to group {g}, but there are {} groups",
                groups.len()
            )));
        }
        Ok(LayerGroupCache {
            groups,
            group_of_layer,
            layer: 0,
        })
    }

    /// The caches, by group index.
    pub fn groups(&self) -> &[CausalKvCache] {
        &self.groups
    }

    /// Sets the model fingerprint of every group (see
    /// [`CausalKvCache::set_fingerprint`]).
    pub fn set_fingerprint(&mut self, fingerprint: kvcache_api::Fingerprint) {
        for group in &mut self.groups {
            group.set_fingerprint(fingerprint);
        }
    }

    /// The group of `layer`, if it is mapped.
    pub fn group_of(&self, layer: usize) -> Option<usize> {
        self.group_of_layer.get(layer).copied()
    }

    /// Reconfigures every group (`configs[g]` for group `g`), all or nothing.
    pub fn configure_groups(&mut self, configs: Vec<CausalConfig>) -> Result<()> {
        if configs.len() != self.groups.len() {
            return Err(CacheError::InvalidArgument(format!(
                "{} configurations for {} groups",
                configs.len(),
                self.groups.len()
            )));
        }
        let fresh = self
            .groups
            .iter()
            .zip(configs)
            .map(|(group, config)| {
                CausalKvCache::with_shared_shift(
                    config,
                    group.device().clone(),
                    group.shared_shift().cloned(),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        self.groups = fresh;
        let layer = self.layer;
        self.set_layer(layer);
        Ok(())
    }

    /// The cells row `row` of the current layer's mask may attend to: the
    /// current layer's group's [`CausalKvCache::visible_cells`] (mask columns of
    /// that group's pass range), with its errors; an
    /// [`InvalidArgument`](CacheError::InvalidArgument) error for a layer outside
    /// every group.
    pub fn visible_cells(&self, row: usize) -> Result<Vec<std::ops::Range<usize>>> {
        self.groups[self.current()?].visible_cells(row)
    }

    /// A picture of every group ([`CausalKvCache::picture`]).
    pub fn picture(&self) -> Result<Vec<CachePicture>> {
        self.groups.iter().map(CausalKvCache::picture).collect()
    }

    /// Panics unless every group's invariants hold.
    pub fn check(&self) {
        for group in &self.groups {
            group.check();
        }
    }

    fn current(&self) -> Result<usize> {
        self.group_of(self.layer).ok_or_else(|| {
            CacheError::InvalidArgument(format!(
                "layer {} belongs to no group ({} layers are mapped)",
                self.layer,
                self.group_of_layer.len()
            ))
        })
    }
}

impl CausalCache for LayerGroupCache {
    type Tensor = Tensor;

    fn config(&self) -> &CausalConfig {
        let group = self.current().unwrap_or(0);
        self.groups[group].config()
    }

    /// The cells of the current layer's group (the width of its masks and
    /// views), as [`config`](CausalCache::config) is that group's configuration;
    /// the first group's for a layer outside every group. Each group's own count
    /// is `groups()[g].num_cells()`.
    fn num_cells(&self) -> usize {
        let group = self.current().unwrap_or(0);
        self.groups[group].num_cells()
    }

    /// A single configuration cannot describe several groups: use
    /// [`LayerGroupCache::configure_groups`].
    fn configure(&mut self, _config: CausalConfig) -> Result<()> {
        Err(CacheError::NotSupported(
            "a layer-group cache has one configuration per group: use configure_groups".into(),
        ))
    }

    fn start_forward(&mut self, batch: &Batch, mode: ForwardMode) -> Result<()> {
        for group in &mut self.groups {
            group.prepare_forward(batch, mode)?;
        }
        for group in &mut self.groups {
            group.commit_forward(batch, mode)?;
        }
        Ok(())
    }

    fn set_layer(&mut self, layer: usize) {
        self.layer = layer;
        if let Some(g) = self.group_of(layer) {
            self.groups[g].set_layer(layer);
        }
    }

    fn set_causal(&mut self, except: &[usize]) -> Result<()> {
        let changed = self
            .groups
            .iter()
            .map(|g| g.prepare_set_causal(except))
            .collect::<Result<Vec<bool>>>()?;
        for (group, changed) in self.groups.iter_mut().zip(changed) {
            group.commit_set_causal(except, changed)?;
        }
        Ok(())
    }

    fn put(&mut self, keys: &Tensor, values: &Tensor) -> Result<()> {
        let g = self.current()?;
        self.groups[g].put(keys, values)
    }

    fn get(&self) -> Result<KvView<Tensor>> {
        self.groups[self.current()?].get()
    }

    fn get_paged(&self) -> Result<PagedKv<'_, Tensor>> {
        self.groups[self.current()?].get_paged()
    }

    fn copy_prefix(&mut self, src: SeqId, dst: SeqId, len: Pos) -> Result<()> {
        for group in &self.groups {
            group.prepare_copy_prefix(src, dst, len)?;
        }
        for group in &mut self.groups {
            group.commit_copy_prefix(src, dst, len);
        }
        Ok(())
    }

    fn can_resume(&self, seq: SeqId, pos: Pos) -> bool {
        self.groups.iter().all(|g| g.can_resume(seq, pos))
    }

    fn remove(&mut self, seq: SeqId, range: PosRange) -> Result<()> {
        let prepared = self
            .groups
            .iter()
            .map(|g| g.prepare_remove(seq, range))
            .collect::<Result<Vec<_>>>()?;
        for (group, prepared) in self.groups.iter_mut().zip(prepared) {
            group.commit_remove(prepared)?;
        }
        Ok(())
    }
}
