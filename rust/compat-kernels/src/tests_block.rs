#![allow(clippy::many_single_char_names)] // matrix math reads best as x, w, y, q, k, v

use super::tests::filled;
use super::*;

fn close(got: f32, want: f64, tolerance: f64) -> bool {
    (f64::from(got) - want).abs() <= tolerance
}

#[test]
fn rms_norm_matches_its_definition() {
    // mean of squares of (3, 4) is 12.5: each value is divided by sqrt(12.5 + eps).
    let norm = RmsNorm {
        weight: &[1.0, 2.0],
        eps: 0.5,
    };
    let mut out = [0.0f32; 4];
    norm.apply(&[3.0, 4.0, -1.0, 1.0], &mut out).unwrap();
    let (first, second) = (1.0 / 13.0f64.sqrt(), 1.0 / 1.5f64.sqrt());
    let want = [3.0 * first, 8.0 * first, -second, 2.0 * second];
    for (got, want) in out.iter().zip(want) {
        assert!(close(*got, want, 1e-6), "got {out:?}, want {want:?}");
    }
}

#[test]
fn rms_norm_rejects_mismatched_rows() {
    let norm = RmsNorm {
        weight: &[1.0, 2.0, 3.0],
        eps: 1e-5,
    };
    assert!(norm.apply(&[1.0; 4], &mut [0.0; 4]).is_err());
    assert!(norm.apply(&[1.0; 6], &mut [0.0; 3]).is_err());
}

fn rope(dims: usize, traditional: bool) -> Rope {
    Rope {
        dims,
        base: 10_000.0,
        scale: 0.5,
        traditional,
    }
}

#[test]
fn rope_turns_each_pair_by_its_own_angle() {
    // Head of 6 features, 4 rotated: pair 0 turns by position·scale, pair 1 by
    // position·scale·base^(-1/2); features 4 and 5 stay.
    let position = 7i64;
    let angles = [3.5f64, 3.5 / 100.0];
    let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    for traditional in [false, true] {
        let mut y = x;
        rope(4, traditional).apply(&mut y, 6, &[position]).unwrap();
        let pairs = if traditional {
            [(0, 1), (2, 3)]
        } else {
            [(0, 2), (1, 3)]
        };
        for ((a, b), angle) in pairs.into_iter().zip(angles) {
            let (x1, x2) = (f64::from(x[a]), f64::from(x[b]));
            assert!(
                close(y[a], x1 * angle.cos() - x2 * angle.sin(), 1e-5),
                "{y:?}"
            );
            assert!(
                close(y[b], x1 * angle.sin() + x2 * angle.cos(), 1e-5),
                "{y:?}"
            );
        }
        assert_eq!(&y[4..], &x[4..]);
    }
}

#[test]
fn rope_gives_each_row_its_own_position_and_leaves_position_zero_alone() {
    let x = filled(2 * 3 * 8, 3); // 2 rows of 3 heads of 8 features
    let mut both = x.clone();
    rope(8, false).apply(&mut both, 8, &[0, 41]).unwrap();
    assert_eq!(&both[..24], &x[..24]);
    let mut alone = x[24..].to_vec();
    rope(8, false).apply(&mut alone, 8, &[41]).unwrap();
    assert_eq!(&both[24..], &alone[..]);
    assert_ne!(&both[24..], &x[24..]);
}

#[test]
fn rope_rejects_bad_shapes() {
    let mut x = vec![0.0f32; 16];
    assert!(rope(3, false).apply(&mut x, 8, &[1, 2]).is_err()); // odd dims
    assert!(rope(16, false).apply(&mut x, 8, &[1, 2]).is_err()); // dims > head
    assert!(rope(8, false).apply(&mut x, 8, &[1, 2, 3]).is_err()); // rows
    assert!(rope(8, false).apply(&mut x, 8, &[]).is_err());
}

