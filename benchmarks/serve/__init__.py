"""`pdserve bench serve`: an online serving benchmark for a running router or node.

- `workload`: what is asked (prompts and output lengths) and when (arrival times).
- `backends`: how one request is sent and timed (pdserve gRPC, OpenAI-compatible HTTP).
- `load`: drives a workload at a rate or concurrency against a backend.
- `metrics`: TTFT, TPOT, ITL, end-to-end latency, throughput and goodput.
- `cluster` and `compare`: 1P1D against colocated nodes on the same pinned cores.
- `peer_server`, `peer_pd`, `pd_proxy` and `vllm_pd_site`: vLLM as the peer, one server
  or 1P1D over its NixlConnector behind our proxy, measured at its best.
- `plot` and `report`: the figure and the tables.
- `runs`: what every run shares (backend, workload, result rows, output).
- `cli`: the command line (`python -m pdserve.benchmarks.serve`).
"""
