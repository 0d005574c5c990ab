//! Pins: pinned blocks outlive unpinned ones, expire, refresh, and stay under the cap.
use super::*;

const BS: usize = 4;

fn cache(num_blocks: usize, fraction: f64) -> PrefixCache {
    let mut c = PrefixCache::new(BS, num_blocks, HashKind::Xxh3).unwrap();
    c.set_pin_fraction(fraction).unwrap();
    c
}

/// Runs `tokens` through a request, pins its breakpoints at `now`, releases it.
fn turn(c: &mut PrefixCache, id: &str, tokens: &[u32], pins: &[PinSpec], now: f64) -> usize {
    let a = c.admit(id, tokens, b"").unwrap();
    c.append(id, &tokens[a.cached_tokens..]).unwrap();
    c.pin(id, pins, now).unwrap();
    c.release(id);
    a.cached_tokens
}

fn spec(end_token: usize, ttl_secs: u32) -> PinSpec {
    PinSpec {
        end_token,
        ttl_secs,
    }
}

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

#[test]
fn a_pinned_prefix_outlives_unpinned_traffic() {
    let mut c = cache(8, 0.5);
    // 3 blocks of a system prompt pinned (the breakpoint ends mid-block 3: 3 full
    // blocks), then one more block of history.
    let system = toks(10_000, 14);
    turn(
        &mut c,
        "s",
        &[&system[..], &toks(0, 6)].concat(),
        &[spec(14, 300)],
        0.0,
    );
    assert_eq!(c.num_pinned_blocks(), 3);
    // Unrelated prompts churn through the other 5 blocks many times over.
    for i in 0..10 {
        turn(&mut c, &format!("u{i}"), &toks(100 * (i + 1), 21), &[], 1.0);
    }
    // The pinned prefix still hits in full; the unpinned history after it is gone.
    let prompt = [&system[..], &toks(0, 6), &[7]].concat();
    assert_eq!(c.lookup(&prompt, b"").unwrap(), 12);
    c.check_invariants().unwrap();
}

#[test]
fn without_pins_the_same_traffic_evicts_the_prefix() {
    let mut c = cache(8, 0.5);
    let system = toks(10_000, 14);
    turn(&mut c, "s", &[&system[..], &toks(0, 6)].concat(), &[], 0.0);
    for i in 0..10 {
        turn(&mut c, &format!("u{i}"), &toks(100 * (i + 1), 21), &[], 1.0);
    }
    let prompt = [&system[..], &toks(0, 6), &[7]].concat();
    assert_eq!(c.lookup(&prompt, b"").unwrap(), 0);
}

#[test]
fn when_only_pinned_blocks_are_free_the_first_to_expire_goes() {
    let mut c = cache(4, 1.0);
    turn(&mut c, "a", &toks(0, 9), &[spec(8, 3600)], 0.0); // 2 blocks, 1h
    turn(&mut c, "b", &toks(100, 9), &[spec(8, 300)], 0.0); // 2 blocks, 5m
    assert_eq!((c.num_pinned_blocks(), c.stats().free_blocks), (4, 4));
    // A new request needs a block: b's pin (expires first) is dropped, a's stays.
    turn(&mut c, "c", &toks(200, 5), &[], 1.0);
    assert_eq!(c.lookup(&toks(0, 9), b"").unwrap(), 8);
    assert_eq!(
        c.lookup(&toks(100, 9), b"").unwrap(),
        4,
        "b's tail went first"
    );
    assert_eq!((c.num_pinned_blocks(), c.dropped_pins()), (2, 1));
    c.check_invariants().unwrap();
}

#[test]
fn pins_past_the_cap_drop_the_earliest_expiry() {
    let mut c = cache(8, 0.5); // at most 4 pinned blocks
    turn(&mut c, "a", &toks(0, 9), &[spec(8, 300)], 0.0);
    turn(&mut c, "b", &toks(100, 9), &[spec(8, 3600)], 0.0);
    assert_eq!(c.num_pinned_blocks(), 4);
    turn(&mut c, "c", &toks(200, 9), &[spec(8, 300)], 10.0);
    // a expired first (at 300), so a goes; b (3600) and c (310) stay.
    let left: Vec<(usize, u32)> = c.pins().iter().map(|p| (p.tokens, p.ttl_secs)).collect();
    assert_eq!(left, [(8, 300), (8, 3600)]);
    assert_eq!(c.pins()[0].expires_at.to_bits(), 310.0_f64.to_bits());
    assert_eq!(c.num_pinned_blocks(), 4);
    // Lowering the fraction drops the earliest again.
    c.set_pin_fraction(0.25).unwrap();
    assert_eq!(c.pins().len(), 1);
    assert_eq!(c.pins()[0].ttl_secs, 3600);
    c.check_invariants().unwrap();
}