struct Weights {
    norm: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    post: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

const HIDDEN: usize = 16;
const HEAD_DIM: usize = 4;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const INTER: usize = 24;

fn weights() -> Weights {
    Weights {
        norm: filled(HIDDEN, 10),
        q: filled(HEADS * HEAD_DIM * HIDDEN, 11),
        k: filled(KV_HEADS * HEAD_DIM * HIDDEN, 12),
        v: filled(KV_HEADS * HEAD_DIM * HIDDEN, 13),
        o: filled(HIDDEN * HEADS * HEAD_DIM, 14),
        post: filled(HIDDEN, 15),
        gate: filled(INTER * HIDDEN, 16),
        up: filled(INTER * HIDDEN, 17),
        down: filled(HIDDEN * INTER, 18),
    }
}

fn block(w: &Weights) -> DecoderBlock<'_> {
    DecoderBlock {
        input_norm: RmsNorm {
            weight: &w.norm,
            eps: 1e-5,
        },
        q: &w.q,
        k: &w.k,
        v: &w.v,
        o: &w.o,
        rope: rope(HEAD_DIM, false),
        post_norm: RmsNorm {
            weight: &w.post,
            eps: 1e-5,
        },
        mlp: SwigluWeights {
            gate: &w.gate,
            up: &w.up,
            down: &w.down,
        },
    }
}

#[test]
fn project_is_norm_then_products_then_rope() {
    let w = weights();
    let x = filled(2 * HIDDEN, 20);
    let got = block(&w).project(&x, &[3, 9], HEAD_DIM).unwrap();
    let mut normed = vec![0.0; x.len()];
    block(&w).input_norm.apply(&x, &mut normed).unwrap();
    let mut keys = vec![0.0; 2 * KV_HEADS * HEAD_DIM];
    matmul_nt(&normed, &w.k, &mut keys, 2, HIDDEN, KV_HEADS * HEAD_DIM).unwrap();
    let mut values = keys.clone();
    matmul_nt(&normed, &w.v, &mut values, 2, HIDDEN, KV_HEADS * HEAD_DIM).unwrap();
    assert_eq!(got.values, values);
    rope(HEAD_DIM, false)
        .apply(&mut keys, HEAD_DIM, &[3, 9])
        .unwrap();
    assert_eq!(got.keys, keys);
    assert_eq!(got.queries.len(), 2 * HEADS * HEAD_DIM);
}

#[test]
fn finish_adds_both_residuals() {
    let w = weights();
    let (x, attention) = (filled(2 * HIDDEN, 30), filled(2 * HEADS * HEAD_DIM, 31));
    let mut out = vec![0.0; x.len()];
    block(&w).finish(&x, &attention, &mut out).unwrap();
    let mut h = vec![0.0; x.len()];
    matmul_nt(&attention, &w.o, &mut h, 2, HEADS * HEAD_DIM, HIDDEN).unwrap();
    let h: Vec<f32> = h.iter().zip(&x).map(|(a, b)| a + b).collect();
    let mut normed = vec![0.0; x.len()];
    block(&w).post_norm.apply(&h, &mut normed).unwrap();
    let mut mlp = vec![0.0; x.len()];
    swiglu_mlp(&normed, block(&w).mlp, &mut mlp, 2, HIDDEN, INTER).unwrap();
    let want: Vec<f32> = mlp.iter().zip(&h).map(|(a, b)| a + b).collect();
    assert_eq!(out, want);
}

#[test]
fn a_row_gives_the_same_bits_alone_or_batched() {
    let w = weights();
    let x = filled(3 * HIDDEN, 40);
    let batched = block(&w).project(&x, &[1, 5, 12], HEAD_DIM).unwrap();
    let alone = block(&w)
        .project(&x[HIDDEN..2 * HIDDEN], &[5], HEAD_DIM)
        .unwrap();
    let row = HEADS * HEAD_DIM;
    assert_eq!(&batched.queries[row..2 * row], &alone.queries[..]);
    let mut out = vec![0.0; x.len()];
    block(&w).finish(&x, &batched.queries, &mut out).unwrap();
    let mut one = vec![0.0; HIDDEN];
    block(&w)
        .finish(&x[HIDDEN..2 * HIDDEN], &alone.queries, &mut one)
        .unwrap();
    assert_eq!(&out[HIDDEN..2 * HIDDEN], &one[..]);
}

#[test]
fn block_rejects_inputs_of_the_wrong_size() {
    let w = weights();
    assert!(block(&w)
        .project(&filled(HIDDEN + 1, 1), &[0], HEAD_DIM)
        .is_err());
    let x = filled(2 * HIDDEN, 1);
    assert!(block(&w)
        .finish(&x, &filled(7, 2), &mut [0.0; 2 * HIDDEN])
        .is_err());
    assert!(block(&w)
        .finish(&x, &filled(2 * 16, 2), &mut [0.0; HIDDEN])
        .is_err());
}
