"""Teaching tools around the chapter: the hash-count table, the chain view, the figures, the
step-through page and the one-Sequence poke session. They watch the engine through
``PrefixCache.events`` and its swappable ``hash_fn``, never by replacing its methods."""
