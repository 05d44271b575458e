"""Teaching tools around the chapter: the hash-count table, the chain view, plots and the
step-through page. They watch the engine through ``PrefixCache.events`` and ``hash_fn``."""
