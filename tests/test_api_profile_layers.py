"""benchmarks/api_profile_layers.py: py-spy stacks of the API process sorted into the layers a streamed event
passes through (issue 37's profile, BENCHMARKS.md H29), and benchmarks/gc_time_site's GC lines read back."""

import os
import subprocess
import sys

from benchmarks import api_profile_layers as apl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = 'process 10:"python -m rlserve serve m";thread (10): MainThread'
READER = 'process 10:"python -m rlserve serve m";thread (11): rlserve-core-reader-0'
CORE = 'process 10:"python -m rlserve serve m";process 12:"python -m rlserve.engine.core.core_proc";thread (12): MainThread'
LOOP = "Runner.run (asyncio/runners.py:118)"
STREAM = (LOOP + ";StreamingResponse.__call__.<locals>.wrap (starlette/responses.py:281);"
          "SSEResponse.stream_response (rlserve/server/openai_stream.py:65);"
          "ServerErrorMiddleware.__call__.<locals>._send (starlette/middleware/errors.py:161)")


def _send(line: int) -> str:
    return f"RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:{line})"


def test_a_sample_goes_to_its_innermost_named_layer():
    write = min(apl.WRITE_LINES)
    assert apl.classify((STREAM + ";" + _send(write)).split(";"), "MainThread").startswith("transport.write")
    assert apl.classify((STREAM + ";" + _send(write + 1000)).split(";"), "MainThread").startswith("uvicorn ")
    assert apl.classify(STREAM.split(";"), "MainThread").startswith("Starlette ")
    assert apl.classify([LOOP], "MainThread") == apl.LOOP
    assert apl.classify([], "MainThread") == apl.LOOP
    decode = min(apl.DECODE_LINES)
    handle = f"CoreProcReplica._handle_pending (rlserve/engine/front/core_client.py:{decode})"
    assert apl.classify([LOOP, handle], "MainThread").startswith("msgspec decode")
    detok = ("OutputProcessor._extend (rlserve/engine/front/output_processor.py:209);"
             "ByteLevelIncrementalDetokenizer._text_for (rlserve/engine/bytelevel_detokenizer.py:84)")
    assert apl.classify([LOOP, handle] + detok.split(";"), "MainThread") == "detokenizer"
    # under FastAPI's request handler everything is admission, even a frame another rule names
    admit = "get_request_handler.<locals>.app (fastapi/routing.py:528);" + _send(write)
    assert apl.classify([LOOP] + admit.split(";"), "MainThread") == apl.ADMISSION
    assert apl.classify(["recv (zmq/sugar/socket.py:1)"], "rlserve-core-reader-0") == apl.READER
    assert apl.classify(["f (somewhere/else.py:3)"], "MainThread") == apl.OTHER


def test_only_the_api_process_samples_count():
    raw = "\n".join([f"{API};{STREAM};{_send(min(apl.WRITE_LINES))} 7", f"{API};{LOOP} 3",
                     f"{READER};recv (zmq/sugar/socket.py:1) 2", f"{CORE};step (core.py:5) 50", "garbage"])
    layers, other = apl.api_samples(raw)
    assert sum(layers.values()) == 12
    assert layers[apl.LOOP] == 3 and layers[apl.READER] == 2
    assert layers["transport.write (uvloop: send syscall, loopback TCP)"] == 7
    assert not other


def test_gc_time_site_lines_are_read_back_for_the_window(tmp_path):
    """The sitecustomize records this process's collections; gc_in_window takes the differences."""
    code = "import gc, time\nfor _ in range(3):\n    gc.collect(0); time.sleep(0.6)\ngc.collect()\n"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "benchmarks", "gc_time_site"), GC_TIME_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code, "serve"], env=env, check=True, timeout=60)
    (name,) = os.listdir(tmp_path)
    lines = (tmp_path / name).read_text().splitlines()
    assert lines[0] == "-c serve"
    rows = [[float(x) for x in ln.split()] for ln in lines[1:]]
    assert len(rows) >= 3 and all(r[1] >= 1 for r in rows) and rows[-1][3] >= 1  # gen 0 and the full collection
    g = apl.gc_in_window(str(tmp_path), [rows[0][0], rows[-1][0]])
    assert g["collections"] == [int(rows[-1][i] - rows[0][i]) for i in (1, 2, 3)]
    assert g["collections"][2] >= 1 and all(s >= 0 for s in g["cpu_s"])
