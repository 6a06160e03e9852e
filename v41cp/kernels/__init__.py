"""GPU kernels (Pallas / jax-triton) for sparse MLA over paged V4.1 caches and the indexer scan.

Empty for now: the kernels issue adds each kernel next to its ``*_reference`` (the jnp paths in
`v41cp.layers` are those references today). jax_triton is imported lazily inside kernels only.
"""
