//! Chained block hashes.
//!
//! Each full block of `block_size` tokens is hashed over this byte layout (every
//! integer little-endian, so a hash is the same on every platform and Rust release):
//!
//! ```text
//! parent digest   D bytes: the previous block's digest, or D zero bytes for block 0
//! token count     u32
//! tokens          u32 each
//! extra length    u32: extra.len() for block 0, 0 for every later block
//! extra           the bytes (block 0 only)
//! media keys      only for a block an image overlaps: u32 count, then per image
//!                 its 16-byte hash and i64 offset (image start - block start)
//! ```
//!
//! A block no image overlaps has no media keys, so text before the first image
//! hashes exactly as in a text-only prompt; a block holding (part of) an image hashes
//! that image's identity and place, so a different image never shares it (vLLM's
//! extra keys).
//!
//! `extra` (image hashes, a per-API-key cache salt) enters block 0 only: every later
//! hash chains through block 0's, so it separates the whole chain at the cost of one
//! copy. `D` is 16 for xxh3-128 (seed [`XXH3_SEED`], digest in the canonical big-endian
//! order xxHash's `XXH128_canonicalFromHash` prints) and 32 for sha256.
use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::error::CoreError;

/// The fixed xxh3 seed: the ASCII bytes of `"compatsv"`, read big-endian.
pub const XXH3_SEED: u64 = 0x636f_6d70_6174_7376;

/// The hash function behind block hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashKind {
    /// xxh3-128 with [`XXH3_SEED`]: fast; not collision-resistant against a chosen
    /// prompt.
    #[default]
    Xxh3,
    /// sha256: slower, collision-resistant (for servers shared by mutually untrusted
    /// clients).
    Sha256,
}

impl HashKind {
    /// Bytes in a digest of this kind.
    pub const fn digest_len(self) -> usize {
        match self {
            Self::Xxh3 => 16,
            Self::Sha256 => 32,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Xxh3 => "xxh3",
            Self::Sha256 => "sha256",
        }
    }
}

impl fmt::Display for HashKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HashKind {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "xxh3" | "xxh3_128" => Ok(Self::Xxh3),
            "sha256" => Ok(Self::Sha256),
            other => Err(CoreError::InvalidInput(format!(
                "unknown block hash {other:?} (expected \"xxh3\" or \"sha256\")"
            ))),
        }
    }
}

/// A block's chained hash: the digest in the first [`HashKind::digest_len`] bytes,
/// zeros after.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockHash([u8; 32]);

impl BlockHash {
    /// The digest bytes of a hash of `kind`.
    pub fn digest(&self, kind: HashKind) -> &[u8] {
        &self.0[..kind.digest_len()]
    }
}

/// The bytes are a digest already: hashing 8 of them for the map is enough.
impl Hash for BlockHash {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.0[..8]);
        state.write_u64(u64::from_le_bytes(head));
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let len = self.0.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        let len = if len <= 16 { 16 } else { 32 };
        for b in &self.0[..len] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// An image's placeholder tokens `[start, start + len)` in a prompt and its hash
/// ([`image_hash`] of its decoded pixels and processor settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaSpan {
    pub start: usize,
    pub len: usize,
    pub hash: [u8; 16],
}

/// xxh3-128 (seed [`XXH3_SEED`], canonical big-endian digest) of an image's bytes.
pub fn image_hash(data: &[u8]) -> [u8; 16] {
    xxh3_128_with_seed(data, XXH3_SEED).to_be_bytes()
}

/// The spans of `media` that overlap tokens `[block_start, block_start + block_len)`.
fn overlapping(
    media: &[MediaSpan],
    block_start: usize,
    block_len: usize,
) -> impl Iterator<Item = &MediaSpan> {
    media.iter().filter(move |m| {
        m.len > 0 && m.start < block_start + block_len && block_start < m.start + m.len
    })
}

/// Hashes blocks, reusing one byte buffer.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    kind: HashKind,
    buf: Vec<u8>,
}

impl BlockHasher {
    pub fn new(kind: HashKind) -> Self {
        Self {
            kind,
            buf: Vec::new(),
        }
    }

    pub fn kind(&self) -> HashKind {
        self.kind
    }

    /// `H(parent, tokens, extra)` in the module's byte layout. The caller passes the
    /// request's `extra` for block 0 and `&[]` for later blocks; `extra` must be
    /// shorter than 4 GiB.
    pub fn hash_block(
        &mut self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: &[u8],
    ) -> BlockHash {
        self.hash_media_block(parent, tokens, extra, &[], 0)
    }

