//! Random `admit` / `append` / `release` / `take_evicted` / `clear` / `pin` /
//! `expire_pins` / `set_pin_fraction` sequences over prompts that
//! share prefixes, in small pools (so eviction and exhaustion happen), checking the
//! invariants after every operation and, through a model of Python's K/V store, that
//! every hit serves exactly the tokens it claims.
use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;

const REQUESTS: usize = 4;
const SALTS: [&[u8]; 2] = [b"", b"salt"];

#[derive(Debug, Clone)]
enum Op {
    /// Admits request `slot` (if it is not open) with a prompt built from a shared
    /// stem: `stem_len` tokens of stem `stem`, then `tail`.
    Admit {
        slot: usize,
        stem: usize,
        stem_len: usize,
        tail: Vec<u32>,
        salt: usize,
    },
    /// Appends up to `n` of the request's next tokens (past the prompt: `decode`).
    Append {
        slot: usize,
        n: usize,
        decode: u32,
    },
    Release {
        slot: usize,
    },
    TakeEvicted,
    Clear,
    /// Pins request `slot`'s blocks up to token `end` for `ttl` seconds.
    Pin {
        slot: usize,
        end: usize,
        ttl: u32,
    },
    /// The clock moves on by `dt` seconds and expired pins go.
    Expire {
        dt: u32,
    },
    PinFraction {
        eighths: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..REQUESTS, 0..2usize, 0..24usize, prop::collection::vec(0..3u32, 0..6), 0..2usize)
            .prop_map(|(slot, stem, stem_len, tail, salt)| Op::Admit { slot, stem, stem_len, tail, salt }),
        6 => (0..REQUESTS, 1..10usize, 0..3u32).prop_map(|(slot, n, decode)| Op::Append { slot, n, decode }),
        3 => (0..REQUESTS).prop_map(|slot| Op::Release { slot }),
        1 => Just(Op::TakeEvicted),
        1 => Just(Op::Clear),
        3 => (0..REQUESTS, 0..30usize, prop::sample::select(vec![300u32, 3600]))
            .prop_map(|(slot, end, ttl)| Op::Pin { slot, end, ttl }),
        1 => (0..600u32).prop_map(|dt| Op::Expire { dt }),
        1 => (0..=8u32).prop_map(|eighths| Op::PinFraction { eighths }),
    ]
}

/// The tokens a block's K/V depends on: the salt and every token up to its end.
type Content = (Vec<u8>, Vec<u32>);

/// An open request as the engine sees it.
#[derive(Debug)]
struct Live {
    name: String,
    prompt: Vec<u32>,
    salt: Vec<u8>,
    /// Tokens whose K/V exists (admitted from cache, then appended).
    computed: Vec<u32>,
}

/// Plays the engine: drives the cache and keeps a K/V store keyed by block id.
#[derive(Debug)]
struct Harness {
    c: PrefixCache,
    live: Vec<Option<Live>>,
    store: HashMap<u32, Content>,
    next_name: u32,
    now: f64,
}

impl Harness {
    fn new(block_size: usize, num_blocks: usize, kind: HashKind) -> Self {
        Self {
            c: PrefixCache::new(block_size, num_blocks, kind).unwrap(),
            live: (0..REQUESTS).map(|_| None).collect(),
            store: HashMap::new(),
            next_name: 0,
            now: 0.0,
        }
    }

