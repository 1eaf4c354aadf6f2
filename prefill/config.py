"""Prefill role configuration: one dataclass; its fields are the `pdserve prefill` flags."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.runtime.options import option


@dataclass
class PrefillConfig:
    transfer_timeout_s: float = option(
        30.0, "deadline of one request's KV write to a decode node (a RemoteSend's own "
              "deadline shortens it further)")
    max_window_age_s: float = option(
        600.0, "refuse a KV window its decode node signed longer ago than this (by this node's "
               "wall clock against the decode node's: keep it far above any clock skew)")
    max_in_flight: int = option(
        64, "RemoteSends worked on at once; more get RESOURCE_EXHAUSTED (the router then "
            "lets the decode node prefill itself)")
    kv_send: str = option(
        "auto", "how a window's KV goes to its decode node: `layerwise` writes each layer as soon "
                "as it is computed (the transfer hides behind the rest of the prefill: wins on a "
                "network link), `whole` writes the window once the prefill ends (one write, the "
                "fewest descriptors: wins on shared memory, where the write is ~1%% of a "
                "prefill); `auto`: whole to a decode node on this host, layerwise to one "
                "elsewhere or unknown", choices=("auto", "whole", "layerwise"))
    layer_write_mb: float = option(
        2.0, "layer-wise sends: post a WRITE once a step's computed layers hold this many MiB "
             "(more layers per WRITE are fewer, larger descriptors: the page-major pool keeps "
             "a page's consecutive layers adjacent; less starts the transfer sooner)")
