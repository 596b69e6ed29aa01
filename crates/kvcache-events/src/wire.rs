//! vLLM's `KVEventBatch` in msgpack, byte for byte as vLLM's msgspec encoder
//! writes it (vLLM 0.31.0, `vllm/distributed/kv_events.py`):
//!
//! - the batch is `array_like`: a 3-element array `[ts, events,
//!   data_parallel_rank]`, `ts` a float64 (seconds since the Unix epoch), the
//!   rank an integer or nil;
//! - each event is a tagged struct that is *not* `array_like`: a map whose
//!   first key is `"type"` (the class name), then the fields in declaration
//!   order, fields with no default always written (nil when `None`) and
//!   fields still at their default left out (`omit_defaults`):
//!   - `BlockStored`: `type, block_hashes, parent_block_hash, token_ids,
//!     block_size, lora_id (nil), medium, lora_name (nil)`, then our
//!     `cache_salt` for a tenant's blocks (see `kvcache_api::events`);
//!   - `BlockRemoved`: `type, block_hashes, medium`;
//!   - `AllBlocksCleared`: `type`;
//! - integers take msgpack's smallest form (positive fixint, then uint8 to
//!   uint64), strings fixstr or str8, arrays and maps their fix forms up to 15
//!   entries, then 16 and 32 bits.
//!
//! Dynamo's decoder (`lib/kv-router/src/zmq_wire.rs`, `KvEventBatch` and
//! `RawKvEvent`) reads the batch as that tuple and events as either maps or
//! arrays.

use kvcache_api::events::KvEvent;
use rmp::encode;

/// Encodes one batch as vLLM's `KVEventBatch`. `ts` is the batch's time in
/// seconds since the Unix epoch.
///
/// ```
/// use kvcache_api::events::KvEvent;
///
/// let bytes = kvcache_events::encode_batch(1.5, &[KvEvent::AllBlocksCleared], Some(0));
/// // [1.5, [{"type": "AllBlocksCleared"}], 0]
/// assert_eq!(bytes[..10], [0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
/// assert_eq!(&bytes[10..13], &[0x91, 0x81, 0xa4]);
/// assert_eq!(bytes.last(), Some(&0));
/// ```
pub fn encode_batch(ts: f64, events: &[KvEvent], data_parallel_rank: Option<i32>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.iter().map(event_size_hint).sum::<usize>());
    encode::write_array_len(&mut out, 3).expect("writing to a Vec");
    encode::write_f64(&mut out, ts).expect("writing to a Vec");
    encode::write_array_len(&mut out, len32(events.len())).expect("writing to a Vec");
    for event in events {
        encode_event(&mut out, event);
    }
    match data_parallel_rank {
        Some(rank) => write_int(&mut out, i64::from(rank)),
        None => encode::write_nil(&mut out).expect("writing to a Vec"),
    }
    out
}

/// Appends one event, a tagged msgspec struct (a map).
fn encode_event(out: &mut Vec<u8>, event: &KvEvent) {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            namespace,
        } => {
            let salted = !namespace.as_str().is_empty();
            encode::write_map_len(out, if salted { 9 } else { 8 }).expect("writing to a Vec");
            write_str(out, "type");
            write_str(out, "BlockStored");
            write_str(out, "block_hashes");
            write_hashes(out, block_hashes);
            write_str(out, "parent_block_hash");
            match parent_block_hash {
                Some(hash) => write_uint(out, *hash),
                None => encode::write_nil(out).expect("writing to a Vec"),
            }
            write_str(out, "token_ids");
            encode::write_array_len(out, len32(token_ids.len())).expect("writing to a Vec");
            for &token in token_ids {
                write_uint(out, u64::from(token));
            }
            write_str(out, "block_size");
            write_uint(out, *block_size as u64);
            write_str(out, "lora_id");
            encode::write_nil(out).expect("writing to a Vec");
            write_str(out, "medium");
            write_str(out, medium.as_str());
            write_str(out, "lora_name");
            encode::write_nil(out).expect("writing to a Vec");
            if salted {
                write_str(out, "cache_salt");
                write_str(out, namespace.as_str());
            }
        }
        KvEvent::BlockRemoved { block_hashes, medium } => {
            encode::write_map_len(out, 3).expect("writing to a Vec");
            write_str(out, "type");
            write_str(out, "BlockRemoved");
            write_str(out, "block_hashes");
            write_hashes(out, block_hashes);
            write_str(out, "medium");
            write_str(out, medium.as_str());
        }
        KvEvent::AllBlocksCleared => {
            encode::write_map_len(out, 1).expect("writing to a Vec");
            write_str(out, "type");
            write_str(out, "AllBlocksCleared");
        }
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) {
    encode::write_array_len(out, len32(hashes.len())).expect("writing to a Vec");
    for &hash in hashes {
        write_uint(out, hash);
    }
}

fn write_uint(out: &mut Vec<u8>, value: u64) {
    encode::write_uint(out, value).expect("writing to a Vec");
}

fn write_int(out: &mut Vec<u8>, value: i64) {
    encode::write_sint(out, value).expect("writing to a Vec");
}

fn write_str(out: &mut Vec<u8>, text: &str) {
    encode::write_str(out, text).expect("writing to a Vec");
}

/// A msgpack length: no event or batch here comes near 2^32 entries.
fn len32(len: usize) -> u32 {
    u32::try_from(len).expect("fewer than 2^32 entries")
}

