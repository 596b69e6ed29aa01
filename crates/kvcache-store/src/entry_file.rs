//! The disk tier's file format: one [safetensors] file per block, readable by
//! any safetensors tool.
//!
//! Tensors, in this order in the data section (which is exactly the block's
//! canonical [`HostKv`](kvcache_api::HostKv) bytes): `layers.{i}.keys`
//! `[kv_heads, tokens, head_dim]` and `layers.{i}.values`
//! `[kv_heads, tokens, head_dim_v]` for every layer `i`, in the layout's dtype.
//! The header's `__metadata__` carries `format`, `key`, `parent` (hex), `start`,
//! `tokens`, `layout`, `fingerprint`, `namespace` and `crc32` (of the data
//! section, 8 hex digits).
//!
//! [safetensors]: https://huggingface.co/docs/safetensors

use std::collections::HashMap;
use std::io::Read;

use kvcache_api::{DType, KvLayout, Namespace};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use crate::error::{Result, StoreError};
use crate::keys::BlockKey;
use crate::tier::{Block, TierContext};

/// The `format` value of files this version writes.
pub const FORMAT: &str = "kvcache-store/1";

/// What a file's header says about its block.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    pub(crate) key: BlockKey,
    pub(crate) parent: BlockKey,
    pub(crate) start: usize,
    pub(crate) tokens: usize,
    pub(crate) namespace: Namespace,
    pub(crate) crc32: u32,
    /// Bytes before the data section (the length word and the JSON).
    pub(crate) header_len: u64,
    /// Bytes of the data section.
    pub(crate) data_len: u64,
    fingerprint: String,
    layout: String,
    table: Metadata,
}

impl Header {
    /// Whether the file was written for this model and layout.
    pub(crate) fn belongs_to(&self, context: &TierContext) -> bool {
        self.fingerprint == context.fingerprint.to_hex() && self.layout == layout_text(&context.layout)
    }

    /// The whole file's expected length.
    pub(crate) fn file_len(&self) -> u64 {
        self.header_len + self.data_len
    }
}

/// `layers=30 kv_heads=3 head_dim=64 head_dim_v=64 dtype=f32`.
pub(crate) fn layout_text(layout: &KvLayout) -> String {
    format!(
        "layers={} kv_heads={} head_dim={} head_dim_v={} dtype={}",
        layout.layers, layout.kv_heads, layout.head_dim, layout.head_dim_v, layout.dtype
    )
}

fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
    }
}

/// The tensors of a block of `tokens` tokens, in data-section order.
fn tensor_infos(layout: &KvLayout, tokens: usize) -> Vec<(String, TensorInfo)> {
    let elem = layout.dtype.size_in_bytes();
    let mut at = 0;
    let mut out = Vec::with_capacity(layout.layers * 2);
    for layer in 0..layout.layers {
        for (part, dim) in [("keys", layout.head_dim), ("values", layout.head_dim_v)] {
            let len = layout.kv_heads * tokens * dim * elem;
            out.push((
                format!("layers.{layer}.{part}"),
                TensorInfo {
                    dtype: safetensors_dtype(layout.dtype),
                    shape: vec![layout.kv_heads, tokens, dim],
                    data_offsets: (at, at + len),
                },
            ));
            at += len;
        }
    }
    out
}

/// What a file's header says of the block it holds (the data aside).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Describe<'a> {
    pub(crate) key: &'a BlockKey,
    pub(crate) parent: &'a BlockKey,
    pub(crate) namespace: &'a Namespace,
    pub(crate) layout: &'a KvLayout,
    pub(crate) start: usize,
    pub(crate) tokens: usize,
}

impl<'a> Describe<'a> {
    /// The description of a whole block.
    pub(crate) fn of(block: &'a Block) -> Self {
        Describe {
            key: &block.key,
            parent: &block.parent,
            namespace: &block.namespace,
            layout: block.kv.layout(),
            start: block.kv.start(),
            tokens: block.kv.tokens(),
        }
    }

    /// Bytes of the data section.
    pub(crate) fn data_len(&self) -> usize {
        self.tokens * self.layout.token_bytes()
    }
}

