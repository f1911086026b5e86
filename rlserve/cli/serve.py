"""``rlserve serve MODEL``: the OpenAI-compatible HTTP server (its flags, named as vLLM's: :mod:`rlserve.cli.serve_args`;
the checks before any engine starts: :mod:`rlserve.cli.serve_checks`): start the engine, serve until a signal, stop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import logging
import os
import signal
import sys
import threading
import time

from rlserve import envs
from rlserve.cli import serve_checks
from rlserve.cli.serve_args import add_serve_parser, engine_config_from_args
from rlserve.cli.tool_flags import check_parsers_fit_tokenizer, check_tool_args, tool_settings
from rlserve.cli.vllm_compat import check_vllm_compat_args, generation_config_dir, generation_defaults, \
    load_chat_template
from rlserve.gc_heap import no_collections_while_importing
from rlserve.model_len import check_checkpoint_max_model_len
from rlserve.server.http_protocol import http_stack

logger = logging.getLogger("rlserve.serve")


def register(subparsers) -> None:
    add_serve_parser(subparsers).set_defaults(func=run)


def _beside(fn, *args, what: str = "") -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread started now: start-up work that runs beside the engine's start
    (its imports with the garbage collector off: :func:`rlserve.gc_heap.no_collections_while_importing`);
    the future's ``result()`` gives its value or raises its exception. ``what``: a start-up line
    (:func:`rlserve.startup_log.log_phase`) when it is done: its wall-clock seconds and the thread's own
    CPU seconds (the rest it waited: on the GIL beside the other threads, on a module another thread
    imports, on the disk)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        t = time.perf_counter()
        try:
            with no_collections_while_importing():
                value = fn(*args)
            fut.set_result(value)
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            fut.set_exception(e)
        if what:
            from rlserve.startup_log import log_phase

            log_phase(logger, f"API process: {what} (beside the engine's start)", time.perf_counter() - t,
                      f"thread CPU {time.thread_time():.2f} s")

    threading.Thread(target=run, name="rlserve-start-beside", daemon=True).start()
    return fut


def _now(fn, *args, what: str = "") -> concurrent.futures.Future:
    """``fn(*args)`` run now (collections off, as :func:`_beside`), as a done future (its interface;
    ``what`` unused: the API process's "flags and checks" line counts it)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    try:
        with no_collections_while_importing():
            value = fn(*args)
        fut.set_result(value)
    except Exception as e:  # noqa: BLE001 - delivered to the caller
        fut.set_exception(e)
    return fut


def _import_app():
    """``rlserve.server.app`` and what serving it imports (uvicorn), beside the engine's start."""
    import uvicorn  # noqa: F401 -- (what _serve imports)

    from rlserve.server import http_protocol, state  # noqa: F401

    return importlib.import_module("rlserve.server.app")


def run(args) -> int:
    """Load the engine, then serve until SIGINT/SIGTERM; then ends the process (``os._exit``)
    with the exit status. Returns the status only when the engine could not start."""
    from rlserve.server import log_prefix, metrics_mp, multi_api

    attach = multi_api.attach_from_env()  # API process 1..N-1 of --api-server-count N (rlserve.server.multi_api)
    # every line starts "(APIServer pid=P)", "(ApiServer_i pid=P)" with N > 1: vLLM's (rlserve.server.log_prefix)
    proc_name = log_prefix.process_name(args.api_server_count, attach["client_index"] if attach else 0)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format=log_prefix.log_format(proc_name),
                        stream=sys.stderr)
    from rlserve.errors import InvalidRequestError, RLServeError

    model_arg = args.model_flag or args.model or "default"
    problem = check_vllm_compat_args(args) or check_tool_args(args) or multi_api.check_args(args)
    if problem is None and args.lora_modules and not args.enable_lora:
        problem = "--lora-modules needs --enable-lora"
    if problem is None and args.enable_lora:  # (else every adapter load would be a 500)
        from rlserve.errors import MissingExtraError
        from rlserve.lora import require_peft

        try:
            require_peft("--enable-lora")
        except MissingExtraError as e:
            problem = str(e)
    if problem is not None:
        print(f"rlserve serve: error: {problem}", file=sys.stderr)
        return 2
    if args.weight_transfer_config is not None and "backend" not in args.weight_transfer_config:
        print("rlserve serve: error: --weight-transfer-config needs a \"backend\" (nccl | gloo | ipc)", file=sys.stderr)
        return 2
    prestart = (args.engine_mode or envs.RLSERVE_ENGINE_MODE) == "process" and attach is None
    if prestart:  # the engine-core processes import the engine while this one imports and checks its part
        from rlserve.engine.front.core_spawn import discard_prestarted, prestart_cores

        prestart_cores(max(1, int(getattr(args, "data_parallel_size", 1) or 1)), args.device)
    try:
        if args.weight_transfer_config is not None:
            from rlserve.config import resolve_device
            from rlserve.transfer.server.manager import check_transfer_config

            check_transfer_config(args.weight_transfer_config, args.weight_staging,
                                  device=resolve_device(args.device).type)
        model_path = serve_checks.resolve_model_name(model_arg)
        chat_template = load_chat_template(args.chat_template)
        generation_config_dir(args.generation_config, model_path)  # (read beside the engine's start below)
        config = engine_config_from_args(args, model_path)
        max_model_len = check_checkpoint_max_model_len(config.max_model_len, model_path)
        serve_checks.check_kv_cache(config, model_path, max_model_len)
        tokenizer = check_parsers_fit_tokenizer(args, args.tokenizer or model_path)  # None: the engine loads it
        serve_checks.check_device(config)
        serve_checks.check_cpu_environment(config)
        for name in ("RLSERVE_CUDA_GRAPH_SIZES", "RLSERVE_PREFILL_CUDA_GRAPHS"):  # read by the engine's warm-up
            envs.read(name)
        stack = http_stack()  # (RLSERVE_HTTP_IMPL)
        sock = multi_api.listen_socket(attach) if attach else serve_checks.bind_listen_socket(args.host, args.port)
        servers = None  # API process 0 of N > 1: processes 1..N-1, started with the cores (AsyncEngine's on_started)
        if args.api_server_count > 1 and not attach:
            servers = multi_api.APIServerProcessManager(args.api_server_count, sock,
                                                        args.argv[args.argv.index("serve") + 1:],
                                                        *metrics_mp.setup_dir())
    except (RLServeError, ValueError, OSError) as e:
        if prestart:
            discard_prestarted()
        print(f"rlserve serve: error: {e}", file=sys.stderr)
        return 2

    from rlserve.engine.front.async_engine import AsyncEngine
    from rlserve.startup_log import Phases, log_phase, process_age

    # on a GPU with RLSERVE_GPU_START_OVERLAP=1, the engine-core processes get their arguments first (AsyncEngine below) and this process's
    # heavier part (torch, FastAPI, the routes; transformers for generation_config.json) loads on threads
    # beside their start (16 cores of the GPU machine to spare); on the CPU (and with --device auto) before
    # it, as before: there the two processes share the cores the engine's own start needs
    now_or_beside = _beside if config.device.startswith("cuda") and envs.RLSERVE_GPU_START_OVERLAP else _now
    app_module = now_or_beside(_import_app, what="app imports")
    sampling = now_or_beside(generation_defaults, args.generation_config, model_path, what="generation defaults")
    log_phase(logger, "API process: flags and checks", process_age())
    phases = Phases(logger)
    logger.info("loading %s (TP=%d, DP=%d, dtype=%s, device=%s)", model_path, config.tensor_parallel_size,
                config.data_parallel_size, config.dtype, config.device)
    template_workers = envs.RLSERVE_TEMPLATE_WORKERS_AT_START and not config.skip_tokenizer_init
    if template_workers:  # they import while this process waits for the engine (rlserve.server.template_worker)
        from rlserve.server.template_pool import discard_prestarted as discard_templates, prestart_workers

        prestart_workers(grammar=prestart and importlib.util.find_spec("xgrammar") is not None)
    try:
        aengine = AsyncEngine(config, weight_version=args.weight_version, engine_mode=args.engine_mode,
                              hold_timeout_s=args.pause_hold_timeout if args.pause_hold_timeout > 0 else None,
                              stream_interval=args.stream_interval, max_engine_restarts=args.max_engine_restarts,
                              engine_restart_window_s=args.engine_restart_window,
                              serve_checkpoint_after_restart=args.serve_checkpoint_after_restart,
                              tokenizer=tokenizer, api_server_count=args.api_server_count, attach=attach,
                              on_started=servers.start if servers is not None else None)
    except (RLServeError, ValueError, OSError, RuntimeError, TimeoutError) as e:
        if servers is not None:
            servers.stop()
        sock.close()
        if prestart:
            discard_prestarted()
        if template_workers:
            discard_templates()
        print(f"rlserve serve: error: could not start the engine: {e}", file=sys.stderr)
        # a setting the engine refused once it knew the model and the device (on a GPU, a KV cache from
        # --gpu-memory-utilization below one --max-model-len sequence): a bad setting, as the checks above
        return 2 if isinstance(e, InvalidRequestError) else 1
    phases.mark("engine start -> ready (API process waiting)")
    if servers is not None:  # (named in a pause's error when one of them does not apply it: front_sync)
        aengine.front_sync.peer_pids = {i: p.pid for i, p in enumerate(servers.procs, start=1)}
    try:
        build_app = app_module.result().build_app
        sampling_defaults = sampling.result()
    except BaseException as e:  # noqa: BLE001 -- the same ends as before the engine started
        if servers is not None:
            servers.stop()
        sock.close()
        aengine.shutdown(timeout_s=5.0)
        if template_workers:
            discard_templates()
        if isinstance(e, (RLServeError, ValueError, OSError)):
            print(f"rlserve serve: error: {e}", file=sys.stderr)
            return 2
        raise
    from rlserve.server.state import ServerSettings, is_loopback

    settings = ServerSettings(
        model=model_arg, served_model_names=args.served_model_name or [model_arg], host=args.host, port=args.port,
        api_key=args.api_key, admin_key=args.admin_key, weight_transfer_config=args.weight_transfer_config,
        weight_staging=args.weight_staging, weight_check_finite=args.weight_check_finite,
        max_request_body_bytes=args.max_request_body_bytes,
        max_request_sequences=args.max_request_sequences, insecure_control_routes=args.insecure_control_routes,
        allow_unknown_fields=args.allow_unknown_fields,
        lora_modules=list(args.lora_modules or []), chat_template=chat_template,
        sampling_defaults=sampling_defaults, enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len, enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        model_impl=args.model_impl, generation_config=args.generation_config, **tool_settings(args),
    )
    if settings.admin_key is None and not is_loopback(args.host):
        if settings.insecure_control_routes:
            why = "VLLM_SERVER_DEV_MODE=1" if envs.VLLM_SERVER_DEV_MODE \
                else "--insecure-control-routes"
            logger.warning("control routes (pause/resume/abort/weight sync/TRL) are served WITHOUT authentication "
                           "on %s (%s, as vLLM's dev mode): anyone who can reach this port can pause the server or "
                           "replace its weights. Set --admin-key KEY to require 'Authorization: Bearer KEY'.",
                           args.host, why)
        else:
            logger.warning("bound to %s without --admin-key: control routes (pause/resume/abort/weights) answer 403 "
                           "(--admin-key KEY to enable them with a key, or --insecure-control-routes / "
                           "VLLM_SERVER_DEV_MODE=1 to serve them without one, as vLLM does)", args.host)
    rc, resignal, app = 1, None, None
    old_term = signal.signal(signal.SIGTERM, _raise_terminated)
    if args.api_server_count > 1:  # the N processes' metric values (process 0's directory: rlserve.server.metrics_mp)
        settings.metrics_multiproc_dir = attach["metrics_dir"] if attach else servers.metrics_dir
    try:
        app = build_app(aengine, settings)
        phases.mark("API app build")
        if attach:  # control routes: API process 0's
            served = multi_api.ForwardControl(app, attach["control_socket"], settings.max_request_body_bytes)
        else:  # (with N > 1 also on the unix socket processes 1..N-1 forward the control routes to)
            served = app
        extra = [servers.control] if servers is not None else []
        rc = stack.run(_serve(served, args, sock, stack, extra, servers, proc_name))
        if servers is not None and servers.failure:
            rc = 1
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down; asyncio.run (uvloop.run) re-raises it
        rc = 130
    except _Terminated:  # SIGTERM: uvicorn has shut down and re-raised it (see _raise_terminated)
        rc, resignal = 128 + signal.SIGTERM, signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
        logger.debug("stopping: HTTP server closed; stopping the engines")
        if servers is not None:
            servers.stop()  # API processes 1..N-1 first (and process 0's metric files): then the cores
        if app is not None:
            app.state.rlserve.close()  # the chat-template workers
        aengine.shutdown(timeout_s=5.0)
        logger.debug("stopping: engines stopped; exit handlers next")
        signal.signal(signal.SIGTERM, old_term)
    _exit_now(rc, resignal)
    return rc  # not reached


