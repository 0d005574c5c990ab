//! The prefix cache on a 128k-token prompt in blocks of 16 (8k blocks): hashing it
//! (xxh3 and sha256), a `lookup` and an `admit` + `release` on a warm pool where all of
//! it is cached, and a cold `admit` + `append` + `release` that stores every block.

use std::hint::black_box;
use std::time::{Duration, Instant};

use compat_core::prefix_cache::{BlockHasher, HashKind, PrefixCache};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const TOKENS: usize = 128 * 1024;
const BLOCK_SIZE: usize = 16;
const PROMPT_BLOCKS: usize = TOKENS / BLOCK_SIZE;

fn prompt(seed: u32) -> Vec<u32> {
    // Spread over a 150k vocabulary, like real token ids.
    (0..TOKENS as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 150_000)
        .collect()
}

/// A pool of `num_blocks` where `tokens` is cached.
fn warm(num_blocks: usize, tokens: &[u32]) -> PrefixCache {
    let mut c = PrefixCache::new(BLOCK_SIZE, num_blocks, HashKind::Xxh3).expect("valid");
    c.admit("warm", tokens, b"").expect("admits");
    c.append("warm", tokens).expect("appends");
    c.release("warm");
    c
}

/// Runs `f` for about a second and prints its rate over a 128k-token prompt.
fn report(what: &str, mut f: impl FnMut()) {
    let start = Instant::now();
    let mut runs = 0u32;
    while start.elapsed() < Duration::from_secs(1) || runs < 3 {
        f();
        runs += 1;
    }
    let secs = start.elapsed().as_secs_f64() / f64::from(runs);
    println!(
        "prefix_cache: {what}: {:.3} ms per 128k-token prompt ({:.1} M tokens/s)",
        secs * 1e3,
        TOKENS as f64 / secs / 1e6
    );
}

fn bench(c: &mut Criterion) {
    let tokens = prompt(0);
    let fresh = prompt(1);
    let mut group = c.benchmark_group("prefix_cache");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .throughput(Throughput::Elements(TOKENS as u64));

    for kind in [HashKind::Xxh3, HashKind::Sha256] {
        let mut hasher = BlockHasher::new(kind);
        let mut hash = || black_box(hasher.chain(BLOCK_SIZE, black_box(&tokens), b""));
        report(&format!("hash ({kind})"), || {
            hash();
        });
        group.bench_function(format!("hash_128k_{kind}"), |b| b.iter(&mut hash));
    }

    let mut cache = warm(2 * PROMPT_BLOCKS, &tokens);
    let lookup = |cache: &PrefixCache| {
        let hit = cache.lookup(black_box(&tokens), b"").expect("looks up");
        assert_eq!(hit, TOKENS - BLOCK_SIZE);
    };
    report("lookup, warm (xxh3)", || lookup(&cache));
    group.bench_function("lookup_128k_warm", |b| b.iter(|| lookup(&cache)));

    let admit = |cache: &mut PrefixCache| {
        let a = cache.admit("r", black_box(&tokens), b"").expect("admits");
        assert_eq!(a.block_ids.len(), PROMPT_BLOCKS - 1);
        cache.release("r");
    };
    report("admit + release, warm (xxh3)", || admit(&mut cache));
    group.bench_function("admit_release_128k_warm", |b| {
        b.iter(|| admit(&mut cache));
    });

    // The pool holds one prompt: every run stores 8k blocks, evicting the previous
    // run's, and alternating prompts keeps every run cold.
    let mut cold = warm(PROMPT_BLOCKS, &tokens);
    let mut flip = false;
    let mut store = |cache: &mut PrefixCache| {
        flip = !flip;
        let p = if flip { &fresh } else { &tokens };
        let a = cache.admit("r", p, b"").expect("admits");
        assert_eq!(a.cached_tokens, 0);
        let filled = cache.append("r", &p[a.cached_tokens..]).expect("appends");
        assert_eq!(filled.len(), PROMPT_BLOCKS);
        cache.release("r");
        cache.take_evicted();
    };
    report("admit + append + release, cold (xxh3)", || store(&mut cold));
    group.bench_function("admit_append_release_128k_cold", |b| {
        b.iter(|| store(&mut cold));
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
