//! Attention of one decode step: one query position per row of the batch, against that
//! row's cached keys and values (grouped-query heads, optional key mask for left padding).

use rayon::prelude::*;

use crate::ShapeError;

/// Keys or values `[batch, kv_heads, positions, head_dim]`, read in place from a strided
/// buffer whose last axis is contiguous (strides in elements).
#[derive(Debug, Clone, Copy)]
pub struct CachedHeads<'a> {
    pub data: &'a [f32],
    pub batch_stride: usize,
    pub head_stride: usize,
    pub position_stride: usize,
}

/// Sizes of a decode attention: `heads` query heads share `kv_heads` key/value heads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeShape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub positions: usize,
    pub head_dim: usize,
    pub scale: f32,
}

impl CachedHeads<'_> {
    fn check(&self, name: &str, shape: &DecodeShape) -> Result<(), ShapeError> {
        let last = (shape.batch - 1) * self.batch_stride
            + (shape.kv_heads - 1) * self.head_stride
            + (shape.positions - 1) * self.position_stride
            + shape.head_dim;
        if last > self.data.len() {
            return Err(ShapeError(format!(
                "{name} reaches element {last} of a buffer of {}",
                self.data.len()
            )));
        }
        Ok(())
    }

    fn row(&self, batch: usize, head: usize, position: usize, head_dim: usize) -> &[f32] {
        let start =
            batch * self.batch_stride + head * self.head_stride + position * self.position_stride;
        &self.data[start..start + head_dim]
    }
}

/// `out[b, h] = softmax(scale · q[b, h] · K[b, g]ᵀ, masked) · V[b, g]` with `g` the key/value
/// head of query head `h`. `queries` and `out` are `[batch, heads, head_dim]`; `mask`, when
/// given, is `[batch, positions]` (`true` = the row may attend to that position).
pub fn attention_decode(
    shape: &DecodeShape,
    queries: &[f32],
    keys: CachedHeads<'_>,
    values: CachedHeads<'_>,
    mask: Option<&[bool]>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let DecodeShape {
        batch,
        heads,
        kv_heads,
        positions,
        head_dim,
        ..
    } = *shape;
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(ShapeError(format!(
            "{heads} query heads cannot share {kv_heads} key/value heads"
        )));
    }
    let expected = batch * heads * head_dim;
    if queries.len() != expected || out.len() != expected {
        return Err(ShapeError(format!(
            "queries ({}) and out ({}) must hold {batch} x {heads} x {head_dim} values",
            queries.len(),
            out.len()
        )));
    }
    if let Some(mask) = mask {
        if mask.len() != batch * positions {
            return Err(ShapeError(format!(
                "mask has {} entries, expected {batch} x {positions}",
                mask.len()
            )));
        }
    }
    if expected == 0 {
        return Ok(());
    }
    if positions == 0 {
        return Err(ShapeError("attention over zero positions".into()));
    }
    keys.check("keys", shape)?;
    values.check("values", shape)?;
    let group = heads / kv_heads;
    out.par_chunks_mut(head_dim)
        .enumerate()
        .for_each(|(index, out_head)| {
            let (b, h) = (index / heads, index % heads);
            let query = &queries[index * head_dim..(index + 1) * head_dim];
            let visible = mask.map(|m| &m[b * positions..(b + 1) * positions]);
            one_head(
                shape,
                query,
                keys,
                values,
                (b, h / group),
                visible,
                out_head,
            );
        });
    Ok(())
}

fn one_head(
    shape: &DecodeShape,
    query: &[f32],
    keys: CachedHeads<'_>,
    values: CachedHeads<'_>,
    (b, g): (usize, usize),
    visible: Option<&[bool]>,
    out: &mut [f32],
) {
    let dim = shape.head_dim;
    let mut scores: Vec<f32> = (0..shape.positions)
        .map(|t| {
            if visible.is_some_and(|v| !v[t]) {
                return f32::NEG_INFINITY;
            }
            shape.scale * dot(query, keys.row(b, g, t, dim))
        })
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    if max == f32::NEG_INFINITY {
        return; // every position masked: MLX gives zeros too
    }
    let mut total = 0.0f32;
    for score in &mut scores {
        *score = (*score - max).exp();
        total += *score;
    }
    for (t, weight) in scores.iter().enumerate() {
        if *weight != 0.0 {
            for (o, v) in out.iter_mut().zip(values.row(b, g, t, dim)) {
                *o += weight * v;
            }
        }
    }
    let inverse = 1.0 / total;
    for o in out.iter_mut() {
        *o *= inverse;
    }
}

/// Dot product in 8 independent lanes (vectorises; fixed order, so results are stable).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}
