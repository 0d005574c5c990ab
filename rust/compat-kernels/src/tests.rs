#![allow(clippy::many_single_char_names)] // matrix math reads best as x, w, y, q, k, v

use proptest::prelude::*;

use super::*;

fn reference(x: &[f32], w: &[f32], rows: usize, depth: usize, cols: usize) -> Vec<f64> {
    let mut y = vec![0.0f64; rows * cols];
    for m in 0..rows {
        for n in 0..cols {
            y[m * cols + n] = (0..depth)
                .map(|k| f64::from(x[m * depth + k]) * f64::from(w[n * depth + k]))
                .sum();
        }
    }
    y
}

/// `sum_k |x_mk| |w_nk|` per output: what the rounding error of a float sum scales with.
fn magnitude(x: &[f32], w: &[f32], rows: usize, depth: usize, cols: usize) -> Vec<f64> {
    let abs = |v: &[f32]| v.iter().map(|a| a.abs()).collect::<Vec<f32>>();
    reference(&abs(x), &abs(w), rows, depth, cols)
}

pub(crate) fn filled(len: usize, seed: u32) -> Vec<f32> {
    // Deterministic values in [-1, 1): enough to catch a wrong index or a dropped lane.
    (0..len)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            (h >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// float32's unit roundoff.
const U: f64 = 1.0 / (1u64 << 24) as f64;

/// The classic bound on a float32 dot product of `depth` terms, in any summation order (any
/// SIMD width, blocking or FMA use): `|computed - exact| <= gamma(depth) * sum |x_k w_k|`
/// with `gamma(n) = n u / (1 - n u)` (Higham, Accuracy and Stability, 3.1), plus the final
/// rounding to float32. It holds on every CPU by construction.
fn gamma(depth: usize) -> f64 {
    let nu = depth as f64 * U;
    nu / (1.0 - nu)
}

fn assert_within(y: &[f32], expected: &[f64], bound: &[f64]) {
    for (i, ((got, want), bound)) in y.iter().zip(expected).zip(bound).enumerate() {
        let tolerance = bound + U * want.abs();
        assert!(
            (f64::from(*got) - want).abs() <= tolerance,
            "element {i}: got {got}, want {want} (bound {tolerance})"
        );
    }
}

/// `y` is the float32 product of operands whose `magnitude` is given, against the exact one.
fn assert_close(y: &[f32], expected: &[f64], magnitude: &[f64], depth: usize) {
    let bound: Vec<f64> = magnitude.iter().map(|m| gamma(depth) * m).collect();
    assert_within(y, expected, &bound);
}

fn check(rows: usize, depth: usize, cols: usize) {
    let x = filled(rows * depth, 1);
    let w = filled(cols * depth, 2);
    let mut y = vec![f32::NAN; rows * cols];
    matmul_nt(&x, &w, &mut y, rows, depth, cols).unwrap();
    let exact = reference(&x, &w, rows, depth, cols);
    assert_close(&y, &exact, &magnitude(&x, &w, rows, depth, cols), depth);
}

#[test]
fn matches_reference_on_model_shapes() {
    for rows in [1, 2, 7, 8, 9, 16, 17] {
        for (depth, cols) in [(576, 1536), (1536, 576), (576, 192), (64, 5000)] {
            check(rows, depth, cols);
        }
    }
}

#[test]
fn handles_depth_not_a_multiple_of_the_vector_width() {
    for depth in [1, 5, 15, 16, 17, 31, 33, 100] {
        check(3, depth, 10);
    }
}

#[test]
fn handles_column_counts_around_block_and_task_boundaries() {
    for cols in [1, 2, 3, 4, 5, 95, 96, 97, 191, 192, 193, 383] {
        check(8, 48, cols);
    }
}

#[test]
fn a_row_gives_the_same_bits_whatever_else_is_in_the_batch() {
    // Batched decode must equal decode alone: a row's sums may not depend on the others.
    let (depth, cols) = (576, 1536);
    let x = filled(8 * depth, 3);
    let w = filled(cols * depth, 4);
    let mut batched = vec![0.0; 8 * cols];
    matmul_nt(&x, &w, &mut batched, 8, depth, cols).unwrap();
    for m in 0..8 {
        let mut alone = vec![0.0; cols];
        matmul_nt(
            &x[m * depth..(m + 1) * depth],
            &w,
            &mut alone,
            1,
            depth,
            cols,
        )
        .unwrap();
        assert_eq!(alone, batched[m * cols..(m + 1) * cols], "row {m}");
    }
}

#[test]
fn simd_and_scalar_paths_agree() {
    let (rows, depth, cols) = (5, 200, 70);
    let x = filled(rows * depth, 5);
    let w = filled(cols * depth, 6);
    let mut scalar = vec![0.0; rows * cols];
    let mut scalar_rows: Vec<&mut [f32]> = scalar.chunks_mut(cols).collect();
    pass_scalar(&x, &w, &mut scalar_rows, depth);
    let mut y = vec![0.0; rows * cols];
    matmul_nt(&x, &w, &mut y, rows, depth, cols).unwrap();
    let expected: Vec<f64> = scalar.iter().map(|v| f64::from(*v)).collect();
    // Two float32 orders, each within gamma * magnitude of the exact product.
    let twice: Vec<f64> = magnitude(&x, &w, rows, depth, cols)
        .iter()
        .map(|m| 2.0 * m)
        .collect();
    assert_close(&y, &expected, &twice, depth);
}

#[test]
fn rejects_operands_of_the_wrong_size() {
    let mut y = vec![0.0; 6];
    let err = matmul_nt(&[0.0; 5], &[0.0; 9], &mut y, 2, 3, 3).unwrap_err();
    assert!(err.0.contains("x has 5 elements, expected 2 x 3"), "{err}");
    let err = matmul_nt(&[0.0; 6], &[0.0; 8], &mut y, 2, 3, 3).unwrap_err();
    assert!(err.0.contains("w has 8 elements"), "{err}");
    let err = matmul_nt(&[0.0; 6], &[0.0; 9], &mut y[..5], 2, 3, 3).unwrap_err();
    assert!(err.0.contains("y has 5 elements"), "{err}");
}

#[test]
fn empty_shapes_are_fine() {
    let mut y = vec![1.0; 6];
    matmul_nt(&[], &[], &mut y, 2, 0, 3).unwrap();
    assert_eq!(y, vec![0.0; 6]);
    matmul_nt(&[], &[0.0; 12], &mut [], 0, 4, 3).unwrap();
}

#[test]
fn swiglu_mlp_matches_its_definition() {
    let (rows, hidden, inter) = (5, 40, 70);
    let x = filled(rows * hidden, 7);
    let (gate, up, down) = (
        filled(inter * hidden, 8),
        filled(inter * hidden, 9),
        filled(hidden * inter, 10),
    );
    let g = reference(&x, &gate, rows, hidden, inter);
    let u = reference(&x, &up, rows, hidden, inter);
    let silu = |g: f64| g / (1.0 + (-g).exp());
    let h: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(g, u)| (silu(*g) * u) as f32)
        .collect();
    let expected = reference(&h, &down, rows, inter, hidden);
    // The bound carried through both products: each of g and u is within
    // gamma(hidden) * magnitude of exact; |silu'| <= 1.1, so h = silu(g) u moves by at most
    // 1.1 |u| dg + |silu(g)| du, plus the rounding of the activation itself (a few u |h|);
    // the down product adds gamma(inter) * sum |h| |down| and passes on sum dh |down|.
    let (mg, mu) = (
        magnitude(&x, &gate, rows, hidden, inter),
        magnitude(&x, &up, rows, hidden, inter),
    );
    let dh: Vec<f32> = (0..rows * inter)
        .map(|i| {
            let (dg, du) = (gamma(hidden) * mg[i], gamma(hidden) * mu[i]);
            let h = silu(g[i]) * u[i];
            (1.1 * u[i].abs() * dg + silu(g[i]).abs() * du + 8.0 * U * h.abs()) as f32
        })
        .collect();
    let carried = magnitude(&dh, &down, rows, inter, hidden);
    let bound: Vec<f64> = magnitude(&h, &down, rows, inter, hidden)
        .iter()
        .zip(&carried)
        .map(|(m, c)| gamma(inter) * m + c * (1.0 + gamma(inter)))
        .collect();
    let mut y = vec![f32::NAN; rows * hidden];
    let weights = SwigluWeights {
        gate: &gate,
        up: &up,
        down: &down,
    };
    swiglu_mlp(&x, weights, &mut y, rows, hidden, inter).unwrap();
    assert_within(&y, &expected, &bound);
}

#[test]
fn swiglu_mlp_rejects_a_down_projection_of_the_wrong_shape() {
    let gate = [0.0; 12];
    let weights = SwigluWeights {
        gate: &gate,
        up: &gate,
        down: &[0.0; 11],
    };
    let err = swiglu_mlp(&[0.0; 3], weights, &mut [0.0; 3], 1, 3, 4).unwrap_err();
    assert!(err.0.contains("w has 11 elements"), "{err}");
}

proptest! {
    #[test]
    fn any_shape_matches_the_reference(rows in 1usize..20, depth in 1usize..70, cols in 1usize..300) {
        check(rows, depth, cols);
    }
}

mod attention {
    use super::filled;
    use crate::{attention_decode, CachedHeads, DecodeShape, ShapeError};

    /// Reference in f64 over contiguous `[batch, kv_heads, positions, dim]` keys/values.
    fn reference(
        shape: &DecodeShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: Option<&[bool]>,
    ) -> Vec<f64> {
        let DecodeShape {
            batch,
            heads,
            kv_heads,
            positions,
            head_dim: d,
            scale,
        } = *shape;
        let mut out = vec![0.0; batch * heads * d];
        for b in 0..batch {
            for h in 0..heads {
                let g = h / (heads / kv_heads);
                let at = |t: usize| ((b * kv_heads + g) * positions + t) * d;
                let scores: Vec<f64> = (0..positions)
                    .map(|t| {
                        if mask.is_some_and(|m| !m[b * positions + t]) {
                            return f64::NEG_INFINITY;
                        }
                        let qk: f64 = (0..d)
                            .map(|i| {
                                f64::from(q[(b * heads + h) * d + i]) * f64::from(k[at(t) + i])
                            })
                            .sum();
                        f64::from(scale) * qk
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for i in 0..d {
                    out[(b * heads + h) * d + i] = (0..positions)
                        .map(|t| weights[t] * f64::from(v[at(t) + i]))
                        .sum::<f64>()
                        / total;
                }
            }
        }
        out
    }

    fn contiguous<'a>(data: &'a [f32], shape: &DecodeShape) -> CachedHeads<'a> {
        let position_stride = shape.head_dim;
        let head_stride = shape.positions * position_stride;
        CachedHeads {
            data,
            batch_stride: shape.kv_heads * head_stride,
            head_stride,
            position_stride,
        }
    }

    /// Attention over contiguous `[batch, kv_heads, positions, dim]` keys and values.
    fn packed(
        shape: &DecodeShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: Option<&[bool]>,
    ) -> Result<Vec<f32>, ShapeError> {
        let mut out = vec![f32::NAN; q.len()];
        attention_decode(
            shape,
            q,
            contiguous(k, shape),
            contiguous(v, shape),
            mask,
            &mut out,
        )?;
        Ok(out)
    }

    fn shape(batch: usize, positions: usize) -> DecodeShape {
        DecodeShape {
            batch,
            heads: 6,
            kv_heads: 2,
            positions,
            head_dim: 20,
            scale: 0.2,
        }
    }

    #[test]
    fn matches_the_reference_with_grouped_heads_and_a_padding_mask() {
        let s = shape(3, 17);
        let n = s.batch * s.kv_heads * s.positions * s.head_dim;
        let (q, k, v) = (
            filled(s.batch * s.heads * s.head_dim, 1),
            filled(n, 2),
            filled(n, 3),
        );
        let mask: Vec<bool> = (0..s.batch * s.positions)
            .map(|i| i % s.positions >= (i / s.positions) * 4)
            .collect();
        for mask in [None, Some(mask.as_slice())] {
            let out = packed(&s, &q, &k, &v, mask).unwrap();
            for (got, want) in out.iter().zip(reference(&s, &q, &k, &v, mask)) {
                assert!((f64::from(*got) - want).abs() < 1e-5, "{got} vs {want}");
            }
        }
    }

    #[test]
    fn reads_a_strided_view_of_a_larger_cache() {
        // A cache allocated for 32 positions, of which the first 9 are in use.
        let s = shape(2, 9);
        let capacity = 32;
        let full = filled(s.batch * s.kv_heads * capacity * s.head_dim, 4);
        let strided = CachedHeads {
            data: &full,
            batch_stride: s.kv_heads * capacity * s.head_dim,
            head_stride: capacity * s.head_dim,
            position_stride: s.head_dim,
        };
        let mut in_use = Vec::new();
        for bg in 0..s.batch * s.kv_heads {
            in_use
                .extend_from_slice(&full[bg * capacity * s.head_dim..][..s.positions * s.head_dim]);
        }
        let q = filled(s.batch * s.heads * s.head_dim, 5);
        let mut from_view = vec![0.0; q.len()];
        attention_decode(&s, &q, strided, strided, None, &mut from_view).unwrap();
        assert_eq!(from_view, packed(&s, &q, &in_use, &in_use, None).unwrap());
    }

    #[test]
    fn a_left_padded_row_gets_the_bits_it_gets_alone() {
        let s = shape(2, 12);
        let n = s.batch * s.kv_heads * s.positions * s.head_dim;
        let (q, k, v) = (
            filled(s.batch * s.heads * s.head_dim, 6),
            filled(n, 7),
            filled(n, 8),
        );
        // Row 1 is padded by 5 positions on the left.
        let mask: Vec<bool> = (0..2 * s.positions)
            .map(|i| i < s.positions || i % s.positions >= 5)
            .collect();
        let batched = packed(&s, &q, &k, &v, Some(&mask)).unwrap();
        let alone_shape = DecodeShape {
            batch: 1,
            positions: 7,
            ..s
        };
        let row_kv = |data: &[f32]| {
            let mut out = Vec::new();
            for g in 0..s.kv_heads {
                out.extend_from_slice(
                    &data[((s.kv_heads + g) * s.positions + 5) * s.head_dim..][..7 * s.head_dim],
                );
            }
            out
        };
        let (k1, v1) = (row_kv(&k), row_kv(&v));
        let half = s.heads * s.head_dim;
        let alone = packed(&alone_shape, &q[half..], &k1, &v1, None).unwrap();
        assert_eq!(alone, batched[half..]);
    }

    #[test]
    fn rejects_views_past_the_end_and_bad_head_groups() {
        let s = shape(1, 4);
        let k = vec![0.0; 10];
        let q = vec![0.0; s.heads * s.head_dim];
        let err = packed(&s, &q, &k, &k, None).unwrap_err();
        assert!(err.0.contains("keys reaches element"), "{err}");
        let bad = DecodeShape { kv_heads: 4, ..s };
        let err = packed(&bad, &q, &k, &k, None).unwrap_err();
        assert!(err.0.contains("6 query heads cannot share 4"), "{err}");
    }
}