    fn apply(&mut self, op: Op) {
        let held_before = self.held();
        match op {
            Op::Admit {
                slot,
                stem,
                stem_len,
                tail,
                salt,
            } => self.admit(slot, stem, stem_len, tail, salt),
            Op::Append { slot, n, decode } => self.append(slot, n, decode, &held_before),
            Op::Release { slot } => {
                if let Some(r) = self.live[slot].take() {
                    assert!(self.c.release(&r.name));
                    assert_eq!(self.c.num_tokens(&r.name), None);
                } else {
                    assert!(!self.c.release("ghost"));
                }
            }
            Op::TakeEvicted => self.drain(),
            Op::Clear => {
                self.drain();
                self.c.clear();
                for id in self.c.take_evicted() {
                    assert!(
                        !held_before.contains(&id.get()),
                        "clear evicted a held block"
                    );
                    self.store.remove(&id.get());
                }
                assert_eq!(self.c.stats().cached_blocks, self.c.stats().in_use_blocks);
                assert!(self.c.pins().is_empty());
            }
            Op::Pin { slot, end, ttl } => match self.live[slot].as_ref() {
                Some(r) => {
                    let name = r.name.clone();
                    self.c
                        .pin(
                            &name,
                            &[PinSpec {
                                end_token: end,
                                ttl_secs: ttl,
                            }],
                            self.now,
                        )
                        .unwrap();
                }
                None => assert!(self.c.pin("ghost", &[], self.now).is_err()),
            },
            Op::Expire { dt } => {
                self.now += f64::from(dt);
                self.c.expire_pins(self.now);
                assert!(self.c.pins().iter().all(|p| p.expires_at > self.now));
                assert!(self.c.pinned_blocks().iter().all(|&(_, at)| at > self.now));
            }
            Op::PinFraction { eighths } => {
                self.c.set_pin_fraction(f64::from(eighths) / 8.0).unwrap();
            }
        }
        self.c.check_invariants().unwrap();
        let s = self.c.stats();
        assert_eq!(s.free_blocks + s.in_use_blocks, s.num_blocks);
        assert_eq!(s.num_requests, self.live.iter().flatten().count());
        // The store holds K/V for exactly the cached blocks.
        let cached: HashSet<u32> = (0..s.num_blocks as u32)
            .filter(|&i| self.c.pool.blocks[i as usize].hash.is_some())
            .collect();
        assert_eq!(cached, self.store.keys().copied().collect::<HashSet<u32>>());
        self.check_pinned_blocks();
    }

    /// What the disk tier is told: each block once, every block RAM holds pinned among
    /// them, earliest expiry first.
    fn check_pinned_blocks(&self) {
        let listed = self.c.pinned_blocks();
        let hashes: HashSet<BlockHash> = listed.iter().map(|&(h, _)| h).collect();
        assert_eq!(hashes.len(), listed.len(), "a block listed twice");
        for block in &self.c.pool.blocks {
            if block.pins > 0 {
                assert!(
                    hashes.contains(&block.hash.unwrap()),
                    "a RAM pin is not listed"
                );
            }
        }
        assert!(listed.windows(2).all(|w| w[0].1 <= w[1].1), "not by expiry");
    }

    fn admit(&mut self, slot: usize, stem: usize, stem_len: usize, tail: Vec<u32>, salt: usize) {
        let bs = self.c.block_size();
        if self.live[slot].is_some() {
            return;
        }
        // Two stems that share their first 5 tokens.
        let mut prompt: Vec<u32> = (0..stem_len as u32)
            .map(|i| if i < 5 || stem == 0 { i % 7 } else { 10 + i })
            .collect();
        prompt.extend(tail);
        let salt = SALTS[salt].to_vec();
        let name = format!("r{}", self.next_name);
        self.next_name += 1;
        let preview = self.c.lookup(&prompt, &salt).unwrap();
        let a = self.c.admit(&name, &prompt, &salt).unwrap();
        assert_eq!(preview, a.cached_tokens);
        assert_eq!(a.cached_tokens, a.block_ids.len() * bs);
        assert!(
            prompt.is_empty() || a.cached_tokens < prompt.len(),
            "a token is left"
        );
        // Python assembles the hit from its store: it must be exactly this prefix.
        for (i, id) in a.block_ids.iter().enumerate() {
            let want = (salt.clone(), prompt[..(i + 1) * bs].to_vec());
            assert_eq!(
                self.store.get(&id.get()),
                Some(&want),
                "hit {i} serves other K/V"
            );
        }
        let computed = prompt[..a.cached_tokens].to_vec();
        self.live[slot] = Some(Live {
            name,
            prompt,
            salt,
            computed,
        });
    }

