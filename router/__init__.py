"""The router: the client-facing Generation service (`service`, and the OpenAI HTTP API in
`openai_http`/`openai_protocol`) and the dispatch of each request over prefill and decode
nodes: `dispatch` (the protocol's order of calls), `admission` (bounds and turns),
`state` (one request in flight), `calls` (how a node is called, and the one mapping of its
failures), `selective` (when the decode node prefills itself), `registry`, `policies`,
`prefix_index`, `load`, `discovery`/`etcd_discovery` (which nodes exist and how busy they
are), `tokenizer`, `validation` and `config`. Never runs a model: imports neither engine
nor torch (a contract in pyproject.toml says so).
"""
