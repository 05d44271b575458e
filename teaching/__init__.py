"""Teaching tools around the chapter: the hash-count table, the chain view, the figures, the
step-through page, the pool drawing and the one-Sequence poke session. They watch the engine
through ``PrefixCache.recording()`` and its swappable ``hash_fn``, never by replacing its
methods."""
