"""uniradix.spec: the executable specification of SGLang's unified radix prefix cache.

Standard library only.  The state is primary state only (docs/DESIGN.md): derived quantities such as
evictable sizes, leaf sets and eviction order are recomputed from scratch by query functions.
"""
