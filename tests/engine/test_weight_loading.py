"""How a node holds the weights it loads: as its own memory, so a checkpoint or LoRA adapter
file truncated or rewritten in place while it serves (a model updated where it lies, an
adapter saved again) changes nothing it answers and crashes nothing; and a tensor-parallel
rank casts only its share of a checkpoint stored in another dtype, never the whole model
before cutting it.

Each test runs the engine in a child process: a weight still mapped from a truncated file
raises SIGBUS, which would end the test run rather than fail the test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pdserve.engine.checkpoint import write_checkpoint

SERVE_THEN_CHANGE_A_FILE = """
import json, os, sys
from pdserve.engine import LLM, SamplingParams
model_dir, tp, change, adapter_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], (sys.argv[4:] or [None])[0]
llm = LLM(model_dir, lora_modules=[f"a={adapter_dir}"] if adapter_dir else [], tensor_parallel_size=tp, page_size=4,
          num_pages=32, num_threads=1)

def answer():
    engine = llm.engine
    engine.add_request("r", [5, 17, 42, 9], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       lora="a" if adapter_dir else "")
    done = []
    while engine.has_unfinished():
        done += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    engine.requests.clear()
    return done[0]

before = answer()
path = os.path.join(adapter_dir, "adapter_model.safetensors") if adapter_dir else os.path.join(model_dir, "model.safetensors")
if change == "truncated":
    os.truncate(path, 0)
else:  # zeros over every byte, header included
    with open(path, "r+b") as f:
        f.write(bytes(os.path.getsize(path)))
after = answer()
llm.close()
print(json.dumps({"before": before, "after": after}))
"""

# Rank 1 of 2's peak resident memory while it loads, above what it held before: the kernel's
# high-water mark, reset first (clear_refs 5), so no sampling misses a peak.
LOAD_RANK_1 = """
import json, sys, torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.model.weights import load_config
from pdserve.engine.tp.shard import load_rank, split_for

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

config = EngineConfig(model_dir=sys.argv[1], tensor_parallel_size=2)
hf = load_config(config.model_dir)
shard = split_for(config, hf)[1]
held = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
load_rank(config, hf, torch.float32, 64, shard)
print(json.dumps({"peak_above": status("VmHWM") - held}))
"""


@pytest.fixture(scope="module")
def bfloat16_model(tmp_path_factory):
    """A checkpoint stored in bfloat16, big enough that its weights dwarf a process's other
    memory, and its size in float32 (as the engine serves it by default)."""
    model_dir = write_checkpoint(tmp_path_factory.mktemp("bf16") / "m", weights_dtype="bfloat16", hidden_size=512,
                                 intermediate_size=2048, num_hidden_layers=16, num_attention_heads=8,
                                 num_key_value_heads=8)
    return model_dir, 2 * sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def run_child(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tp, changed, change", [(1, "model", "truncated"), (2, "model", "overwritten"),
                                                 (1, "adapter", "overwritten")])
def test_a_file_changed_in_place_while_serving_changes_no_answer(tp, changed, change, checkpoint_dirs, tmp_path):
    from pdserve.engine.checkpoint import write_lora_adapter

    model_dir = shutil.copytree(checkpoint_dirs("llama"), tmp_path / "m")
    adapter = [str(write_lora_adapter(model_dir, tmp_path / "a", seed=1))] if changed == "adapter" else []
    answers = run_child(SERVE_THEN_CHANGE_A_FILE, str(model_dir), str(tp), change, *adapter)
    assert answers["after"] == answers["before"] and len(answers["before"]) == 8


def test_a_rank_casts_its_share_of_the_weights_not_the_whole_model(bfloat16_model):
    # The whole model in float32 is twice the file. Rank 1 keeps half the layers; its peak
    # also counts the file's pages it maps while it reads them (the whole file: o's and
    # down's columns span it). Casting every weight before cutting it peaks at the file plus
    # the whole float32 model, 1.5 times that model.
    model_dir, float32_model = bfloat16_model
    peak_above = run_child(LOAD_RANK_1, str(model_dir))["peak_above"]
    assert peak_above < 1.25 * float32_model, f"rank 1 peaked {peak_above / float32_model:.2f} times the float32 model"
