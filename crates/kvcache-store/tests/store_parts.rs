//! A cache's parts in two stores (`StoreParts`): a part without a window
//! stored from position 0, a window part the tail its memory keeps; a
//! restore ends where both serve the prompt, and not at all where the
//! window part lacks the window before every point the other part reaches.

use std::sync::Arc;
use std::time::Duration;

use kvcache_api::{
    CacheError, DType, Fingerprint, HostKv, KvLayout, Namespace, PrefixStore, StorePart, StoreParts,
    WriteBack,
};
use kvcache_store::{MemoryTier, StoreConfig, TieredStore};

const MODEL: Fingerprint = Fingerprint([4; 32]);
const LAYOUT: KvLayout = KvLayout {
    layers: 3,
    kv_heads: 1,
    head_dim: 2,
    head_dim_v: 2,
    dtype: DType::F32,
};

fn parts() -> (StoreParts, Vec<Arc<TieredStore>>) {
    let window = StorePart::layers(vec![0, 1], Some(4), Some(6));
    let global = StorePart::layers(vec![2], None, None);
    let mut stores = Vec::new();
    let mut parts: Vec<(StorePart, Arc<dyn PrefixStore>)> = Vec::new();
    for part in [window, global] {
        let config = StoreConfig::new(part.fingerprint(MODEL), part.layout(LAYOUT)).with_block_tokens(4);
        let memory = MemoryTier::new(config.context(), 1 << 20);
        let store = Arc::new(TieredStore::new(config, vec![Box::new(memory)]).unwrap());
        stores.push(store.clone());
        parts.push((part, store));
    }
    (
        StoreParts::new(MODEL, parts, Duration::from_secs(1)).unwrap(),
        stores,
    )
}

/// Rows of `range` for part `part` whose every byte names the part and
/// the position.
fn rows(part: usize, range: std::ops::Range<usize>) -> Result<HostKv, CacheError> {
    let layout = KvLayout {
        layers: if part == 0 { 2 } else { 1 },
        ..LAYOUT
    };
    let mut kv = HostKv::zeroed(layout, range.start, range.len());
    for layer in 0..layout.layers {
        let rows = kv.layer_mut(layer);
        let per = rows.keys.len() / range.len();
        for (i, b) in rows.keys.iter_mut().enumerate() {
            *b = (part * 100 + range.start + i / per) as u8;
        }
    }
    Ok(kv)
}

#[test]
fn a_window_part_stores_its_tail_and_restores_only_where_it_covers_the_window() {
    let (parts, stores) = parts();
    let ns = Namespace::shared();
    let tokens: Vec<u32> = (0..20).map(|t| t * 3 + 1).collect();
    let wrote = parts.write_back(&ns, &tokens, |_| 0, rows).unwrap();
    // The window part keeps 6 positions below the next one (15..20): its
    // tail from the block at 16; the global part everything.
    assert_eq!(
        wrote.iter().map(WriteBack::stored_tokens).collect::<Vec<_>>(),
        [4, 20]
    );
    for store in &stores {
        store.flush();
    }
    assert_eq!(stores[0].known_from(&ns, &tokens, 16), 20);
    assert_eq!(stores[0].known_from(&ns, &tokens, 12), 12, "nothing from 12");
    assert_eq!(stores[0].known_prefix(&ns, &tokens), 0);
    assert_eq!(stores[1].known_prefix(&ns, &tokens), 20);
    // Written once: the next write-back finds both parts held.
    let again = parts.write_back(&ns, &tokens, |_| 0, rows).unwrap();
    assert_eq!(again, [WriteBack::Held, WriteBack::Held]);

    // The next turn: all 20 back, the window part from 16 (a query at 20
    // needs 17..20).
    let mut next = tokens.clone();
    next.extend([99, 98]);
    let found = parts.restore(&ns, &next, 0).unwrap().expect("restored");
    assert_eq!(found.end, 20);
    assert_eq!(found.parts[0].kv.range(), 16..20);
    assert_eq!(found.parts[1].kv.range(), 0..20);
    assert_eq!(found.parts[0].fingerprint, parts.layout()[0].fingerprint(MODEL));
    assert_eq!(found.parts[0].kv, rows(0, 16..20).unwrap());
    assert_eq!(found.parts[1].kv, rows(1, 0..20).unwrap());
    assert_eq!(found.tiers, vec![("memory", 20)]);
    // From 18 (the cache holds 0..18): both parts from there.
    let found = parts.restore(&ns, &next, 18).unwrap().expect("restored");
    assert_eq!(
        (found.parts[0].kv.range(), found.parts[1].kv.range()),
        (18..20, 18..20)
    );

    // Parting at 18: the global part serves whole blocks to 16, but the
    // window part holds nothing over 13..16: nothing comes back.
    let mut parted = tokens[..18].to_vec();
    parted.extend([99, 98, 97]);
    assert_eq!(parts.restore(&ns, &parted, 0).unwrap(), None);
    // Another namespace: nothing.
    let other = Namespace::new("tenant").unwrap();
    assert_eq!(parts.restore(&other, &next, 0).unwrap(), None);
}

#[test]
fn stores_of_another_part_or_model_are_refused() {
    let window = StorePart::layers(vec![0, 1], Some(4), Some(6));
    let global = StorePart::layers(vec![2], None, None);
    let store = |fingerprint| -> Arc<dyn PrefixStore> {
        let config = StoreConfig::new(fingerprint, LAYOUT).with_block_tokens(4);
        let memory = MemoryTier::new(config.context(), 1 << 20);
        Arc::new(TieredStore::new(config, vec![Box::new(memory)]).unwrap())
    };
    // The model's own fingerprint is not a part's.
    let err = StoreParts::new(
        MODEL,
        vec![
            (window.clone(), store(MODEL)),
            (global.clone(), store(global.fingerprint(MODEL))),
        ],
        Duration::from_secs(1),
    )
    .unwrap_err();
    assert!(
        matches!(err, CacheError::LayoutMismatch { what: "model", .. }),
        "{err:?}"
    );
    // Only window parts: nothing says how far a prompt is stored.
    let err = StoreParts::new(
        MODEL,
        vec![(window.clone(), store(window.fingerprint(MODEL)))],
        Duration::from_secs(1),
    )
    .unwrap_err();
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err:?}");
}
