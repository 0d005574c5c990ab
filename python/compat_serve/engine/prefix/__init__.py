"""The prefix cache, in tiers behind one interface (`PrefixCaching`, engine thread only):

- `cache`: admission, reading prefixes back; `storing`: storing as tokens get computed,
  finish; between them the Rust `PrefixCache` bookkeeping (chained block hashes, block
  pool) and the Python mirror of RAM blocks; the KV event publisher the engine hands
  in hears of every stored and evicted block;
- `store`: the RAM tier's tensors (K/V per block, hybrid state snapshots);
- `tails`: partial last blocks of finished requests;
- `disk`: the disk tier (`--cache-dir`), written through by a background thread.
"""

from compat_serve.engine.prefix.cache import PrefixCaching

__all__ = ["PrefixCaching"]