fn event_size_hint(event: &KvEvent) -> usize {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            token_ids,
            ..
        } => 120 + 9 * block_hashes.len() + 5 * token_ids.len(),
        KvEvent::BlockRemoved { block_hashes, .. } => 40 + 9 * block_hashes.len(),
        KvEvent::AllBlocksCleared => 24,
    }
}

#[cfg(test)]
mod tests {
    use kvcache_api::events::Medium;
    use kvcache_api::Namespace;

    use super::*;

    /// msgpack of a str of fewer than 32 bytes: fixstr.
    fn s(text: &str) -> Vec<u8> {
        assert!(text.len() < 32);
        let mut out = vec![0xa0 | text.len() as u8];
        out.extend_from_slice(text.as_bytes());
        out
    }

    fn cat(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    /// The batch frame around one encoded event: `[1.5, [event], 0]`.
    fn batch_of(event: &[u8]) -> Vec<u8> {
        cat(&[&[0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x91], event, &[0x00]])
    }

    #[test]
    fn all_blocks_cleared_is_a_one_key_map() {
        let expected = batch_of(&cat(&[&[0x81], &s("type"), &s("AllBlocksCleared")]));
        assert_eq!(encode_batch(1.5, &[KvEvent::AllBlocksCleared], Some(0)), expected);
    }

    #[test]
    fn block_stored_writes_every_field_without_a_default_in_order() {
        let event = KvEvent::BlockStored {
            block_hashes: vec![u64::MAX, 300, 70_000, (1 << 32) + 1],
            parent_block_hash: Some(5),
            token_ids: vec![1, 200, 40_000],
            block_size: 16,
            medium: Medium::Device,
            namespace: Namespace::shared(),
        };
        let expected = batch_of(&cat(&[
            &[0x88],
            &s("type"),
            &s("BlockStored"),
            &s("block_hashes"),
            // fixarray(4): uint64, uint16, uint32, uint64
            &[0x94, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            &[0xcd, 0x01, 0x2c],
            &[0xce, 0x00, 0x01, 0x11, 0x70],
            &[0xcf, 0, 0, 0, 1, 0, 0, 0, 1],
            &s("parent_block_hash"),
            &[0x05],
            &s("token_ids"),
            &[0x93, 0x01, 0xcc, 0xc8, 0xcd, 0x9c, 0x40],
            &s("block_size"),
            &[0x10],
            &s("lora_id"),
            &[0xc0],
            &s("medium"),
            &s("GPU"),
            &s("lora_name"),
            &[0xc0],
        ]));
        assert_eq!(encode_batch(1.5, &[event], Some(0)), expected);
    }

    #[test]
    fn a_tenants_block_carries_its_salt_as_a_ninth_key() {
        let event = KvEvent::BlockStored {
            block_hashes: vec![1],
            parent_block_hash: None,
            token_ids: vec![1],
            block_size: 1,
            medium: Medium::HostMemory,
            namespace: Namespace::new("tenant-a").unwrap(),
        };
        let expected = batch_of(&cat(&[
            &[0x89],
            &s("type"),
            &s("BlockStored"),
            &s("block_hashes"),
            &[0x91, 0x01],
            &s("parent_block_hash"),
            &[0xc0],
            &s("token_ids"),
            &[0x91, 0x01],
            &s("block_size"),
            &[0x01],
            &s("lora_id"),
            &[0xc0],
            &s("medium"),
            &s("CPU"),
            &s("lora_name"),
            &[0xc0],
            &s("cache_salt"),
            &s("tenant-a"),
        ]));
        assert_eq!(encode_batch(1.5, &[event], Some(0)), expected);
    }

    #[test]
    fn block_removed_is_type_hashes_medium() {
        let event = KvEvent::BlockRemoved {
            block_hashes: vec![7, 128],
            medium: Medium::Disk,
        };
        let expected = batch_of(&cat(&[
            &[0x83],
            &s("type"),
            &s("BlockRemoved"),
            &s("block_hashes"),
            &[0x92, 0x07, 0xcc, 0x80],
            &s("medium"),
            &s("STORAGE"),
        ]));
        assert_eq!(encode_batch(1.5, &[event], Some(0)), expected);
    }

    #[test]
    fn an_empty_batch_without_a_rank_keeps_three_elements() {
        // msgspec writes an array_like struct's defaults too: nil, not a shorter array.
        assert_eq!(
            encode_batch(1.5, &[], None),
            [0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x90, 0xc0]
        );
    }

    #[test]
    fn long_lists_switch_to_array16() {
        let event = KvEvent::BlockRemoved {
            block_hashes: (0..16).collect(),
            medium: Medium::Device,
        };
        let bytes = encode_batch(1.5, &[event], Some(0));
        let at = bytes.windows(3).position(|w| w == [0xdc, 0x00, 0x10]);
        assert!(at.is_some(), "array16 header for 16 hashes");
    }

    #[test]
    fn known_bytes_from_vllms_encoder() {
        // msgspec 0.19 encoding vLLM 0.31's KVEventBatch(ts=1.5, events=[
        //   BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None),
        //   BlockRemoved([1], "GPU"), AllBlocksCleared()], data_parallel_rank=0)
        let vllm = "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368\
                    6573920102b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa\
                    626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d\
                    65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739101a66d6564\
                    69756da347505581a474797065b0416c6c426c6f636b73436c656172656400";
        let events = [
            KvEvent::BlockStored {
                block_hashes: vec![1, 2],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                medium: Medium::Device,
                namespace: Namespace::shared(),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![1],
                medium: Medium::Device,
            },
            KvEvent::AllBlocksCleared,
        ];
        let hex: String = encode_batch(1.5, &events, Some(0))
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(hex, vllm);
    }
}
