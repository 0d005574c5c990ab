//! KV memory accounting, behind a small trait so a block pool can replace the token
//! counter without touching the scheduler.
use std::fmt;

/// What the scheduler asks of KV memory. Every call names how many tokens the request
/// holds *before* the change, so an implementation counting blocks can round.
pub trait KvBudget: fmt::Debug {
    /// Units in use (tokens here; blocks for a block pool).
    fn used(&self) -> u64;
    /// Units available in total.
    fn capacity(&self) -> u64;
    /// Units a request holding `held` tokens occupies.
    fn usage_for(&self, held: u32) -> u64;
    /// How many more tokens a request holding `held` tokens can take right now.
    fn headroom(&self, held: u32) -> u32;
    /// Reserve `extra` tokens for a request holding `held`. Must fit the headroom.
    fn grow(&mut self, held: u32, extra: u32);
    /// Release the last `by` of the `held` tokens of a request.
    fn shrink(&mut self, held: u32, by: u32);
}

/// One unit per token of KV.
#[derive(Debug, Clone)]
pub struct TokenKv {
    capacity: u64,
    used: u64,
}

impl TokenKv {
    pub fn new(capacity: u64) -> Self {
        Self { capacity, used: 0 }
    }
}

impl KvBudget for TokenKv {
    fn used(&self) -> u64 {
        self.used
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn usage_for(&self, held: u32) -> u64 {
        u64::from(held)
    }

    fn headroom(&self, _held: u32) -> u32 {
        u32::try_from(self.capacity - self.used).unwrap_or(u32::MAX)
    }

    fn grow(&mut self, held: u32, extra: u32) {
        debug_assert!(extra <= self.headroom(held), "KV over-committed");
        self.used += u64::from(extra);
    }

    fn shrink(&mut self, held: u32, by: u32) {
        debug_assert!(by <= held, "released more KV than held");
        debug_assert!(u64::from(by) <= self.used, "KV accounting underflow");
        self.used -= u64::from(by);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_and_shrink_balance() {
        let mut kv = TokenKv::new(10);
        assert_eq!(kv.headroom(0), 10);
        kv.grow(0, 6);
        kv.grow(6, 4);
        assert_eq!((kv.used(), kv.headroom(10)), (10, 0));
        kv.shrink(10, 3);
        assert_eq!((kv.used(), kv.headroom(7)), (7, 3));
        kv.shrink(7, 7);
        assert_eq!(kv.used(), 0);
    }

    #[test]
    fn headroom_saturates_for_huge_capacities() {
        let kv = TokenKv::new(u64::MAX);
        assert_eq!(kv.headroom(0), u32::MAX);
        assert_eq!(kv.usage_for(7), 7);
    }

    #[test]
    #[should_panic(expected = "KV over-committed")]
    #[cfg(debug_assertions)]
    fn over_commit_is_caught_in_debug_builds() {
        let mut kv = TokenKv::new(2);
        kv.grow(0, 3);
    }
}
