//! The parts both candle decoders (the Llama and Gemma) are built of: the
//! weights around the blocks ([`Trunk`]: embedding, blocks, final norm, read
//! or drawn in that order, and the token lookup), a block's query, key and
//! value projections ([`Qkv`]) and its gated feed-forward ([`FeedForward`]),
//! and the attention callback of their layer loops ([`AttendFn`]).

use candle_core::quantized::QTensor;
use candle_core::Tensor;

use crate::kernels::{self, Activation};
use crate::weights::{forward_shared, Linear, WeightSource, WeightSpec};
use crate::{ModelError, Result};

/// What a layer loop asks of the attention: `attend(layer, q, keys, values)`
/// gets the pass's roped queries `[n, n_heads, head_dim]`, keys and values
/// `[n, kv_heads, head_dim]`, and returns the attention's output
/// `[n, n_heads * head_dim]`.
pub(crate) type AttendFn<'a> = dyn FnMut(usize, &Tensor, &Tensor, &Tensor) -> Result<Tensor> + 'a;

/// A candle decoder's weights up to its output projection, read or drawn in
/// this order: the token embedding, the blocks, the final norm.
#[derive(Debug, Clone)]
pub(crate) struct Trunk<B> {
    /// `[vocab_size, dim]`, f32.
    pub(crate) embed: Tensor,
    /// The blocks, in layer order.
    pub(crate) blocks: Vec<B>,
    /// `[dim]`.
    pub(crate) norm: Tensor,
}

impl<B> Trunk<B> {
    /// From `source`: the embedding `embed`, `n_layers` blocks made by
    /// `block(layer, source)`, the final norm `norm`. Also returns the
    /// embedding as the file stores it (see [`WeightSource::embedding`]).
    pub(crate) fn new(
        source: &mut dyn WeightSource,
        (embed, norm): (&WeightSpec, &WeightSpec),
        n_layers: usize,
        mut block: impl FnMut(usize, &mut dyn WeightSource) -> Result<B>,
    ) -> Result<(Self, Option<QTensor>)> {
        let (embed, stored) = source.embedding(embed)?;
        let blocks = (0..n_layers)
            .map(|l| block(l, &mut *source))
            .collect::<Result<_>>()?;
        let norm = source.tensor(norm)?;
        Ok((Trunk { embed, blocks, norm }, stored))
    }

    /// The embedding's rows for `tokens`, `[n, dim]`; an `InvalidArgument`
    /// error for a token outside the vocabulary.
    pub(crate) fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        check_tokens(tokens, self.embed.dim(0)?)?;
        let ids = Tensor::from_slice(tokens, tokens.len(), self.embed.device())?;
        Ok(self.embed.index_select(&ids, 0)?)
    }
}

/// An `InvalidArgument` error naming the first of `tokens` outside a
/// vocabulary of `vocab_size`.
pub(crate) fn check_tokens(tokens: &[u32], vocab_size: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab_size) {
        Some(t) => Err(ModelError::InvalidArgument(format!(
            "token {t} outside the vocabulary of {vocab_size}"
        ))),
        None => Ok(()),
    }
}

/// Three matrices a block applies together, read from a source in order.
fn three(source: &mut dyn WeightSource, [a, b, c]: [&WeightSpec; 3]) -> Result<[Linear; 3]> {
    Ok([source.linear(a)?, source.linear(b)?, source.linear(c)?])
}

/// A block's query, key and value projections `[q, k, v]`, applied together.
#[derive(Debug, Clone)]
pub(crate) struct Qkv([Linear; 3]);

impl Qkv {
    /// Bytes of the three matrices.
    pub(crate) fn bytes(&self) -> usize {
        self.0.iter().map(Linear::bytes).sum()
    }

    /// The matrices `[q, k, v]` from `source`, in that order.
    pub(crate) fn new(source: &mut dyn WeightSource, specs: [&WeightSpec; 3]) -> Result<Self> {
        three(source, specs).map(Qkv)
    }

    /// `h: [n, dim]` to queries `[n, heads, head_dim]`, keys and values
    /// `[n, kv_heads, head_dim]`.
    pub(crate) fn forward(
        &self,
        h: &Tensor,
        (heads, kv_heads, head_dim): (usize, usize, usize),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let n = h.dim(0)?;
        let [q, k, v] = &self.0;
        let [q, k, v] = forward_shared([q, k, v], h)?;
        let q = q.reshape((n, heads, head_dim))?;
        let k = k.reshape((n, kv_heads, head_dim))?;
        let v = v.reshape((n, kv_heads, head_dim))?;
        Ok((q, k, v))
    }
}

/// A block's gated feed-forward `[gate, up, down]`: `down(act(gate h) * up h)`.
#[derive(Debug, Clone)]
pub(crate) struct FeedForward([Linear; 3]);

impl FeedForward {
    /// Bytes of the three matrices.
    pub(crate) fn bytes(&self) -> usize {
        self.0.iter().map(Linear::bytes).sum()
    }

    /// The matrices `[gate, up, down]` from `source`, in that order.
    pub(crate) fn new(source: &mut dyn WeightSource, specs: [&WeightSpec; 3]) -> Result<Self> {
        three(source, specs).map(FeedForward)
    }

    /// `h: [n, dim]` to `[n, dim]`, the gate through `activation`.
    pub(crate) fn forward(&self, h: &Tensor, activation: Activation) -> Result<Tensor> {
        let [gate, up, down] = &self.0;
        let [g, u] = forward_shared([gate, up], h)?;
        down.forward(&kernels::gated(&g, &u, activation)?)
    }
}
