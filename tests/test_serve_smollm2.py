"""Issue 45: SmolLM2-135M's real weights (float32) behind the server: 16 concurrent greedy requests (different prompt
lengths, arrival times, `max_tokens`, some with `stop`) each return what `generate` gives for the prompt alone; the
chat template works. The server runs in this process (one model in memory), on a loopback port."""
from __future__ import annotations

import threading
import time

import numpy as np
import openai
import pytest


@pytest.fixture(scope="module")
def served():
    from eformer_nb.serve.engine import Engine, EngineConfig
    from eformer_nb.serve.server import Server, load_model
    model, codec = load_model("smollm2")
    srv = Server(Engine(model, EngineConfig(max_num_seqs=16, page_size=16, max_model_length=128, prefill_chunk=32,
                                            max_prefill_seqs=4)), codec, "smollm2", port=0).start()
    try:
        yield model, codec, srv
    finally:
        srv.stop()


def test_sixteen_concurrent_greedy_requests_match_generate_alone(served):
    import jax.numpy as jnp
    model, codec, srv = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)
    texts = ["The capital of France is", "Water boils at a temperature of", "The largest planet in our solar system",
             "In the morning, Alice walked to the"]
    lengths = [3, 5, 6, 8]
    prompts = [codec.encode(texts[i % 4] + " and then")[:lengths[i // 4]] for i in range(16)]
    maxes = [3 + i % 4 for i in range(16)]
    ref = {}
    for i, p in enumerate(prompts):  # generate alone, the longest answer once per prompt (greedy: a prefix of it)
        full = np.asarray(model.generate(jnp.asarray([p]), max_new_tokens=6).sequences)[0, len(p):].tolist()
        ref[i] = full[:maxes[i]]
    eos = model.config.eos_token_id
    stops = {i: codec.decode(ref[i][1:])[:3].strip() or None for i in range(0, 16, 5)}
    results, errors = {}, []

    def ask(i):
        try:
            time.sleep(0.1 * i)
            kw = {"stop": stops[i]} if stops.get(i) else {}
            results[i] = client.completions.create(model="smollm2", prompt=prompts[i], max_tokens=maxes[i],
                                                   temperature=0, **kw)
        except Exception as e:  # noqa: BLE001 - collected and raised below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    [t.start() for t in threads]
    [t.join(600) for t in threads]
    assert not errors, errors
    for i in range(16):
        toks = ref[i][:ref[i].index(eos) + 1] if eos in ref[i] else ref[i]
        want = codec.decode(toks)
        if stops.get(i) and stops[i] in want:
            want = want[:want.index(stops[i])]
        assert results[i].choices[0].text == want, (i, prompts[i], results[i].choices[0].text, want)
    print(f"compiled step shapes: {srv.engine.stats()['compiled_shapes']}")

