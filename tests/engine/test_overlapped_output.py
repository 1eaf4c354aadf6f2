"""Overlapped output (the GPU's mode: a step's text is made during the next step's
forward) gives exactly what the plain mode gives: the same tokens, text, finish reasons,
logprobs and streamed deltas, one step later; a stop string found a step late drops the
token computed meanwhile; aborts in between lose nothing. Run on the CPU by switching the
mode on."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams


def engines(model_dir, **kwargs):
    plain = LLM(model_dir, **kwargs)
    overlapped = LLM(model_dir, **kwargs)
    overlapped.engine.overlap_output = True
    return plain, overlapped


def run_streaming(engine, prompts, params):
    """Every delta of every request, and the final outputs, stepping the engine by hand."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    deltas, finals = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                deltas.setdefault((out.request_id, c.index), []).append((tuple(c.new_token_ids), c.new_text))
            if out.finished:
                finals[out.request_id] = out
    assert engine.num_free_pages() == engine.num_total_pages()
    return deltas, finals


def summary(out):
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.logprobs) for c in out.outputs]


PROMPTS = [[5, 6, 7, 8, 9] * 3, [10, 11, 12], [13, 40, 7] * 5, [99] * 30]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.8, seed=3, n=2, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.0),  # EOS may end some early
], ids=["greedy", "seeded-n2-logprobs", "eos"])
def test_overlapped_mode_gives_the_plain_modes_outputs(checkpoint_dirs, params):
    plain, overlapped = engines(checkpoint_dirs("llama"), max_num_batched_tokens=32, max_num_seqs=3)
    deltas_a, finals_a = run_streaming(plain.engine, PROMPTS, params)
    deltas_b, finals_b = run_streaming(overlapped.engine, PROMPTS, params)
    assert {k: summary(v) for k, v in finals_a.items()} == {k: summary(v) for k, v in finals_b.items()}
    # The same pieces, concatenated, whatever the stepping
    for key in deltas_a:
        joined = ["".join(t for _, t in d) for d in (deltas_a[key], deltas_b[key])]
        ids = [[i for piece, _ in d for i in piece] for d in (deltas_a[key], deltas_b[key])]
        assert joined[0] == joined[1] and ids[0] == ids[1], key


def test_a_stop_string_found_a_step_late_drops_the_token_computed_meanwhile(checkpoint_dirs):
    model = checkpoint_dirs("llama")
    free = LLM(model).generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    plain, overlapped = engines(model)
    tried = 0
    for prompt, out in zip(PROMPTS, free):
        text = out.outputs[0].text
        if len(text) < 6:
            continue
        tried += 1
        stop = text[len(text) // 2:len(text) // 2 + 2]  # somewhere in the middle
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
        a = plain.generate([prompt], params)[0]
        b = overlapped.generate([prompt], params)[0]
        assert summary(a) == summary(b) and a.outputs[0].finish_reason == "stop"
        assert len(b.outputs[0].token_ids) < 16
    assert tried >= 2
    assert overlapped.engine.num_free_pages() == overlapped.engine.num_total_pages()


def test_abort_while_the_text_is_pending_frees_everything(checkpoint_dirs):
    _, overlapped = engines(checkpoint_dirs("llama"))
    engine = overlapped.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9], params)
    engine.step()  # both prefilled, their first tokens' text pending
    assert engine.abort("a")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"b"} and outs[-1].finished
    assert len(outs[-1].outputs[0].token_ids) == 8
    assert engine.num_free_pages() == engine.num_total_pages()