    /// [`Self::hash_block`] for the block starting at prompt token `block_start`, with
    /// the media keys of every span in `media` that overlaps it.
    pub fn hash_media_block(
        &mut self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: &[u8],
        media: &[MediaSpan],
        block_start: usize,
    ) -> BlockHash {
        let d = self.kind.digest_len();
        let buf = &mut self.buf;
        buf.clear();
        buf.reserve(d + 8 + 4 * tokens.len() + extra.len());
        match parent {
            Some(p) => buf.extend_from_slice(p.digest(self.kind)),
            None => buf.resize(d, 0),
        }
        buf.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        buf.extend_from_slice(&(extra.len() as u32).to_le_bytes());
        buf.extend_from_slice(extra);
        let keys: Vec<&MediaSpan> = overlapping(media, block_start, tokens.len()).collect();
        if !keys.is_empty() {
            buf.extend_from_slice(&(keys.len() as u32).to_le_bytes());
            for m in keys {
                buf.extend_from_slice(&m.hash);
                #[allow(clippy::cast_possible_wrap)]
                let offset = m.start as i64 - block_start as i64;
                buf.extend_from_slice(&offset.to_le_bytes());
            }
        }
        let mut out = [0u8; 32];
        match self.kind {
            HashKind::Xxh3 => {
                out[..16].copy_from_slice(&xxh3_128_with_seed(buf, XXH3_SEED).to_be_bytes());
            }
            HashKind::Sha256 => out.copy_from_slice(&Sha256::digest(buf.as_slice())),
        }
        BlockHash(out)
    }

    /// The chained hashes of every full block of `tokens`.
    pub fn chain(&mut self, block_size: usize, tokens: &[u32], extra: &[u8]) -> Vec<BlockHash> {
        self.chain_media(block_size, tokens, extra, &[])
    }

    /// [`Self::chain`] with the media keys of `media` in the blocks images overlap.
    pub fn chain_media(
        &mut self,
        block_size: usize,
        tokens: &[u32],
        extra: &[u8],
        media: &[MediaSpan],
    ) -> Vec<BlockHash> {
        let mut hashes: Vec<BlockHash> = Vec::with_capacity(tokens.len() / block_size);
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let extra = if i == 0 { extra } else { &[] };
            let hash = self.hash_media_block(hashes.last(), block, extra, media, i * block_size);
            hashes.push(hash);
        }
        hashes
    }
}

