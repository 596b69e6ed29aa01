//! Driving an engine over the causal cache to the end, for the engine tests.

use kvcache_causal::CausalKvCache;
use kvcache_engine::engine::{Engine, Event, Finished};

/// Steps `engine` until it is idle, then checks the cache's invariants;
/// returns the requests that finished, by id.
pub fn drain(engine: &mut Engine<'_, CausalKvCache>) -> Vec<Finished> {
    let mut finished = Vec::new();
    while engine
        .step(&mut |e| {
            if let Event::Finished(f) = e {
                finished.push(f.clone());
            }
        })
        .expect("an engine step")
    {}
    engine.cache().check();
    finished.sort_by_key(|f| f.id);
    finished
}
