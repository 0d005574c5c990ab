use super::*;

const BS: usize = 4;

fn cache(num_blocks: usize) -> PrefixCache {
    PrefixCache::new(BS, num_blocks, HashKind::Xxh3).unwrap()
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// Admits `tokens`, appends what was not cached, and returns the admission and the
/// blocks the appends filled (the request stays open).
fn run(c: &mut PrefixCache, id: &str, tokens: &[u32], extra: &[u8]) -> (Admission, Vec<NewBlock>) {
    let a = c.admit(id, tokens, extra).unwrap();
    let filled = c.append(id, &tokens[a.cached_tokens..]).unwrap();
    (a, filled)
}

fn ids(blocks: &[NewBlock]) -> Vec<u32> {
    blocks.iter().map(|b| b.block_id.get()).collect()
}

#[test]
fn a_shared_prefix_hits_and_the_rest_is_stored() {
    let mut c = cache(16);
    let (a, filled) = run(&mut c, "a", &toks(0..10), b"");
    assert_eq!(
        a,
        Admission {
            cached_tokens: 0,
            block_ids: vec![]
        }
    );
    assert_eq!(
        filled,
        [0, 1].map(|i| NewBlock {
            block_id: BlockId::new(i as u32),
            index: i,
            start_token: i * BS,
            is_new: true
        })
    );
    assert!(c.release("a"));

    // Same first 9 tokens, then different: the two full blocks hit.
    let mut prompt = toks(0..9);
    prompt.extend([99, 98, 97]);
    let (b, filled) = run(&mut c, "b", &prompt, b"");
    assert_eq!(b.cached_tokens, 8);
    assert_eq!(b.block_ids, [BlockId::new(0), BlockId::new(1)]);
    assert_eq!(ids(&filled), [2]);
    assert_eq!((filled[0].index, filled[0].start_token), (2, 8));
    let s = c.stats();
    assert_eq!((s.query_tokens, s.hit_tokens, s.stored_blocks), (22, 8, 3));
    assert_eq!(
        (s.cached_blocks, s.in_use_blocks, s.free_blocks),
        (3, 3, 13)
    );
}

#[test]
fn a_fully_cached_prompt_still_computes_a_token() {
    let mut c = cache(16);
    run(&mut c, "a", &toks(0..8), b"");
    c.release("a");
    // 8 tokens = 2 full blocks, all cached: the last block is dropped from the hit.
    assert_eq!(c.lookup(&toks(0..8), b"").unwrap(), 4);
    let (a, filled) = run(&mut c, "b", &toks(0..8), b"");
    assert_eq!(a.cached_tokens, 4);
    // Recomputing the last block finds it cached: Python stores nothing.
    assert_eq!(filled.len(), 1);
    assert!(!filled[0].is_new);
    assert_eq!(filled[0].block_id, BlockId::new(1));
    // One token more and both blocks serve it.
    assert_eq!(c.lookup(&toks(0..9), b"").unwrap(), 8);
    assert_eq!(c.lookup(&[], b"").unwrap(), 0);
}

#[test]
fn lookup_acquires_nothing() {
    let mut c = cache(4);
    run(&mut c, "a", &toks(0..9), b"");
    c.release("a");
    let before = c.stats();
    assert_eq!(c.lookup(&toks(0..9), b"").unwrap(), 8);
    assert_eq!(c.stats(), before);
}

#[test]
fn concurrent_fills_of_the_same_block_are_deduplicated() {
    let mut c = cache(8);
    c.admit("a", &toks(0..9), b"").unwrap();
    c.admit("b", &toks(0..9), b"").unwrap();
    let fa = c.append("a", &toks(0..9)).unwrap();
    let fb = c.append("b", &toks(0..9)).unwrap();
    assert!(fa.iter().all(|b| b.is_new));
    assert!(fb.iter().all(|b| !b.is_new));
    assert_eq!(ids(&fa), ids(&fb));
    let s = c.stats();
    assert_eq!(
        (s.stored_blocks, s.deduplicated_blocks, s.in_use_blocks),
        (2, 2, 2)
    );
    c.release("a");
    assert_eq!(c.stats().in_use_blocks, 2, "b still holds both");
}

#[test]
fn appends_in_any_chunking_fill_the_same_blocks() {
    let tokens = toks(100..130);
    let mut whole = cache(16);
    whole.admit("r", &tokens, b"").unwrap();
    let expected = whole.append("r", &tokens).unwrap();
    for chunk in [1, 3, 4, 5, 7] {
        let mut c = cache(16);
        c.admit("r", &tokens, b"").unwrap();
        let got: Vec<_> = tokens
            .chunks(chunk)
            .flat_map(|part| c.append("r", part).unwrap())
            .collect();
        assert_eq!(got, expected, "chunk {chunk}");
        assert_eq!(c.num_tokens("r"), Some(30));
        assert_eq!(whole.block_hashes(&tokens, b"").unwrap().len(), 7);
    }
}

#[test]
fn decode_tokens_are_cached_too() {
    let mut c = cache(8);
    run(&mut c, "a", &toks(0..6), b"");
    // Two sampled tokens complete block 1.
    assert!(c.append("a", &[50]).unwrap().is_empty());
    assert_eq!(ids(&c.append("a", &[51]).unwrap()), [1]);
    c.release("a");
    let mut next = toks(0..6);
    next.extend([50, 51, 7]);
    assert_eq!(c.lookup(&next, b"").unwrap(), 8);
}

#[test]
fn with_every_block_in_use_a_request_stops_caching_without_failing() {
    let mut c = cache(2);
    run(&mut c, "a", &toks(0..8), b"");
    let (_, filled) = run(&mut c, "b", &toks(50..62), b"");
    assert!(filled.is_empty());
    assert_eq!(c.stats().uncached_blocks, 1);
    // Later blocks would be unreachable: b no longer tries, even with room.
    c.release("a");
    assert!(c.append("b", &toks(62..70)).unwrap().is_empty());
    assert_eq!(c.num_tokens("b"), Some(20));
    c.release("b");
    let (_, filled) = run(&mut c, "c", &toks(50..62), b"");
    assert_eq!(filled.len(), 2);
}

#[test]
fn eviction_takes_the_least_recently_freed_and_the_chain_tail_first() {
    let mut c = cache(4);
    run(&mut c, "a", &toks(0..8), b""); // blocks 0, 1
    run(&mut c, "b", &toks(100..108), b""); // blocks 2, 3
    c.release("a");
    c.release("b");
    // Free list: 1, 0, 3, 2 (each chain tail first, a before b).
    let (_, filled) = run(&mut c, "c", &toks(200..212), b"");
    assert_eq!(ids(&filled), [1, 0, 3]);
    assert_eq!(
        c.take_evicted(),
        [BlockId::new(1), BlockId::new(0), BlockId::new(3)]
    );
    assert!(c.take_evicted().is_empty());
    assert_eq!(c.stats().evictions, 3);
    assert_eq!(c.lookup(&toks(0..9), b"").unwrap(), 0);
    // b's first block survived: its prefix still hits.
    assert_eq!(c.lookup(&toks(100..109), b"").unwrap(), 4);
}

#[test]
fn a_hit_refreshes_a_free_block() {
    let mut c = cache(3);
    run(&mut c, "a", &toks(0..5), b""); // block 0
    run(&mut c, "b", &toks(10..15), b""); // block 1
    c.release("a");
    c.release("b");
    // Free list: 2 (empty), 0, 1. Re-admitting a's prompt touches block 0.
    let (hit, _) = run(&mut c, "a2", &toks(0..5), b"");
    assert_eq!(hit.block_ids, [BlockId::new(0)]);
    c.release("a2");
    // Free list: 2, 1, 0: b's block goes before a's.
    let (_, filled) = run(&mut c, "c", &toks(20..29), b"");
    assert_eq!(ids(&filled), [2, 1]);
    assert_eq!(c.lookup(&toks(0..5), b"").unwrap(), 4);
}

#[test]
fn an_aborted_prefill_keeps_its_finished_blocks() {
    let mut c = cache(8);
    let prompt = toks(0..20);
    c.admit("a", &prompt, b"").unwrap();
    c.append("a", &prompt[..10]).unwrap();
    assert!(c.release("a"));
    assert_eq!(c.lookup(&prompt, b"").unwrap(), 8);
}

#[test]
fn extra_bytes_separate_chains() {
    let mut c = cache(8);
    run(&mut c, "a", &toks(0..9), b"key-1");
    c.release("a");
    assert_eq!(c.lookup(&toks(0..9), b"key-1").unwrap(), 8);
    assert_eq!(c.lookup(&toks(0..9), b"key-2").unwrap(), 0);
    assert_eq!(c.lookup(&toks(0..9), b"").unwrap(), 0);
    // The same tokens under another salt are stored separately, not deduplicated.
    let (_, filled) = run(&mut c, "b", &toks(0..9), b"key-2");
    assert!(filled.iter().all(|b| b.is_new));
    assert_eq!(c.stats().cached_blocks, 4);
}

#[test]
fn clear_evicts_what_nobody_holds() {
    let mut c = cache(8);
    run(&mut c, "a", &toks(0..5), b"");
    run(&mut c, "b", &toks(10..15), b"");
    c.release("a");
    c.clear();
    assert_eq!(c.take_evicted(), [BlockId::new(0)]);
    assert_eq!(c.lookup(&toks(0..5), b"").unwrap(), 0);
    assert_eq!(c.lookup(&toks(10..15), b"").unwrap(), 4);
    c.check_invariants().unwrap();
}

#[test]
fn misuse_is_an_error() {
    assert!(PrefixCache::new(0, 4, HashKind::Xxh3).is_err());
    assert!(PrefixCache::new(4, u32::MAX as usize, HashKind::Xxh3).is_err());
    let mut c = cache(4);
    c.admit("a", &toks(0..3), b"").unwrap();
    assert!(matches!(
        c.admit("a", &[], b""),
        Err(CoreError::DuplicateRequest(_))
    ));
    assert!(matches!(
        c.append("nope", &[1]),
        Err(CoreError::UnknownRequest(_))
    ));
    assert!(!c.release("nope"));
    assert!(c.release("a"));
    assert!(!c.release("a"));
}

#[test]
fn sha256_caches_like_xxh3() {
    let mut c = PrefixCache::new(BS, 8, HashKind::Sha256).unwrap();
    run(&mut c, "a", &toks(0..9), b"");
    c.release("a");
    assert_eq!(c.lookup(&toks(0..9), b"").unwrap(), 8);
    let h = c.block_hashes(&toks(0..9), b"").unwrap();
    assert_eq!(h[0].digest(HashKind::Sha256).len(), 32);
}

#[test]
fn a_long_prompt_in_small_blocks() {
    let prompt: Vec<u32> = (0..16 * 1024).map(|i| i * 7 % 50_000).collect();
    let mut c = PrefixCache::new(16, 2048, HashKind::Xxh3).unwrap();
    let (a, filled) = run(&mut c, "a", &prompt, b"");
    assert_eq!((a.cached_tokens, filled.len()), (0, 1024));
    c.release("a");
    let mut next = prompt.clone();
    next.push(1);
    let (b, _) = run(&mut c, "b", &next, b"");
    assert_eq!(b.cached_tokens, prompt.len());
}

#[test]
fn an_image_is_part_of_the_blocks_it_overlaps() {
    let mut c = cache(32);
    let image = |hash: u8| MediaSpan {
        start: 5,
        len: 6,
        hash: [hash; 16],
    };
    // Tokens 5..11 are one image's placeholders (the same ids for every image).
    let prompt = toks(0..18);
    let a = c.admit_media("a", &prompt, b"", &[image(1)]).unwrap();
    assert_eq!(a.cached_tokens, 0);
    c.append("a", &prompt).unwrap();
    c.release("a");
    // The same image re-sent: every full block hits, past the image.
    assert_eq!(c.media_lookup(&prompt, b"", &[image(1)]).unwrap(), 16);
    // A different image with the same tokens: only the block before it.
    assert_eq!(c.media_lookup(&prompt, b"", &[image(2)]).unwrap(), 4);
    // The same tokens as text: only the block before the image.
    assert_eq!(c.lookup(&prompt, b"").unwrap(), 4);
    let hashes = c.media_block_hashes(&prompt, b"", &[image(1)]).unwrap();
    assert_eq!(hashes[0], c.block_hashes(&prompt, b"").unwrap()[0]);
    c.check_invariants().unwrap();
}
