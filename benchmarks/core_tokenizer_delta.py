"""What the tree before session 22 did in the engine-core process before ready and this tree does after (issue 37):
import transformers' tokenizer classes and load the tokenizer. Runs this tree's core start on the CPU (warm-up
imports, then the engine with ``defer_tokenizer``, as ``core_proc`` does), then measures
``core_tokenizer.load_tokenizer(TOKENIZER)`` alone: CPU seconds, and the modules it imported. With ``CALLGRIND=1``
under valgrind, callgrind's instrumentation is on for that part only (instruction counts: steady on a loaded machine):

    python benchmarks/core_tokenizer_delta.py MODEL_DIR TOKENIZER_DIR
    CALLGRIND=1 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=cg.out \
        python benchmarks/core_tokenizer_delta.py MODEL_DIR TOKENIZER_DIR   # then: grep totals cg.out
"""
import os, subprocess, sys, time
from rlserve.engine.core.core_proc import warm_up_imports
from rlserve.gc_heap import no_collections_while_importing as g
with g():
    warm_up_imports("cpu")
from rlserve.config import EngineConfig
from rlserve.engine.core.engine_core import EngineCore
from rlserve.engine.core.llm_engine import LLMEngine
from rlserve.engine.core.core_tokenizer import load_tokenizer
EngineCore(LLMEngine(EngineConfig(model=sys.argv[1], max_model_len=64, max_num_seqs=2), defer_tokenizer=True), 0, "0",
           deltas=True)
n0 = len(sys.modules)
if os.environ.get("CALLGRIND"):
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True)
t = time.process_time()
tok = load_tokenizer(sys.argv[2])
dt = time.process_time() - t
if os.environ.get("CALLGRIND"):
    subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], capture_output=True)
import transformers
print("DELTA", transformers.__version__, sys.argv[2], round(dt, 3), "s CPU", len(sys.modules) - n0, "modules", len(tok))
