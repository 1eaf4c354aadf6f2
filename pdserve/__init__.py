"""The composition: the `pdserve` command line (`cli`, flags from each layer's
configuration dataclasses, `envflags` for PDSERVE_* variables), a worker process wired from
engine, agent and roles (`worker`), the colocated node (`colocated`), `pdserve up`
(`up`), the one helper that starts and stops nodes as processes (`procs`) and the gRPC
client (`client`). Imports every layer below it; `pdserve bench` runs the benchmarks (the
layer above) as their own programs.
"""
