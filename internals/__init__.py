"""The engine's inner parts, beside the reading path: the fast attention kinds, the sampler,
per-request records and the CPU thread policy. A reader of the chapter can skip this package."""
