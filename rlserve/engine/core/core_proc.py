"""The engine-core process: one engine replica (scheduler, KV cache, model runner, its TP
worker processes) stepping in a process of its own, driven over ZMQ by the API server
(:mod:`rlserve.engine.front.core_client` starts it; messages in :mod:`rlserve.engine.core_protocol`).

Between two steps it takes every message waiting on its input socket (adds, aborts, stop-string
stops, utility calls), then runs one step and sends that step's token deltas as one message
(no text: the API process detokenizes, see :mod:`rlserve.engine.front.output_processor`). Idle or frozen (a
keep-pause), it blocks on the input socket. It never outlives the API process: the kernel
kills it when its parent dies (``PR_SET_PDEATHSIG``: the API process starts every core from one
thread that lives as long as it does, ``core_spawn._Spawner``, because the kernel means the
parent *thread*), and it also checks its parent id every loop. SIGINT is ignored (a Ctrl-C reaches the API process, which stops the cores); SIGTERM
stops it cleanly. Once out of its loop it sends :class:`~rlserve.engine.core_protocol.CoreExiting`
and ends with ``os._exit`` (no interpreter teardown).

With ``rlserve serve --api-server-count N`` (N > 1) the core serves N API processes (vLLM's
clients): ``--client-input ADDR --client-output ADDR`` once for each of processes 1..N-1 (process
0's are ``--input`` / ``--output``). Its one ``PULL`` socket connects to every process's input
address (fair-queued; each process's messages stay in order); it has one ``PUSH`` socket per
process, and sends each request's deltas and errors to the process that added it
(``AddRequest.client_index``), utility answers to process 0 (the only caller), stats and the
ready / exiting messages to every process. Process 0's admission state reaches the others through
here (utility ``front_state``: :class:`~rlserve.engine.core_protocol.FrontState` out,
:class:`~rlserve.engine.core_protocol.FrontStateAck` back, then the answer;
:mod:`rlserve.engine.front.front_sync`).

Run as ``python -m rlserve.engine.core.core_proc --input ADDR --output ADDR --dp-index I
--parent-pid PID --config JSON [--client-input ADDR --client-output ADDR]...``. ``RLSERVE_ENGINE_CORE_INIT=module:function`` names a
function called before the engine is built (tests patch the process with it).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time

import msgspec

from rlserve import envs
from rlserve.errors import InvalidRequestError

logger = logging.getLogger("rlserve.engine.core.core_proc")

_IDLE_POLL_MS = 1000  # an idle core wakes at least this often (milliseconds)
#: Utility methods the API process may call (UtilityCall.method).
UTILITY_METHODS = ("abort", "abort_all", "set_frozen", "wait_drained", "reset_prefix_cache", "call", "stats",
                   "lift_quarantine", "front_state", "front_pending")


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``),
    and exit now if the parent already died before this call."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):  # pragma: no cover - no libc: the loop's check remains
            pass
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)


class CoreServer:
    """The loop of an engine-core process around an :class:`~rlserve.engine.core.engine_core.EngineCore`.

    Args:
        core: the engine core (built).
        input_sock: connected ZMQ ``PULL`` socket (to every API process's input address).
        output_sock: connected ZMQ ``PUSH`` socket, or a list of them: one per API process, by
            client index (``--api-server-count``).
        parent_pid: the API process id (the loop exits when the parent changes).
    """

    def __init__(self, core, input_sock, output_sock, parent_pid: int = 0):
        from rlserve.engine import core_protocol as proto

        self.proto = proto
        self.core = core
        self.input = input_sock
        self.outputs = list(output_sock) if isinstance(output_sock, (list, tuple)) else [output_sock]
        self.output = self.outputs[0]  # API process 0's: utility answers
        self._client_of: dict[str, int] = {}  # request id -> its API process, for processes 1..N-1
        self._front_epoch = 0
        self._front_waits: dict[int, list] = {}  # epoch -> [call id, processes yet to ack, their aborted sum]
        self.parent_pid = parent_pid
        self.stopping = False
        self._dec = proto.input_decoder()
        self._enc = proto.output_encoder()
        self._outs: list = []  # RequestDeltas not sent yet
        self._errors: list = []
        self._drain_calls: list[int] = []  # wait_drained calls answered once idle

    # ---- sending -----------------------------------------------------------------------
    def _send(self, msg) -> None:
        self.output.send(self._enc.encode(msg), copy=False)

    def flush(self, stats: dict | None = None) -> None:
        """Send the outputs and errors gathered so far (and ``stats``) as one message (one per
        API process with ``--api-server-count``: :meth:`_flush_routed`)."""
        if len(self.outputs) > 1:
            self._flush_routed(stats)
        elif self._outs or self._errors or stats is not None:
            msg = self.proto.CoreOutputs(self._outs, self._errors, stats)
            self._outs, self._errors = [], []
            self._send(msg)

    def _flush_routed(self, stats: dict | None) -> None:
        """Each request's deltas and errors to the API process that added it (``client_index``;
        the request is forgotten with its last one), ``stats`` to every process."""
        per = [([], []) for _ in self.outputs]
        client_of = self._client_of
        for d in self._outs:
            per[client_of.pop(d.request_id, 0) if d.finished else client_of.get(d.request_id, 0)][0].append(d)
        for e in self._errors:
            per[client_of.pop(e.request_id, 0)][1].append(e)
        self._outs, self._errors = [], []
        for sock, (deltas, errors) in zip(self.outputs, per):
            if deltas or errors or stats is not None:
                sock.send(self._enc.encode(self.proto.CoreOutputs(deltas, errors, stats)), copy=False)

    def broadcast(self, msg) -> None:
        """``msg`` to every API process (ready, exiting)."""
        data = self._enc.encode(msg)
        for sock in self.outputs:
            sock.send(data)

    def _reply(self, call_id: int, result=None, error: BaseException | None = None) -> None:
        self.flush()  # the outputs a call produced arrive before its answer
        p = self.proto
        if error is not None:
            self._send(p.UtilityResult(call_id, None, p.error_info(error)))
            return
        try:
            self._send(p.UtilityResult(call_id, p.to_wire(result)))
        except Exception as e:  # noqa: BLE001 - a result MessagePack cannot hold
            self._send(p.UtilityResult(call_id, None, p.error_info(TypeError(f"unsendable result: {e}"))))

    # ---- receiving -----------------------------------------------------------------------
    def _drain_input(self, timeout_ms: int) -> None:
        import zmq

        if not self.input.poll(timeout_ms):
            return
        while True:
            try:
                raw = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self._dec.decode(raw.buffer)
            except Exception as e:  # noqa: BLE001 - msgspec's DecodeError / ValidationError, a __post_init__'s error
                self._refuse(raw.buffer, e)
                continue
            try:
                self._handle(msg)
            except Exception:  # noqa: BLE001 - one message's failure (a bug) must not end the loop
                logger.exception("engine core: handling a %s message failed", type(msg).__name__)
            if self.stopping:
                return

    def _refuse(self, data, exc: Exception) -> None:
        """A message that does not decode as :data:`~rlserve.engine.core_protocol.InputMessage`
        fails alone: an add is answered with its request's error (``InvalidRequestError``: the
        API process answers 400), a utility call with its call's error; anything else is logged
        and dropped. The message is read a second time without the schema (plain MessagePack:
        never pickle) only to find whom to answer."""
        p = self.proto
        err = InvalidRequestError(f"the engine core could not decode this message: {exc}")
        try:
            obj = msgspec.msgpack.decode(data)
        except Exception:  # noqa: BLE001 - not MessagePack at all
            obj = None
        kind = obj.get("type") if isinstance(obj, dict) else None
        rid = obj.get("request_id") if isinstance(obj, dict) else None
        cid = obj.get("call_id") if isinstance(obj, dict) else None
        if kind == "add" and isinstance(rid, str):
            logger.error("engine core: refused request %s: %s", rid, exc)
            self._errors.append(p.RequestError(rid, p.error_info(err)))
        elif kind == "call" and isinstance(cid, int) and not isinstance(cid, bool) and cid > 0:
            logger.error("engine core: refused utility call %d: %s", cid, exc)
            self._reply(cid, error=err)
        else:
            logger.error("engine core: dropped an undecodable input message (%d bytes): %s", len(data), exc)

    def _handle(self, msg) -> None:
        p, core = self.proto, self.core
        if isinstance(msg, p.AddRequest):
            if msg.client_index:
                if not 0 < msg.client_index < len(self.outputs):
                    logger.error("engine core: dropped request %s of unknown API process %d", msg.request_id,
                                 msg.client_index)
                    return
                self._client_of[msg.request_id] = msg.client_index
            try:
                core.add(msg.request_id, msg.prompt, msg.params, msg.stream, msg.arrival_time)
            except Exception as e:  # noqa: BLE001 - InvalidRequestError and bugs alike: this request only
                self._errors.append(p.RequestError(msg.request_id, p.error_info(e)))
        elif isinstance(msg, p.Abort):
            self._outs.extend(core.abort(msg.request_ids))
        elif isinstance(msg, p.StopSamples):
            try:
                self._outs.extend(core.stop_samples(msg.request_id, msg.indices))
            except Exception:  # noqa: BLE001 - this request only (its abort ends it)
                logger.exception("stopping samples of request %s failed", msg.request_id)
                self._outs.extend(core.abort([msg.request_id]))
        elif isinstance(msg, p.SetWeightVersion):
            core.weight_version = msg.version
        elif isinstance(msg, p.UtilityCall):
            self._utility(msg)
        elif isinstance(msg, p.Shutdown):
            self.stopping = True
        elif isinstance(msg, p.FrontStateAck):
            self._front_acked(msg.epoch, msg.client_index, msg.aborted)

    def _front_state(self, call_id: int, args: list) -> bool:
        """Utility ``front_state`` (``[paused, pause_mode, refusal, weight_version, abort_held, abort_ids, abort_seq]``,
        from API process 0): relay it to processes 1..N-1 as :class:`FrontState`; answered (the requests their acks
        say they aborted, summed) once each acked (True: answered now, there being no other process)."""
        if len(self.outputs) == 1:
            return True
        self._front_epoch += 1
        epoch = self._front_epoch
        self.flush()  # outputs of requests they added come before the state
        data = self._enc.encode(self.proto.FrontState(epoch, bool(args[0]), *args[1:7]))
        for sock in self.outputs[1:]:
            sock.send(data)
        self._front_waits[epoch] = [call_id, set(range(1, len(self.outputs))), 0]
        return False

    def _front_acked(self, epoch: int, client: int, aborted: int) -> None:
        wait = self._front_waits.get(epoch)
        if wait is None or client not in wait[1]:
            return
        wait[1].discard(client)
        wait[2] += int(aborted)
        if not wait[1]:
            del self._front_waits[epoch]
            self._reply(wait[0], wait[2])

    def _utility(self, msg) -> None:
        core, args = self.core, msg.args
        try:
            if msg.method == "abort":
                self._outs.extend(core.abort(args[0]))
                result = None
            elif msg.method == "abort_all":
                outs = core.abort_all()
                self._outs.extend(outs)
                if args and args[0]:
                    core.lift_quarantine()
                result = len(outs)
            elif msg.method == "lift_quarantine":
                core.lift_quarantine()
                return  # no answer (call id 0)
            elif msg.method == "set_frozen":
                core.frozen = bool(args[0])
                if core.frozen:  # stats() and every request's tokens (progress) as of the freeze, before the answer
                    self._outs.extend(core.progress())
                    core.snapshot_stats(force=True)
                    self.flush(dict(core.stats))
                result = None
            elif msg.method == "wait_drained":
                core.frozen = False  # a replica frozen by an earlier keep-pause steps to drain
                self._drain_calls.append(msg.call_id)
                return
            elif msg.method == "reset_prefix_cache":
                result = core.reset_prefix_cache()
            elif msg.method == "call":
                result = core.call(args[0], *args[1:])
            elif msg.method == "stats":
                core.snapshot_stats(force=True)
                result = core.stats
            elif msg.method == "front_state":
                if not self._front_state(msg.call_id, args):
                    return  # answered once every API process acked (_front_acked)
                result = 0  # (no other API process: none of theirs aborted)
            elif msg.method == "front_pending":  # the API processes that owe an ack (a pause that timed out)
                result = sorted(set().union(*(w[1] for w in self._front_waits.values())))
            else:
                raise ValueError(f"unknown engine-core method {msg.method!r}; known: {', '.join(UTILITY_METHODS)}")
        except Exception as e:  # noqa: BLE001 - delivered to the caller
            self._reply(msg.call_id, error=e)
            return
        self._reply(msg.call_id, result)

    # ---- loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until :class:`Shutdown`, SIGTERM or the parent's death."""
        from rlserve.errors import EngineDeadError

        core = self.core
        step_failures = 0
        was_busy = True
        try:
            while not self.stopping:
                busy = core.busy()
                self._drain_input(0 if busy and not core.halted else _IDLE_POLL_MS)
                if self.stopping or (self.parent_pid and os.getppid() != self.parent_pid):
                    break
                busy = core.busy()
                if core.halted or not busy:
                    if core.snapshot_stats(force=was_busy):
                        self.flush(dict(core.stats))
                    else:
                        self.flush()
                    was_busy = False
                    if not busy and self._drain_calls:
                        calls, self._drain_calls = self._drain_calls, []
                        for c in calls:
                            self._reply(c)
                    continue
                try:
                    outs = core.step()
                    self._outs.extend(outs)
                    step_failures = 0
                except Exception as e:  # noqa: BLE001 - must not kill the loop
                    step_failures += 1
                    ids, err = core.fail_all(e)
                    self._errors.extend(self.proto.RequestError(r, self.proto.error_info(err)) for r in ids)
                    if step_failures > 1:
                        time.sleep(min(0.05 * step_failures, 1.0))  # do not spin on a broken engine
                    outs = ()
                # a request that finished leaves with numbers that no longer count it
                fresh = core.snapshot_stats(force=any(o.finished for o in outs))
                self.flush(dict(core.stats) if fresh else None)
                was_busy = True
        finally:
            ids, err = core.fail_all(EngineDeadError(f"engine replica {core.index} stopped"), abort_in_engine=False)
            self._errors.extend(self.proto.RequestError(r, self.proto.error_info(err)) for r in ids)
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the API process may be gone
                pass
            core.shutdown()