class _Terminated(BaseException):
    """SIGTERM arrived outside uvicorn's own handler (see :func:`_raise_terminated`)."""


def _raise_terminated(_sig, _frame) -> None:
    """SIGTERM's handler while the server runs (uvicorn installs its own during ``serve()`` and
    puts this one back after). uvicorn ends ``serve()`` by re-raising the signal it stopped for;
    with the default action a SIGTERM then killed the process on the spot, before the engines'
    stop (the cores died of ``PR_SET_PDEATHSIG`` and their socket directories
    ``<tmp>/rlserve-core-<pid>-*`` stayed behind). Raised as an exception instead, the stop in
    :func:`run` runs as on Ctrl-C, and :func:`_exit_now` ends the process by SIGTERM after it."""
    raise _Terminated()


def _signal_name(sig) -> str:
    try:
        return signal.Signals(sig).name
    except (ValueError, TypeError):
        return f"signal {sig}"


def _exit_now(rc: int, resignal: int | None = None) -> None:
    """End the process once serving is over: the atexit handlers (multiprocessing's stops the TP
    followers), flushed logs and streams, then ``os._exit``. This skips the interpreter's own
    teardown of torch / transformers' thousands of modules and objects, which took 9-14 s after
    Ctrl-C on a busy 2-core machine (BENCHMARKS.md, start-up and stop).

    ``resignal``: the signal the server stopped for (SIGTERM): the process ends by it (default
    action), so its parent sees "killed by SIGTERM" as from any program that does not handle it;
    ``rc`` only if that fails."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        logger.debug("stopping: exit handlers done")
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
                pass
        if resignal is not None:
            signal.signal(resignal, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {resignal})
            os.kill(os.getpid(), resignal)
        os._exit(rc)


async def _serve(app, args, sock, stack, extra_sockets=(), servers=None, name: str = "APIServer") -> int:
    """Serve ``app`` on ``sock`` (and ``extra_sockets``: API process 0's control socket) until a
    signal, or until one of ``servers`` (:class:`~rlserve.server.multi_api.APIServerProcessManager`)
    ends; uvicorn's log lines prefixed with this process's ``name`` (:mod:`rlserve.server.log_prefix`).
    Returns the exit status."""
    import uvicorn

    from rlserve.server.log_prefix import uvicorn_log_config

    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=uvicorn_log_config(name),
                            log_level=args.uvicorn_log_level or args.log_level,
                            access_log=not args.disable_access_log, timeout_graceful_shutdown=1,
                            timeout_keep_alive=30, http=stack.protocol(args.http_header_timeout))
    if extra_sockets:  # API process 0's control socket: its forwarded requests are logged where they came in
        from rlserve.server.multi_api import quiet_control_socket_access_log

        quiet_control_socket_access_log()
    logger.info("HTTP: uvicorn on %s", stack.name)
    loop = asyncio.get_running_loop()
    st = app.state  # (ForwardControl, in API processes > 0, carries its app's state)
    aengine = st.rlserve.aengine

    class Server(uvicorn.Server):
        """On SIGINT/SIGTERM, also end every request at once (503) and stop the engines, so
        open connections close and the process exits within about a second."""

        stopped_for = None  # the first signal handled

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                self.stopped_for = sig
                logger.info("stopping: %s received", _signal_name(sig))
                if servers is not None:  # API processes 1..N-1 end their requests before the cores go
                    servers.terminate()
                loop.call_soon_threadsafe(aengine.begin_shutdown, "the server is shutting down")

    server = Server(config)

    def stop_for(why: str) -> None:
        """An API process 1..N-1 ended: stop as on a signal (not one: uvicorn would raise it again at its end)."""
        server.should_exit = True
        servers.terminate()
        aengine.begin_shutdown(f"the server is shutting down: {why}")

    if servers is not None:
        servers.watch(lambda: loop.call_soon_threadsafe(stop_for, servers.failure))

    async def announce():
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        port = args.port
        try:
            port = server.servers[0].sockets[0].getsockname()[1]
        except (IndexError, AttributeError):
            pass
        host = args.host if ":" not in args.host else f"[{args.host}]"
        url = f"http://{host}:{port}"
        if aengine.front_sync.client_index:
            logger.info("API server %d of %d: serving on %s", aengine.front_sync.client_index,
                        aengine.front_sync.count, url)
            from rlserve.server.multi_api import attach_from_env, say_ready

            say_ready(attach_from_env())
            return
        if servers is not None and not await asyncio.to_thread(servers.wait_ready):
            return  # one of them ended before it served (the watcher stops the server)
        print(f"rlserve: serving {st.rlserve.settings.model!r} as {st.rlserve.model_name!r} on {url} "
              f"(OpenAI API at {url}/v1, weight version {aengine.weight_version})", flush=True)
        logger.info("ready: %s", url)
        log_phase(logger, "rlserve serve: process start -> ready", process_age())

    task = asyncio.create_task(announce())
    from rlserve.gc_heap import freeze_startup_heap
    from rlserve.startup_log import log_phase, process_age

    freeze_startup_heap("API server")  # full collections skip the start-up heap from here on
    await server.serve(sockets=[sock, *extra_sockets])
    task.cancel()
    if server.stopped_for == signal.SIGINT:
        # uvicorn re-raises the SIGINT it stopped for; asyncio.run (and uvloop.run) turns it into a
        # KeyboardInterrupt by cancelling this task, unless the task has already returned by
        # then (a race seen on a loaded machine: exit status 0 instead of 130)
        return 130
    return 0 if server.started else 1
