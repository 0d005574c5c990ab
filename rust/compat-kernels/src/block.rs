//! A llama-style decoder block's decode step around its products: RMS norm, rotary position
//! embedding and the residual adds, so one block runs in two calls (before and after the
//! KV cache update) instead of a dozen framework ops, each with its own dispatch.

use crate::{check_len, matmul_nt, swiglu_mlp, ShapeError, SwigluWeights};

/// An RMS norm layer: `y = (x / sqrt(mean(x²) + eps)) · weight`, per row.
#[derive(Debug, Clone, Copy)]
pub struct RmsNorm<'a> {
    pub weight: &'a [f32],
    pub eps: f32,
}

impl RmsNorm<'_> {
    /// Normalises every row of `x` (rows of `weight.len()` values) into `out`.
    pub fn apply(&self, x: &[f32], out: &mut [f32]) -> Result<(), ShapeError> {
        let dim = self.weight.len();
        if dim == 0 || !x.len().is_multiple_of(dim) || out.len() != x.len() {
            return Err(ShapeError(format!(
                "RMS norm of {dim} features over {} inputs into {} outputs",
                x.len(),
                out.len()
            )));
        }
        for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            let squares: f64 = row.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
            let mean = squares / dim as f64;
            let inverse = (1.0 / (mean + f64::from(self.eps)).sqrt()) as f32;
            for ((o, v), w) in out_row.iter_mut().zip(row).zip(self.weight) {
                *o = v * inverse * w;
            }
        }
        Ok(())
    }
}

/// Rotary position embedding as `mlx.nn.RoPE` defines it: the first `dims` features of a
/// head rotate in pairs, pair `i` by `position · scale · base^(-2i / dims)`. Pairs are
/// `(i, i + dims/2)`, or `(2i, 2i + 1)` when `traditional`; features past `dims` stay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub dims: usize,
    pub base: f32,
    pub scale: f32,
    pub traditional: bool,
}

impl Rope {
    /// Rotates every head of `x` (`[rows, heads, head_dim]`) in place, row `r` at
    /// `positions[r]`. Angles are computed in f64 (MLX computes them in f32, which drifts
    /// by up to ~1e-3 at positions in the thousands).
    pub fn apply(
        &self,
        x: &mut [f32],
        head_dim: usize,
        positions: &[i64],
    ) -> Result<(), ShapeError> {
        let rows = positions.len();
        if !self.dims.is_multiple_of(2) || self.dims > head_dim || head_dim == 0 {
            return Err(ShapeError(format!(
                "RoPE over {} of {head_dim} features (must be even and fit)",
                self.dims
            )));
        }
        if rows == 0 || !x.len().is_multiple_of(rows * head_dim) {
            return Err(ShapeError(format!(
                "{} values are not {rows} rows of whole {head_dim}-feature heads",
                x.len()
            )));
        }
        let half = self.dims / 2;
        let row_len = x.len() / rows;
        for (row, &position) in x.chunks_exact_mut(row_len).zip(positions) {
            let turns: Vec<(f32, f32)> = (0..half)
                .map(|i| {
                    let frequency = f64::from(self.base).powf(-(i as f64) / half as f64);
                    let angle = position as f64 * f64::from(self.scale) * frequency;
                    (angle.cos() as f32, angle.sin() as f32)
                })
                .collect();
            for head in row.chunks_exact_mut(head_dim) {
                for (i, &(cos, sin)) in turns.iter().enumerate() {
                    let (a, b) = if self.traditional {
                        (2 * i, 2 * i + 1)
                    } else {
                        (i, i + half)
                    };
                    let (x1, x2) = (head[a], head[b]);
                    head[a] = x1 * cos - x2 * sin;
                    head[b] = x1 * sin + x2 * cos;
                }
            }
        }
        Ok(())
    }
}

/// The weights of a pre-norm decoder block with a `SwiGLU` feed-forward (llama and its
/// kin); matrices are `[out, in]` row-major, as a linear layer stores them.
#[derive(Debug, Clone, Copy)]
pub struct DecoderBlock<'a> {
    pub input_norm: RmsNorm<'a>,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a [f32],
    pub rope: Rope,
    pub post_norm: RmsNorm<'a>,
    pub mlp: SwigluWeights<'a>,
}

/// Queries, keys and values of one new position per row, each `[rows, heads, head_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct NewPosition {
    pub queries: Vec<f32>,
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

impl DecoderBlock<'_> {
    fn hidden(&self) -> usize {
        self.input_norm.weight.len()
    }

    /// Before the cache update: `h = norm(x)`, the three products of `h`, and the rotary
    /// embedding of queries and keys at each row's position. `x` is `[rows, hidden]`.
    pub fn project(
        &self,
        x: &[f32],
        positions: &[i64],
        head_dim: usize,
    ) -> Result<NewPosition, ShapeError> {
        let (rows, hidden) = (positions.len(), self.hidden());
        check_len("x", x.len(), rows, hidden)?;
        let mut normed = vec![0.0f32; x.len()];
        self.input_norm.apply(x, &mut normed)?;
        let product = |w: &[f32]| -> Result<Vec<f32>, ShapeError> {
            let cols = w.len() / hidden.max(1);
            let mut y = vec![0.0f32; rows * cols];
            matmul_nt(&normed, w, &mut y, rows, hidden, cols)?;
            Ok(y)
        };
        let (mut queries, mut keys, values) =
            (product(self.q)?, product(self.k)?, product(self.v)?);
        self.rope.apply(&mut queries, head_dim, positions)?;
        self.rope.apply(&mut keys, head_dim, positions)?;
        Ok(NewPosition {
            queries,
            keys,
            values,
        })
    }

    /// After attention: `h = x + attention · oᵀ`, then `out = h + mlp(norm(h))`. `x` and
    /// `out` are `[rows, hidden]`, `attention` is `[rows, heads · head_dim]`.
    pub fn finish(&self, x: &[f32], attention: &[f32], out: &mut [f32]) -> Result<(), ShapeError> {
        let hidden = self.hidden();
        if hidden == 0 || !x.len().is_multiple_of(hidden) {
            return Err(ShapeError(format!(
                "x has {} values, not rows of {hidden}",
                x.len()
            )));
        }
        let rows = x.len() / hidden;
        check_len("out", out.len(), rows, hidden)?;
        let width = attention.len() / rows.max(1);
        check_len("attention", attention.len(), rows, width)?;
        let mut h = vec![0.0f32; x.len()];
        matmul_nt(attention, self.o, &mut h, rows, width, hidden)?;
        for (value, residual) in h.iter_mut().zip(x) {
            *value += residual;
        }
        let mut normed = vec![0.0f32; x.len()];
        self.post_norm.apply(&h, &mut normed)?;
        let inter = self.mlp.gate.len() / hidden;
        swiglu_mlp(&normed, self.mlp, out, rows, hidden, inter)?;
        for (value, residual) in out.iter_mut().zip(&h) {
            *value += residual;
        }
        Ok(())
    }
}