def main(argv=None, prestarted: tuple | None = None) -> int:
    """The engine-core process (see the module docstring). ``prestarted``: ``(seconds of imports,
    seconds then waited for the arguments[, warm_up_imports' list of (part, seconds)])`` of a
    :func:`prestarted_main` start (logged)."""
    t_main = time.perf_counter()
    ap = argparse.ArgumentParser(description="rlserve engine-core process (started by the API server)")
    ap.add_argument("--input", required=True, help="ZMQ address of the API's input socket")
    ap.add_argument("--output", required=True, help="ZMQ address of the API's output socket")
    ap.add_argument("--dp-index", type=int, default=0)
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    ap.add_argument("--log-level", default=envs.RLSERVE_LOG_LEVEL)
    ap.add_argument("--client-input", action="append", default=[],
                    help="ZMQ input address of API process 1, 2, ... (--api-server-count; repeated, in order)")
    ap.add_argument("--client-output", action="append", default=[],
                    help="ZMQ output address of API process 1, 2, ... (as --client-input)")
    args = ap.parse_args(argv)
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s [engine-core {args.dp_index}] %(name)s: %(message)s",
                        stream=sys.stderr)
    from rlserve.startup_log import log_phase, uncached_bytecode

    if prestarted is not None:
        parts = "".join(f"{what} {s:.2f} s, " for what, s in (prestarted[2] if len(prestarted) > 2 else ()))
        log_phase(logger, "engine-core imports (prestarted)", prestarted[0],
                  f"{parts}then {prestarted[1]:.2f} s waiting for the API process's arguments")
    uncached = uncached_bytecode()
    if uncached and args.dp_index == 0:
        logger.warning("start-up: %s have no cached bytecode (.pyc) and this process cannot write it "
                       "(PYTHONDONTWRITEBYTECODE=1 or a read-only install): every start compiles their sources "
                       "again, seconds of each start (`python -m compileall` over the install once, or "
                       "PYTHONPYCACHEPREFIX=DIR without PYTHONDONTWRITEBYTECODE, caches them)", ", ".join(uncached))

    import zmq

    from rlserve.engine import core_protocol as proto

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    if len(args.client_input) != len(args.client_output):
        raise SystemExit("--client-input and --client-output must come in pairs")
    for addr in [args.input, *args.client_input]:
        inp.connect(addr)
    outs = []
    for addr in [args.output, *args.client_output]:
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.SNDHWM, 0)
        out.setsockopt(zmq.LINGER, 2000)
        out.connect(addr)
        outs.append(out)
    out = outs[0]
    enc = proto.output_encoder()
    server = None

    def on_term(signum, frame):
        if server is not None:
            server.stopping = True
        else:
            raise SystemExit(1)

    signal.signal(signal.SIGTERM, on_term)
    try:
        init = envs.RLSERVE_ENGINE_CORE_INIT
        from rlserve.config import EngineConfig
        from rlserve.engine.core.engine_core import EngineCore, resolve_target
        from rlserve.engine.core.llm_engine import LLMEngine

        if init:
            resolve_target(init)()
        from rlserve.engine.cpu.cpu_threads import allow_binding

        allow_binding()  # this process only runs the engine: its CPU engine thread may be pinned
        config = msgspec.json.decode(args.config.encode(), type=EngineConfig)
        engine = LLMEngine(config, dp_index=args.dp_index, defer_tokenizer=True)  # loaded after ready (below)
        core = EngineCore(engine, args.dp_index, args.weight_version, deltas=True)
        dtype = str(getattr(engine, "dtype", "")).removeprefix("torch.")
        info = proto.EngineInfo(pid=os.getpid(), vocab_size=int(engine.vocab_size),
                                max_model_len=int(engine.max_model_len),
                                max_num_batched_tokens=config.max_num_batched_tokens,
                                device=str(engine.device), dtype=dtype,
                                num_kv_blocks=int(engine.block_manager.num_blocks),
                                eos_token_ids=sorted(int(t) for t in getattr(engine, "eos_token_ids", ()) or ()))
    except BaseException as e:  # noqa: BLE001 - reported to the API process
        if isinstance(e, InvalidRequestError):  # a setting refused (one line; the API process says it again)
            logger.error("engine replica %d failed to start: %s", args.dp_index, e)
        else:
            logger.exception("engine replica %d failed to start", args.dp_index)
        for o in outs:
            o.send(enc.encode(proto.CoreFailed(proto.error_info(e))))
            o.close(linger=2000)
        ctx.term()
        return 1
    from rlserve.gc_heap import freeze_startup_heap

    for o in outs:
        o.send(enc.encode(proto.CoreReady(info)))
    log_phase(logger, "engine-core process: arguments -> ready", time.perf_counter() - t_main)
    # after CoreReady: this collection (~0.3 s) overlaps the API process's own app build and heap
    # freeze, which come before its first request; a message meanwhile waits in the socket
    freeze_startup_heap(f"engine-core process {args.dp_index}")  # the model's objects: never collected
    # the tokenizer (text prompts, structured outputs; transformers' tokenizer stack) loads from here on, beside
    # the loop: not before ready (rlserve.engine.core.core_tokenizer)
    engine.start_tokenizer_load()
    server = CoreServer(core, inp, outs, args.parent_pid)
    try:
        server.run()
        # the API process waits for an exiting core instead of killing it at its grace
        server.broadcast(proto.CoreExiting())
    finally:
        inp.close(linger=0)
        for o in outs:
            o.close(linger=1000)
        ctx.term()
    return 0


from rlserve.engine.core.core_prestart import prestarted_main, warm_up_imports  # noqa: E402,F401 (its entry point)

if __name__ == "__main__":
    rc = prestarted_main(main) if sys.argv[1:2] == ["--prestarted"] else main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no interpreter teardown: the engine is shut down, its memory goes with the process
