//! One request's grammar state: the mask before a token, the token after.
use llguidance::Matcher;

use crate::error::CoreError;

/// A compiled grammar following one generation.
pub struct Constraint {
    matcher: Matcher,
    mask_words: usize,
    consumed: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("consumed", &self.consumed)
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    pub(crate) fn new(matcher: Matcher, mask_words: usize) -> Self {
        Self {
            matcher,
            mask_words,
            consumed: 0,
        }
    }

    /// `u32` words in this constraint's mask row.
    pub fn mask_words(&self) -> usize {
        self.mask_words
    }

    /// Tokens consumed so far.
    pub fn consumed(&self) -> usize {
        self.consumed
    }

    /// Writes the tokens allowed next into `out` (`mask_words()` words). Once the
    /// grammar is complete only the end-of-sequence ids are allowed.
    pub fn fill_mask(&mut self, out: &mut [u32]) -> Result<(), CoreError> {
        if out.len() != self.mask_words {
            return Err(CoreError::InvalidInput(format!(
                "mask row has {} words, expected {}",
                out.len(),
                self.mask_words
            )));
        }
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| failed(&e))?;
        let words = mask.as_slice();
        let n = words.len().min(out.len());
        out[..n].copy_from_slice(&words[..n]);
        out[n..].fill(0);
        Ok(())
    }

    /// Advances past `token`; an error if the grammar does not allow it.
    pub fn consume(&mut self, token: u32) -> Result<(), CoreError> {
        self.matcher.consume_token(token).map_err(|e| failed(&e))?;
        self.consumed += 1;
        Ok(())
    }

    /// How many of `tokens` the grammar accepts in order, without advancing.
    pub fn validate(&mut self, tokens: &[u32]) -> Result<usize, CoreError> {
        self.matcher.validate_tokens(tokens).map_err(|e| failed(&e))
    }

    /// Undoes the last `n` consumed tokens.
    pub fn rollback(&mut self, n: usize) -> Result<(), CoreError> {
        if n > self.consumed {
            return Err(CoreError::InvalidInput(format!(
                "cannot roll back {n} tokens, only {} consumed",
                self.consumed
            )));
        }
        self.matcher.rollback(n).map_err(|e| failed(&e))?;
        self.consumed -= n;
        Ok(())
    }

    /// The grammar is complete and nothing may follow: generation should end.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The output so far is a complete match (more may still follow).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// The error that put the constraint in its failed state, if any.
    pub fn error(&self) -> Option<String> {
        self.matcher.get_error()
    }
}

fn failed(err: &impl std::fmt::Display) -> CoreError {
    CoreError::Grammar(format!("grammar: {err}"))
}

/// Fills one mask row per constraint into `out` (rows of `words` words, in order);
/// rows without a constraint allow every token. Each row's error is reported on its own,
/// so one failed constraint never hides the others' masks.
pub fn fill_masks(
    rows: &mut [Option<&mut Constraint>],
    out: &mut [u32],
    words: usize,
) -> Vec<Option<CoreError>> {
    assert_eq!(out.len(), rows.len() * words, "mask buffer size");
    rows.iter_mut()
        .zip(out.chunks_mut(words))
        .map(|(row, chunk)| {
            if let Some(constraint) = row {
                constraint.fill_mask(chunk).err()
            } else {
                chunk.fill(u32::MAX);
                None
            }
        })
        .collect()
}