#[cfg(test)]
mod tests {
    use std::fmt::Write;

    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().fold(String::new(), |mut s, b| {
            write!(s, "{b:02x}").unwrap();
            s
        })
    }

    /// The documented layout, spelled out by hand.
    fn layout(parent: &[u8], tokens: &[u32], extra: &[u8]) -> Vec<u8> {
        let mut bytes = parent.to_vec();
        bytes.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        for &t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        bytes.extend_from_slice(&(extra.len() as u32).to_le_bytes());
        bytes.extend_from_slice(extra);
        bytes
    }

    const TOKENS: [u32; 8] = [1, 2, 3, 4, 5, 6, 7, 0xdead_beef];
    const SALT: &[u8] = b"salt";

    /// Golden values over [`TOKENS`] in blocks of 4 with extra `b"salt"`: computed
    /// once, pinned, and reproduced independently from the documented layout with
    /// Python's `hashlib.sha256` and with the C reference xxHash 0.8.1
    /// (`XXH3_128bits_withSeed`, high 64 bits first, each big-endian).
    #[test]
    fn golden_xxh3() {
        let h = BlockHasher::new(HashKind::Xxh3).chain(4, &TOKENS, SALT);
        let got: Vec<_> = h.iter().map(|h| hex(h.digest(HashKind::Xxh3))).collect();
        assert_eq!(got, GOLDEN_XXH3);
    }

    #[test]
    fn golden_sha256() {
        let h = BlockHasher::new(HashKind::Sha256).chain(4, &TOKENS, SALT);
        let got: Vec<_> = h.iter().map(|h| hex(h.digest(HashKind::Sha256))).collect();
        assert_eq!(got, GOLDEN_SHA256);
    }

    const GOLDEN_XXH3: [&str; 2] = [
        "ff4d3e460b73d92591c690959c36ca37",
        "61224bcc6243cb15ebb9cb490b4be79f",
    ];
    const GOLDEN_SHA256: [&str; 2] = [
        "bc848b2f161c3fce6c79da9da99cd4f4cd811911d9b28c679dc18cf2ae6d90f2",
        "5f86d63232b8b603cd86afdf89f2071cf673e058507d4a1c7a68da4163bc1287",
    ];

    #[test]
    fn chain_matches_the_documented_layout() {
        for kind in [HashKind::Xxh3, HashKind::Sha256] {
            let digest = |bytes: &[u8]| -> Vec<u8> {
                match kind {
                    HashKind::Xxh3 => xxh3_128_with_seed(bytes, XXH3_SEED).to_be_bytes().to_vec(),
                    HashKind::Sha256 => Sha256::digest(bytes).to_vec(),
                }
            };
            let first = digest(&layout(&vec![0; kind.digest_len()], &TOKENS[..4], SALT));
            let second = digest(&layout(&first, &TOKENS[4..], b""));
            let chain = BlockHasher::new(kind).chain(4, &TOKENS, SALT);
            assert_eq!(chain.len(), 2);
            assert_eq!(chain[0].digest(kind), first.as_slice(), "{kind}");
            assert_eq!(chain[1].digest(kind), second.as_slice(), "{kind}");
        }
    }

    #[test]
    fn partial_blocks_are_not_hashed_and_prefixes_agree() {
        let mut h = BlockHasher::new(HashKind::Xxh3);
        let long = h.chain(3, &TOKENS, b"");
        assert_eq!(long.len(), 2);
        assert_eq!(h.chain(3, &TOKENS[..5], b""), long[..1]);
        assert!(h.chain(3, &TOKENS[..2], b"").is_empty());
    }

    #[test]
    fn every_input_changes_the_hash() {
        let mut h = BlockHasher::new(HashKind::Xxh3);
        let base = h.hash_block(None, &[1, 2], b"");
        let parent = h.hash_block(None, &[9], b"");
        assert_ne!(base, h.hash_block(Some(&parent), &[1, 2], b""));
        assert_ne!(base, h.hash_block(None, &[1, 3], b""));
        assert_ne!(base, h.hash_block(None, &[2, 1], b""));
        assert_ne!(base, h.hash_block(None, &[1, 2], b"x"));
        // The length prefixes keep tokens and extra bytes apart.
        assert_ne!(
            h.hash_block(None, &[1], &[2, 0, 0, 0]),
            h.hash_block(None, &[1, 2], b"")
        );
        let mut s = BlockHasher::new(HashKind::Sha256);
        assert_ne!(
            base.digest(HashKind::Xxh3),
            &s.hash_block(None, &[1, 2], b"").digest(HashKind::Sha256)[..16]
        );
    }

    #[test]
    fn media_keys_touch_only_the_blocks_an_image_overlaps() {
        let tokens: Vec<u32> = (0..16).collect();
        let image = |hash: u8, start: usize| MediaSpan {
            start,
            len: 6,
            hash: [hash; 16],
        };
        for kind in [HashKind::Xxh3, HashKind::Sha256] {
            let mut h = BlockHasher::new(kind);
            let plain = h.chain(4, &tokens, b"");
            // Image tokens 5..11 overlap blocks 1 and 2.
            let a = h.chain_media(4, &tokens, b"", &[image(1, 5)]);
            assert_eq!(a[0], plain[0], "text before the image hashes as text-only");
            assert_ne!(a[1], plain[1]);
            assert_ne!(a[2], plain[2]);
            assert_ne!(a[3], plain[3], "later blocks chain through the image");
            // The same image again: the same chain; a different one shares block 0 only.
            assert_eq!(h.chain_media(4, &tokens, b"", &[image(1, 5)]), a);
            let b = h.chain_media(4, &tokens, b"", &[image(2, 5)]);
            assert_eq!(b[0], a[0]);
            assert!(b[1..].iter().zip(&a[1..]).all(|(x, y)| x != y));
            // The same image one token later: a different offset inside block 1.
            let moved = h.chain_media(4, &tokens, b"", &[image(1, 6)]);
            assert_ne!(moved[1], a[1]);
            // An image after the last full block changes nothing.
            assert_eq!(h.chain_media(4, &tokens, b"", &[image(1, 16)]), plain);
        }
    }

    #[test]
    fn image_hash_is_xxh3_128_with_the_seed() {
        assert_eq!(
            image_hash(b"pixels"),
            xxh3_128_with_seed(b"pixels", XXH3_SEED).to_be_bytes()
        );
        assert_ne!(image_hash(b"pixels"), image_hash(b"pixelz"));
    }

    #[test]
    fn kinds_parse_and_print() {
        for kind in [HashKind::Xxh3, HashKind::Sha256] {
            assert_eq!(kind.as_str().parse::<HashKind>().unwrap(), kind);
        }
        assert_eq!("xxh3_128".parse::<HashKind>().unwrap(), HashKind::Xxh3);
        assert!("md5".parse::<HashKind>().is_err());
    }
}
