//! AVX-512 pass of the skinny matmul. The only module with unsafe code: SIMD loads from
//! slice pointers (bounds checked by slicing first) and the call into a
//! `#[target_feature]` function after the feature was detected at run time.
#![allow(unsafe_code)]

/// Output columns (weight rows) one block computes together.
pub const COLUMN_BLOCK: usize = 3;

#[cfg(target_arch = "x86_64")]
pub fn avx512_available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
pub fn avx512_available() -> bool {
    false
}

/// One pass: `out_rows[m][n] = x[m, :] · w[n, :]` for up to 8 rows of `x`.
#[cfg(target_arch = "x86_64")]
pub fn pass_avx512(x: &[f32], w: &[f32], out_rows: &mut [&mut [f32]], depth: usize) {
    assert!(
        avx512_available(),
        "pass_avx512 called on a CPU without AVX-512F"
    );
    macro_rules! dispatch {
        ($($rows:literal)*) => {
            match out_rows.len() {
                $($rows => {
                    // SAFETY: AVX-512F was detected on this CPU just above.
                    unsafe { x86::pass::<$rows>(x, w, out_rows, depth) }
                })*
                other => panic!("a pass takes 1..=8 rows, got {other}"),
            }
        };
    }
    dispatch!(1 2 3 4 5 6 7 8);
}

#[cfg(not(target_arch = "x86_64"))]
pub fn pass_avx512(_: &[f32], _: &[f32], _: &mut [&mut [f32]], _: usize) {
    unreachable!("AVX-512 is never reported available off x86_64")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m512, __mmask16, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_maskz_loadu_ps,
        _mm512_reduce_add_ps, _mm512_setzero_ps,
    };

    use super::COLUMN_BLOCK;

    const LANES: usize = 16;

    /// Loads 16 floats starting at `at`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load(s: &[f32], at: usize) -> __m512 {
        let lanes = &s[at..at + LANES];
        // SAFETY: `lanes` holds exactly 16 initialised f32s; the load is unaligned.
        unsafe { _mm512_loadu_ps(lanes.as_ptr()) }
    }

    /// Loads the `mask`ed lanes of the last, partial group of 16 starting at `at`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load_tail(s: &[f32], at: usize, mask: __mmask16) -> __m512 {
        let lanes = &s[at..];
        debug_assert!(lanes.len() >= mask.count_ones() as usize);
        // SAFETY: `mask` selects the first `lanes.len()` lanes (< 16) only; masked-off
        // lanes are not read, so the load stays inside `lanes`.
        unsafe { _mm512_maskz_loadu_ps(mask, lanes.as_ptr()) }
    }

    #[target_feature(enable = "avx512f")]
    pub fn pass<const ROWS: usize>(
        x: &[f32],
        w: &[f32],
        out_rows: &mut [&mut [f32]],
        depth: usize,
    ) {
        let cols = out_rows[0].len();
        let full = depth / LANES * LANES;
        let tail_mask: __mmask16 = ((1u32 << (depth - full)) - 1) as __mmask16;
        let inputs: [&[f32]; ROWS] = std::array::from_fn(|m| &x[m * depth..(m + 1) * depth]);
        let mut col = 0;
        while col < cols {
            let width = COLUMN_BLOCK.min(cols - col);
            // A short last block repeats its first weight row; those sums are dropped.
            let weight_row = |j: usize| {
                let n = col + if j < width { j } else { 0 };
                &w[n * depth..(n + 1) * depth]
            };
            let (w0, w1, w2) = (weight_row(0), weight_row(1), weight_row(2));
            let mut acc = [[_mm512_setzero_ps(); COLUMN_BLOCK]; ROWS];
            let mut k = 0;
            while k < full {
                let (a0, a1, a2) = (load(w0, k), load(w1, k), load(w2, k));
                for m in 0..ROWS {
                    let v = load(inputs[m], k);
                    acc[m][0] = _mm512_fmadd_ps(a0, v, acc[m][0]);
                    acc[m][1] = _mm512_fmadd_ps(a1, v, acc[m][1]);
                    acc[m][2] = _mm512_fmadd_ps(a2, v, acc[m][2]);
                }
                k += LANES;
            }
            if full < depth {
                let (a0, a1, a2) = (
                    load_tail(w0, full, tail_mask),
                    load_tail(w1, full, tail_mask),
                    load_tail(w2, full, tail_mask),
                );
                for m in 0..ROWS {
                    let v = load_tail(inputs[m], full, tail_mask);
                    acc[m][0] = _mm512_fmadd_ps(a0, v, acc[m][0]);
                    acc[m][1] = _mm512_fmadd_ps(a1, v, acc[m][1]);
                    acc[m][2] = _mm512_fmadd_ps(a2, v, acc[m][2]);
                }
            }
            for (out, sums) in out_rows.iter_mut().zip(&acc) {
                for j in 0..width {
                    out[col + j] = _mm512_reduce_add_ps(sums[j]);
                }
            }
            col += COLUMN_BLOCK;
        }
    }
}
