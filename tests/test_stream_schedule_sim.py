"""benchmarks/stream_schedule_sim.py: the closed-loop workload through the real scheduler gives the
step-time model's exact numbers on a workload small enough to work out by hand."""

import argparse

from benchmarks.stream_schedule_sim import simulate


def _args(**kw):
    base = dict(num_prompts=1, prompt_len=10, output_len=3, max_num_seqs=4, max_num_batched_tokens=64,
                num_kv_blocks=16, turnaround_ms=1.0, random_lens=None, decode_fixed_ms=1.0, hbm_gbps=1.0, kv_bytes_per_token=0,
                prefill_fixed_ms=0.5, prefill_us_per_token=100.0)
    base.update(kw)
    return argparse.Namespace(**base)


def test_one_request_by_hand():
    # prefill 0.5 + 10 x 0.1 = 1.5 ms (TTFT), then two decode steps of 1.0 ms: 3 tokens in 3.5 ms
    r = simulate(_args(), "old", 1)
    assert r["ttft_mean_ms"] == 2 and r["wall_s"] == 0.004  # 1.5 and 3.5 ms, rounded
    assert (r["gap_p50_ms"], r["gap_max_ms"]) == (1.0, 1.0)
    assert r["output_tok_s"] == round(3 / 3.5e-3)


def test_a_prefill_between_decode_steps_stalls_the_running_stream():
    # two clients; the second prompt (30 tokens, 3.5 ms) is prefilled while the first decodes: one of the
    # first stream's gaps is prefill + decode = 4.5 ms; budget 8 does not split a prompt (it runs alone)
    args = _args(num_prompts=2, prompt_len=30, output_len=4, max_num_batched_tokens=30)  # one prompt a step
    for budget in ("old", "8"):
        r = simulate(args, budget, 2)
        assert r["gap_max_ms"] == 4.5 and r["gap_p50_ms"] == 1.0


def test_chunked_prefill_bounds_the_stall_by_the_chunk():
    # the same two clients with chunked prefill and an 8-token budget while a stream decodes: the second
    # prompt runs in chunks of 8, 8, 8 (1.3 ms each, one between two decode steps: gaps of 2.3 ms), then, the
    # first stream done at 9.1 ms, its last 6 with nothing running (1.1 ms: its first token at 10.2 ms)
    args = _args(num_prompts=2, prompt_len=30, output_len=4, max_num_batched_tokens=30)
    r = simulate(args, "8", 2, chunked=True)
    assert (r["gap_max_ms"], r["gap_p50_ms"]) == (2.3, 1.0)
    assert r["ttft_mean_ms"] == round((3.5 + 10.2) / 2)
    assert simulate(args, "8", 2)["gap_max_ms"] == 4.5  # unchunked: the whole prompt at once


def test_a_mixed_step_stalls_the_stream_once():
    # the same two clients with mixed steps: the second prompt is prefilled in a step that also decodes the
    # first stream (31 tokens: 0.5 + 3.1 = 3.6 ms), so the stalled gap is that one step, not prefill + decode
    args = _args(num_prompts=2, prompt_len=30, output_len=4, max_num_batched_tokens=30)
    r = simulate(args, "old", 2, mixed=True)
    assert (r["gap_max_ms"], r["gap_p50_ms"]) == (3.6, 1.0) and r["steps"]["mixed"] == 1
    # a host launch time that the GPU's work hides under: the mixed step takes the launch time
    r = simulate(argparse.Namespace(**{**vars(args), "prefill_launch_ms": 5.0}), "old", 2, mixed=True)
    assert r["gap_max_ms"] == 5.0


def _graph_args(**kw):
    return _args(graph_buckets=[256, 512, 2048], graph_step_ms={256: 2.0, 2048: 9.0}, graph_mixed_host_ms=4.0, **kw)


def test_graph_step_time_rounds_up_to_a_bucket_and_interpolates():
    from benchmarks.stream_schedule_sim import graph_ms

    args = _graph_args()
    assert graph_ms(args, 1) == 2.0 and graph_ms(args, 256) == 2.0  # flat below the first measured point
    assert graph_ms(args, 257) == 2.0 + 7.0 * 256 / 1792  # bucket 512, between 256 and 2048
    assert graph_ms(args, 2048) == 9.0 and graph_ms(args, 2049) is None  # above the largest bucket: eager


def test_prefill_graphs_replace_the_eager_prefill_step():
    # one request, its 10-token prompt in bucket 256 (2.0 ms instead of the eager 0.5 + 10 x 0.1 = 1.5 ms),
    # then two decode steps of 1.0 ms; a 3,000-token prompt is above every bucket: eager (0.5 + 300 ms)
    r = simulate(_graph_args(), "old", 1, graphs=True)
    assert r["ttft_mean_ms"] == 2 and r["wall_s"] == 0.004 and r["prefill_step_p50_ms"] == 2.0
    args = _graph_args(prompt_len=3000, max_num_batched_tokens=4096, num_kv_blocks=256)
    assert simulate(args, "old", 1, graphs=True)["prefill_step_p50_ms"] == 300.5


def test_a_mixed_graph_step_takes_its_host_time_or_its_work():
    # the two clients of the mixed test above, graphs on: prefill of the first (2.0 ms), one decode step
    # (the first stream at 32 tokens), then the mixed step (33 tokens, bucket 256: 2.0 ms) takes
    # max(graph_mixed_host_ms 4.0, 2.0 + its decode row's KV reads, 0 here) = 4.0 ms
    args = _graph_args(num_prompts=2, prompt_len=30, output_len=4, max_num_batched_tokens=30)
    r = simulate(args, "old", 2, mixed=True, graphs=True)
    assert r["gap_max_ms"] == 4.0 and r["steps"]["mixed"] == 1
    # at 100 KB a token and 1 GB/s the row's 32 tokens of context read 3.2 ms: 2.0 + 3.2 = 5.2 ms > the host's 4.0
    r = simulate(argparse.Namespace(**{**vars(args), "kv_bytes_per_token": 100_000}), "old", 2, mixed=True, graphs=True)
    assert r["steps"]["mixed"] == 1 and r["prefill_step_p50_ms"] == 5.2  # (its decode steps read the KV too)
