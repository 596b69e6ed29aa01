//! The causal scenarios of SCENARIOS.md (S1-S6) and more, from the text files in
//! `fixtures/causal/`, in every dtype and value layout, with insta snapshots of
//! their transcripts (mask grids, cells, keys and what each token sees).

mod common;

use common::fixture::{check_scenario, dir};

macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                check_scenario(stringify!($name));
            }
        )*

        #[test]
        fn every_fixture_file_has_a_test() {
            let listed = [$(stringify!($name)),*];
            let mut files: Vec<String> = std::fs::read_dir(dir())
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "txt"))
                .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
                .collect();
            files.sort();
            let mut listed: Vec<String> = listed.iter().map(|s| s.to_string()).collect();
            listed.sort();
            assert_eq!(files, listed, "add a line to scenarios! for each fixture file");
        }
    };
}

scenarios!(
    s1_store,
    s2_sliding_window,
    s3_chunked,
    s4_two_sequences,
    s5_remove_shift,
    s5_remove_errors,
    s6_copy_prefix,
    s7_padding_causal_reserve,
    s8_window_idle_sequences,
    s9_window_memory,
    s10_contiguous_compaction,
    s11_compact_threshold,
    s12_shared_prefix_lifecycle,
);