#[test]
fn a_hit_refreshes_and_expiry_unpins() {
    let mut c = cache(8, 0.5);
    let prompt = toks(0, 9);
    turn(&mut c, "a", &prompt, &[spec(8, 300)], 0.0);
    // The next turn carries the same breakpoint: it hits and refreshes the pin.
    assert_eq!(turn(&mut c, "b", &prompt, &[spec(8, 300)], 200.0), 8);
    assert_eq!(c.pins().len(), 1);
    assert_eq!(c.pins()[0].expires_at.to_bits(), 500.0_f64.to_bits());
    // A 1h breakpoint on the same prefix lengthens it; a shorter one never shortens.
    turn(&mut c, "c", &prompt, &[spec(8, 3600)], 250.0);
    turn(&mut c, "d", &prompt, &[spec(8, 300)], 260.0);
    assert_eq!(
        (c.pins()[0].ttl_secs, c.pins()[0].expires_at),
        (3600, 3850.0)
    );
    assert_eq!(c.expire_pins(3849.0), 0);
    assert_eq!(c.expire_pins(3850.0), 1);
    assert_eq!(c.num_pinned_blocks(), 0);
    // Still cached, now on the ordinary LRU.
    assert_eq!(c.lookup(&prompt, b"").unwrap(), 8);
    c.check_invariants().unwrap();
}

#[test]
fn nested_breakpoints_share_blocks_and_clear_drops_pins() {
    let mut c = cache(8, 1.0);
    // System (1 block), tools (2 blocks) and last message (3 blocks) breakpoints.
    turn(
        &mut c,
        "a",
        &toks(0, 13),
        &[spec(4, 3600), spec(9, 3600), spec(12, 300)],
        0.0,
    );
    assert_eq!((c.pins().len(), c.num_pinned_blocks()), (3, 3));
    // A breakpoint in the first block or past what the table holds pins nothing.
    let a = c.admit("b", &toks(0, 13), b"").unwrap();
    assert_eq!(a.cached_tokens, 12);
    assert_eq!(c.pin("b", &[spec(3, 300), spec(40, 300)], 1.0).unwrap(), 0);
    c.release("b");
    assert!(c.pin("nobody", &[spec(4, 300)], 1.0).is_err());
    assert!(c.set_pin_fraction(1.5).is_err());
    c.clear();
    assert_eq!(
        (
            c.pins().len(),
            c.num_pinned_blocks(),
            c.stats().cached_blocks
        ),
        (0, 0, 0)
    );
    c.check_invariants().unwrap();
}

#[test]
fn a_pin_ram_let_go_of_still_lists_its_blocks_for_the_disk_tier() {
    let hashes = |c: &PrefixCache, tokens: &[u32]| c.block_hashes(tokens, b"").unwrap();
    let mut c = cache(4, 1.0);
    let (a, b) = (toks(0, 9), toks(100, 9));
    turn(&mut c, "a", &a, &[spec(8, 3600)], 0.0); // 2 blocks, 1h
    turn(&mut c, "b", &b, &[spec(8, 300)], 0.0); // 2 blocks, 5m
    let (ha, hb) = (hashes(&c, &a), hashes(&c, &b));
    // Earliest expiry first; within a pin, the chain's last block first.
    let listed = [
        (hb[1], 300.0),
        (hb[0], 300.0),
        (ha[1], 3600.0),
        (ha[0], 3600.0),
    ];
    assert_eq!(c.pinned_blocks(), listed);
    // RAM needs b's blocks: b leaves RAM (and the status list) but holds on disk, so
    // what the disk tier is told is unchanged.
    let generation = c.pin_generation();
    turn(&mut c, "c", &toks(200, 9), &[], 1.0);
    assert_eq!(c.pin_generation(), generation);
    assert_eq!(c.lookup(&[&b[..], &[9]].concat(), b"").unwrap(), 0);
    assert_eq!(
        (c.pins().len(), c.num_pinned_blocks(), c.dropped_pins()),
        (1, 2, 1)
    );
    assert_eq!(c.pinned_blocks(), listed);
    // Read back (the engine promotes it from disk into RAM blocks) and pinned again: RAM
    // holds it again, with the refreshed expiry.
    let r = c.admit("d", &b, b"").unwrap();
    assert_eq!(r.cached_tokens, 0);
    c.append("d", &b[..8]).unwrap();
    c.pin("d", &[spec(8, 300)], 100.0).unwrap();
    c.release("d");
    assert_ne!(c.pin_generation(), generation);
    assert_eq!(c.pins().len(), 2);
    assert_eq!(c.pins()[0].expires_at.to_bits(), 400.0_f64.to_bits());
    assert_eq!(c.lookup(&[&b[..], &[9]].concat(), b"").unwrap(), 8);
    // A shared block takes the latest expiry of the pins covering it.
    turn(&mut c, "e", &toks(0, 5), &[spec(4, 300)], 200.0); // a's first block, 5m
    assert_eq!(
        c.pinned_blocks(),
        [
            (hb[1], 400.0),
            (hb[0], 400.0),
            (ha[1], 3600.0),
            (ha[0], 3600.0)
        ]
    );
    // Expiry ends a pin in both tiers (b at 400, e at 500).
    let generation = c.pin_generation();
    assert_eq!(c.expire_pins(500.0), 2);
    assert_ne!(c.pin_generation(), generation);
    assert_eq!(c.pinned_blocks(), [(ha[1], 3600.0), (ha[0], 3600.0)]);
    c.check_invariants().unwrap();
}
