"""zerodram runtime: topology, rank context, KV cache, communication, MoE, engine, metrics.

Layering: `zerodram.launch` (CLI, torchrun entry, dashboard) uses this package, which uses
`zerodram.kernels`; never the other way round.
"""

__version__ = "0.1.0"
