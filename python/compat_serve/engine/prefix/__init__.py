"""The prefix cache, in tiers behind one interface (`PrefixCaching`, engine thread only):

- `cache`: admission, storing as tokens get computed, finish; the Rust `PrefixCache`
  bookkeeping (chained block hashes, block pool) and the Python mirror of RAM blocks;
  KV events subscribe to its store/evict notifications;
- `store`: the RAM tier's tensors (K/V per block, hybrid state snapshots);
- `tails`: partial last blocks of finished requests;
- `disk`: the disk tier (`--cache-dir`), written through by a background thread.
"""

from compat_serve.engine.prefix.cache import PrefixCaching

__all__ = ["PrefixCaching"]
