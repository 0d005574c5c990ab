//! CPU kernels for the decode path.
//!
//! A decode step multiplies a handful of rows (one per running request) by every weight
//! matrix of the model. BLAS `sgemm` is tuned for large products: on this class of CPU,
//! `OpenBLAS` streams the weights at about half of memory bandwidth when the product has
//! 2–16 rows. [`matmul_nt`] streams each weight row exactly once for up to
//! [`MAX_ROWS_PER_PASS`] input rows, splitting the output columns across threads.
//!
//! Unsafe code is confined to [`simd`], where SIMD loads read from slices whose bounds are
//! checked before the load.

mod attention;
mod block;
mod simd;

pub use attention::{attention_decode, CachedHeads, DecodeShape};
pub use block::{DecoderBlock, NewPosition, RmsNorm, Rope};

use rayon::prelude::*;

/// Input rows one pass over the weights serves; more rows take more passes.
pub const MAX_ROWS_PER_PASS: usize = 8;

/// Output columns a thread takes at least: below this, threading costs more than it saves.
const MIN_COLUMNS_PER_TASK: usize = 96;

/// Shape mismatch between the operands of [`matmul_nt`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShapeError {}

/// Which implementation [`matmul_nt`] uses on this CPU.
pub fn kernel_name() -> &'static str {
    if simd::avx512_available() {
        "avx512"
    } else {
        "scalar"
    }
}

/// `y[m, n] = Σ_k x[m, k] · w[n, k]`: `x` is `[rows, depth]`, `w` is `[cols, depth]`
/// (the `[out, in]` layout of a linear layer), `y` is `[rows, cols]`, all row-major.
pub fn matmul_nt(
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    rows: usize,
    depth: usize,
    cols: usize,
) -> Result<(), ShapeError> {
    check_len("x", x.len(), rows, depth)?;
    check_len("w", w.len(), cols, depth)?;
    check_len("y", y.len(), rows, cols)?;
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    if depth == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let tasks = task_count(cols);
    if tasks == 1 {
        compute_columns(x, w, &mut y.chunks_mut(cols).collect::<Vec<_>>(), depth, 0);
        return Ok(());
    }
    // Each task owns a column range of every output row: split the rows at the same
    // column boundaries, so tasks write disjoint slices.
    let bounds = column_bounds(cols, tasks);
    let mut per_task: Vec<Vec<&mut [f32]>> = (0..tasks).map(|_| Vec::with_capacity(rows)).collect();
    for row in y.chunks_mut(cols) {
        let mut rest = row;
        for (task, window) in bounds.windows(2).enumerate() {
            let (head, tail) = rest.split_at_mut(window[1] - window[0]);
            per_task[task].push(head);
            rest = tail;
        }
    }
    per_task
        .into_par_iter()
        .zip(bounds[..tasks].par_iter())
        .for_each(|(mut out_rows, &first_col)| {
            compute_columns(x, w, &mut out_rows, depth, first_col);
        });
    Ok(())
}

/// The `SwiGLU` feed-forward block of a decode step, one call instead of five ops:
/// `y = (silu(x · w_gateᵀ) ⊙ (x · w_upᵀ)) · w_downᵀ`, with `x` `[rows, hidden]`, `w_gate` and
/// `w_up` `[inter, hidden]`, `w_down` `[hidden, inter]` and `y` `[rows, hidden]`.
pub fn swiglu_mlp(
    x: &[f32],
    weights: SwigluWeights<'_>,
    y: &mut [f32],
    rows: usize,
    hidden: usize,
    inter: usize,
) -> Result<(), ShapeError> {
    let mut gate = vec![0.0f32; rows * inter];
    let mut up = vec![0.0f32; rows * inter];
    matmul_nt(x, weights.gate, &mut gate, rows, hidden, inter)?;
    matmul_nt(x, weights.up, &mut up, rows, hidden, inter)?;
    for (g, u) in gate.iter_mut().zip(&up) {
        *g = silu(*g) * u;
    }
    matmul_nt(&gate, weights.down, y, rows, inter, hidden)
}

/// The three weight matrices of a `SwiGLU` block, each `[out, in]` row-major.
#[derive(Debug, Clone, Copy)]
pub struct SwigluWeights<'a> {
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub down: &'a [f32],
}

/// `x · sigmoid(x)`, as `nn.silu` computes it.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn check_len(name: &str, len: usize, a: usize, b: usize) -> Result<(), ShapeError> {
    match a.checked_mul(b) {
        Some(expected) if expected == len => Ok(()),
        _ => Err(ShapeError(format!(
            "{name} has {len} elements, expected {a} x {b}"
        ))),
    }
}

/// Tasks per thread: with a few tasks each, an idle core steals work from a busy one (the
/// HTTP thread or a client on the same machine) instead of the product waiting for the
/// slower of two static halves.
const TASKS_PER_THREAD: usize = 4;

fn task_count(cols: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    (threads * TASKS_PER_THREAD)
        .min(cols / MIN_COLUMNS_PER_TASK)
        .max(1)
}

/// Column boundaries of `tasks` near-equal ranges, each a multiple of the SIMD column block
/// (except the last), so blocks never straddle two tasks.
fn column_bounds(cols: usize, tasks: usize) -> Vec<usize> {
    let block = simd::COLUMN_BLOCK;
    let blocks = cols.div_ceil(block);
    let mut bounds: Vec<usize> = (0..tasks)
        .map(|t| (blocks * t / tasks * block).min(cols))
        .collect();
    bounds.push(cols);
    bounds
}

/// Computes output columns `first_col..first_col + out_rows[0].len()` for every row.
fn compute_columns(
    x: &[f32],
    w: &[f32],
    out_rows: &mut [&mut [f32]],
    depth: usize,
    first_col: usize,
) {
    let width = out_rows.first().map_or(0, |r| r.len());
    let weights = &w[first_col * depth..(first_col + width) * depth];
    for (pass, rows) in out_rows.chunks_mut(MAX_ROWS_PER_PASS).enumerate() {
        let start = pass * MAX_ROWS_PER_PASS * depth;
        let inputs = &x[start..start + rows.len() * depth];
        if simd::avx512_available() {
            simd::pass_avx512(inputs, weights, rows, depth);
        } else {
            pass_scalar(inputs, weights, rows, depth);
        }
    }
}

/// Reference implementation: same arithmetic, no SIMD.
fn pass_scalar(x: &[f32], w: &[f32], out_rows: &mut [&mut [f32]], depth: usize) {
    for (m, out) in out_rows.iter_mut().enumerate() {
        let xr = &x[m * depth..(m + 1) * depth];
        for (n, value) in out.iter_mut().enumerate() {
            let wr = &w[n * depth..(n + 1) * depth];
            *value = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
        }
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_block;