/// The bytes before the data section of a block's file: the header length
/// (u64 LE) and the JSON header, padded with spaces to a multiple of 8.
pub(crate) fn encode_header(block: Describe<'_>, context: &TierContext, crc32: u32) -> Result<Vec<u8>> {
    let metadata: HashMap<String, String> = [
        ("format", FORMAT.to_owned()),
        ("key", block.key.to_hex()),
        ("parent", block.parent.to_hex()),
        ("start", block.start.to_string()),
        ("tokens", block.tokens.to_string()),
        ("layout", layout_text(block.layout)),
        ("fingerprint", context.fingerprint.to_hex()),
        ("namespace", block.namespace.as_str().to_owned()),
        ("crc32", format!("{crc32:08x}")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let metadata = Metadata::new(Some(metadata), tensor_infos(block.layout, block.tokens))
        .map_err(|e| StoreError::Corrupt(format!("cannot describe the block: {e}")))?;
    let mut json = serde_json::to_vec(&metadata)
        .map_err(|e| StoreError::Corrupt(format!("cannot encode a header: {e}")))?;
    while (8 + json.len()) % 8 != 0 {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// The longest header accepted (safetensors' own limit is 100 MB; ours are a
/// few kilobytes per hundred layers).
const MAX_HEADER: u64 = 16 << 20;

/// Reads and checks the header at the start of `reader`. A short or unparseable
/// header, or one whose tensors do not describe a block of its layout, is
/// [`StoreError::Corrupt`]; I/O failures are [`StoreError::Io`] on `path`.
pub(crate) fn read_header(reader: &mut impl Read, path: &std::path::Path) -> Result<Header> {
    let corrupt = |why: String| StoreError::Corrupt(format!("{}: {why}", path.display()));
    let io = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            corrupt("truncated header".into())
        } else {
            StoreError::io("read", path, e)
        }
    };
    let mut word = [0u8; 8];
    reader.read_exact(&mut word).map_err(io)?;
    let n = u64::from_le_bytes(word);
    if n > MAX_HEADER {
        return Err(corrupt(format!("header of {n} bytes")));
    }
    let mut json = vec![0u8; n as usize];
    reader.read_exact(&mut json).map_err(io)?;
    let metadata: Metadata =
        serde_json::from_slice(&json).map_err(|e| corrupt(format!("unparseable header: {e}")))?;
    let fields = metadata
        .metadata()
        .as_ref()
        .ok_or_else(|| corrupt("no __metadata__".into()))?;
    let field = |name: &str| {
        fields
            .get(name)
            .map(String::as_str)
            .ok_or_else(|| corrupt(format!("no `{name}` in __metadata__")))
    };
    let number = |name: &str| -> Result<usize> {
        field(name)?
            .parse()
            .map_err(|_| corrupt(format!("`{name}` is not a number")))
    };
    let key_of = |name: &str| -> Result<BlockKey> {
        BlockKey::from_hex(field(name)?).ok_or_else(|| corrupt(format!("`{name}` is not a key")))
    };
    if field("format")? != FORMAT {
        return Err(corrupt(format!("format {:?}", field("format")?)));
    }
    let namespace = match field("namespace")? {
        "" => Namespace::shared(),
        salt => Namespace::new(salt).map_err(|e| corrupt(format!("namespace: {e}")))?,
    };
    let crc32 = u32::from_str_radix(field("crc32")?, 16).map_err(|_| corrupt("`crc32` is not hex".into()))?;
    let header = Header {
        key: key_of("key")?,
        parent: key_of("parent")?,
        start: number("start")?,
        tokens: number("tokens")?,
        namespace,
        crc32,
        header_len: 8 + n,
        data_len: metadata.data_len() as u64,
        fingerprint: field("fingerprint")?.to_owned(),
        layout: field("layout")?.to_owned(),
        table: metadata.clone(),
    };
    Ok(header)
}

impl Header {
    /// Checks that the tensor table describes a block of `layout` with the
    /// header's token count: names, dtypes, shapes and offsets in canonical order.
    pub(crate) fn check_tensors(&self, layout: &KvLayout) -> Result<()> {
        let tensors = self.table.tensors();
        let expected = tensor_infos(layout, self.tokens);
        if self.tokens == 0 || tensors.len() != expected.len() {
            return Err(StoreError::Corrupt(format!(
                "{} tensors for {} tokens, a block has {}",
                tensors.len(),
                self.tokens,
                expected.len()
            )));
        }
        for (name, want) in &expected {
            match tensors.get(name) {
                Some(got)
                    if got.dtype == want.dtype
                        && got.shape == want.shape
                        && got.data_offsets == want.data_offsets => {}
                _ => return Err(StoreError::Corrupt(format!("tensor {name} missing or misshapen"))),
            }
        }
        Ok(())
    }
}
