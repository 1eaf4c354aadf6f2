"""pdserve, one namespace: the design's folders (proto/, engine/, router/, worker/, ...)
install as `pdserve.<folder>` (setuptools package-dir in pyproject.toml).

This folder holds the top: the `pdserve` command line (`cli`, flags from each layer's
configuration dataclasses, `envflags` for PDSERVE_* variables), `pdserve up` (`up`), the
helpers that start and stop nodes as processes (`procs`, `launch`, `netns`) and the gRPC
client (`client`, `results`), which the plain install runs without torch, NIXL or Triton.
`arith` is the one module below every layer. `pdserve bench` runs the benchmarks (the layer
above) as their own programs.
"""
