"""pdserve's benchmarks: the top layer, importing whatever they measure.

Each harness is a module run as a program (`python -m pdserve.benchmarks.<name>`, or
`pdserve bench <name>`), prints one JSON object with `--json`, and compares against a
baseline measured in the same run, because these machines are noisy:
- `engine`: the engine's `LLM` against transformers `generate` (greedy).
- `transfer`: a KV window through the transfer plan against one raw NIXL descriptor, with
  `kv_receiver` as the receiving process; `--link` puts the two on two "hosts" (network
  namespaces joined by a tc-shaped veth, `link.py`) so NIXL moves it over TCP.
- `router`: the router's added time to first token and its request rate.
- `serve`: online serving (TTFT, TPOT, goodput), and 1P1D against colocated nodes.
- `chaos`: a 2P2D soak under load while nodes die, freeze, lose their link and the router
  restarts; every answer checked against a colocated oracle, every page accounted for.
- `trust`: per-request NIXL registration and clearing freed pages, against the KV write.
`model_choice` is the `--model` of `engine` and `serve --compare`: SmolLM2-135M-Instruct by
default, random-weight checkpoints as an option. Committed results live in `results/`.
"""
