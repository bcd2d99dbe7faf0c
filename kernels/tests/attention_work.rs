//! `attention_work` against a brute-force count of the visible pairs of every tile.

use longctx_kernels::attention::{KEY_TILE, QUERY_TILE};
use longctx_kernels::{attention_work, AttnMask, AttnParams, AttnShape, Positions};
use proptest::prelude::*;

/// Per tile pair: (visible pairs, all pairs).
fn brute_tiles(m: &AttnMask<'_>, sq: usize, sk: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for q0 in (0..sq).step_by(QUERY_TILE) {
        for k0 in (0..sk).step_by(KEY_TILE) {
            let (q1, k1) = ((q0 + QUERY_TILE).min(sq), (k0 + KEY_TILE).min(sk));
            let seen = (q0..q1).flat_map(|i| (k0..k1).map(move |j| (i, j))).filter(|&(i, j)| m.visible(i, j)).count();
            out.push((seen, (q1 - q0) * (k1 - k0)));
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn tile_counts_bound_the_visible_pairs(
        (heads, sq, sk) in (1usize..=3, 1usize..=700, 1usize..=700),
        (causal, window, q_off, k_off) in (any::<bool>(), prop::option::of(1u64..600), 0i64..900, 0i64..900),
        explicit in prop::option::of(prop::collection::vec(0i64..2000, 700 * 2)),
        docs in prop::option::of(1i64..300),
    ) {
        let shape = AttnShape { batch: 1, q_heads: heads, kv_heads: 1, q_len: sq, kv_len: sk, head_dim: 32 };
        let (q_pos, k_pos): (Vec<i64>, Vec<i64>) = match &explicit {
            Some(v) => (v[..sq].to_vec(), v[700..700 + sk].to_vec()),
            None => ((0..sq as i64).map(|i| q_off + i).collect(), (0..sk as i64).map(|i| k_off + i).collect()),
        };
        let q_doc: Vec<u32> = q_pos.iter().map(|&p| (p / docs.unwrap_or(1)) as u32).collect();
        let k_doc: Vec<u32> = k_pos.iter().map(|&p| (p / docs.unwrap_or(1)) as u32).collect();
        let mut m = AttnMask::full().with_positions(Positions::Explicit(&q_pos), Positions::Explicit(&k_pos));
        if explicit.is_none() {
            m = m.with_positions(Positions::Offset(q_off), Positions::Offset(k_off));
        }
        m.causal = causal;
        m.window = window;
        if docs.is_some() {
            m = m.with_docs(&q_doc, &k_doc);
        }
        let w = attention_work(&AttnParams::new(shape).with_mask(m)).unwrap();
        let tiles = brute_tiles(&m, sq, sk);
        let h = heads as u64;
        let empty = tiles.iter().filter(|t| t.0 == 0).count() as u64;
        let full = tiles.iter().filter(|t| t.0 == t.1).count() as u64;
        let seen: u64 = tiles.iter().map(|t| t.0 as u64).sum();
        prop_assert_eq!(w.visible_tiles + w.partial_tiles + w.hidden_tiles, tiles.len() as u64 * h);
        // Conservative: never skips a tile with a visible pair, never drops the mask where one pair is hidden.
        prop_assert!(w.hidden_tiles <= empty * h, "{:?}: {} empty tiles", w, empty);
        prop_assert!(w.visible_tiles <= full * h, "{:?}: {} full tiles", w, full);
        prop_assert!(w.scores >= seen * h);
        // With consecutive positions and no documents the range test is exact.
        if explicit.is_none() && docs.is_none() {
            prop_assert_eq!(w.hidden_tiles, empty * h);
            prop_assert_eq!(w.visible_tiles, full * h);
            let computed: u64 = tiles.iter().filter(|t| t.0 > 0).map(|t| t.1 as u64).sum();
            prop_assert_eq!(w.scores, computed * h);
        }
    }
}

#[test]
fn zigzag_shards_get_equal_work() {
    // 4 ranks over 8 chunks of 256: rank r holds chunks r and 7 - r. Summed over the ring's steps (every
    // source rank's keys), every rank computes the same number of scores.
    let (cp, chunk) = (4usize, 256usize);
    let pos = |r: usize| -> Vec<i64> {
        let c = |c: usize| (c * chunk) as i64..((c + 1) * chunk) as i64;
        c(r).chain(c(2 * cp - 1 - r)).collect()
    };
    let l = 2 * chunk;
    let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: l, kv_len: l, head_dim: 64 };
    let per_rank: Vec<u64> = (0..cp)
        .map(|r| {
            let qp = pos(r);
            (0..cp)
                .map(|src| {
                    let kp = pos(src);
                    let m = AttnMask::causal().with_positions(Positions::Explicit(&qp), Positions::Explicit(&kp));
                    attention_work(&AttnParams::new(shape).with_mask(m)).unwrap().scores
                })
                .sum()
        })
        .collect();
    assert!(per_rank.iter().all(|&x| x == per_rank[0]), "{per_rank:?}");
    // The whole causal triangle in tiles: 16 tile rows, 16·17/2 tiles, times 2 heads, over 4 ranks.
    assert_eq!(per_rank[0] * cp as u64, 2 * (16 * 17 / 2) * (128 * 128) as u64);
}

#[test]
fn bad_params_are_an_error() {
    let shape = AttnShape { batch: 1, q_heads: 3, kv_heads: 2, q_len: 4, kv_len: 4, head_dim: 64 };
    assert!(attention_work(&AttnParams::new(shape)).is_err());
}