    fn append(&mut self, slot: usize, n: usize, decode: u32, held_before: &HashSet<u32>) {
        let bs = self.c.block_size();
        let Some(r) = self.live[slot].as_mut() else {
            assert!(self.c.append("ghost", &[1]).is_err());
            return;
        };
        let start = r.computed.len();
        let next: Vec<u32> = (start..start + n)
            .map(|i| r.prompt.get(i).copied().unwrap_or(decode))
            .collect();
        r.computed.extend(&next);
        let (name, salt, computed) = (r.name.clone(), r.salt.clone(), r.computed.clone());
        let unpinned_free = self.c.pool.free.len;
        let pinned_before: HashSet<u32> = (0..self.c.pool.len() as u32)
            .filter(|&i| self.c.pool.blocks[i as usize].pins > 0)
            .collect();
        let filled = self.c.append(&name, &next).unwrap();
        // A pinned block is taken only once every unpinned free block was.
        let allocated = filled.iter().filter(|b| b.is_new).count();
        if filled
            .iter()
            .any(|b| b.is_new && pinned_before.contains(&b.block_id.get()))
        {
            assert!(
                allocated > unpinned_free,
                "a pinned block went before an unpinned one"
            );
        }
        // Evictions first (as documented), then the new blocks.
        let evicted: Vec<(BlockId, BlockHash)> = self.c.pool.evicted.clone();
        let new: HashSet<BlockId> = filled
            .iter()
            .filter(|b| b.is_new)
            .map(|b| b.block_id)
            .collect();
        for (id, old) in &evicted {
            assert!(
                !held_before.contains(&id.get()),
                "evicted {id}, which was held"
            );
            assert!(
                self.c.pool.find(old) != Some(*id) || new.contains(id),
                "evicted {id} still answers for its old hash"
            );
        }
        self.drain();
        for b in &filled {
            assert_eq!(b.start_token, b.index * bs);
            let end = b.start_token + bs;
            assert!(
                end <= computed.len() && end > start,
                "block outside this append"
            );
            let content = (salt.clone(), computed[..end].to_vec());
            if b.is_new {
                self.store.insert(b.block_id.get(), content);
            } else {
                assert_eq!(self.store.get(&b.block_id.get()), Some(&content), "dedup");
            }
        }
    }

    fn drain(&mut self) {
        for id in self.c.take_evicted() {
            self.store.remove(&id.get());
        }
    }

    fn held(&self) -> HashSet<u32> {
        self.c
            .tables
            .values()
            .flat_map(|t| t.blocks.iter().map(|b| b.get()))
            .collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_operations_keep_the_books(
        block_size in 1..5usize,
        num_blocks in 1..12usize,
        sha in any::<bool>(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let kind = if sha { HashKind::Sha256 } else { HashKind::Xxh3 };
        let mut h = Harness::new(block_size, num_blocks, kind);
        let mut held_before: HashMap<u32, Option<BlockHash>> = HashMap::new();
        for op in ops {
            h.apply(op);
            // A block some request held before and after the step kept its content.
            let held = h.held();
            for (id, hash) in &held_before {
                if held.contains(id) {
                    prop_assert_eq!(&h.c.pool.blocks[*id as usize].hash, hash);
                }
            }
            held_before = held.into_iter().map(|id| (id, h.c.pool.blocks[id as usize].hash)).collect();
        }
        for slot in 0..REQUESTS {
            h.apply(Op::Release { slot });
        }
        let s = h.c.stats();
        prop_assert_eq!((s.in_use_blocks, s.free_blocks), (0, s.num_blocks));
    }
}
