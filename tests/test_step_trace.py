"""benchmarks/step_trace.py: the engine step trace of the streaming device runs (issue 37) reads back
into step-time histograms and the gaps between decode steps, cut into one block per benchmark run."""

import os
import subprocess
import sys

from benchmarks import step_trace


def test_summarize_groups_steps_and_decode_gaps():
    # D (10 ms) D (10 ms) P 8192 (20 ms) D (10 ms) P 2048 (5 ms) D: times in seconds
    rows = [(0.000, "D", 240, 240, 240), (0.010, "D", 240, 240, 240), (0.020, "P", 8192, 16, 256),
            (0.040, "D", 256, 256, 256), (0.050, "P", 2048, 4, 256), (0.055, "D", 256, 256, 256)]
    s = step_trace.summarize(rows)
    assert s["steps"]["P 4097-8192"] == {"n": 1, "p50": 20.0, "p90": 20.0, "max": 20.0, "tokens": 8192}
    assert s["steps"]["P 1025-2048"]["p50"] == 5.0
    assert s["steps"]["D 1-1024"]["n"] == 3  # the last step has no successor
    gaps = s["decode_gaps"]
    assert gaps["0"]["n"] == 1 and gaps["0"]["max"] == 10.0 and gaps["0"]["streams"] == 240
    assert gaps["4097-8192"]["max"] == 30.0 and gaps["4097-8192"]["streams"] == 240
    assert gaps["1025-2048"]["max"] == 15.0 and gaps["1025-2048"]["streams"] == 256


def test_segments_cut_at_idle_time_and_drop_short_ones():
    run1 = [(float(i) * 0.01, "D", 1, 1, 1) for i in range(60)]
    warm = [(5.0, "P", 10, 1, 1), (5.01, "D", 1, 1, 1)]
    run2 = [(10.0 + i * 0.01, "D", 1, 1, 1) for i in range(70)]
    segs = step_trace.segments(run1 + warm + run2)
    assert [len(s) for s in segs] == [60, 70]


def test_installed_in_an_engine_core_process_only(tmp_path):
    site = step_trace.site_dir(str(tmp_path))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(step_trace.__file__)))
    env = dict(os.environ, STEP_TRACE_DIR=str(tmp_path), PYTHONPATH=f"{site}{os.pathsep}{repo}")
    code = ("from rlserve.engine.core.scheduler import Scheduler; from rlserve.engine.core.block_manager import "
            "BlockManager; from rlserve.engine.core.sequence import Sequence; from rlserve.engine.sampling_params "
            "import SamplingParams; s = Scheduler(BlockManager(8, 4), 4, 16); "
            "s.add(Sequence('a', 0, [1, 2, 3], SamplingParams(max_tokens=4), 4)); print(s.schedule().num_tokens)")
    for argv, n_files in ((["--prestarted"], 1), (["serve"], 1)):  # an API process ("serve") writes none
        out = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "3", out.stderr
        assert len([f for f in os.listdir(tmp_path) if f.endswith(".steps")]) == n_files
    rows = step_trace.read_steps(str(tmp_path))
    assert [r[1:] for r in rows] == [("P", 3, 1, 1)]


def test_a_mixed_step_ends_one_decode_gap_and_holds_the_next():
    # D (10 ms) M 1792 + 256 decodes (15 ms) D (10 ms) D: the gap from M to the next D holds M's prefill
    rows = [(0.000, "D", 256, 256, 256), (0.010, "M", 1792, 256, 259), (0.025, "D", 259, 259, 259),
            (0.035, "D", 259, 259, 259)]
    s = step_trace.summarize(rows)
    assert s["steps"]["M 1025-2048"] == {"n": 1, "p50": 15.0, "p90": 15.0, "max": 15.0, "tokens": 1792}
    gaps = s["decode_gaps"]
    assert gaps["0"]["n"] == 2 and gaps["0"]["max"] == 10.0 and gaps["0"]["streams"] == 256 + 259
    assert gaps["1025-2048"] == {"n": 1, "p50": 15.0, "p90": 15.0, "p99": 15.0, "max": 15.0, "streams": 256}


def test_an_emptied_engine_is_idle_not_a_step_and_a_long_step_is_a_stall():
    # D 256 (7 ms) ... D 5: all five finish; the engine waits 260 ms; P 2000 of 4 new sequences (running 4);
    # then D 4 (30 ms: a stall only if >= STALL_S) and a 900 ms step with 4 running
    rows = [(0.000, "D", 256, 256, 256), (0.007, "D", 5, 5, 5), (0.267, "P", 2000, 4, 4),
            (0.287, "D", 4, 4, 4), (0.317, "P", 1500, 3, 7), (1.217, "D", 7, 7, 7), (1.224, "D", 7, 7, 7)]
    s = step_trace.summarize(rows)
    assert s["idle"] == {"n": 1, "p50": 260.0, "max": 260.0, "ms": 260.0}
    assert s["steps"]["D 1-1024"]["n"] == 3 and s["steps"]["D 1-1024"]["max"] == 30.0  # the idle is not a step
    assert s["stalls"] == [[0.317, "P", 1500, 3, 900.0]]
    gaps = s["decode_gaps"]
    # D 256 -> D 5 (7 ms, 256 streams); D 5 -> D 4 spans the emptied engine: no stream gap
    assert gaps["0"]["streams"] == 256 + 7 and gaps["0"]["n"] == 2
    assert gaps["1025-2048"] == {"n": 1, "p50": 930.0, "p90": 930.0, "p99": 930.0, "max": 930.0, "streams": 4}


def test_a_long_stall_inside_a_run_does_not_cut_it():
    run = [(i * 0.01, "D", 8, 8, 8) for i in range(60)] + [(0.6 + 0.9 + i * 0.01, "D", 8, 8, 8) for i in range(60)]
    assert [len(s) for s in step_trace.segments(run)] == [120]
