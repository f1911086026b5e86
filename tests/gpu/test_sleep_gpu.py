"""Sleep mode on one GPU (issue 19): the memory really goes back to the driver, and comes back at
the same addresses.

Qwen3-1.7B shape, random (dummy) weights, bfloat16, offline ``LLM(enable_sleep_mode=True)``:

- level 1: the device memory a second process sees free grows by the weights + KV cache, and
  that process can allocate it; ``wake_up`` restores: greedy tokens equal to before the sleep,
  parameter and KV-cache addresses unchanged, decode replays the CUDA graphs captured at start
  (``num_replays`` grows) at the same step time;
- level 2: a plain ``wake_up`` reloads the (seeded dummy) weights: greedy equal to before;
  ``wake_up(tags=["weights"])`` + the trainer's weights + ``wake_up(tags=["kv_cache"])`` gives
  the trainer's (Hugging Face, bf16) greedy tokens, up to near ties.

Numbers (bytes released, sleep / wake seconds per level, decode step ms before/after) are
printed and written to ``$RLSERVE_GPU_REPORT/sleep.json`` when that is set (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from tests.gpu.report import gpu_report  # noqa: E402

GiB = 2**30
PROMPTS = [[1000 + 37 * i + j for j in range(24)] for i in range(8)]
NEW = 32


def _report(key, value):
    gpu_report("sleep", key, value)


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _greedy(llm, n=NEW):
    from rlserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp)]


def _decode_step_ms(llm, steps: int = 48) -> float:
    """Median wall time of a decode step of the 8-prompt batch (prefill excluded), ms."""
    from rlserve import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"step-{time.monotonic_ns()}-{i}", p, sp)
    eng.step()  # prefill
    times = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    return 1000 * times[len(times) // 2]


def _fingerprint(llm) -> torch.Tensor:
    """float64 sum of every parameter: equal before and after means restored (up to a
    permutation that a sum misses, which a copy-back cannot make)."""
    return torch.stack([p.double().sum() for p in llm.engine.model.parameters()]).cpu()


def _addresses(llm) -> list[int]:
    runner = llm.engine.executor.runner
    return [p.data_ptr() for p in llm.engine.model.parameters()] + [t.data_ptr() for kv in runner.kv_caches for t in kv]


def _other_process_allocates() -> dict:
    """A second process reads the free device memory and allocates all of it but 1 GiB."""
    code = textwrap.dedent("""
        import json, torch
        free, total = torch.cuda.mem_get_info()
        n = free - (1 << 30)
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        x.fill_(7)
        torch.cuda.synchronize()
        print(json.dumps({"free": free, "allocated": n}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from model_shapes import save_shape

    from rlserve import LLM
    from tests.tiny_models import build_tokenizer

    root = str(tmp_path_factory.mktemp("shapes"))
    path = save_shape("qwen3-1.7b", root)
    tok = os.path.join(root, "tok")
    build_tokenizer().save_pretrained(tok)
    t0 = time.perf_counter()
    llm = LLM(path, tokenizer=tok, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=1024,
              max_num_seqs=16, gpu_memory_utilization=0.85, enable_sleep_mode=True,
              extra={"cuda_graph_sizes": "1,2,4,8,16"})
    _report("engine_start_s", round(time.perf_counter() - t0, 2))
    yield llm


def test_level1_releases_and_restores(llm):
    runner = llm.engine.executor.runner
    assert runner.cuda_graphs is not None, "CUDA graphs were not captured at start"
    info = llm.engine.sleep_mode.info()
    _report("region_bytes", info["bytes"])
    before = _greedy(llm)
    step_before = _decode_step_ms(llm)
    addrs, fp = _addresses(llm), _fingerprint(llm)
    free_awake = _free()
    t0 = time.perf_counter()
    llm.sleep(level=1)
    sleep_s = time.perf_counter() - t0
    free_asleep = _free()
    released = free_asleep - free_awake
    other = _other_process_allocates()
    _report("level1", {"sleep_s": round(sleep_s, 3), "released_bytes": released,
                       "released_gib": round(released / GiB, 2), "free_awake_gib": round(free_awake / GiB, 2),
                       "free_asleep_gib": round(free_asleep / GiB, 2),
                       "other_process_allocated_gib": round(other["allocated"] / GiB, 2)})
    expected = info["bytes"]["weights"] + info["bytes"]["kv_cache"]
    assert released >= 0.98 * expected, (released, expected)
    assert other["allocated"] > free_awake + 0.9 * expected  # it got the engine's memory
    t0 = time.perf_counter()
    llm.wake_up()
    wake_s = time.perf_counter() - t0
    assert _free() <= free_awake + (256 << 20)
    assert _addresses(llm) == addrs
    assert torch.equal(_fingerprint(llm), fp)
    replays = runner.cuda_graphs.num_replays
    after = _greedy(llm)
    step_after = _decode_step_ms(llm)
    _report("level1_wake", {"wake_up_s": round(wake_s, 3), "greedy_equal": after == before,
                            "decode_step_ms_before": round(step_before, 3), "decode_step_ms_after": round(step_after, 3),
                            "graph_replays_after_wake": runner.cuda_graphs.num_replays - replays})
    assert after == before
    assert runner.cuda_graphs.num_replays - replays >= NEW - 1  # the same graphs, replayed
    assert step_after < 1.5 * step_before + 0.2


def test_level2_reload_and_trainer_sync(llm):
    from transformers import AutoModelForCausalLM

    from rlserve.demo import Completion, compare_completions, measure_gaps

    before = _greedy(llm)
    free_awake = _free()
    t0 = time.perf_counter()
    llm.sleep(level=2)
    sleep_s = time.perf_counter() - t0
    released = _free() - free_awake
    t0 = time.perf_counter()
    llm.wake_up()  # nobody refilled the weights: the seeded dummy weights are reloaded
    wake_reload_s = time.perf_counter() - t0
    assert _greedy(llm) == before

    from transformers import AutoConfig

    torch.manual_seed(1)  # the trainer: Hugging Face's own random init of the same shape
    with torch.device("cuda"):
        trainer = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llm.engine.config.model))
    trainer = trainer.to(torch.bfloat16).eval()
    llm.sleep(level=2)
    t0 = time.perf_counter()
    llm.wake_up(tags=["weights"])
    wake_w_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.engine.load_weights((k, v) for k, v in trainer.state_dict().items())
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.wake_up(tags=["kv_cache"])
    wake_kv_s = time.perf_counter() - t0
    assert llm.engine.sleep_mode.stats["reloads"] == 1  # only the plain wake above reloaded
    after = _greedy(llm)
    ref = []
    with torch.no_grad():
        for p in PROMPTS:
            x = torch.tensor([p], device="cuda")
            y = trainer.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                                 min_new_tokens=NEW, pad_token_id=0)
            ref.append(y[0, len(p):].tolist())
    comps = [Completion(prompt=str(i), text="", token_ids=a, prompt_token_ids=p)
             for i, (a, p) in enumerate(zip(after, PROMPTS))]
    mism = compare_completions(comps, ref)
    measure_gaps(trainer, comps, mism)
    _report("level2", {"sleep_s": round(sleep_s, 3), "released_gib": round(released / GiB, 2),
                       "wake_up_with_reload_s": round(wake_reload_s, 3), "wake_up_weights_s": round(wake_w_s, 3),
                       "load_trainer_weights_s": round(load_s, 3), "wake_up_kv_cache_s": round(wake_kv_s, 3),
                       "greedy_equal_trainer": f"{len(PROMPTS) - len(mism)}/{len(PROMPTS)}",
                       "mismatch_gaps": [m.gap for m in mism]})
    assert after != before
    assert all(m.near_tie(0.5) for m in mism), [(m.index, m.first_difference, m.gap) for m in mism]
    # exact: the same trainer weights loaded into the awake engine give the same parameters
    fp = _fingerprint(llm)
    llm.engine.load_weights((k, v) for k, v in trainer.state_dict().items())
    assert torch.equal(_fingerprint(llm), fp)
